"""Section 06: ResNet-18, torchrun, and when DDP all-reduces its buckets (comp_perf/s06_ddp.py)."""

import pytest
import torch
from process_checks import alive, children, wait_until

import common
from comp_perf.processes import node_gpus


def test_resnet18_for_28x28_inputs():
    narrow, full = common.resnet18(width=8), common.resnet18()
    assert narrow(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    count = lambda net: sum(p.numel() for p in net.parameters())  # noqa: E731
    assert 11_000_000 < count(full) < 11_400_000 and count(full) > 50 * count(narrow)


def _script(tmp_path, body):
    path = tmp_path / 'job.py'
    path.write_text('import os, sys, time\nimport torch.distributed as dist\n' + body)
    return path


@pytest.mark.procs
def test_torchrun_two_nodes_meet_on_this_host(tmp_path):
    job = _script(tmp_path, "dist.init_process_group('gloo')\n"
                            "print('node', os.environ['GROUP_RANK'], 'rank', dist.get_rank(),"
                            " 'of', dist.get_world_size(), flush=True)\n"
                            'dist.barrier()\ndist.destroy_process_group()\n')
    outputs = common.torchrun(job, nnodes=2, timeout=120)
    lines = sorted(line for out in outputs for line in out.splitlines() if line.startswith('node'))
    assert lines == ['node 0 rank 0 of 2', 'node 1 rank 1 of 2']


@pytest.mark.procs
def test_torchrun_tells_the_script_the_notebooks_language(tmp_path, monkeypatch):
    """A Chinese notebook's language comes from its folder; the script learns it from COURSE_LANG."""
    folder = tmp_path / 'notebooks' / 'zh'
    folder.mkdir(parents=True)
    monkeypatch.chdir(folder)
    monkeypatch.delenv('COURSE_LANG', raising=False)
    job = _script(tmp_path, "print('language', os.environ.get('COURSE_LANG'), flush=True)\n")
    assert 'language zh' in common.torchrun(job, timeout=120)[0].splitlines()


@pytest.mark.procs
def test_torchrun_failure_raises_with_the_scripts_error(tmp_path):
    job = _script(tmp_path, "raise SystemExit('the script broke on purpose')\n")
    with pytest.raises(RuntimeError, match='the script broke on purpose'):
        common.torchrun(job, nproc_per_node=2, timeout=120)


def test_06_adds_a_run_on_every_gpu_only_on_t2(fake_gpus):
    """06's choice of process counts, read from its source and run with a faked GPU count."""
    from types import SimpleNamespace
    import nbpair
    src = next(f for f in nbpair.sources() if f.name.startswith('06'))
    line = next(row for c in nbpair.parse(src) if c['type'] == 'code'
                for row in c['en'].splitlines() if row.startswith('counts = '))
    for gpus, backend, expected in [(0, 'gloo', [1, 2]), (1, 'gloo', [1, 2]), (2, 'nccl', [1, 2]),
                                    (8, 'nccl', [1, 2, 8]), (8, 'gloo', [1, 2])]:
        fake_gpus(gpus)
        namespace = {'common': common, 'cfg': SimpleNamespace(backend=backend)}
        exec(line, namespace)
        assert namespace['counts'] == expected, (gpus, backend)


def test_two_nodes_on_a_multi_gpu_host_see_their_own_gpus(monkeypatch, fake_gpus):
    """On T2, two launchers must not both give LOCAL_RANK 0 the same cuda:0 (NCCL refuses)."""
    fake_gpus(4)
    monkeypatch.delenv('CUDA_VISIBLE_DEVICES', raising=False)
    assert node_gpus(2, 1) == ['0', '1']
    assert node_gpus(2, 2) == ['0,1', '2,3']
    assert node_gpus(1, 4) == [None]                 # one node: leave the environment alone
    assert node_gpus(3, 2) == [None, None, None]     # not a GPU for every process: leave it
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '4,5,6,7')   # the user already restricted the GPUs
    assert node_gpus(2, 2) == ['4,5', '6,7']
    fake_gpus(0)
    assert node_gpus(2, 1) == [None, None]           # CPU machines: gloo, nothing to hide


@pytest.mark.procs
def test_torchrun_timeout_leaves_nothing_behind(tmp_path):
    job = _script(tmp_path, f"open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\n"
                            'time.sleep(600)\n')
    with pytest.raises(TimeoutError, match='did not finish within 8 s'):
        common.torchrun(job, nproc_per_node=2, timeout=8)
    # however far torchrun got in 8 s on a loaded machine, nothing it started may survive
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) <= 2 and wait_until(lambda: not any(alive(pid) for pid in pids), 10)
    assert wait_until(lambda: not children(), 10), children()


# DDP's bucketed all-reduce during backward, measured (06's timeline)

DDP_RUN = dict(width=8, batch_size=32, bucket_cap_mb=0.1, warmup=2, steps=5)


DDP_MODES = ('overlapped', 'after backward')


@pytest.fixture(scope='module')
def ddp_result():
    return common.launch(common.ddp_timeline, 2, DDP_RUN, threads=1, timeout=120)[0]


@pytest.fixture(scope='module')
def ddp_names():
    return [name for name, _ in common.resnet18(width=DDP_RUN['width']).named_parameters()]


@pytest.mark.procs
def test_hooks_give_the_gradients_of_ddps_builtin_allreduce(ddp_result):
    assert ddp_result['same_grads'] is True


@pytest.mark.procs
def test_every_parameter_is_in_exactly_one_bucket(ddp_result, ddp_names):
    in_buckets = [name for bucket in ddp_result['buckets'] for name in bucket]
    assert sorted(in_buckets) == sorted(ddp_names)
    assert 3 <= len(ddp_result['buckets']) <= 6


@pytest.mark.parametrize('mode', DDP_MODES)
@pytest.mark.procs
def test_ddp_sees_every_gradient_once_per_step(ddp_result, ddp_names, mode):
    # register_post_accumulate_grad_hook fires under DDP, once per parameter
    seen = [name for name, _ in ddp_result[mode]['median step']['grad']]
    assert sorted(seen) == sorted(ddp_names)


@pytest.mark.parametrize('mode', DDP_MODES)
@pytest.mark.procs
def test_a_bucket_is_sent_only_after_its_gradients_are_ready(ddp_result, mode):
    step = ddp_result[mode]['median step']
    ready = dict(step['grad'])
    starts = {k: start for k, start, _ in step['allreduce']}
    assert sorted(starts) == list(range(len(ddp_result['buckets'])))  # every bucket, once
    for k, bucket in enumerate(ddp_result['buckets']):
        assert starts[k] >= max(ready[name] for name in bucket)
    assert list(starts.values()) == sorted(starts.values())  # DDP sends buckets in index order
    assert all(start <= end for _, start, end in step['allreduce'])


@pytest.mark.procs
def test_ddp_starts_all_but_the_last_bucket_while_backward_computes(ddp_result):
    step = ddp_result['overlapped']['median step']
    *early, last = step['allreduce']
    assert all(start < step['computed'] for _, start, _ in early)
    assert last[1] >= step['computed']  # the last bucket holds the last gradient
    assert ddp_result['overlapped']['overlap'] > 0


@pytest.mark.procs
def test_the_baseline_sends_nothing_before_backward_has_computed_everything(ddp_result):
    step = ddp_result['after backward']['median step']
    assert all(start >= step['computed'] for _, start, _ in step['allreduce'])
    assert ddp_result['after backward']['overlap'] == 0


@pytest.mark.parametrize('mode', DDP_MODES)
@pytest.mark.procs
def test_ddp_phases_follow_each_other(ddp_result, mode):
    step = ddp_result[mode]['median step']
    assert 0 < step['forward'][1] == step['backward'][0] < step['computed'] <= step['backward'][1]
    assert step['backward'][1] == step['optimizer'][0] < step['optimizer'][1] == step['step_s']
    assert max(end for _, _, end in step['allreduce']) <= step['backward'][1]  # DDP waits for all
    assert step['all computed'] >= step['computed']
