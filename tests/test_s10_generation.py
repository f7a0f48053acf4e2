"""Section 10: the page's model, counts and formulas, its KV cache, its int8 weights, and the GPU decisions (faked).

The page's own functions are executed from its source (notebook_code.definitions) with small settings, so that
what the student reads is what is tested.
"""
import types

import pytest
import torch
from notebook_code import definitions
from torch import nn
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

import common

PAGE_NAMES = ('plain_attention', 'Block', 'GPT', 'new_model', 'layer_rows', 'block_activation_formula', 'generate',
              'weight_bytes', 'cache_bytes', 'quantise_per_channel', 'Int8Linear', 'with_int8_weights',
              'fused_int8_runs', 'dynamic_int8', 'stored_bytes')


@pytest.fixture()
def page():
    ns = definitions('10-attention-and-generation', *PAGE_NAMES)
    ns.update(cfg=types.SimpleNamespace(d=32, heads=2, layers=2, context=24), device=torch.device('cpu'))
    return ns


def test_plain_attention_is_sdpa_with_and_without_the_mask(page):
    q, k, v = torch.randn(3, 2, 2, 9, 8).unbind(0)
    for causal in (False, True):
        torch.testing.assert_close(page['plain_attention'](q, k, v, is_causal=causal),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=causal))


def test_the_layer_table_matches_what_the_flop_counter_sees(page):
    model = page['new_model'](attention=page['plain_attention'])
    t = 24
    total = sum(flops for _, _, flops in page['layer_rows'](model, t))
    tokens = torch.randint(256, (2, t))
    with FlopCounterMode(display=False) as counter:
        model(tokens)
    assert counter.get_total_flops() == total * tokens.numel()
    assert sum(n for _, n, _ in page['layer_rows'](model, t)) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize('attention', ['sdpa', 'plain'])
def test_the_activation_formula_matches_what_autograd_saves(page, attention):
    fn, written_out = ((F.scaled_dot_product_attention, False) if attention == 'sdpa'
                       else (page['plain_attention'], True))
    for t in (16, 48):
        x = torch.randn(2, t, 32, requires_grad=True)
        block = page['Block'](32, 2, fn)
        _, saved = common.saved_activation_bytes(block, x, exclude=list(block.parameters()) + [x])
        formula = page['block_activation_formula'](2, t, 32, 2, written_out)
        assert abs((saved + x.nbytes) / formula - 1) < 0.05, (t, saved + x.nbytes, formula)


def test_the_cache_changes_nothing_and_holds_what_cache_bytes_counts(page):
    model = page['new_model']().eval()
    prompt = torch.randint(256, (3, 5))
    cached, logits_cached = page['generate'](model, prompt, 12)
    recomputed, logits_recomputed = page['generate'](model, prompt, 12, cached=False)
    assert torch.equal(cached, recomputed)
    torch.testing.assert_close(logits_cached, logits_recomputed, rtol=1e-4, atol=1e-4)
    caches = [{} for _ in model.blocks]
    with torch.no_grad():
        model(prompt, caches)
        model(prompt[:, :1], caches)
    held = sum(c[key].nbytes for c in caches for key in ('k', 'v'))
    assert held == page['cache_bytes'](model, 3, 6)


def test_a_cache_refuses_several_new_tokens_and_a_too_long_text(page):
    model = page['new_model']().eval()
    caches = [{} for _ in model.blocks]
    with torch.no_grad():
        model(torch.zeros(1, 4, dtype=torch.long), caches)
        with pytest.raises(ValueError, match='one new token'):
            model(torch.zeros(1, 2, dtype=torch.long), caches)
    with pytest.raises(ValueError, match='do not fit the context'):
        page['generate'](model, torch.zeros(1, 20, dtype=torch.long), 5)


def test_weight_bytes_leave_out_the_embedding_tables(page):
    model = page['new_model']()
    tables = model.tok.weight.nbytes + model.pos.weight.nbytes
    assert page['weight_bytes'](model) == sum(p.nbytes for p in model.parameters()) - tables


def test_per_channel_int8_maps_each_rows_largest_weight_to_127(page):
    weight = torch.randn(6, 40) * torch.logspace(-3, 1, 6)[:, None]   # rows of very different sizes
    q, scale = page['quantise_per_channel'](weight)
    assert q.dtype == torch.int8 and q.abs().amax(1).tolist() == [127] * 6
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-9).all()


def test_int8_linear_computes_the_product_with_the_rounded_weights(page):
    linear = nn.Linear(48, 24)
    x = torch.randn(3, 5, 48)
    q, scale = page['quantise_per_channel'](linear.weight.detach())
    expected = F.linear(x, q.float() * scale[:, None], linear.bias)
    torch.testing.assert_close(page['Int8Linear'](linear)(x), expected)
    if page['fused_int8_runs'](page['new_model']()):
        torch.testing.assert_close(page['Int8Linear'](linear, fused=True)(x), expected, rtol=0.05, atol=0.05)


def test_the_fused_kernel_is_refused_where_it_would_crash(page):
    # torch 2.14's CPU _weight_int8pack_mm ends the process (SIGSEGV) when the input width is not a multiple of 16
    with pytest.raises(ValueError, match='multiple of 16, not 40'):
        page['Int8Linear'](nn.Linear(40, 24), fused=True)
    assert page['fused_int8_runs'](page['new_model'](d=40, heads=2)) is False


def test_stored_bytes_count_int8_and_pytorchs_packed_weights(page):
    model = page['new_model']().eval()
    fp32 = page['stored_bytes'](model)
    int8 = page['stored_bytes'](page['with_int8_weights'](model))
    assert 0.25 < int8 / fp32 < 0.45        # int8 matrices, fp32 scales, biases and norms
    dynamic = page['dynamic_int8'](model)
    if dynamic is not None:                 # packed weights must be counted, not skipped as non-tensors
        assert 0.2 < page['stored_bytes'](dynamic) / fp32 < 0.45


def test_on_a_gpu_pytorchs_dynamic_route_is_not_offered(page):
    page['device'] = torch.device('cuda')   # faked: the function decides before it touches the device
    assert page['dynamic_int8'](nn.Linear(2, 2)) is None


@pytest.mark.parametrize('failure', ['absent', 'not implemented', 'runtime error'])
def test_without_the_fused_int8_kernel_the_page_says_so_and_uses_the_written_out_one(page, monkeypatch, failure):
    if failure == 'absent':
        monkeypatch.delattr(torch, '_weight_int8pack_mm', raising=False)
    else:
        error = NotImplementedError if failure == 'not implemented' else RuntimeError

        def refuse(*args):
            raise error('no kernel for this device')
        monkeypatch.setattr(torch, '_weight_int8pack_mm', refuse)
    assert page['fused_int8_runs'](page['new_model']()) is False
