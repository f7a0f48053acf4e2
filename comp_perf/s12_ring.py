"""Section 12, the piece you build: ring attention, the sequence split over processes.

Each rank keeps the queries of its part of the sequence; the key/value blocks travel round the
ring of ranks (batch_isend_irecv), the next transfer started before the current block is
computed, and the partial results are merged with their logsumexp as 10's online softmax merges
tiles. The reference is written as the notebook's skeleton is, one function per gap;
check_ring_attention() runs anyone's version of it in gloo processes against plain attention in
float64 and says pass or fail, part by part, with the order of transfers and computations
recorded (as 06's check records all-reduces), a second wait() on a finished transfer refused
(it would hang) and a ring that waits for ever stopped after a stated time.
"""
import importlib
import importlib.util
import math
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from comp_perf.language import tr
from comp_perf.processes import launch, run_keys
from comp_perf.s10_flash_checks import LARGE, TOL, TOL_LARGE, plain_attention

# ----- the layout of the sequence over the ranks -----

LAYOUTS = ('contiguous', 'zigzag')


def split_positions(t, world_size, layout='contiguous'):
    """The global positions of the tokens each rank holds, a list of 1-D tensors, rank by rank.

    contiguous: rank r holds the r-th of world_size nearly equal runs. zigzag: the sequence is cut
    into 2·world_size chunks and rank r holds chunks r and 2·world_size − 1 − r, an early one and a
    late one, so that under the causal mask every rank has about the same work.
    """
    if layout not in LAYOUTS:
        raise ValueError(f'layout must be one of {LAYOUTS}, got {layout!r}.')
    pieces = world_size if layout == 'contiguous' else 2 * world_size
    if not isinstance(t, int) or t < pieces:
        raise ValueError(f'a sequence of {t!r} tokens cannot give each of {pieces} pieces a token.')
    chunks = torch.arange(t).tensor_split(pieces)
    if layout == 'contiguous':
        return list(chunks)
    return [torch.cat([chunks[r], chunks[pieces - 1 - r]]) for r in range(world_size)]


def pad_block(k, v, k_pos):
    """(k, v, k_pos) padded with keys at position −1 to the longest block of any rank.

    A transfer needs buffers of a known size, and the ranks' blocks differ by a token when the
    length does not divide: every rank pads to the same length, and the mask hides position −1.
    """
    length = torch.tensor([k.shape[-2]], device=k.device)
    dist.all_reduce(length, op=dist.ReduceOp.MAX)
    extra = int(length) - k.shape[-2]

    def pad(x):
        return torch.cat([x, x.new_zeros(*x.shape[:-2], extra, x.shape[-1])], -2)
    return pad(k), pad(v), torch.cat([k_pos, k_pos.new_full((extra,), -1)])


def visible_part(q_pos, k_pos, causal):
    """(rows, cols): which queries see at least one key of the block and which keys at least one query
    sees; only these are computed (a block wholly after every query is skipped, as 10 skips tiles)."""
    seen = (k_pos >= 0)[None, :].expand(len(q_pos), -1)
    if causal:
        seen = seen & (k_pos[None, :] <= q_pos[:, None])
    return seen.any(1), seen.any(0)


# ----- the reference: one function per gap of the notebook's skeleton -----

def block_attention(q, k, v, q_pos, k_pos, causal):
    """(out, lse) of the queries against one block of keys, as if the block were all there is.

    Positions are global, so a block that came from another rank is masked rightly: a key at
    position −1 (padding) is hidden, and with the causal mask so is a key after the query.
    Every row passed here sees at least one key (visible_part), so lse is finite.
    """
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    hidden = (k_pos < 0)[None, :]
    if causal:
        hidden = hidden | (k_pos[None, :] > q_pos[:, None])
    s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, -1)
    return torch.exp(s - lse[..., None]) @ v, lse


def merge(out, lse, block_out, block_lse):
    """Two softmax results over disjoint sets of keys, for the same rows, as one.

    Each part's weight is its share of the joint normaliser, exp(lse − lse_new), where
    lse_new = log(exp(lse) + exp(block_lse)) is computed from the larger of the two (logaddexp),
    so no exponential overflows; a row that has seen no key yet has lse = −inf and weight 0.
    """
    new = torch.logaddexp(lse, block_lse)
    return (out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[..., None]), new


def send_and_receive(block, rank, world_size):
    """Start sending each tensor of `block` to the next rank and receiving the previous rank's into new
    buffers; return (buffers, works) at once, without waiting: the caller computes meanwhile."""
    buffers = [torch.empty_like(t) for t in block]
    ops = ([dist.P2POp(dist.isend, t, (rank + 1) % world_size) for t in block]
           + [dist.P2POp(dist.irecv, b, (rank - 1) % world_size) for b in buffers])
    return buffers, dist.batch_isend_irecv(ops)


def ring_attention(q, k, v, q_pos, k_pos, causal=False):
    """softmax(q kᵀ / √d) v of this rank's queries against the whole sequence's keys: (out, lse).

    q: (..., t_rank, d) this rank's queries, k and v its block of keys and values, q_pos and
    k_pos their global positions. world_size steps: in each, the next transfer of the block
    round the ring starts, the block held now is computed and merged, and the transfer is
    waited for once. Out is in q's dtype, lse float32.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    block = pad_block(k.float(), v.float(), k_pos)
    out = torch.zeros(*q.shape[:-1], v.shape[-1], device=q.device)
    lse = torch.full(q.shape[:-1], -math.inf, device=q.device)
    for step in range(world_size):
        if step < world_size - 1:   # the next block is on its way while this one is computed
            incoming, works = send_and_receive(block, rank, world_size)
        k_b, v_b, pos_b = block
        rows, cols = visible_part(q_pos, pos_b, causal)
        if rows.any():
            o, l_b = block_attention(q[..., rows, :].float(), k_b[..., cols, :], v_b[..., cols, :],
                                     q_pos[rows], pos_b[cols], causal)
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o, l_b)
        if step < world_size - 1:
            for work in works:
                work.wait()
            block = incoming
    return out.to(q.dtype), lse


GAPS = (block_attention, merge, send_and_receive, ring_attention)


def ring_bytes_per_rank(t, world_size, heads_and_batch, d, d_v, element_bytes=4):
    """Bytes each rank sends in one ring pass: world_size − 1 blocks of k, v and positions (int64),
    each block ⌈t / world_size⌉ tokens long (padded)."""
    length = -(-t // world_size)
    return (world_size - 1) * length * (heads_and_batch * (d + d_v) * element_bytes + 8)


# ----- the check: anyone's ring against plain attention in float64 -----

# TOL, TOL_LARGE (part (d)) and LARGE, q and k's scale in part (d), are 10's.
RING_HANG_SECONDS = 10  # a transfer that waits longer is a deadlock: a passing check's transfers take milliseconds
D, BATCH = 16, (2,)
# (letter, processes, t, causal, layout, scale): every case each group of processes runs
CASES = (('a', 2, 96, False, 'contiguous', 1.0), ('b', 2, 96, True, 'contiguous', 1.0),
         ('c', 3, 100, False, 'contiguous', 1.0), ('c', 3, 100, True, 'contiguous', 1.0),
         ('d', 3, 60, True, 'contiguous', LARGE), ('e', 3, 100, True, 'zigzag', 1.0))


class _Watched:
    """A transfer's work object: notes its first wait, refuses a second (on gloo it would hang for ever)."""

    def __init__(self, inner, note):
        self._inner, self._note, self._waited = inner, note, False

    def wait(self, *args, **kwargs):
        if self._waited:
            raise RuntimeError(tr('wait() was called a second time on a transfer that had already finished: '
                                  'over gloo that call never returns. Wait for each transfer once.'))
        self._waited = True
        self._note()
        return self._inner.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _recording(events, sent):
    """Wrap torch.distributed.batch_isend_irecv (before the student's file is loaded, so that a
    `from torch.distributed import ...` gets it too) to record ('transfer', n) when transfer n starts,
    ('wait', n) when it is first waited for, and the bytes it sends; returns what undoes it."""
    real_batch = dist.batch_isend_irecv

    def batch_isend_irecv(ops):
        n = sum(kind == 'transfer' for kind, *_ in events)
        events.append(('transfer', n))
        sent.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
        waited = []

        def note():
            if not waited:
                waited.append(True)
                events.append(('wait', n))
        return [_Watched(work, note) for work in real_batch(ops)]
    dist.batch_isend_irecv = batch_isend_irecv
    return lambda: setattr(dist, 'batch_isend_irecv', real_batch)


def _noting_computes(block_attention, events):
    """block_attention that records ('compute',) each time it runs."""
    def noted(*args, **kwargs):
        events.append(('compute',))
        return block_attention(*args, **kwargs)
    return noted


def load_module(source):
    """A student's module (a .py path) or a module name, loaded in this process."""
    if str(source).endswith('.py'):
        path = Path(source).resolve()
        spec = importlib.util.spec_from_file_location(f'_ring_{path.stem}', path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(source)


def _case_inputs(t, scale, seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return [torch.randn(*BATCH, t, D) * scale, torch.randn(*BATCH, t, D) * scale, torch.randn(*BATCH, t, D)]


def _error(got, want):
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
        return math.inf
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def ring_check_worker(rank, world_size, run):
    """Worker for launch(): run's cases for this many processes through `source`.ring_attention.

    Returns, per case, the errors of out and lse against plain attention in float64 on this
    rank's rows, the events recorded while it ran and the bytes each transfer sent; or
    {'not built': message} for a gap still raising NotImplementedError.
    """
    run_keys(run, ('source', 'cases'))
    events, sent = [], []
    restore = _recording(events, sent)
    try:
        module = load_module(run['source'])
        module.block_attention = _noting_computes(module.block_attention, events)
        results = []
        for letter, _, t, causal, layout, scale in run['cases']:
            q, k, v = _case_inputs(t, scale, seed=t + 7 * causal)
            pos = split_positions(t, world_size, layout)[rank]
            want_out, want_lse = plain_attention(q.double(), k.double(), v.double(), causal)
            events.clear()
            sent.clear()
            with torch.no_grad():
                got = module.ring_attention(q[..., pos, :], k[..., pos, :], v[..., pos, :], pos, pos.clone(),
                                            causal=causal)
            if not isinstance(got, (tuple, list)) or len(got) != 2:
                raise TypeError(tr('ring_attention should return (out, lse), it returned {what}',
                                   what=type(got).__name__))
            results.append(dict(errors=(_error(got[0], want_out[..., pos, :]), _error(got[1], want_lse[..., pos])),
                                events=list(events), sent=list(sent)))
        return results
    except NotImplementedError as gap:
        # every rank stops at the same gap, some with a transfer under way: leaving at once would cut a
        # peer's connection mid-transfer, so the ranks leave together
        dist.barrier()
        return {'not built': str(gap) or 'NotImplementedError'}
    finally:
        restore()


def overlapped(events):
    """(transfers with a computation between their start and their wait, transfers) in one pass's events."""
    starts = {n: i for i, (kind, *rest) in enumerate(events) if kind == 'transfer' for n in rest}
    waits = {rest[0]: i for i, (kind, *rest) in enumerate(events) if kind == 'wait'}
    computes = [i for i, (kind, *_) in enumerate(events) if kind == 'compute']
    hidden = sum(any(starts[n] < i < waits.get(n, math.inf) for i in computes) for n in starts)
    return hidden, len(starts)


def _failure_line(error):
    """What a worker's exception most likely means, in one line, with the worker's own message."""
    text = f'{type(error).__name__}: {error} {error.__cause__ or ""}'
    if isinstance(error, TimeoutError) or 'imed out' in text or 'timeout' in text.lower():
        return tr('FAIL: the ranks waited for each other for more than {s} s and were stopped: a deadlock. The '
                  'likely cause: every rank receives (or sends with a blocking call) before any rank sends, or a '
                  'rank skips a transfer the others make. Start every send and receive of a step together, with '
                  'batch_isend_irecv, on every rank.', s=RING_HANG_SECONDS)
    if 'second time' in text:
        return tr('FAIL: wait() was called a second time on a finished transfer (over gloo it never returns; the '
                  'check refused it). Wait for each transfer once.')
    return tr('FAIL: ring_attention raised an error in a worker process: {error}',
              error=str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__)


def _run_groups(source, cases, hang_seconds):
    """{processes: the workers' results} for every group of processes the cases need."""
    results = {}
    for procs in sorted({case[1] for case in cases}):
        mine = [case for case in cases if case[1] == procs]
        results[procs] = launch(ring_check_worker, procs, dict(source=str(source), cases=mine), threads=1,
                                timeout=hang_seconds + 60, op_timeout=hang_seconds)
        if any(isinstance(r, dict) for r in results[procs]):   # not built yet: the next group would say so too
            break
    return results


def _by_case(cases, results):
    """[(case, every rank's result for it)] in the order of cases, from {processes: [rank's list of results]}."""
    seen = {procs: 0 for procs in results}
    paired = []
    for case in cases:
        procs = case[1]
        paired.append((case, [ranks[seen[procs]] for ranks in results[procs]]))
        seen[procs] += 1
    return paired


def _part_lines(cases, results):
    """{letter: (passed, line)} for the parts (a)-(e), and part (f), the overlap, from every rank's results."""
    names = {'a': tr('without the mask, 2 processes, t = 96'),
             'b': tr('causal, 2 processes, t = 96'),
             'c': tr('3 processes, t = 100 (blocks of 34, 33 and 33 tokens), causal and not'),
             'd': tr('large scores (q and k × {s:g}), causal, 3 processes', s=LARGE),
             'e': tr('zig-zag split (rank r holds chunks r and 2P − 1 − r), causal, 3 processes')}
    worst, passes = {}, []
    for (letter, _, _, causal, *_), per_rank in _by_case(cases, results):
        errors = [math.inf if math.isnan(e) else e for r in per_rank for e in r['errors']]
        worst[letter] = max([worst.get(letter, 0.0)] + errors)
        if not causal:
            passes += [overlapped(r['events']) for r in per_rank]
    lines = {}
    for letter, what in names.items():
        tol = TOL_LARGE if letter == 'd' else TOL
        ok = worst[letter] <= tol
        lines[letter] = (ok, tr('{verdict} ({letter}) {what}: largest error {err:.1e} of the largest value '
                                '(allowed {tol:.0e})', verdict=_verdict(ok), letter=letter,
                                what=what, err=worst[letter], tol=tol))
    hidden, count = sum(h for h, _ in passes), sum(n for _, n in passes)
    ok = count > 0 and hidden == count
    lines['f'] = (ok, tr('{verdict} (f) overlap: over every rank\'s passes without the mask, {h} of {n} transfers had '
                         'a block computed between their start and their wait (all needed)',
                         verdict=_verdict(ok), h=hidden, n=count))
    return lines


def _verdict(ok):
    return tr('pass') if ok else tr('FAIL')


def _not_built(why):
    number = re.fullmatch(r'gap (\d+)(: \w+)?', why)
    print(tr('not built yet: gap {n} still raises NotImplementedError (fill it in, run the %%writefile '
             'cell again, then this one)', n=number.group(1)) if number else tr('not built yet: {gap}', gap=why))
    return False


def check_ring_attention(source='comp_perf.s12_ring', hang_seconds=None):
    """Hold ring_attention(q, k, v, q_pos, k_pos, causal=False) -> (out, lse) from `source` to plain attention.

    source: a student's file (e.g. 'artifacts/my_ring.py') or a module name. It runs in gloo
    processes, 2 and then 3, on fp32 inputs (batch 2, d = 16); the reference is plain attention
    in float64 over the whole sequence, and each rank's rows are compared (allowed TOL = 1e-4 of
    the largest value; 1e-3 in (d)). Parts: (a) no mask, 2 processes; (b) causal, 2 processes;
    (c) 3 processes and t = 100, which does not divide, causal and not; (d) q and k × 20, so
    that exp overflows unless the merge works from the larger logsumexp; (e) the zig-zag split,
    where a block from another rank holds two separate runs of positions; (f) the overlap: in
    the passes without the mask, every transfer has a block computed between the moment it
    starts (batch_isend_irecv) and its wait. A second wait() on a finished transfer is refused
    with a message (over gloo it would hang), and a ring that waits longer than hang_seconds
    (default RING_HANG_SECONDS) is stopped and called a deadlock, with its likely cause. Prints one
    line per part and a Result; returns True when all pass.
    """
    hang_seconds = hang_seconds or RING_HANG_SECONDS
    if str(source).endswith('.py'):
        if not Path(source).exists():
            print(tr('fail: there is no file {path} (run the %%writefile cell first)', path=source))
            return False
        source = str(Path(source).resolve())   # the workers import it by its full path
    print(tr('Check of ring_attention from {source}: gloo processes, batch {b}, head size {d}; a transfer that '
             'waits more than {s} s is called a deadlock', source=Path(source).name if str(source).endswith('.py')
             else source, b=BATCH[0], d=D, s=hang_seconds))
    try:
        results = _run_groups(source, CASES, hang_seconds)
    except Exception as error:   # a deadlock, a double wait, an error in the student's code
        print(_failure_line(error))
        print(tr('Ring attention: fail'))
        return False
    gaps = [r['not built'] for ranks in results.values() for r in ranks if isinstance(r, dict)]
    if gaps:
        return _not_built(gaps[0])
    lines = _part_lines(CASES, results)
    for ok, line in lines.values():
        print(line)
    passed = all(ok for ok, _ in lines.values())
    print(tr('Ring attention: pass') if passed else tr('Ring attention: fail'))
    return passed


def ring_run(rank, world_size, run):
    """Worker for launch(): the reference ring once, its per-rank work and times, for part 3's balance.

    run: t, heads, d, causal, layout, repeats. Returns this rank's score pairs computed (the
    rows × columns that visible_part keeps, summed over the blocks), the median seconds of the
    whole ring and of its computation alone, and the bytes it sent.
    """
    run_keys(run, ('t', 'heads', 'd', 'causal', 'layout', 'repeats'))
    t, heads, d = run['t'], run['heads'], run['d']
    q, k, v = _case_inputs_sized(t, heads, d)
    pos = split_positions(t, world_size, run['layout'])[rank]
    module = sys.modules[__name__]
    work, compute, sent = [0], [0.0], []
    real_block, real_batch = module.block_attention, dist.batch_isend_irecv

    def timed_block(q_b, k_b, *args):
        start = time.perf_counter()
        result = real_block(q_b, k_b, *args)
        compute[0] += time.perf_counter() - start
        work[0] += q_b.shape[-2] * k_b.shape[-2]
        return result

    def counted_batch(ops):
        sent.append(sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend))
        return real_batch(ops)
    module.block_attention, dist.batch_isend_irecv = timed_block, counted_batch
    try:
        totals, computes = [], []
        for _ in range(run['repeats'] + 1):   # the first pass warms up
            work[0], compute[0] = 0, 0.0
            sent.clear()
            dist.barrier()
            start = time.perf_counter()
            with torch.no_grad():
                ring_attention(q[..., pos, :], k[..., pos, :], v[..., pos, :], pos, pos.clone(), run['causal'])
            totals.append(time.perf_counter() - start)
            computes.append(compute[0])
        median = lambda xs: sorted(xs[1:])[len(xs[1:]) // 2]   # noqa: E731
        return dict(pairs=work[0], seconds=median(totals), compute=median(computes), sent=sum(sent))
    finally:
        module.block_attention, dist.batch_isend_irecv = real_block, real_batch


def _case_inputs_sized(t, heads, d):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return [torch.randn(heads, t, d) for _ in range(3)]



def show_ring_solution():
    """The reference's four gap functions, folded as a solution is."""
    from comp_perf.s06_bucketed import show_solution
    show_solution(*GAPS)


def imbalance(values):
    """The largest over the mean: 1 when every rank has the same work, P when one rank has all of it."""
    return max(values) / (sum(values) / len(values))
