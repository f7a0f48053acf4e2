"""Section 10's checks: anyone's tiled attention, forward and backward, held to plain attention in float64,
with the causal skipping counted in FLOPs, and peak_allocated(), the memory they measure. They import no
reference: the student edition ships them without s10_flash_attention.
"""
import importlib
import importlib.util
import math
import re
import traceback
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from comp_perf.language import tr


def check_attention_inputs(q, k, v):
    """(t_q, t_k), or a clear error: floating-point q, k, v of matching shapes, at least one key.

    Without it an integer q comes back as integers, and a k shorter than q fails deep inside
    with an IndexError about amax; the tiles broadcast nothing, so the batch and head
    dimensions must be equal.
    """
    if not all(x.is_floating_point() for x in (q, k, v)):
        raise TypeError(tr('attention needs floating-point q, k and v; got {dtypes}',
                           dtypes=', '.join(str(x.dtype) for x in (q, k, v))))
    shapes = ' '.join(f'{name}={tuple(x.shape)}' for name, x in zip('qkv', (q, k, v)))
    if not (q.dim() >= 2 and q.dim() == k.dim() == v.dim() and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(tr('q, k and v need the same leading (batch, head) dimensions: {shapes}', shapes=shapes))
    if k.shape[-1] != q.shape[-1] or v.shape[-2] != k.shape[-2] or k.shape[-2] == 0:
        raise ValueError(tr('k needs the head size of q, and v as many rows as k (at least one): {shapes}',
                            shapes=shapes))
    return q.shape[-2], k.shape[-2]


# ----- memory: the peak a function allocates, on CPU or CUDA -----

class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages the ops create while it is active: now (live) and at most (peak).

    A storage is counted once, when an op first returns a tensor on it that none of the op's
    inputs shares (a view or an in-place result is not new memory), and let go when the last
    tensor on it that an op returned is garbage-collected.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.storages = {}   # address -> [bytes, tensors on it still alive]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {_address(x) for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        for x in tree_leaves(result):
            if not isinstance(x, torch.Tensor) or x.device.type == 'meta':
                continue
            key = _address(x)
            if key not in self.storages:
                if key in inputs or x.untyped_storage().nbytes() == 0:
                    continue                              # memory that was there before fn ran
                self.storages[key] = [x.untyped_storage().nbytes(), 0]
                self.live += self.storages[key][0]
                self.peak = max(self.peak, self.live)
            self.storages[key][1] += 1
            weakref.finalize(x, self._release, key)
        return result

    def _release(self, key):
        entry = self.storages[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self.storages[key]


def _address(tensor):
    return tensor.untyped_storage().data_ptr()


def peak_allocated(fn, device='cpu'):
    """Bytes fn() allocates at most while it runs, above what was allocated before (its result counts).

    CUDA: the caching allocator's own peak (reset_peak_memory_stats, max_memory_allocated).
    CPU: a TorchDispatchMode adds each new storage an op returns and subtracts it when the
    last tensor on it is garbage-collected (torch keeps no allocation statistics on the CPU).
    """
    device = torch.device(device)
    if device.type == 'cuda':
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with _LiveBytes() as counter:
        fn()
    return counter.peak


# ----- the checks -----

TOL = 1e-4         # largest error relative to the reference's largest |value| (fp32 against float64)
TOL_LARGE = 1e-3   # part (d): scores near ±2000 carry fp32 rounding of ~1e-4 into exp
LARGE = 20.0       # part (d): q and k scaled by this, so scores reach about ±2000 (exp overflows above 88)
MEMORY = dict(batch=4, t=1024, d=32, block=64)   # part (f): the t × t scores are 16 MiB in fp32
DV = 24            # part (g): a value head size unlike the query/key head size 16
BATCH = (2, 3)     # the inputs' leading (batch, head) dimensions


class _Stop(Exception):
    """The check cannot go on: the message says why, in one line."""


def plain_attention(q, k, v, causal=False):
    """(out, lse) of softmax(q kᵀ / √d) v with the t_q × t_k scores materialised: the float64 reference.
    The causal mask is SDPA's: torch.ones(t_q, t_k).tril() keeps key j for query i where j <= i."""
    check_attention_inputs(q, k, v)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _inputs(t, seed, scale=1.0, batch=BATCH, d=16, t_k=None, d_v=None):
    """fp32 q (t rows), k and v (t_k rows, t unless given; v of head size d_v, d unless given)."""
    t_k, d_v = t if t_k is None else t_k, d if d_v is None else d_v
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [torch.randn(*batch, t, d) * scale, torch.randn(*batch, t_k, d) * scale, torch.randn(*batch, t_k, d_v)]


def load_solution(source, name):
    """The function `name` from a student's file (a path ending in .py) or a module (a module name)."""
    try:
        if str(source).endswith('.py'):
            path = Path(source).resolve()
            if not path.exists():
                raise _Stop(tr('fail: there is no file {path} (run the %%writefile cell first)', path=source))
            spec = importlib.util.spec_from_file_location(f'_flash_{path.stem}', path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(source)
        return getattr(module, name)
    except (_Stop, NotImplementedError):
        raise
    except Exception as error:
        raise _Stop(tr('fail: loading {source} raised {error}', source=source,
                       error=f'{type(error).__name__}: {error}')) from None


def _where(error, fn):
    """' (in the function, line and code of fn's file where error was raised)', or '' if not raised there."""
    path = getattr(getattr(fn, '__code__', None), 'co_filename', None)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename == path]
    if not frames:
        return ''
    frame = frames[-1]   # the innermost: the gap's function rather than the loop that called it
    return tr(' (in {function}, line {line} of {file}: {code})', function=frame.name, line=frame.lineno,
              file=Path(path).name, code=frame.line)


def _lse_shape_hint(fn):
    """A hint when the file's finish_rows (gap 4) returns a logsumexp of the wrong shape; '' otherwise."""
    finish = getattr(fn, '__globals__', {}).get('finish_rows')
    if not callable(finish):
        return ''
    m = torch.zeros(*BATCH, 4, 1)
    try:
        lse = finish(m, torch.ones_like(m), torch.ones(*BATCH, 4, 5))[1]
    except Exception:   # a gap that fails on its own shows in the error itself
        return ''
    if tuple(lse.shape) == (*BATCH, 4):
        return ''
    return tr('; hint: gap 4 (finish_rows) returns a logsumexp of shape {got} for rows of shape {rows}: it needs '
              'one number per row, shape {want}', got=tuple(lse.shape), rows=tuple(m.shape), want=(*BATCH, 4))


def _call(fn, n_results, *args, **kwargs):
    """fn(*args, **kwargs) as a tuple of n_results tensors, or _Stop saying in one line what went wrong,
    and where in the student's file."""
    try:
        with torch.no_grad():
            result = fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as error:
        raise _Stop(tr('fail: {name} raised {error}', name=getattr(fn, '__name__', 'your function'),
                       error=f'{type(error).__name__}: {error}') + _where(error, fn) + _lse_shape_hint(fn)) from None
    if not isinstance(result, (tuple, list)) or len(result) != n_results or \
            not all(isinstance(x, torch.Tensor) for x in result):
        raise _Stop(tr('fail: {name} should return {n} tensors, it returned {what}',
                       name=getattr(fn, '__name__', 'your function'), n=n_results, what=type(result).__name__))
    return tuple(result)


def _error(got, want):
    """Largest |got - want| relative to the largest |want|; inf for a wrong shape, nan stays nan."""
    if tuple(got.shape) != tuple(want.shape):
        return math.inf
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def _verdict(ok):
    return tr('pass') if ok else tr('FAIL')


def _report(letter, what, errors, tol):
    """Print one part's line: its largest error against the tolerance; True when within it (nan is not)."""
    worst = max(errors, key=lambda e: math.inf if math.isnan(e) else e)
    ok = worst <= tol
    print(tr('{verdict} ({letter}) {what}: largest error {err:.1e} of the largest value (allowed {tol:.0e})',
             verdict=_verdict(ok), letter=letter, what=what, err=worst, tol=tol))
    return ok


def _forward_errors(flash, t, block_q, block_k, causal, seed, scale=1.0, lse_too=False, t_k=None, d_v=None,
                    batch=BATCH):
    """Errors of (out[, lse]) from flash against float64 plain attention, on fp32 inputs (_inputs)."""
    q, k, v = _inputs(t, seed, scale, batch, t_k=t_k, d_v=d_v)
    out, lse = _call(flash, 2, q, k, v, causal=causal, block_q=block_q, block_k=block_k)
    want_out, want_lse = plain_attention(q.double(), k.double(), v.double(), causal)
    if lse_too and lse.shape != want_lse.shape:
        raise _Stop(tr('the logsumexp has shape {got}; it needs one number per query row, shape {want}',
                       got=tuple(lse.shape), want=tuple(want_lse.shape)))
    return [_error(lse, want_lse)] if lse_too else [_error(out, want_out)]


def _largest_score(t, seed, scale, batch=BATCH):
    q, k, _ = _inputs(t, seed, scale, batch)
    return (q @ k.transpose(-2, -1)).abs().max().item() / math.sqrt(q.shape[-1])


def forward_parts(flash, block, batch=BATCH):
    """Parts (a) to (e): one line each; the list of their verdicts."""
    half = max(1, block // 2)
    return [
        _report('a', tr('without the mask, t = {t}', t=4 * block),
                [_forward_errors(flash, 4 * block, block, block, False, 1, batch=batch)[0]], TOL),
        _report('b', tr('causal, t = {t}, blocks {bq}×{bq}, {bq}×{bk} and {bk}×{bq}', t=4 * block, bq=block, bk=half),
                [_forward_errors(flash, 4 * block, bq, bk, True, 2, batch=batch)[0]
                 for bq, bk in ((block, block), (block, half), (half, block))], TOL),
        _report('c', tr('t = {t}, not a multiple of the block {b} (causal and not)', t=2 * block + 13, b=block),
                [_forward_errors(flash, 2 * block + 13, block, block, causal, 3, batch=batch)[0]
                 for causal in (False, True)], TOL),
        _report('d', tr('large scores (q and k × {s:g}: |scores| up to {top:.0f}), finite and equal', s=LARGE,
                        top=_largest_score(2 * block, 4, LARGE, batch)),
                [_forward_errors(flash, 2 * block, block, block, causal, 4, LARGE, batch=batch)[0]
                 for causal in (False, True)], TOL_LARGE),
        _report_or_fail('e', tr('the logsumexp of each row (small and large scores, causal and not)'), lambda: [
            _forward_errors(flash, 2 * block + 13, block, block, causal, 5, scale, lse_too=True, batch=batch)[0]
            for causal in (False, True) for scale in (1.0, LARGE)]),
    ]


def skipping_part(flash, block, batch=BATCH):
    """Part (h): with the causal mask, the matrix products flash computes against those without it.

    Only the n(n+1)/2 tiles on and below the diagonal of n × n blocks hold a key some query can
    see; a version that reads every key block and masks it gets the same numbers at full cost,
    which no comparison of results can see, so the FLOPs are counted (FlopCounterMode).
    """
    from torch.utils.flop_counter import FlopCounterMode   # here: importing it imports Triton (seconds)
    t, n = 4 * block, 4
    q, k, v = _inputs(t, 8, batch=batch)
    flops = {}
    for causal in (False, True):
        with FlopCounterMode(display=False) as counter:
            _call(flash, 2, q, k, v, causal=causal, block_q=block, block_k=block)
        flops[causal] = counter.get_total_flops()
    share = flops[True] / flops[False] if flops[False] else math.inf
    most = (n + 2) / (2 * n)   # the tiles that can be seen, n(n+1)/2 of n², and half a row of blocks to spare
    ok = share <= most
    print(tr('{verdict} (h) causal block skipping, t = {t}: with the mask, your function computed {share:.0%} of the '
             'matrix products it computed without it (allowed {most:.0%}: {seen} of the {tiles} tiles hold a key a '
             'query can see)', verdict=_verdict(ok), t=t, share=share, most=most, seen=n * (n + 1) // 2,
             tiles=n * n))
    if not ok:
        print(tr('    gap 1 (visible_keys) decides how many key blocks each query block reads: with the mask, a '
                 'block after the query block\'s last row holds no key it can see'))
    return ok


def lengths_part(flash, block, batch=BATCH):
    """Part (g): unequal query and key lengths, and a value head size unlike d."""
    what = tr('queries and keys of different lengths (t_q = {a}, t_k = {b} and the reverse, causal and not), '
              'value head size {dv} ≠ d', a=block + 7, b=3 * block + 5, dv=DV)
    return _report_or_fail('g', what, lambda: [
        _forward_errors(flash, t_q, block, block, causal, 7, t_k=t_k, d_v=DV, batch=batch)[0]
        for t_q, t_k in _unequal_lengths(block) for causal in (False, True)])


def _report_gradients(letter, what, errors, tol):
    """_report for the backward pass: errors holds (dq, dk, dv) per case, and each gradient's worst is printed,
    so a wrong dk is named even where dq is right."""
    worst = [max(case[i] for case in errors) for i in range(3)]
    bad = [name for name, e in zip(('dq', 'dk', 'dv'), worst) if not e <= tol]
    print(tr('{verdict} ({letter}) {what}: largest error dq {q:.1e}, dk {k:.1e}, dv {v:.1e} of each gradient\'s '
             'largest value (allowed {tol:.0e})', verdict=_verdict(not bad), letter=letter, what=what, q=worst[0],
             k=worst[1], v=worst[2], tol=tol) + (tr(': {names} wrong', names=', '.join(bad)) if bad else ''))
    return not bad


def _report_or_fail(letter, what, errors, report=_report):
    """report of errors(), or, where a version written for one length raises (an IndexError from amax
    over zero keys, a shape mismatch), a FAIL line for this part that leaves the other parts standing."""
    try:
        return report(letter, what, errors(), TOL)
    except _Stop as stop:
        print(tr('{verdict} ({letter}) {what} → {why}', verdict=_verdict(False), letter=letter, what=what, why=stop))
        return False


def _unequal_lengths(block):
    """(t_q, t_k) pairs for part (g): fewer queries than keys, then more, neither a multiple of the block."""
    return ((block + 7, 3 * block + 5), (3 * block + 5, block + 7))


def _memory_part(flash):
    """Part (f): the extra memory flash allocates against plain attention's, at a t where t × t dominates."""
    b, t, d, block = MEMORY.values()
    q, k, v = _inputs(t, 6, batch=(b,), d=d)
    plain = peak_allocated(lambda: plain_attention(q, k, v))
    mine = peak_allocated(lambda: _call(flash, 2, q, k, v, causal=False, block_q=block, block_k=block))
    ok = mine < plain / 2
    print(tr('{verdict} (f) peak memory at batch {b}, t = {t}, d = {d}, blocks of {block}: {mine:.1f} MiB, '
             'plain attention {plain:.1f} MiB (allowed: under half of it)', verdict=_verdict(ok), b=b, t=t, d=d,
             block=block, mine=mine / 2**20, plain=plain / 2**20))
    return ok


def _not_built(gap):
    number = re.fullmatch(r'gap (\d+)', str(gap))
    print(tr('not built yet: gap {n} still raises NotImplementedError (fill it in, run the %%writefile '
             'cell again, then this one)', n=number.group(1)) if number else
          tr('not built yet: {gap}', gap=str(gap) or 'NotImplementedError'))
    return False


def check_flash_attention(source='comp_perf.s10_flash_attention', block=32):
    """Hold flash_attention(q, k, v, causal=False, block_q=..., block_k=...) from `source` to plain attention.

    source: a student's file (e.g. 'artifacts/my_flash_attention.py') or a module name. Inputs
    are fp32 (2 × 3 heads, d = 16); the reference is plain attention in float64. Errors are the
    largest |difference| over the largest |reference value|, allowed TOL = 1e-4 (TOL_LARGE = 1e-3
    in (d), where fp32 rounding of scores near ±2000 reaches the exponentials). Parts: (a) no
    mask, t = 4 blocks; (b) causal, with equal and with unequal query and key blocks (block and
    block/2 either way), so a mask right only where tiles align fails; (c) t = 2 blocks + 13,
    causal and not; (d) q and k × 20: scores reach about ±2000, exp overflows unless the max is
    subtracted; (e) the returned logsumexp; (f) the extra memory while it runs, at batch 4,
    t = 1024, d = 32, blocks of 64, under half of plain attention's (peak_allocated); (g) fewer
    and more queries than keys (block + 7 and 3 blocks + 5, causal with SDPA's top-left
    alignment and not) with a value head size of 24; (h) with the causal mask at t = 4 blocks, the
    matrix products' FLOPs at most 75% of those without it (the 10 tiles of 16 that hold a visible
    key need 62.5%), so a version that reads and masks every block fails. Prints one
    line per part and a Result; True when all pass. A gap still raising NotImplementedError, a
    missing file, an error or a wrong return prints one line saying so, not a traceback.
    """
    def parts():
        flash = load_solution(source, 'flash_attention')
        return forward_parts(flash, block) + [_memory_part(flash), lengths_part(flash, block),
                                              skipping_part(flash, block)]
    return graded_check(parts, 'FlashAttention forward: pass', 'FlashAttention forward: fail')


def graded_check(parts, passed, failed):
    """Run a check's parts (each prints its line) and print its result; one line, not a traceback, for a
    gap still unfilled or a file that cannot be graded (_Stop)."""
    try:
        results = parts()
    except NotImplementedError as gap:
        return _not_built(gap)
    except _Stop as stop:
        print(stop)
        return False
    print(tr(passed) if all(results) else tr(failed))
    return all(results)


def _backward_errors(backward, t, block_q, block_k, causal, seed, t_k=None, d_v=None):
    """Errors (dq, dk, dv) from backward against autograd through float64 plain attention."""
    q, k, v = _inputs(t, seed, t_k=t_k, d_v=d_v)
    dout = _inputs(t, seed + 100, d=v.shape[-1])[0]
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = plain_attention(*leaves, causal)
    want = torch.autograd.grad(out, leaves, dout.double())
    got = _call(backward, 3, q, k, v, out.detach().float(), lse.detach().float(), dout,
                causal=causal, block_q=block_q, block_k=block_k)
    return tuple(_error(g, w) for g, w in zip(got, want))


def check_flash_backward(source='comp_perf.s10_flash_attention', block=32):
    """Hold flash_attention_backward(q, k, v, out, lse, dout, causal=False, block_q=..., block_k=...) -> (dq, dk, dv)
    from `source` to autograd through plain attention in float64.

    The same inputs and tolerance (TOL = 1e-4 of each gradient's largest |value|; each part prints
    dq's, dk's and dv's worst and names the wrong ones) as check_flash_attention; out and lse are
    plain attention's, in fp32. Parts: (a) no mask; (b) causal with unequal query and key blocks,
    both ways; (c) t = 2 blocks + 13, causal and not; (d) queries and keys of different lengths,
    both ways, with a value head size of 24. Prints one line per part and a Result; True when all pass.
    """
    half = max(1, block // 2)

    def parts():
        backward = load_solution(source, 'flash_attention_backward')
        return [
            _report_gradients('a', tr('gradients without the mask, t = {t}', t=4 * block),
                              [_backward_errors(backward, 4 * block, block, block, False, 11)], TOL),
            _report_gradients('b', tr('gradients, causal, t = {t}, blocks {bq}×{bk} and {bk}×{bq}', t=4 * block,
                                      bq=block, bk=half),
                              [_backward_errors(backward, 4 * block, bq, bk, True, 12)
                               for bq, bk in ((block, half), (half, block))], TOL),
            _report_gradients('c', tr('gradients, t = {t}, not a multiple of the block {b} (causal and not)',
                                      t=2 * block + 13, b=block),
                              [_backward_errors(backward, 2 * block + 13, block, block, causal, 13)
                               for causal in (False, True)], TOL),
            _report_or_fail('d', tr('gradients, queries and keys of different lengths ({a} and {b}, both ways, causal '
                                    'and not), value head size {dv}', a=block + 7, b=3 * block + 5, dv=DV),
                            lambda: [_backward_errors(backward, t_q, block, block, causal, 14, t_k=t_k, d_v=DV)
                                     for t_q, t_k in _unequal_lengths(block) for causal in (False, True)],
                            report=_report_gradients),
        ]
    return graded_check(parts, 'FlashAttention backward: pass', 'FlashAttention backward: fail')
