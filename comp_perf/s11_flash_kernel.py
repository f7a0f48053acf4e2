"""Section 11, the piece you build: FlashAttention-2's forward pass as one Triton kernel (Dao 2023,
Algorithm 1), written as the notebook's skeleton is, and its launcher.

This module imports Triton, so nothing imports it at `import common`: comp_perf.s11_triton loads it
from its file when a check or the autograd wrapper needs it, after the mode is chosen, because
`@triton.jit` decides when a kernel is defined whether it compiles for the GPU or is interpreted
(TRITON_INTERPRET=1). The same code runs both ways.
"""
import math

import torch
import triton
import triton.language as tl

from comp_perf.s10_flash_checks import check_attention_inputs


@triton.jit
def flash_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, t_q, t_k, d, d_v, scale,
                         BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr):
    # One program instance: query block i of one (batch, head). q, k, v, out are contiguous (heads, t, d).
    i, head = tl.program_id(0), tl.program_id(1)
    rows = i * BLOCK_Q + tl.arange(0, BLOCK_Q)            # global query positions
    dims, vdims = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + head * t_q * d + rows[:, None] * d + dims[None, :],
                mask=(rows[:, None] < t_q) & (dims[None, :] < d), other=0.0)
    m = tl.full((BLOCK_Q,), -float('inf'), tl.float32)    # running max of each row
    row_sum = tl.zeros((BLOCK_Q,), tl.float32)            # running sum of exp(s - m)
    acc = tl.zeros((BLOCK_Q, BLOCK_DV), tl.float32)       # unnormalised output
    end = t_k
    if CAUSAL:   # key blocks wholly after this block's last query are never read (top-left alignment)
        end = tl.minimum(t_k, (i + 1) * BLOCK_Q)
    for start in range(0, end, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)               # global key positions
        k = tl.load(k_ptr + head * t_k * d + cols[:, None] * d + dims[None, :],
                    mask=(cols[:, None] < t_k) & (dims[None, :] < d), other=0.0)
        # ieee: fp32 products in fp32 (a GPU's default for fp32 tl.dot is TF32, ~1e-3 off)
        s = tl.dot(q, tl.trans(k), input_precision='ieee') * scale
        keep = cols[None, :] < t_k                         # the last block may be partial
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, -float('inf'))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float('inf'), 0.0, m_new)   # a padding row sees no key: exp(-inf) = 0
        p = tl.exp(s - m_safe[:, None])
        correction = tl.exp(m - m_safe)                    # rescales what was summed against the old max
        v = tl.load(v_ptr + head * t_k * d_v + cols[:, None] * d_v + vdims[None, :],
                    mask=(cols[:, None] < t_k) & (vdims[None, :] < d_v), other=0.0)
        row_sum = row_sum * correction + tl.sum(p, axis=1)
        acc = acc * correction[:, None] + tl.dot(p, v, input_precision='ieee')
        m = m_new
    tl.store(out_ptr + head * t_q * d_v + rows[:, None] * d_v + vdims[None, :], acc / row_sum[:, None],
             mask=(rows[:, None] < t_q) & (vdims[None, :] < d_v))
    tl.store(lse_ptr + head * t_q + rows, m + tl.log(row_sum), mask=rows < t_q)


def triton_flash_attention(q, k, v, causal=False, block_q=32, block_k=32):
    """(out, lse) like comp_perf.s10_flash_attention.flash_attention, computed by the kernel above:
    q (..., t_q, d), k (..., t_k, d), v (..., t_k, d_v), fp32 or fp16, on the GPU or (interpreted) the CPU."""
    t_q, t_k = check_attention_inputs(q, k, v)
    d, d_v = q.shape[-1], v.shape[-1]
    flat = [x.reshape(-1, *x.shape[-2:]).contiguous() for x in (q, k, v)]
    out = q.new_empty(*q.shape[:-1], d_v)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)   # fp32 whatever q is, as FA keeps it
    grid = (triton.cdiv(t_q, block_q), flat[0].shape[0])
    flash_forward_kernel[grid](*flat, out, lse, t_q, t_k, d, d_v, 1 / math.sqrt(d),
                               BLOCK_Q=block_q, BLOCK_K=block_k, BLOCK_D=max(16, triton.next_power_of_2(d)),
                               BLOCK_DV=max(16, triton.next_power_of_2(d_v)), CAUSAL=causal)
    return out, lse

