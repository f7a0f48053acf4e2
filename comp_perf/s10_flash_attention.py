"""Section 10, the piece you build: FlashAttention's forward pass in tiles (flash_attention, the reference,
written as the notebook's skeleton is, one small function per gap) and its backward pass (the exercise).
The checks that hold anyone's version to plain attention are in s10_flash_checks.
"""
import math

import torch

from comp_perf.s10_flash_checks import check_attention_inputs


# ----- the reference: FlashAttention-2's forward pass (Dao 2023, Algorithm 1) -----

def visible_keys(i, rows, t_k, causal):
    """How many keys, from key 0 on, query rows i .. i+rows-1 can see: with the causal mask a key block
    wholly after the block's last query is never read at all."""
    return min(t_k, i + rows) if causal else t_k


def tile_scores(q_tile, k_tile, i, j, causal):
    """The tile's scaled scores q kᵀ / √d; causal: -inf where key j+c comes after query i+r."""
    s = q_tile @ k_tile.transpose(-2, -1) / math.sqrt(q_tile.shape[-1])
    rows, cols = s.shape[-2:]
    if causal and j + cols - 1 > i:                       # the tile reaches above the diagonal
        query = torch.arange(i, i + rows, device=s.device)[:, None]   # global positions, not tile-local
        key = torch.arange(j, j + cols, device=s.device)
        s = s.masked_fill(key > query, -math.inf)         # key j is visible to query i iff j <= i
    return s


def online_update(m, row_sum, acc, s, v_tile):
    """Fold one tile into the running max m, normaliser row_sum and unnormalised output acc of each row."""
    m_new = torch.maximum(m, s.amax(-1, keepdim=True))   # the max so far: exp never sees a positive number
    p = torch.exp(s - m_new)
    correction = torch.exp(m - m_new)                     # what was summed against the old max, rescaled
    return m_new, row_sum * correction + p.sum(-1, keepdim=True), acc * correction + p @ v_tile


def finish_rows(m, row_sum, acc):
    """(output rows, logsumexp rows): the one division FA-2 defers to the end, and L = m + log row_sum,
    all the backward pass keeps of the softmax."""
    return acc / row_sum, (m + torch.log(row_sum)).squeeze(-1)


def flash_attention(q, k, v, causal=False, block_q=32, block_k=32):
    """softmax(q kᵀ / √d) v in tiles, and the row logsumexp: (out, lse), out in q's dtype, lse float32 (..., t_q).

    q: (..., t_q, d), k: (..., t_k, d), v: (..., t_k, d_v), the same leading batch and head
    dimensions, floating point; out is (..., t_q, d_v). The causal mask is aligned as
    F.scaled_dot_product_attention's is_causal aligns it, at the top left: query i sees keys
    0 .. i, whatever t_k is. Each query block (outer loop, as FlashAttention-2 does) reads the
    key/value blocks it can see once, keeping per row a running max, normaliser and output in
    float32: no t_q × t_k tensor is ever built.
    """
    t_q, t_k = check_attention_inputs(q, k, v)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    for i in range(0, t_q, block_q):
        q_tile = q[..., i:i + block_q, :].float()         # the last block may be shorter
        rows = q_tile.shape[-2]
        m = torch.full((*q.shape[:-2], rows, 1), -math.inf, device=q.device)
        row_sum = torch.zeros_like(m)
        acc = torch.zeros(*q.shape[:-2], rows, v.shape[-1], device=q.device)
        for j in range(0, visible_keys(i, rows, t_k, causal), block_k):
            s = tile_scores(q_tile, k[..., j:j + block_k, :].float(), i, j, causal)
            m, row_sum, acc = online_update(m, row_sum, acc, s, v[..., j:j + block_k, :].float())
        out[..., i:i + rows, :], lse[..., i:i + rows] = finish_rows(m, row_sum, acc)
    return out, lse


def flash_attention_backward(q, k, v, out, lse, dout, causal=False, block_q=32, block_k=32):
    """(dq, dk, dv) of flash_attention from its out and lse (FlashAttention-2, Algorithm 2), in q's dtype.

    Nothing of the forward's softmax is stored but lse: each tile's P is recomputed from q, k
    and lse. Key blocks are the outer loop, so dk and dv of a block are summed in one place.
    """
    t_q, t_k = check_attention_inputs(q, k, v)
    scale = 1 / math.sqrt(q.shape[-1])
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float32) for x in (q, k, v))
    big_d = (dout.float() * out.float()).sum(-1, keepdim=True)   # D = rowsum(dO ∘ O) = rowsum(dP ∘ P)
    for j in range(0, t_k, block_k):
        k_tile, v_tile = k[..., j:j + block_k, :].float(), v[..., j:j + block_k, :].float()
        first = (j // block_q) * block_q if causal else 0   # earlier query blocks cannot see these keys
        for i in range(first, t_q, block_q):
            q_tile, do_tile = q[..., i:i + block_q, :].float(), dout[..., i:i + block_q, :].float()
            p = torch.exp(tile_scores(q_tile, k_tile, i, j, causal) - lse[..., i:i + block_q, None])
            dv[..., j:j + block_k, :] += p.transpose(-2, -1) @ do_tile
            ds = p * (do_tile @ v_tile.transpose(-2, -1) - big_d[..., i:i + block_q, :])   # dS = P ∘ (dP - D)
            dq[..., i:i + block_q, :] += ds @ k_tile * scale
            dk[..., j:j + block_k, :] += ds.transpose(-2, -1) @ q_tile * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def show_flash_solution():
    """The reference forward pass, folded as a solution is: the four gaps' functions and the loops."""
    from comp_perf.s06_bucketed import show_solution
    show_solution(visible_keys, tile_scores, online_update, finish_rows, flash_attention)
