"""Section 10's model, GPT-2's design in miniature (Radford et al., 2019): pre-norm blocks of causal
self-attention and a four-times-wide MLP, with a KV cache for generation. Section 10 teaches it (its page
shows this code); section 11 trains it with a Triton kernel as its attention.
"""
import torch
from torch import nn
from torch.nn import functional as F


class Block(nn.Module):
    def __init__(self, d, heads, attention):
        super().__init__()
        self.heads, self.attention = heads, attention
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, cache=None):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if cache is not None:   # generation: keep this call's keys and values, attend over all kept so far
            if 'k' in cache:
                if t > 1:
                    raise ValueError('a cache takes one new token at a time once it holds the prompt')
                k, v = torch.cat([cache['k'], k], dim=2), torch.cat([cache['v'], v], dim=2)
            cache['k'], cache['v'] = k, v
        # several new tokens (training, a prompt): each sees those before it; one new token sees them all
        a = self.attention(q, k, v, is_causal=t > 1)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, d, heads, layers, context, attention=F.scaled_dot_product_attention, vocab=256):
        super().__init__()
        self.context = context
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads, attention) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx, caches=None):
        start = caches[0]['k'].shape[2] if caches and 'k' in caches[0] else 0   # tokens already cached
        x = self.tok(idx) + self.pos(torch.arange(start, start + idx.shape[1], device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block(x, None if caches is None else caches[i])
        return self.head(self.norm(x))
