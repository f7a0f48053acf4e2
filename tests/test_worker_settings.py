"""The workers' `run` dicts are checked (comp_perf/processes.py: run_keys): a misspelt or a
missing key stops the worker with a message naming it and the keys allowed, before the
worker touches a process group, so most of these tests call the workers in this process.
"""
import ast
import importlib

import pytest
from helpers import ROOT

import common
from comp_perf.s06_bucketed import bucketed_check

# Every worker that takes a `run` dict, with its smallest valid dict (the required keys).
WORKER_RUNS = {
    'dp_worker': dict(batch_size=64, lr=0.2, steps=1),
    'ddp_timeline': dict(width=8, batch_size=32, bucket_cap_mb=0.1, warmup=2, steps=5),
    'ps_process': dict(servers=1, steps=1, batch_size=32, lr=0.1),
    'ps_async_process': dict(servers=1, steps=1, batch_size=32, lr=0.1),
    'sharded_training': dict(widths=[4, 4], batch_size=4, steps=1, lr=0.1, modes=('ddp',), count_step=0),
    'tensor_parallel_check': dict(d=8, hidden=16, batch_size=4),
    'pipeline_run': dict(hidden=8, layers=2, classes=4, batch_size=4, repeats=1, schedules=[('GPipe', 2)]),
    'mesh_2d_training': dict(dp=2, tp=2, d=16, hidden=64, batch_size=16, steps=2, lr=0.1),
    'fsdp_timeline': dict(widths=[8, 8], batch_size=8, steps=1),
    'zero1_check_worker': dict(source='comp_perf.s08_zero_by_hand', widths=[4, 4], batch_size=4, steps=1,
                               lr=0.1, optimizers=('Adam',)),
    'ring_check_worker': dict(source='comp_perf.s12_ring', cases=()),
    'ring_run': dict(t=8, heads=1, d=4, causal=True, layout='contiguous', repeats=1),
    'dimensions_measured': dict(sharded={}, tensor={}, pipeline={}),
    'expert_parallel_check': dict(d=4, hidden=8, experts=2, top_k=1, capacity_factor=1.0, tokens=4, seed=0),
}
# Workers whose run is a list of runs (ps_in_turn) or an optional last argument (bucketed_check).
OTHER_SHAPES = {'ps_in_turn', 'bucketed_check'}


def _workers_with_a_run():
    """Names of the package's launch() workers that take a `run` or `runs` argument."""
    found = set()
    for path in (ROOT / 'comp_perf').glob('*.py'):
        for node in ast.parse(path.read_text(encoding='utf-8')).body:
            if isinstance(node, ast.FunctionDef) and \
                    (ast.get_docstring(node) or '').startswith('Worker for launch()') and \
                    {'run', 'runs'} & {a.arg for a in node.args.args}:
                found.add(node.name)
    return found


def _worker(name):
    """The worker function `name`, from the module that defines it (not all are in the map)."""
    for path in (ROOT / 'comp_perf').glob('*.py'):
        module = importlib.import_module(f'comp_perf.{path.stem}')
        if getattr(getattr(module, name, None), '__module__', None) == module.__name__:
            return getattr(module, name)
    raise LookupError(name)


def test_every_worker_with_a_run_dict_is_checked_here():
    assert _workers_with_a_run() == set(WORKER_RUNS) | OTHER_SHAPES, \
        'a new worker takes a run dict: call run_keys at its top and add it to WORKER_RUNS'


@pytest.mark.parametrize('name', sorted(WORKER_RUNS))
def test_a_misspelt_key_is_refused_with_the_keys_allowed(name):
    run = dict(WORKER_RUNS[name], timout=5)
    with pytest.raises(ValueError, match=rf"{name}: unknown key\(s\) \['timout'\]") as error:
        _worker(name)(0, 2, run)
    assert all(key in str(error.value) for key in WORKER_RUNS[name]), str(error.value)


@pytest.mark.parametrize('name', sorted(WORKER_RUNS))
def test_a_missing_key_is_refused(name):
    run = dict(WORKER_RUNS[name])
    first = next(iter(run))
    del run[first]
    with pytest.raises(ValueError, match=rf"{name}: missing key\(s\) \['{first}'\]"):
        _worker(name)(0, 2, run)


def test_the_message_lists_the_optional_keys_too():
    with pytest.raises(ValueError, match='It takes batch_size, lr, steps and optionally seed, subset, full_fp32.'):
        common.dp_worker(0, 1, dict(WORKER_RUNS['dp_worker'], subsets=64))
    with pytest.raises(TypeError, match='dp_worker takes its settings as a dict, got list'):
        common.dp_worker(0, 1, [64, 0.2, 1])


ASYNC = dict(servers=1, steps=20, batch_size=32, lr=0.1, subset=4096, timeout=30)


def test_a_misspelt_staleness_does_not_turn_an_async_run_into_a_synchronous_one():
    # ps_in_turn sends a run with a 'staleness' key to the asynchronous server; without the
    # check, 'stalenes' would quietly run the synchronous one and ignore the straggler.
    good, typo = dict(ASYNC, staleness=0, slow={1: 0.03}), dict(ASYNC, stalenes=0, slow={1: 0.03})
    with pytest.raises(ValueError, match=r"ps_in_turn: a run without a 'staleness' key goes to ps_process: "
                                         r"unknown key\(s\) \['stalenes', 'slow'\]") as error:
        common.ps_in_turn(0, 3, [good, typo])    # refused before the first run starts (no process group here)
    assert 'optionally seed, subset, piece, test_subset, timeout, fault, checkpoint' in str(error.value)


def test_the_fault_and_checkpoint_dicts_are_checked_too():
    with pytest.raises(ValueError, match=r"ps_process's fault: unknown key\(s\) \['stp'\]"):
        common.ps_process(0, 3, dict(WORKER_RUNS['ps_process'], fault=dict(role='worker', index=1, stp=3)))
    with pytest.raises(ValueError, match=r"ps_process's checkpoint: missing key\(s\) \['every'\]"):
        common.ps_process(0, 3, dict(WORKER_RUNS['ps_process'], checkpoint=dict(dir='ckpt', resume=True)))


def test_the_bucket_check_refuses_ddps_name_for_the_bucket_size():
    # 06 gives ddp_timeline bucket_cap_mb (DDP's name) but the check bucket_mb: one is easily taken for the other.
    with pytest.raises(ValueError, match=r"check_bucketed_allreduce: unknown key\(s\) \['bucket_cap_mb'\]"):
        common.check_bucketed_allreduce('my_buckets', run=dict(bucket_cap_mb=0.5))
    with pytest.raises(ValueError, match=r"bucketed_check: unknown key\(s\) \['bucket_cap_mb'\]"):
        bucketed_check(0, 2, 'my_buckets', str(ROOT), dict(bucket_cap_mb=0.5))


@pytest.mark.procs
def test_a_worker_process_reports_the_misspelt_key():
    # The same refusal, raised in the worker processes, reaches the caller through launch.
    with pytest.raises(ValueError, match=r"ps_in_turn: .*unknown key\(s\) \['stalenes'\]"):
        common.launch(common.ps_in_turn, 3, [dict(ASYNC, stalenes=2)], timeout=60, threads=1)
