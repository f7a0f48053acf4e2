"""Checks that only a GPU can run: the course's CUDA and NCCL paths, for real.

They are skipped on machines without CUDA (CI has none). Run them on a GPU
machine with `python -m pytest tests/test_gpu.py`; tools/gpu_smoke.py runs the
notebooks there. Every comparison is between two measurements of one run.
"""
import pytest
import torch
from helpers import ROOT
from notebook_code import definitions

import common

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA GPU')


@pytest.mark.procs
def test_launch_with_nccl_communicates_gpu_tensors():
    n = min(2, common.num_gpus())
    assert common.launch(common.allreduce_check, n, backend='nccl') == [n * (n + 1) / 2] * n


@pytest.mark.procs
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason='a ring of one rank sends nothing: needs two GPUs')
def test_ring_allreduce_on_nccl_between_two_gpus():
    assert max(common.launch(common.ring_check, 2, 1001, backend='nccl')) < 1e-5


@pytest.mark.procs
def test_dp_worker_on_nccl_trains_on_the_gpu_like_on_the_cpu(fashion_mnist):
    run = dict(batch_size=64, lr=0.2, steps=2, subset=256, full_fp32=True)
    gpu = common.launch(common.dp_worker, 1, run, backend='nccl')[0]
    cpu = common.launch(common.dp_worker, 1, run, backend='gloo')[0]
    assert (gpu['device'], cpu['device']) == ('cuda:0', 'cpu')
    difference = common.step_difference(common.lenet_params(0), gpu['params'], cpu['params'])
    print(f'dp_worker, 2 steps: GPU (full FP32) against CPU: {difference:.1e} of the step')
    assert difference < common.step_tolerance(torch.float32, 'cuda')


def test_full_fp32_removes_the_tf32_error_of_convolutions():
    torch.manual_seed(0)
    x = torch.randn(64, 32, 28, 28, device='cuda')
    w = torch.randn(64, 32, 3, 3, device='cuda')
    exact = torch.nn.functional.conv2d(x.double(), w.double())
    knob = torch.backends.cudnn.conv
    saved = knob.fp32_precision
    try:
        knob.fp32_precision = 'tf32'
        fast = torch.nn.functional.conv2d(x, w)
        with common.full_fp32():
            full = torch.nn.functional.conv2d(x, w)
        assert knob.fp32_precision == 'tf32'
    finally:
        knob.fp32_precision = saved
    err_tf32 = float((fast.double() - exact).abs().max())
    err_full = float((full.double() - exact).abs().max())
    print(f'largest error: TF32 {err_tf32:.2e}, full FP32 {err_full:.2e}')
    assert err_full < err_tf32 / 10


def test_data_parallel_step_equals_single_device_step_on_the_gpu():
    torch.manual_seed(0)
    X, y = torch.rand(256, 1, 28, 28), torch.randint(0, 10, (256,))
    params = common.lenet_params(seed=2)
    devices = common.replica_devices(2)
    section = definitions('05-multi-gpu-from-scratch', 'get_params', 'allreduce', 'split_batch', 'train_batch')
    get_params, train_batch = section['get_params'], section['train_batch']
    with common.full_fp32():
        replicas = [get_params(params, d) for d in devices]
        train_batch(X, y, replicas, devices, lr=0.2)
        single = [get_params(params, devices[0])]
        train_batch(X, y, single, devices[:1], lr=0.2)
    difference = common.step_difference(params, replicas[0], single[0])
    print(f'2 replicas against 1 device, on the GPU: {difference:.1e} of the step')
    assert difference < common.step_tolerance(torch.float32, devices[0])
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(replicas[0], replicas[1]))


def test_measure_without_sync_sees_the_gpu_run_ahead():
    m = torch.randn(4096, 4096, device='cuda')
    queued = common.measure(lambda: torch.mm(m, m), repeats=7, sync=False, device='cuda')
    finished = common.measure(lambda: torch.mm(m, m), repeats=7, sync=True, device='cuda')
    print(f'4096² product: returns after {queued * 1e6:.0f} µs, done after {finished * 1e6:.0f} µs')
    assert queued < finished / 2


def test_synchronize_waits_for_queued_work():
    m = torch.randn(4096, 4096, device='cuda')
    for _ in range(20):
        m = m @ m / 4096
    common.synchronize()
    assert torch.cuda.current_stream().query()


@pytest.mark.procs
def test_timing_cpu_work_creates_no_cuda_context():
    # synchronize() once waited on every visible GPU, creating a CUDA context on each
    import subprocess
    import sys
    code = ('import torch, common\n'
            'common.synchronize()\n'
            'common.measure(sum, [1, 2], repeats=3)\n'
            'common.measure(sum, [1, 2], min_run_time=0.01)\n'
            'with common.Benchmark(verbose=False):\n'
            '    pass\n'
            'print("initialised", torch.cuda.is_initialized())\n')
    child = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    assert 'initialised False' in child.stdout, child.stdout[-1000:] + child.stderr[-2000:]


# ---- what notebooks 02 and 03 teach about GPUs, checked where a GPU exists

def _late_error_script():
    """The five-line script of notebook 02's late-error cell, read from its source."""
    import re
    source = (ROOT / 'notebooks' / 'src' / '02-asynchronous-computation.txt').read_text(encoding='utf-8')
    return re.search(r'late_error = """(.*?)"""', source, re.S).group(1)


@pytest.mark.procs
def test_launch_blocking_raises_the_device_error_at_its_own_line():
    import os
    import re
    import subprocess
    import sys
    script = _late_error_script()
    child = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, CUDA_LAUNCH_BLOCKING='1'))
    lines = [int(n) for n in re.findall(r'File "<string>", line (\d+)', child.stderr)]
    assert child.returncode != 0 and lines, child.stderr[-2000:]
    assert 'torch.tensor([5]' in script.splitlines()[lines[-1] - 1]


def test_sync_debug_mode_flags_what_notebook_02_says():
    import warnings
    v = torch.randn(10_000, device='cuda')

    def synchronises(line):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            line()
        return any('synchronizing' in str(w.message) for w in caught)

    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='Synchronization debug mode is a prototype')
        torch.cuda.set_sync_debug_mode('warn')
    try:
        assert not synchronises(lambda: v.sum())
        assert synchronises(lambda: v.nonzero())
        assert synchronises(lambda: float(v.max()))
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_a_pinned_copy_returns_before_queued_work_and_a_pageable_one_does_not():
    import time
    busy = torch.randn(4096, 4096, device='cuda')
    pageable = torch.rand(16 * 2**20)
    pinned = pageable.pin_memory()

    def issue(batch):
        torch.cuda.synchronize()
        for _ in range(20):
            busy @ busy
        start = time.perf_counter()
        batch.to('cuda', non_blocking=True)
        seconds = time.perf_counter() - start
        torch.cuda.synchronize()
        return seconds

    issue(pageable), issue(pinned)
    t_pageable = sorted(issue(pageable) for _ in range(5))[2]
    t_pinned = sorted(issue(pinned) for _ in range(5))[2]
    print(f'issuing a 64 MB copy behind queued work: pageable {t_pageable * 1e3:.2f} ms, '
          f'pinned {t_pinned * 1e3:.3f} ms')
    assert t_pinned < t_pageable / 2
