"""Section 06's piece to build: bucketed gradient all-reduce from autograd hooks, and its check.

The check (common.check_bucketed_allreduce) passes the reference solution and fails planted
bugs, each on the part it should: no division by the world size fails the gradients; sending
every bucket after backward, or blocking backward on each all-reduce, fails the overlap; counts
never reset fail the second step's gradients; the notebook's own skeleton is reported as not
built yet. The tests that start processes (common.launch, directly or inside the check) carry
the procs mark.
"""
import nbpair
import pytest
import torch
from helpers import ROOT

import common
from comp_perf.s06_bucketed import TOLERANCE, bucketed_check, bucketed_parts

NO_DIVISION = '''
from comp_perf.s06_bucketed import BucketedAllReduce as Reference


class BucketedAllReduce(Reference):
    def __init__(self, model, bucket_mb=25):
        super().__init__(model, bucket_mb)
        self.world_size = 1   # planted: the sum of the gradients, not their mean
'''

AFTER_BACKWARD = '''
import torch
import torch.distributed as dist
from comp_perf.s06_bucketed import make_buckets


class BucketedAllReduce:   # planted: every bucket sent from finish(), after backward, then waited for
    def __init__(self, model, bucket_mb=25):
        self.buckets = make_buckets(list(model.parameters()), bucket_mb)

    def finish(self):
        sent = []
        for bucket in self.buckets:
            flat = torch.cat([q.grad.flatten() for q in bucket])
            sent.append((dist.all_reduce(flat, async_op=True), flat, bucket))
        for handle, flat, bucket in sent:
            handle.wait()
            flat /= dist.get_world_size()
            for q, g in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad.copy_(g.view_as(q.grad))
'''

NO_RESET = '''
from comp_perf.s06_bucketed import BucketedAllReduce as Reference


class BucketedAllReduce(Reference):
    def finish(self):   # planted: the counts are never reset, so the second step sends nothing
        ready = self.ready
        super().finish()
        self.ready = ready
'''

BLOCKING = '''
import torch
import torch.distributed as dist
from comp_perf.s06_bucketed import BucketedAllReduce as Reference


class BucketedAllReduce(Reference):
    def gradient_ready(self, p):   # planted: each full bucket's all-reduce blocks the backward pass
        k = self.bucket_of[p]
        self.ready[k] += 1
        if self.ready[k] == len(self.buckets[k]):
            flat = torch.cat([q.grad.flatten() for q in self.buckets[k]])
            dist.all_reduce(flat)
            self.pending.append((flat.new_empty(0), flat, self.buckets[k]))

    def finish(self):
        for _, flat, bucket in self.pending:
            flat /= self.world_size
            for q, g in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad.copy_(g.view_as(q.grad))
        self.ready, self.pending = [0] * len(self.buckets), []
'''

PLANTED = {'no_division': NO_DIVISION, 'after_backward': AFTER_BACKWARD, 'no_reset': NO_RESET, 'blocking': BLOCKING}


def notebook_skeleton():
    """The code of 06's %%writefile my_buckets.py cell, as the student gets it."""
    source = next((ROOT / 'notebooks' / 'src').glob('06-*.txt'))
    cell = next(c['en'] for c in nbpair.parse(source) if c['type'] == 'code'
                and c['en'].startswith('%%writefile my_buckets.py'))
    return cell.split('\n', 1)[1]


# What a student writes into the skeleton's three gaps
FILLED = {
    "    raise NotImplementedError('GAP 1: make_buckets')": """\
    buckets, size = [[]], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > bucket_mb * 2**20:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets""",
    "        raise NotImplementedError('GAP 2: gradient_ready')": """\
        if self.ready[k] == len(self.buckets[k]):
            flat = torch.cat([q.grad.flatten() for q in self.buckets[k]])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[k]))""",
    "        raise NotImplementedError('GAP 3: finish')": """\
        for handle, flat, bucket in self.pending:
            handle.wait()
            flat /= self.world_size
            for q, average in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad.copy_(average.view_as(q.grad))
        self.ready = [0] * len(self.buckets)
        self.pending = []""",
}


def filled_skeleton(gaps=FILLED):
    code = notebook_skeleton()
    for gap, answer in gaps.items():
        assert code.count(gap) == 1, gap
        code = code.replace(gap, answer)
    return code


# Without processes: the buckets and the verdict's parts

def test_make_buckets_fills_in_reverse_order_within_the_size():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 30, 40)]   # float32: 4 bytes each
    buckets = common.make_buckets(params, bucket_mb=240 / 2**20)                      # 240 bytes
    assert [[p.numel() for p in b] for b in buckets] == [[40], [30, 20], [300], [10]]
    assert sorted(id(p) for b in buckets for p in b) == sorted(id(p) for p in params)
    assert common.make_buckets(params, bucket_mb=25) == [list(reversed(params))]


def _result(steps, grad_gap=0.0, param_gap=0.0, params=4):
    return {'grad_gap': grad_gap, 'param_gap': param_gap, 'params': params, 'steps': steps}


GOOD_STEP = [('gradient', 'd', 0.1), ('gradient', 'c', 0.2), ('all-reduce', 2, 0.21, True),
             ('gradient', 'b', 0.3), ('gradient', 'a', 0.4), ('all-reduce', 2, 0.41, True)]


def test_parts_pass_a_good_step_and_name_each_failure():
    parts = bucketed_parts(_result([GOOD_STEP, GOOD_STEP]))
    assert {name: ok for name, (ok, _) in parts.items()} == {'grads': True, 'overlap': True, 'buckets': True}
    assert parts['overlap'][1] == (1, 2)
    assert not bucketed_parts(_result([GOOD_STEP], grad_gap=1.0))['grads'][0]
    assert not bucketed_parts(_result([GOOD_STEP], param_gap=2 * TOLERANCE))['grads'][0]
    late = [e for e in GOOD_STEP if e[0] == 'gradient'] + [('all-reduce', 2, 0.5, True), ('all-reduce', 2, 0.6, True)]
    assert not bucketed_parts(_result([GOOD_STEP, late]))['overlap'][0]   # every step must overlap
    waiting = [e[:3] + (False,) if e[0] == 'all-reduce' else e for e in GOOD_STEP]
    assert not bucketed_parts(_result([waiting]))['overlap'][0]   # a blocking all-reduce hides nothing
    one = [e for e in GOOD_STEP if e[0] == 'gradient'] + [('all-reduce', 4, 0.5, True)]
    assert not bucketed_parts(_result([one]))['buckets'][0]
    each = [e for pair in zip([e for e in GOOD_STEP if e[0] == 'gradient'], [('all-reduce', 1, 0, True)] * 4)
            for e in pair]
    parts = bucketed_parts(_result([each]))
    assert parts['overlap'][0] and not parts['buckets'][0]   # one all-reduce per parameter is not bucketing
    assert not bucketed_parts(_result([]))['overlap'][0]


# With processes (common.launch): the reference, planted bugs and the notebook's skeleton

@pytest.fixture(scope='module')
def planted(tmp_path_factory):
    """{name: bucketed_check's result} for each planted bug, run in two gloo processes."""
    folder = tmp_path_factory.mktemp('planted')
    for name, code in PLANTED.items():
        (folder / f'{name}.py').write_text(code)
    return {name: common.launch(bucketed_check, 2, name, str(folder), None, threads=1, timeout=120,
                                op_timeout=60)[0] for name in PLANTED}


def _passed(result):
    return {name: ok for name, (ok, _) in bucketed_parts(result).items()}


@pytest.mark.procs
def test_the_reference_passes_every_part(capsys):
    assert common.check_bucketed_allreduce('comp_perf.s06_bucketed') == 'pass'
    out = capsys.readouterr().out
    parts = [line for line in out.splitlines() if line.startswith('  ')]
    assert len(parts) == 3 and all(line.endswith(': pass') for line in parts)
    assert out.rstrip().endswith('Result: pass')


@pytest.mark.procs
def test_the_notebooks_skeleton_is_not_built_yet(tmp_path, capsys):
    (tmp_path / 'skeleton.py').write_text(notebook_skeleton())
    assert common.check_bucketed_allreduce('skeleton', folder=tmp_path) == 'not built'
    out = capsys.readouterr().out
    assert 'not built yet: GAP 1: make_buckets' in out and 'Traceback' not in out


@pytest.mark.procs
def test_forgetting_to_divide_fails_the_gradients_only(planted):
    assert _passed(planted['no_division']) == {'grads': False, 'overlap': True, 'buckets': True}
    assert planted['no_division']['grad_gap'] >= 0.5   # twice DDP's gradients: a gap of about the largest one


@pytest.mark.procs
def test_sending_after_backward_fails_the_overlap_only(planted):
    assert _passed(planted['after_backward']) == {'grads': True, 'overlap': False, 'buckets': True}
    assert bucketed_parts(planted['after_backward'])['overlap'][1][0] == 0


@pytest.mark.procs
def test_a_blocking_all_reduce_during_backward_fails_the_overlap(planted):
    assert _passed(planted['blocking']) == {'grads': True, 'overlap': False, 'buckets': True}


@pytest.mark.procs
def test_counts_never_reset_fail_the_second_step(planted):
    assert _passed(planted['no_reset'])['grads'] is False
    first, second = planted['no_reset']['steps']
    assert any(kind == 'all-reduce' for kind, *_ in first)
    assert not any(kind == 'all-reduce' for kind, *_ in second)


@pytest.mark.procs
def test_the_skeleton_with_its_gaps_filled_passes_and_half_filled_is_not_built(tmp_path, capsys):
    (tmp_path / 'filled.py').write_text(filled_skeleton())
    assert common.check_bucketed_allreduce('filled', folder=tmp_path) == 'pass'
    two_gaps = {gap: answer for gap, answer in FILLED.items() if 'GAP 3' not in gap}
    (tmp_path / 'half.py').write_text(filled_skeleton(two_gaps))
    assert common.check_bucketed_allreduce('half', folder=tmp_path) == 'not built'
    assert 'not built yet: GAP 3: finish' in capsys.readouterr().out


@pytest.mark.procs
def test_a_failing_check_prints_fail_and_names_the_part(tmp_path, capsys):
    (tmp_path / 'late.py').write_text(AFTER_BACKWARD)
    assert common.check_bucketed_allreduce('late', folder=tmp_path) == 'fail'
    assert capsys.readouterr().out.rstrip().endswith('Result: fail (the overlap)')
