"""Section 06's piece to build: bucketed gradient all-reduce from autograd hooks, and its check.

The check (common.check_bucketed_allreduce) passes the reference solution, in 2 and in 3 gloo
processes, and fails planted bugs, each on the part it should: no broadcast at construction
fails the start; no division by the world size fails the gradients; an all-reduce waited for
inside the hook, every bucket sent from finish(), fail the overlap; one all-reduce per parameter
fails the buckets; a bucket held back by a parameter without a gradient fails the unused layer;
a bucket built from one backward pass's gradient only fails the accumulation. The notebook's own
skeleton is reported as not built yet, and with its gaps filled as a student would, passes. The
tests that start processes (common.launch, directly or inside the check) carry the procs mark.
"""
import nbpair
import pytest
import torch
import workers
from helpers import ROOT

import common
from comp_perf import s06_bucketed
from comp_perf.s06_bucketed import TOLERANCE, bucketed_parts, combine, overlapping

REFERENCE = 'from comp_perf.s06_bucketed import BucketedAllReduce as Reference, make_buckets\n'

PLANTED = {
    'no_broadcast': REFERENCE + '''
import torch.distributed as dist


class BucketedAllReduce(Reference):
    def __init__(self, model, bucket_mb=25):   # planted: no broadcast, every rank keeps its own weights
        self.world_size = dist.get_world_size()
        self.buckets = make_buckets([p for p in model.parameters() if p.requires_grad], bucket_mb)
        self.bucket_of = {p: k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.ready, self.pending, self.in_backward = [0] * len(self.buckets), [], False
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self.gradient_ready)
''',
    'no_division': REFERENCE + '''

class BucketedAllReduce(Reference):
    def __init__(self, model, bucket_mb=25):
        super().__init__(model, bucket_mb)
        self.world_size = 1   # planted: the sum of the gradients, not their mean
''',
    'wait_in_hook': REFERENCE + '''
import torch
import torch.distributed as dist


class BucketedAllReduce(Reference):
    def send(self, k):   # planted: started asynchronously, then waited for at once, inside the hook
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).flatten()
                          for q in self.buckets[k]])
        handle = dist.all_reduce(flat, async_op=True)
        handle.wait()
        self.pending.append((handle, flat, self.buckets[k]))
''',
    'all_in_finish': REFERENCE + '''

class BucketedAllReduce(Reference):
    def gradient_ready(self, p):   # planted: counts and queues finish(), but sends nothing until then
        if not self.in_backward:
            self.in_backward = True
            __import__('torch').autograd.Variable._execution_engine.queue_callback(self.finish)
''',
    'one_per_parameter': REFERENCE + '''

class BucketedAllReduce(Reference):
    def __init__(self, model, bucket_mb=25):
        super().__init__(model, bucket_mb=0)   # planted: every parameter is a bucket of its own
''',
    'unused_ignored': REFERENCE + '''

class BucketedAllReduce(Reference):
    def finish(self):   # planted: a bucket held back by a parameter without a gradient is never sent
        for handle, flat, bucket in self.pending:
            handle.wait()
            flat /= self.world_size
            for q, average in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad = average.view_as(q)
        self.ready, self.pending, self.in_backward = [0] * len(self.buckets), [], False
''',
    'accumulation_overwritten': REFERENCE + '''
import torch
import torch.distributed as dist


class BucketedAllReduce(Reference):
    """planted: each bucket carries this backward pass's gradient only, so finish() overwrites
    what earlier passes accumulated in .grad with the last micro-batch's average."""

    def __init__(self, model, bucket_mb=25):
        super().__init__(model, bucket_mb)
        self.this_pass = {}
        for p in self.bucket_of:
            p.register_hook(lambda g, p=p: self.this_pass.__setitem__(p, g))

    def send(self, k):
        flat = torch.cat([self.this_pass.get(q, torch.zeros_like(q)).flatten() for q in self.buckets[k]])
        self.pending.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[k]))

    def finish(self):
        super().finish()
        self.this_pass = {}
''',
}

# the one part each planted bug must fail (no_division fails every part that compares gradients)
FAILS = {'no_broadcast': {'same_start'}, 'no_division': {'grads', 'accumulation', 'unused'},
         'wait_in_hook': {'overlap'}, 'all_in_finish': {'overlap'}, 'one_per_parameter': {'buckets'},
         'unused_ignored': {'unused'}, 'accumulation_overwritten': {'accumulation'}}


def notebook_skeleton():
    """The code of 06's %%writefile my_buckets.py cell, as the student gets it."""
    source = next((ROOT / 'notebooks' / 'src').glob('06-*.txt'))
    cell = next(c['en'] for c in nbpair.parse(source) if c['type'] == 'code'
                and c['en'].startswith('%%writefile my_buckets.py'))
    return cell.split('\n', 1)[1]


# What a student writes into the skeleton's five gaps
FILLED = {
    "    raise NotImplementedError('gap 1: make_buckets')": """\
    buckets, size = [[]], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > bucket_mb * 2**20:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets""",
    "        raise NotImplementedError('gap 2: __init__')": """\
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.detach(), src=0)""",
    "        raise NotImplementedError('gap 3: gradient_ready')": """\
        while len(self.pending) < len(self.buckets):
            k = len(self.pending)
            if self.ready[k] < len(self.buckets[k]):
                break
            self.send(k)""",
    "        raise NotImplementedError('gap 4: send')": """\
        grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in self.buckets[k]]
        flat = torch.cat([g.flatten() for g in grads])
        self.pending.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[k]))""",
    "        raise NotImplementedError('gap 5: finish')": """\
        for k in range(len(self.pending), len(self.buckets)):
            self.send(k)
        for handle, flat, bucket in self.pending:
            handle.wait()
            flat /= self.world_size
            for q, average in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad = average.view_as(q)
        self.ready = [0] * len(self.buckets)
        self.pending = []
        self.in_backward = False""",
}


def filled_skeleton(gaps=FILLED):
    code = notebook_skeleton()
    for gap, answer in gaps.items():
        assert code.count(gap) == 1, gap
        code = code.replace(gap, answer)
    return code


# Without processes: the buckets and the verdict's parts

def test_each_part_points_at_gaps_the_skeleton_has():
    skeleton = notebook_skeleton()
    assert set(s06_bucketed.PART_GAPS) == set(s06_bucketed.PARTS)
    for part, gaps in s06_bucketed.PART_GAPS.items():
        for n, name in gaps:
            assert f"raise NotImplementedError('gap {n}: {name}')" in skeleton, (part, n, name)


def test_make_buckets_fills_in_reverse_order_within_the_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 30, 40)]   # float32: 4 bytes each
    buckets = common.make_buckets(params, bucket_mb=240 / 2**20)                      # 240 bytes
    assert [[p.numel() for p in b] for b in buckets] == [[40], [30, 20], [300], [10]]
    assert sorted(id(p) for b in buckets for p in b) == sorted(id(p) for p in params)
    assert common.make_buckets(params, bucket_mb=25) == [list(reversed(params))]


GOOD_PASS = [('gradient', 'd'), ('gradient', 'c'), ('all-reduce', 0, 2),
             ('gradient', 'b'), ('gradient', 'a'), ('all-reduce', 1, 2), ('wait', 0), ('wait', 1)]


def _result(passes, params=4, **gaps):
    return {'params': params, 'passes': passes,
            **{part: gaps.get(part, 0.0) for part in ('same_start', 'grads', 'accumulation', 'unused')}}


def _ok(result):
    return {name: ok for name, (ok, _) in bucketed_parts(result).items()}


def test_overlap_counts_an_all_reduce_only_if_it_started_early_and_was_not_waited_for_early():
    assert overlapping(GOOD_PASS) == (1, 2)
    waited = GOOD_PASS[:3] + [('wait', 0)] + GOOD_PASS[3:6] + [('wait', 1)]   # .wait() inside the hook
    assert overlapping(waited) == (0, 2)
    late = [e for e in GOOD_PASS if e[0] == 'gradient'] + [('all-reduce', 0, 4), ('wait', 0)]
    assert overlapping(late) == (0, 1)
    assert overlapping([]) == (0, 0)


def test_the_recorder_notes_a_wait_through_the_handle_its_future_or_a_synchronous_call(monkeypatch):
    class Future:
        def wait(self):
            return 'summed'

    class Work:
        def wait(self):
            return True

        def get_future(self):
            return Future()

        def is_completed(self):
            return False

    monkeypatch.setattr(s06_bucketed.dist, 'all_reduce', lambda t, async_op=False: Work() if async_op else None)
    events, recording = [], [True]
    all_reduce = s06_bucketed._record_all_reduce(events, recording)
    handle = all_reduce(torch.zeros(3), async_op=True)
    assert events == [('all-reduce', 0, 3)] and handle.is_completed() is False   # other methods pass through
    assert handle.get_future().wait() == 'summed'
    assert events[1:] == [('wait', 0)]   # a wait through the Future counts
    assert handle.wait() is True and events[1:] == [('wait', 0)]   # noted once, at the first wait
    all_reduce(torch.zeros(2))   # synchronous: it waits at once
    assert events[2:] == [('all-reduce', 1, 2), ('wait', 1)]
    recording[0] = False
    assert isinstance(all_reduce(torch.zeros(1), async_op=True), Work) and len(events) == 4


def test_parts_pass_good_passes_and_name_each_failure():
    assert all(_ok(_result([GOOD_PASS] * 3)).values())
    for part in ('same_start', 'grads', 'accumulation', 'unused'):
        assert _ok(_result([GOOD_PASS], **{part: 2 * TOLERANCE})) == {
            name: name != part for name in ('same_start', 'grads', 'accumulation', 'unused', 'overlap', 'buckets')}
    waited = GOOD_PASS[:3] + [('wait', 0)] + GOOD_PASS[3:6] + [('wait', 1)]
    assert not _ok(_result([GOOD_PASS, waited]))['overlap']   # every backward pass must overlap
    one = [e for e in GOOD_PASS if e[0] == 'gradient'] + [('all-reduce', 0, 4)]
    assert not _ok(_result([one]))['buckets']
    each = [e for k, g in enumerate(e for e in GOOD_PASS if e[0] == 'gradient')
            for e in (g, ('all-reduce', k, 1))]
    assert _ok(_result([each]))['overlap'] and not _ok(_result([each]))['buckets']
    assert not _ok(_result([]))['overlap']


def test_combine_takes_the_largest_gap_of_any_rank():
    ranks = [_result([GOOD_PASS]), {part: 0.0 for part in ('same_start', 'grads', 'accumulation', 'unused')}]
    ranks[1]['grads'] = 0.5
    assert combine(ranks)['grads'] == 0.5 and combine(ranks)['passes'] == [GOOD_PASS]
    assert combine([ranks[0], {'not built': 'gap 1'}]) == {'not built': 'gap 1'}


def test_the_check_refuses_a_world_of_one():
    with pytest.raises(ValueError, match='procs must be an integer of at least 2'):
        common.check_bucketed_allreduce('comp_perf.s06_bucketed', procs=1)


# With processes (common.launch): the reference, planted bugs and the notebook's skeleton

def _graded(folder, procs):
    """{name: combined bucketed_check result} for every planted bug, graded in one group of `procs` processes."""
    for name, code in PLANTED.items():
        (folder / f'{name}.py').write_text(code)
    results = common.launch(workers.bucketed_checks, procs, sorted(PLANTED), str(folder), threads=1, timeout=180,
                            op_timeout=60)
    return {name: combine([r[name] for r in results]) for name in PLANTED}


@pytest.fixture(scope='module')
def planted(tmp_path_factory):
    """{procs: {name: combined result}} for each planted bug, in two and in three gloo processes."""
    return {procs: _graded(tmp_path_factory.mktemp(f'planted{procs}'), procs) for procs in (2, 3)}


@pytest.mark.procs
@pytest.mark.parametrize('procs', [2, 3])
def test_the_reference_passes_every_part(procs, capsys):
    assert common.check_bucketed_allreduce('comp_perf.s06_bucketed', procs=procs) == 'pass'
    out = capsys.readouterr().out
    assert f': {procs} processes (gloo)' in out
    parts = [line for line in out.splitlines() if line.startswith('  ')]
    assert len(parts) == 6 and all(line.endswith(': pass') for line in parts)
    assert out.rstrip().endswith('Result: pass')


@pytest.mark.procs
@pytest.mark.parametrize('procs', [2, 3])
@pytest.mark.parametrize('bug', sorted(PLANTED))
def test_each_planted_bug_fails_its_own_part(planted, bug, procs):
    failed = {name for name, ok in _ok(planted[procs][bug]).items() if not ok}
    assert failed == FAILS[bug], f'{bug} in {procs} processes: failed {failed}'


@pytest.mark.procs
def test_the_planted_bugs_say_why(planted):
    planted = planted[2]
    assert planted['no_division']['grads'] >= 0.5   # twice DDP's gradients: a gap of about the largest one
    assert all(early == 0 for early, _ in map(overlapping, planted['wait_in_hook']['passes']))
    assert all(n == planted['one_per_parameter']['params'] for _, n in map(overlapping,
                                                                          planted['one_per_parameter']['passes']))


@pytest.mark.procs
def test_a_planted_bug_in_three_processes_prints_its_part(tmp_path, capsys):
    (tmp_path / 'unused_ignored.py').write_text(PLANTED['unused_ignored'])
    assert common.check_bucketed_allreduce('unused_ignored', folder=tmp_path, procs=3) == 'fail'
    out = capsys.readouterr().out.rstrip()
    assert out.endswith('Result: fail (the unused layer)\n  the unused layer: the work of gap 4 (send)'), out


# Accumulation first, in the middle and last: micro-batches per step
PLANS = [(2, 1, 1), (1, 2, 1), (1, 1, 2)]


@pytest.mark.procs
@pytest.mark.parametrize('procs', [2, 3])
def test_the_reference_equals_a_plain_average_in_float64_with_accumulation_anywhere(tmp_path, procs):
    """Trained together for several steps, never reset: the reference stays on the plain average; a class
    that keeps only the last micro-batch's gradient does not (its gap is of the order of the gradients)."""
    (tmp_path / 'overwritten.py').write_text(PLANTED['accumulation_overwritten'])
    results = common.launch(workers.bucketed_against_plain_average, procs, ['comp_perf.s06_bucketed', 'overwritten'],
                            str(tmp_path), PLANS, threads=1, timeout=120, op_timeout=60)
    for plan, *gaps in zip(PLANS, *(r['comp_perf.s06_bucketed'] for r in results)):
        assert max(gaps) < 1e-12, f'{procs} processes, micro-batches {plan}: the reference is {max(gaps):.1e} away'
    for plan, *gaps in zip(PLANS, *(r['overwritten'] for r in results)):
        assert max(gaps) > 1e-3, f'{procs} processes, micro-batches {plan}: the planted bug passed ({max(gaps):.1e})'


@pytest.mark.procs
def test_the_notebooks_skeleton_is_not_built_yet(tmp_path, capsys):
    (tmp_path / 'skeleton.py').write_text(notebook_skeleton())
    assert common.check_bucketed_allreduce('skeleton', folder=tmp_path) == 'not built'
    out = capsys.readouterr().out
    assert 'not built yet: gap 1 (make_buckets) still raises NotImplementedError' in out and 'Traceback' not in out


@pytest.mark.procs
def test_the_skeleton_with_its_gaps_filled_passes_and_half_filled_is_not_built(tmp_path, capsys):
    (tmp_path / 'filled.py').write_text(filled_skeleton())
    assert common.check_bucketed_allreduce('filled', folder=tmp_path) == 'pass'
    no_finish = {gap: answer for gap, answer in FILLED.items() if 'gap 5' not in gap}
    (tmp_path / 'half.py').write_text(filled_skeleton(no_finish))
    assert common.check_bucketed_allreduce('half', folder=tmp_path) == 'not built'
    assert 'not built yet: gap 5 (finish) still raises NotImplementedError' in capsys.readouterr().out


def test_each_step_of_the_check_starts_from_ddps_parameters():
    """Models trained apart drift by rounding, more on some CPUs than others: each compared step starts equal."""
    class Wrapped(torch.nn.Module):   # stands in for DDP: what _step uses of it is .module and the call
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, x):
            return self.module(x)

    torch.manual_seed(0)
    theirs, mine = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)   # different starting weights
    batch = [(torch.randn(5, 4), torch.randint(0, 3, (5,)))]
    assert s06_bucketed._step(Wrapped(theirs), mine, batch, 0.1, [], [False], []) == 0.0
    assert torch.equal(mine.weight, theirs.weight)
