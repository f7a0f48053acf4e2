"""Unit tests of common.py, bad input included."""
import gzip
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

import common
from notebook_code import definitions
import workers

ROOT = Path(__file__).resolve().parent.parent

TESTS = Path(__file__).resolve().parent


# ------------------------------------------------------------------ devices

def test_try_gpu_falls_back_to_cpu(monkeypatch, fake_gpus):
    fake_gpus(0)
    assert common.try_gpu() == torch.device('cpu')
    assert common.try_gpu(3) == torch.device('cpu')
    assert common.try_all_gpus() == [torch.device('cpu')]


def test_try_gpu_uses_gpus_that_exist(monkeypatch, fake_gpus):
    fake_gpus(2)
    assert common.try_gpu(1) == torch.device('cuda:1')
    assert common.try_gpu(2) == torch.device('cpu')
    assert common.try_all_gpus() == [torch.device('cuda:0'), torch.device('cuda:1')]


@pytest.mark.parametrize('bad', [-1, 1.5, '0', True])
def test_impossible_device_index_is_refused(bad):
    with pytest.raises(ValueError, match='whole number'):
        common.try_gpu(bad)


def test_gpu_that_does_not_exist_gives_clear_error(monkeypatch, fake_gpus):
    fake_gpus(1)
    with pytest.raises(RuntimeError, match=r'cuda:3 was requested, but this machine has 1 GPU'):
        common.gpu(3)
    assert common.gpu(0) == torch.device('cuda:0')


@pytest.mark.parametrize('gpus,env,tier', [
    (0, {}, 'T0'), (1, {}, 'T1'), (4, {}, 'T2'),
    (2, {'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2'}, 'T3'),
])
def test_detect_tier(monkeypatch, fake_gpus, gpus, env, tier):
    fake_gpus(gpus)
    for key in ('WORLD_SIZE', 'LOCAL_WORLD_SIZE'):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert common.detect_tier() == tier


def test_environment_report_names_tier_and_data(monkeypatch, fake_gpus, tmp_path, capsys):
    fake_gpus(0)
    monkeypatch.setattr(common, 'DEBIAN_DIR', tmp_path / 'none')
    info = common.environment_report(data_root=tmp_path)
    out = capsys.readouterr().out
    assert info['tier'] == 'T0' and 'T0: CPU only' in out
    assert 'NOT FOUND' in out


def test_environment_report_speaks_chinese_in_zh_folder(monkeypatch, fake_gpus, tmp_path, capsys):
    folder = tmp_path / 'notebooks' / 'zh'
    folder.mkdir(parents=True)
    monkeypatch.chdir(folder)
    monkeypatch.delenv('COURSE_LANG', raising=False)
    fake_gpus(0)
    common.environment_report()
    assert '档位' in capsys.readouterr().out


# ----------------------------------------------------------------- settings

def test_settings_pick_tier_and_fall_back(monkeypatch, fake_gpus, capsys):
    monkeypatch.delenv(common.SETTINGS_ENV, raising=False)
    fake_gpus(4)
    cfg = common.settings(T0=dict(epochs=1), T1=dict(epochs=5))
    assert (cfg.tier, cfg.epochs) == ('T2', 5)  # no T2 entry: falls back to T1
    assert 'tier T2' in capsys.readouterr().out


def test_settings_override_by_environment(monkeypatch, fake_gpus, capsys):
    fake_gpus(1)
    monkeypatch.setenv(common.SETTINGS_ENV, 'T0, epochs=3, name=fast')
    cfg = common.settings(T0=dict(epochs=1, name='x', lr=0.1), T1=dict(epochs=9, name='y', lr=0.2))
    assert (cfg.tier, cfg.epochs, cfg.name, cfg.lr) == ('T0', 3, 'fast', 0.1)
    assert "epochs=3" in capsys.readouterr().out


@pytest.mark.parametrize('value,message', [('T9', 'neither a tier'), ('epoch=3', 'unknown setting')])
def test_settings_bad_override_is_explained(monkeypatch, value, message):
    monkeypatch.setenv(common.SETTINGS_ENV, value)
    with pytest.raises(ValueError, match=message):
        common.settings(T0=dict(epochs=1))


def test_settings_print_no_override_note_without_an_override(monkeypatch, fake_gpus, capsys):
    monkeypatch.delenv(common.SETTINGS_ENV, raising=False)
    fake_gpus(0)
    common.settings(T0=dict(epochs=1))
    out = capsys.readouterr().out
    assert 'override' not in out and 'epochs=1' in out
    monkeypatch.setenv(common.SETTINGS_ENV, 'T1')
    common.settings(T0=dict(epochs=1), T1=dict(epochs=4))
    assert 'override: COURSE_SETTINGS tier=T1]' in capsys.readouterr().out


def test_settings_higher_tiers_inherit_so_cpu_sizes_stay(monkeypatch, fake_gpus, capsys):
    # A CPU stand-in experiment keeps its T0 size on a GPU machine unless a tier changes it.
    monkeypatch.delenv(common.SETTINGS_ENV, raising=False)
    fake_gpus(1)
    cfg = common.settings(T0=dict(cpu_matrix=512, gpu_matrix=512), T1=dict(gpu_matrix=4096))
    assert (cfg.tier, cfg.cpu_matrix, cfg.gpu_matrix) == ('T1', 512, 4096)
    assert 'settings of T1 + T0' in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"T1 sets \['steps'\], which T0 lacks"):
        common.settings(T0=dict(epochs=1), T1=dict(steps=3))


@pytest.mark.parametrize('value,ok', [
    ('epochs=abc', "epochs='abc' is not a int"), ('epochs=2.5', 'is not a int'),
    ('lr=1', None), ('subset=None', None), ('subset=12', None), ('sizes=[1,2]', None),
    ('sizes=3', 'is not a list'), ('flag=1', 'is not a bool'), ('flag=False', None),
])
def test_settings_overrides_must_have_the_notebooks_types(monkeypatch, fake_gpus, capsys, value, ok):
    fake_gpus(0)
    monkeypatch.setenv(common.SETTINGS_ENV, value)
    call = lambda: common.settings(  # noqa: E731
        T0=dict(epochs=1, lr=0.1, subset=100, sizes=(1, 4), flag=True), T1=dict(subset=None))
    if ok is None:
        cfg = call()
        key = value.split('=')[0]
        assert f'[override: COURSE_SETTINGS {key}=' in capsys.readouterr().out
        assert isinstance(cfg.sizes, tuple)  # a list override keeps the notebook's own type
    else:
        with pytest.raises(ValueError, match=re.escape(ok)):
            call()


def test_settings_need_t0():
    with pytest.raises(ValueError, match='T0'):
        common.settings(T1=dict(epochs=1))


# ------------------------------------------------------------------- timing

def test_timer_records_times():
    timer = common.Timer()
    time.sleep(0.01)
    first = timer.stop()
    timer.start()
    time.sleep(0.02)
    timer.stop()
    assert first >= 0.01 and timer.sum() >= 0.03
    assert timer.avg() == pytest.approx(timer.sum() / 2)


def test_benchmark_times_block(capsys):
    with common.Benchmark('nap') as bench:
        time.sleep(0.02)
    assert bench.elapsed >= 0.02
    assert capsys.readouterr().out.startswith('nap: ')


def test_benchmark_without_sync_still_times_cpu_work():
    with common.Benchmark(verbose=False, sync=False) as bench:
        time.sleep(0.01)
    assert bench.elapsed >= 0.01


def test_quiet_native_stderr_hides_fd2_then_restores_it(tmp_path):
    code = ('import os, common\n'
            'with common.quiet_native_stderr():\n'
            '    os.write(2, b"hidden\\n")\n'
            'os.write(2, b"shown\\n")\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, timeout=60)
    assert out.stderr.decode().splitlines()[-1] == 'shown' and b'hidden' not in out.stderr


def test_plot_timeline_draws_one_row_per_lane():
    spans = [('front end', 0.0, 0.001, 'a'), ('back end', 0.001, 0.004, 'b'),
             ('front end', 0.002, 0.003, 'c')]
    ax = common.plot_timeline(spans, unit='ms', title='t')
    assert [t.get_text() for t in ax.get_yticklabels()] == ['front end', 'back end']
    assert len(ax.collections) == 3
    bar = ax.collections[1].get_paths()[0].get_extents()
    assert (bar.x0, bar.x1) == pytest.approx((1.0, 4.0))  # seconds drawn in milliseconds


def test_measure_with_repeats_skips_warm_up():
    calls = []

    def slow_first():
        calls.append(1)
        time.sleep(0.2 if len(calls) == 1 else 0.01)

    median = common.measure(slow_first, repeats=5, sync=False)
    assert len(calls) == 6 and 0.01 <= median < 0.1


def _count_syncs(monkeypatch):
    calls = []
    monkeypatch.setattr(common, 'synchronize', lambda device=None: calls.append(device))
    return calls


@pytest.mark.parametrize('sync,expected', [(False, 2), (True, 3)])
def test_measure_sync_false_does_not_wait_for_the_device(monkeypatch, sync, expected):
    # one synchronisation after the warm-up, one before the timed call, and one
    # after it only with sync=True: that last one is what 02 leaves out
    calls = _count_syncs(monkeypatch)
    common.measure(lambda: None, repeats=1, sync=sync, device='cuda:0')
    assert len(calls) == expected and set(calls) == {'cuda:0'}


@pytest.mark.parametrize('sync,expected', [(False, 1), (True, 2)])
def test_benchmark_sync_false_does_not_wait_at_the_end(monkeypatch, sync, expected):
    calls = _count_syncs(monkeypatch)
    with common.Benchmark(verbose=False, sync=sync):
        pass
    assert len(calls) == expected


def test_measure_refuses_nonsense():
    with pytest.raises(ValueError, match='sync=False needs repeats'):
        common.measure(lambda: None, sync=False)
    with pytest.raises(ValueError, match='whole number'):
        common.measure(lambda: None, repeats=0)


def test_synchronize_waits_for_every_gpu(monkeypatch, fake_gpus):
    waited = []
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: waited.append(device))
    fake_gpus(3)
    common.synchronize()
    assert waited == [0, 1, 2]
    waited.clear()
    common.synchronize('cuda:1')
    common.synchronize('cpu')
    assert waited == ['cuda:1']


# ----------------------------------------------------------------- verdicts

CASES = [(0.9, 'slower', ('compile is slower', '编译版更慢')), (1.1, 'same', ('no difference', '没有差别')),
         (math.inf, 'faster', ('compile is faster', '编译版更快'))]


@pytest.mark.parametrize('value,key', [(0.64, 'slower'), (0.9, 'same'), (1.0, 'same'), (9.6, 'faster')])
def test_verdict_picks_the_case_and_prints_the_number(monkeypatch, capsys, value, key):
    monkeypatch.setenv('COURSE_LANG', 'en')
    assert common.verdict(('compile/eager', '编译/eager'), value, CASES) == key
    text = dict((k, t) for _, k, t in CASES)[key][0]
    assert capsys.readouterr().out == f'Verdict: compile/eager: {value:.2f}× → {text}\n'


def test_verdict_speaks_chinese_and_can_show_a_comparison(monkeypatch, capsys):
    monkeypatch.setenv('COURSE_LANG', 'zh')
    common.verdict(('threads / intra-op', '线程 / 算子内'), 1.6 / 1.98, CASES, shown='1.60× vs 1.98×')
    assert capsys.readouterr().out == '结论：线程 / 算子内：1.60× vs 1.98× → 编译版更慢\n'
    # plain English texts are looked up in FIGURE_TEXT, as the notebooks pass them
    common.verdict('time of sum(list) over torch.sum', 100.0,
                   [(math.inf, 'x', 'sum(list) handles one Python object per number: overhead-bound')])
    assert capsys.readouterr().out.endswith('100.00× → sum(list) 每个数都要处理一个 Python 对象：受开销限制\n')


def test_verdict_refuses_cases_that_cannot_decide():
    with pytest.raises(ValueError, match='math.inf'):
        common.verdict('r', 5.0, CASES[:2])
    with pytest.raises(ValueError, match='must increase'):
        common.verdict('r', 1.0, CASES[::-1])
    with pytest.raises(ValueError, match='measured number'):
        common.verdict('r', float('nan'), CASES)


def test_step_tolerance_follows_dtype_and_device():
    assert common.step_tolerance() == 1e-4
    assert common.step_tolerance(torch.float32, 'cuda:0') > common.step_tolerance()
    assert common.step_tolerance(torch.float64) < common.step_tolerance(torch.bfloat16)
    with pytest.raises(ValueError, match='floating-point'):
        common.step_tolerance(torch.int64)


def test_step_difference_sees_a_wrong_step_but_not_rounding():
    before = [torch.zeros(3), torch.ones(2)]
    step = [torch.tensor([0.1, -0.2, 0.3]), torch.tensor([1.0, 1.1])]
    good = [torch.tensor([0.1, -0.2, 0.3000001]), torch.tensor([1.0, 1.1])]
    half = [torch.tensor([0.05, -0.1, 0.15]), torch.tensor([1.0, 1.05])]   # a gradient halved
    assert common.step_difference(before, good, step) < common.step_tolerance()
    assert common.step_difference(before, half, step) == pytest.approx(0.5, rel=1e-4)


def test_full_fp32_turns_tf32_off_and_restores_it():
    knobs = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    before = [k.fp32_precision for k in knobs]
    torch.backends.cudnn.conv.fp32_precision = 'tf32'
    try:
        with pytest.raises(KeyError):
            with common.full_fp32():
                assert [k.fp32_precision for k in knobs] == ['ieee'] * 3
                raise KeyError('restored even after an error')
        assert torch.backends.cudnn.conv.fp32_precision == 'tf32'
    finally:
        for k, v in zip(knobs, before):
            k.fp32_precision = v


def test_measure_reports_median_not_first_call():
    calls = []

    def slow_first(x):
        calls.append(x)
        time.sleep(0.2 if len(calls) == 1 else 0.001)

    median = common.measure(slow_first, 1, min_run_time=0.05)
    assert len(calls) > 3
    assert 0.001 <= median < 0.1  # the 0.2 s first call is the warm-up, not measured


# --------------------------------------------------------------------- data

def _write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b''.join(d.to_bytes(4, 'big') for d in array.shape)
    with gzip.open(path, 'wb') as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def tiny_fashion(tmp_path, monkeypatch):
    """A fake Fashion-MNIST in tmp/fashion-mnist: 20 training and 10 test images."""
    monkeypatch.setattr(common, 'DEBIAN_DIR', tmp_path / 'no-debian')
    common.clear_cache()
    folder = tmp_path / 'fashion-mnist'
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (('train', 20), ('test', 10)):
        images, labels = common.FASHION_FILES[split]
        _write_idx(folder / f'{images}.gz', rng.integers(0, 256, (n, 28, 28)))
        _write_idx(folder / f'{labels}.gz', np.arange(n) % 10)
    yield tmp_path
    common.clear_cache()


def test_loader_reads_idx_files(tiny_fashion):
    train_iter, test_iter = common.load_data_fashion_mnist(4, root=tiny_fashion, download=False)
    X, y = next(iter(test_iter))
    assert X.shape == (4, 1, 28, 28) and X.dtype == torch.float32
    assert 0 <= X.min() and X.max() <= 1
    assert y.tolist() == [0, 1, 2, 3]
    assert len(train_iter.dataset) == 20 and train_iter.num_workers == 0


def test_loader_resizes_and_subsets(tiny_fashion):
    train_iter, _ = common.load_data_fashion_mnist(5, resize=32, subset=7, root=tiny_fashion,
                                                   download=False, num_workers=0)
    X, _ = next(iter(train_iter))
    assert X.shape == (5, 1, 32, 32)
    assert len(train_iter.dataset) == 7


def test_loader_refuses_impossible_subset(tiny_fashion):
    with pytest.raises(ValueError, match='subset must be between 1 and 20'):
        common.load_data_fashion_mnist(4, subset=21, root=tiny_fashion, download=False)


def test_incomplete_folder_is_not_accepted(tiny_fashion):
    (tiny_fashion / 'fashion-mnist' / 't10k-labels-idx1-ubyte.gz').unlink()
    with pytest.raises(FileNotFoundError):
        common.find_fashion_mnist(tiny_fashion, download=False)


def test_missing_data_message_names_three_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(common, 'DEBIAN_DIR', tmp_path / 'no-debian')
    with pytest.raises(FileNotFoundError) as info:
        common.load_data_fashion_mnist(8, root=tmp_path, download=False)
    message = str(info.value)
    assert 'apt-get install dataset-fashion-mnist' in message
    assert str(tmp_path / 'fashion-mnist') in message
    assert 'download=True' in message


def test_failed_download_stops_within_seconds(tmp_path, monkeypatch):
    import torchvision
    monkeypatch.setattr(common, 'DEBIAN_DIR', tmp_path / 'no-debian')
    # A closed port on this machine: the download fails at once, as with no network.
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, 'mirrors', ['http://127.0.0.1:9/'])
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match='could not be downloaded'):
        common.find_fashion_mnist(tmp_path, download=True, timeout=5)
    assert time.monotonic() - start < 30


@pytest.fixture
def fashion_mnist():
    """The installed Fashion-MNIST folder; missing data fails in CI (a set-up bug) and skips elsewhere."""
    try:
        return common.find_fashion_mnist(download=False)
    except FileNotFoundError:
        if os.environ.get('CI'):
            raise
        pytest.skip('Fashion-MNIST is not installed on this machine')


def test_real_fashion_mnist_when_installed(fashion_mnist):
    common.clear_cache()
    train, test = common.fashion_mnist_datasets()
    assert (len(train), len(test)) == (60000, 10000)
    assert sorted(test.tensors[1].unique().tolist()) == list(range(10))
    images = train.tensors[0]
    assert images.shape == (60000, 1, 28, 28) and images.dtype == torch.float32
    assert 0 <= float(images.min()) < float(images.max()) <= 1
    assert common.find_fashion_mnist(download=False) == fashion_mnist


# ----------------------------------------------------------------- training

def test_accuracy_and_evaluate_accuracy():
    y = torch.tensor([0, 1, 2, 3])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 0]), 4).float()
    assert common.accuracy(logits, y) == 3
    assert common.accuracy(torch.tensor([0, 1, 0, 3]), y) == 3
    data = [(logits[:2], y[:2]), (logits[2:], y[2:])]
    assert common.evaluate_accuracy(torch.nn.Identity(), data, 'cpu') == 0.75


def test_animator_collects_points_outside_a_notebook():
    anim = common.Animator(xlabel='epoch', legend=['loss', 'acc'])
    for epoch in range(3):
        anim.add(epoch, [1.0 / (epoch + 1), None if epoch == 0 else 0.5])
    assert anim.X == [[0, 1, 2], [1, 2]]
    assert len(anim.ax.get_lines()) == 2
    with pytest.raises(ValueError, match='expected 2'):
        anim.add(3, [1.0])


# --------------------------------------------------------- worker processes

def _alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _children():
    """This process's descendants, except multiprocessing's resource tracker (it lives on by design)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if 'resource_tracker' not in ' '.join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_until(condition, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_launch_runs_real_process_group():
    assert common.launch(workers.rank_and_world, 2, backend='gloo') == [
        (0, 2, 0, 2, '0'), (1, 2, 1, 2, '1')]
    assert common.launch(common.allreduce_check, 3) == [6.0, 6.0, 6.0]


@pytest.mark.parametrize('gpus', [1, 2, 8])
def test_launch_never_picks_nccl_by_itself(fake_gpus, gpus):
    # The old rule chose NCCL whenever there were as many GPUs as processes, and
    # every CPU tensor then failed ("No backend type associated with device type cpu").
    fake_gpus(gpus)
    for world_size in sorted({1, 2, min(gpus, 3)}):
        assert common.launch(workers.backend_and_device, world_size) == [('gloo', 'cpu')] * world_size


def test_worker_device_follows_the_backend_it_was_given(monkeypatch):
    monkeypatch.setattr(common.dist, 'get_rank', lambda: 3)
    monkeypatch.setattr(common.dist, 'get_backend', lambda: 'nccl')
    assert common.worker_device() == torch.device('cuda:3')
    monkeypatch.setattr(common.dist, 'get_backend', lambda: 'gloo')
    assert common.worker_device() == torch.device('cpu')


def test_nccl_is_checked_against_the_gpu_count(fake_gpus):
    fake_gpus(2)
    with pytest.raises(ValueError, match='nccl needs one GPU per process: 3 processes, 2 GPU'):
        common.launch(common.allreduce_check, 3, backend='nccl')


@pytest.mark.parametrize('gpus', [1, 2, 8])
def test_every_worker_the_notebooks_launch_runs_whatever_the_gpu_count(fashion_mnist, fake_gpus, gpus):
    # 00, 05 and 07 call these exactly like this; with the GPU count faked, each
    # must still run on CPU processes over gloo and give its CPU answer.
    fake_gpus(gpus)
    assert common.launch(common.allreduce_check, 2) == [3.0, 3.0]
    assert max(common.launch(common.ring_check, 2, 1001)) < 1e-5
    bench = common.launch(common.comm_benchmark, 2, [4096], 1, ('ring', 'all_reduce'))[0]
    assert set(bench) == {'pingpong', 'exchange', 'ring', 'all_reduce'}
    run = dict(batch_size=32, lr=0.1, steps=1, subset=64)
    one = common.launch(common.dp_worker, 1, dict(run, full_fp32=True), threads=1)[0]  # a no-op on CPUs
    two = common.launch(common.dp_worker, 2, run)
    assert {one['device'], two[0]['device'], two[1]['device']} == {'cpu'}
    assert common.step_difference(common.lenet_params(0), two[0]['params'], one['params']) \
        < common.step_tolerance()
    ps = common.launch(common.ps_process, 3, dict(servers=1, steps=1, batch_size=32, lr=0.1,
                                                   subset=64, piece=4096))
    assert ps[1]['allreduce_diff'] < 1e-6


def test_beyond_data_parallelism_workers_stay_on_the_cpu_in_processes_that_see_gpus():
    # 08's workers run over gloo; fully_shard's default mesh would be CUDA wherever CUDA exists.
    # Spawned processes see the real machine, so the worker fakes a GPU inside each process.
    for result in common.launch(workers.beyond_data_parallelism_seeing_gpus, 2, threads=1):
        assert result['devices'] == {'ddp': 'cpu', 'fsdp': 'cpu'} and result['same']
        assert result['tp'] < 1e-5 and result['pipe'] < 1e-5


def test_workers_can_return_tensors_that_outlive_them():
    out = common.launch(workers.return_tensor, 2)
    assert [t.tolist() for t in out] == [[0.0] * 3, [1.0] * 3]


def test_worker_exception_is_reraised_with_traceback():
    with pytest.raises(ZeroDivisionError, match='on purpose') as info:
        common.launch(workers.fail_on_rank_one, 2, timeout=60)
    remote = str(info.value.__cause__)
    assert 'worker rank 1' in remote and 'fail_on_rank_one' in remote


def test_worker_that_dies_is_named():
    with pytest.raises(common.WorkerError, match='rank 0 exited with code 7'):
        common.launch(workers.die_hard, 2, timeout=60)


def test_hanging_worker_times_out_and_leaves_no_process(tmp_path):
    # Readiness does not matter here: on a loaded machine the 4 s may pass before a worker has
    # even written its pid. Whatever state they reached, no process may outlive the call.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r'rank\(s\) \[0, 1\] did not finish within 4 s'):
        common.launch(workers.report_pid_then_hang, 2, str(tmp_path), timeout=4)
    assert time.monotonic() - start < 30
    pids = [int(p.read_text()) for p in tmp_path.glob('*.pid')]
    assert len(pids) <= 2 and not any(_alive(pid) for pid in pids)
    assert _wait_until(lambda: not _children(), 10), _children()


def test_bad_launch_requests_are_refused():
    with pytest.raises(ValueError, match='world_size'):
        common.launch(common.allreduce_check, 0)
    with pytest.raises(ValueError, match='nccl needs one GPU per process'):
        common.launch(common.allreduce_check, common.num_gpus() + 1, backend='nccl')
    for bad in ('carrier-pigeon', 'NCCL', None):
        with pytest.raises(ValueError, match="backend must be 'gloo'"):
            common.launch(common.allreduce_check, 2, backend=bad)

    def local(rank, world_size):
        return rank
    local.__module__ = '__main__'  # as if defined in a notebook
    with pytest.raises(ValueError, match='defined in the notebook'):
        common.launch(local, 2)


@pytest.mark.parametrize('how', ['interrupt', 'kill'])
def test_no_orphans_when_launcher_is_interrupted_or_killed(tmp_path, how):
    # The launcher runs in its own process, as a notebook kernel would. If it ever hangs,
    # faulthandler writes every thread's stack to its stderr file, which the failure shows.
    # A kernel always turns SIGINT into KeyboardInterrupt; a process started from a background
    # job inherits SIGINT as *ignored*, so the child installs Python's handler explicitly.
    code = (f'import sys, signal, faulthandler; sys.path.insert(0, {str(TESTS)!r})\n'
            'signal.signal(signal.SIGINT, signal.default_int_handler)\n'
            'faulthandler.dump_traceback_later(20, exit=False)\n'
            'import common, workers\n'
            f'common.launch(workers.report_pid_then_hang, 2, {str(tmp_path)!r}, timeout=600)\n')
    log = tmp_path / 'launcher.stderr'
    with open(log, 'w') as stderr:
        parent = subprocess.Popen([sys.executable, '-c', code], stderr=stderr)
    try:
        assert _wait_until(lambda: len(list(tmp_path.glob('*.pid'))) == 2, 60), 'workers did not start'
        pids = [int(p.read_text()) for p in tmp_path.glob('*.pid')]
        parent.send_signal(signal.SIGINT if how == 'interrupt' else signal.SIGKILL)
        try:
            parent.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f'launcher did not exit after {how}:\n{log.read_text()[-4000:]}')
        assert _wait_until(lambda: not any(_alive(pid) for pid in pids), 15), \
            f'workers {pids} outlived their launcher ({how})'
    finally:
        parent.kill()
        parent.wait()


# -------------------------------------------------------------- section 04

def _written_file(section, filename):
    """The body of the code cell of a section that starts with %%writefile filename."""
    sys.path.insert(0, str(ROOT / 'tools'))
    import nbpair
    src = next(f for f in nbpair.sources() if f.name.startswith(section))
    bodies = [c['en'].split('\n', 1)[1] for c in nbpair.parse(src)
              if c['type'] == 'code' and c['en'].startswith(f'%%writefile {filename}\n')]
    assert len(bodies) == 1, f'{section} writes {filename} once'
    return bodies[0]


def test_cache_knees_finds_the_steps_and_ignores_one_noisy_point():
    sizes = [2 ** p for p in range(12, 24)]
    rates = [100, 100, 100, 100, 60, 60, 60, 60, 60, 20, 20, 20]
    assert common.cache_knees(sizes, rates) == [2 ** 16, 2 ** 21]
    noisy = list(rates)
    noisy[6] = 20                                   # one slow point inside a plateau is not a knee
    assert common.cache_knees(sizes, noisy) == [2 ** 16, 2 ** 21]
    with pytest.raises(ValueError, match='as many rates as sizes'):
        common.cache_knees(sizes, rates[:-1])


def test_04s_pointer_chase_compiles_and_sees_memory_slower_than_l1(tmp_path):
    source = tmp_path / 'chase.c'
    source.write_text(_written_file('04', 'artifacts/chase.c'))
    program = common.compile_c(source)
    done = subprocess.run([str(program), str(8 * 1024), str(128 * 2 ** 20)], capture_output=True,
                          text=True, timeout=300, check=True)
    small, large = (float(row.split()[1]) for row in done.stdout.splitlines())
    assert large > 5 * small, (small, large)        # a 128 MiB block leaves every cache; 8 KiB fits L1


def test_04s_false_sharing_program_counts_right(tmp_path):
    source = tmp_path / 'false_sharing.c'
    source.write_text(_written_file('04', 'artifacts/false_sharing.c'))
    program = common.compile_c(source, '-pthread')
    for distance in (8, 128):
        done = subprocess.run([str(program), '1000000', str(distance)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and float(done.stdout) > 0   # exit 0: both counters reached N


def test_compile_c_reports_the_compilers_message(tmp_path):
    bad = tmp_path / 'bad.c'
    bad.write_text('int main(void) { return undefined_name; }\n')
    with pytest.raises(RuntimeError, match='undefined_name'):
        common.compile_c(bad)
    with pytest.raises(FileNotFoundError):
        common.compile_c(tmp_path / 'missing.c')


def test_compile_c_without_a_compiler_says_what_to_install(tmp_path, monkeypatch):
    good = tmp_path / 'ok.c'
    good.write_text('int main(void) { return 0; }\n')
    monkeypatch.setattr(common.shutil, 'which', lambda name: None)
    with pytest.raises(RuntimeError, match='apt-get install g\\+\\+'):
        common.compile_c(good)


@pytest.mark.parametrize('name, bf16, memory', [
    ('NVIDIA H200', 989.5, 4800), ('NVIDIA H100 80GB HBM3', 989.5, 3350), ('NVIDIA H100 PCIe', 756, 2000),
    ('NVIDIA A100-SXM4-80GB', 312, 2039), ('NVIDIA A100-SXM4-40GB', 312, 1555),
    ('NVIDIA A100 80GB PCIe', 312, 1935), ('NVIDIA L4', 121, 300), ('Tesla V100-SXM2-16GB', None, 900),
    ('Tesla T4', None, 320), ('NVIDIA H100 NVL', 835.5, 3900), ('NVIDIA H200 NVL', 835.5, 4800),
    ('NVIDIA GH200 480GB', 989.5, 4000)])
def test_gpu_datasheet_rows_match_the_device_names_torch_reports(name, bf16, memory):
    sheet = common.gpu_datasheet(name)
    assert (sheet['bf16'], sheet['memory_gbs']) == (bf16, memory)


def test_gpu_datasheet_does_not_guess():
    assert common.gpu_datasheet('NVIDIA L40S') is None            # not the L4
    assert common.gpu_datasheet('NVIDIA GeForce RTX 4090') is None


# ---------------------------------------------------- data parallelism by hand

# The functions are section 05's, defined on its page; the tests run that code.
SECTION_05 = definitions('05-multi-gpu-from-scratch', 'get_params', 'allreduce', 'split_batch', 'train_batch')


def test_get_params_copies_even_on_the_same_device():
    params = common.lenet_params(seed=1)
    copy = SECTION_05['get_params'](params, 'cpu')
    with torch.no_grad():
        copy[0].add_(1.0)
    assert not torch.equal(copy[0], params[0]) and copy[0].requires_grad


def test_allreduce_leaves_the_sum_everywhere():
    data = [torch.full((2, 3), float(i + 1)) for i in range(3)]
    SECTION_05['allreduce'](data)
    assert all(torch.equal(t, torch.full((2, 3), 6.0)) for t in data)


def test_split_batch_uneven_and_bad_input():
    split_batch = SECTION_05['split_batch']
    X, y = torch.arange(14).reshape(7, 2), torch.arange(7)
    xs, ys = split_batch(X, y, ['cpu'] * 3)
    assert [len(s) for s in xs] == [3, 2, 2] and torch.equal(torch.cat(ys), y)
    with pytest.raises(ValueError, match='X has 7 examples but y has 6'):
        split_batch(X, y[:6], ['cpu'] * 2)
    with pytest.raises(ValueError, match='cannot split 2 examples over 3 devices'):
        split_batch(X[:2], y[:2], ['cpu'] * 3)


@pytest.mark.parametrize('k', [2, 3])
def test_data_parallel_step_equals_single_device_step(k):
    get_params, train_batch = SECTION_05['get_params'], SECTION_05['train_batch']
    torch.manual_seed(0)
    X, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    params = common.lenet_params(seed=2)
    replicas = [get_params(params, 'cpu') for _ in range(k)]
    single = [get_params(params, 'cpu')]
    train_batch(X, y, replicas, ['cpu'] * k, lr=0.5)
    train_batch(X, y, single, ['cpu'], lr=0.5)
    for i, reference in enumerate(single[0]):
        assert not torch.equal(reference, params[i])  # the step changed every parameter
        assert all(torch.equal(r[i], replicas[0][i]) for r in replicas)
    assert common.step_difference(params, replicas[0], single[0]) < common.step_tolerance()


def test_a_broken_train_batch_fails_the_equivalence_check():
    """The equivalence check can fail: a step that forgets the allreduce differs from one device."""
    source = definitions('05-multi-gpu-from-scratch', 'get_params', 'split_batch', 'train_batch')
    source['allreduce'] = lambda data: None   # replicas keep their own shard's gradient
    torch.manual_seed(0)
    X, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    params = common.lenet_params(seed=2)
    replicas = [source['get_params'](params, 'cpu') for _ in range(2)]
    single = [source['get_params'](params, 'cpu')]
    source['train_batch'](X, y, replicas, ['cpu'] * 2, lr=0.5)
    source['train_batch'](X, y, single, ['cpu'], lr=0.5)
    assert common.step_difference(params, replicas[0], single[0]) > common.step_tolerance()


def test_replica_devices_falls_back_and_refuses_nonsense(monkeypatch, fake_gpus):
    fake_gpus(1)
    assert common.replica_devices(2) == [torch.device('cuda:0')] * 2
    fake_gpus(0)
    assert common.replica_devices(3) == [torch.device('cpu')] * 3
    with pytest.raises(ValueError, match='whole number >= 1'):
        common.replica_devices(0)


def test_batch_indices_wrap_and_split_the_same_global_batch():
    order = torch.arange(10)
    assert common.batch_indices(order, 0, 4).tolist() == [0, 1, 2, 3]
    assert common.batch_indices(order, 2, 4).tolist() == [8, 9, 0, 1]   # full size at the wrap
    parts = [common.batch_indices(order, 2, 4, p, 3).tolist() for p in range(3)]
    assert parts == [[8, 9], [0], [1]]


def test_dp_worker_ranks_agree_and_match_one_process(fashion_mnist):
    run = dict(batch_size=64, lr=0.2, steps=1, subset=256)
    two = common.launch(common.dp_worker, 2, run)
    one = common.launch(common.dp_worker, 1, run)
    assert two[0]['checksum'] == two[1]['checksum'] and two[1]['params'] is None
    assert common.step_difference(common.lenet_params(0), two[0]['params'], one[0]['params']) \
        < common.step_tolerance()


def test_the_worker_recipe_of_05s_exercise_runs_and_matches_dp_worker(fashion_mnist, tmp_path, monkeypatch):
    """Solution 2 of 05: %%writefile my_worker.py, import it, launch it. It must work as written."""
    import importlib
    (tmp_path / 'my_worker.py').write_text(_writefile_block('05-multi-gpu-from-scratch', 'my_worker.py'))
    monkeypatch.syspath_prepend(str(tmp_path))   # the spawned processes inherit sys.path
    my_worker = importlib.import_module('my_worker')
    run = dict(batch_size=64, lr=0.2, steps=2, subset=256)
    flat = common.launch(my_worker.flat_dp_worker, 2, run)
    per_tensor = common.launch(common.dp_worker, 2, run)
    assert flat[0]['checksum'] == flat[1]['checksum']
    assert abs(flat[0]['checksum'] - per_tensor[0]['checksum']) < 1e-4 * abs(per_tensor[0]['checksum'])


def test_05s_sharded_allreduce_solution_leaves_the_same_sums():
    """Solution 5 of 05 (reduce-scatter, then all-gather) against the notebook's allreduce."""
    import nbformat
    stored = nbformat.read(ROOT / 'notebooks' / 'en' / '05-multi-gpu-from-scratch.ipynb', as_version=4)
    code = next(re.search(r'```python\n(.*?)```', c.source.split('Solution 5</summary>')[1], re.S).group(1)
                for c in stored.cells if c.cell_type == 'markdown' and 'Solution 5</summary>' in c.source)
    namespace = dict(SECTION_05, devices=[torch.device('cpu')] * 3)
    exec(code.split('\n\n\ndata = ')[0], namespace)
    data = [torch.randn(1001) * (i + 1) for i in range(3)]      # 1001: slices of unequal length
    expected = [t.clone() for t in data]
    namespace['allreduce'](expected)
    namespace['sharded_allreduce'](data)
    for got, want in zip(data, expected):
        torch.testing.assert_close(got, want)


def _writefile_block(notebook, filename):
    """The one ```python block of a notebook's markdown that starts with %%writefile filename."""
    import nbformat
    stored = nbformat.read(ROOT / 'notebooks' / 'en' / f'{notebook}.ipynb', as_version=4)
    blocks = [b for c in stored.cells if c.cell_type == 'markdown'
              for b in re.findall(r'```python\n(.*?)```', c.source, re.S)
              if b.startswith(f'%%writefile {filename}')]
    assert len(blocks) == 1, f'{notebook} shows one %%writefile {filename} block'
    return blocks[0].split('\n', 1)[1]


def test_the_worker_recipe_of_07s_exercise_runs(tmp_path, monkeypatch):
    """Solution 1 of 07: the ring in a file written with %%writefile, imported, launched."""
    import importlib
    (tmp_path / 'my_ring.py').write_text(_writefile_block('07-parameter-servers', 'my_ring.py'))
    monkeypatch.syspath_prepend(str(tmp_path))
    my_ring = importlib.import_module('my_ring')
    assert max(common.launch(my_ring.check, 3, 100_003)) < 1e-4


# -------------------------------------------------------------- section 06

def test_resnet18_for_28x28_inputs():
    narrow, full = common.resnet18(width=8), common.resnet18()
    assert narrow(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    count = lambda net: sum(p.numel() for p in net.parameters())  # noqa: E731
    assert 11_000_000 < count(full) < 11_400_000 and count(full) > 50 * count(narrow)


def _script(tmp_path, body):
    path = tmp_path / 'job.py'
    path.write_text('import os, sys, time\nimport torch.distributed as dist\n' + body)
    return path


def test_torchrun_two_nodes_meet_on_this_host(tmp_path):
    job = _script(tmp_path, "dist.init_process_group('gloo')\n"
                            "print('node', os.environ['GROUP_RANK'], 'rank', dist.get_rank(),"
                            " 'of', dist.get_world_size(), flush=True)\n"
                            'dist.barrier()\ndist.destroy_process_group()\n')
    outputs = common.torchrun(job, nnodes=2, timeout=120)
    lines = sorted(line for out in outputs for line in out.splitlines() if line.startswith('node'))
    assert lines == ['node 0 rank 0 of 2', 'node 1 rank 1 of 2']


def test_torchrun_failure_raises_with_the_scripts_error(tmp_path):
    job = _script(tmp_path, "raise SystemExit('the script broke on purpose')\n")
    with pytest.raises(RuntimeError, match='the script broke on purpose'):
        common.torchrun(job, nproc_per_node=2, timeout=120)


def test_06_adds_a_run_on_every_gpu_only_on_t2(fake_gpus):
    """06's choice of process counts, read from its source and run with a faked GPU count."""
    from types import SimpleNamespace
    sys.path.insert(0, str(ROOT / 'tools'))
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
    assert common.node_gpus(2, 1) == ['0', '1']
    assert common.node_gpus(2, 2) == ['0,1', '2,3']
    assert common.node_gpus(1, 4) == [None]                 # one node: leave the environment alone
    assert common.node_gpus(3, 2) == [None, None, None]     # not a GPU for every process: leave it
    monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '4,5,6,7')   # the user already restricted the GPUs
    assert common.node_gpus(2, 2) == ['4,5', '6,7']
    fake_gpus(0)
    assert common.node_gpus(2, 1) == [None, None]           # CPU machines: gloo, nothing to hide


def test_torchrun_timeout_leaves_nothing_behind(tmp_path):
    job = _script(tmp_path, f"open(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\n"
                            'time.sleep(600)\n')
    with pytest.raises(TimeoutError, match='did not finish within 8 s'):
        common.torchrun(job, nproc_per_node=2, timeout=8)
    # however far torchrun got in 8 s on a loaded machine, nothing it started may survive
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) <= 2 and _wait_until(lambda: not any(_alive(pid) for pid in pids), 10)
    assert _wait_until(lambda: not _children(), 10), _children()


# DDP's bucketed all-reduce during backward, measured (06's timeline)

DDP_RUN = dict(width=8, batch_size=32, bucket_cap_mb=0.1, warmup=2, steps=5)
DDP_MODES = ('overlapped', 'after backward')


@pytest.fixture(scope='module')
def ddp_result():
    return common.launch(common.ddp_timeline, 2, DDP_RUN, threads=1, timeout=120)[0]


@pytest.fixture(scope='module')
def ddp_names():
    return [name for name, _ in common.resnet18(width=DDP_RUN['width']).named_parameters()]


def test_hooks_give_the_gradients_of_ddps_builtin_allreduce(ddp_result):
    assert ddp_result['same_grads'] is True


def test_every_parameter_is_in_exactly_one_bucket(ddp_result, ddp_names):
    in_buckets = [name for bucket in ddp_result['buckets'] for name in bucket]
    assert sorted(in_buckets) == sorted(ddp_names)
    assert 3 <= len(ddp_result['buckets']) <= 6


@pytest.mark.parametrize('mode', DDP_MODES)
def test_ddp_sees_every_gradient_once_per_step(ddp_result, ddp_names, mode):
    # register_post_accumulate_grad_hook fires under DDP, once per parameter
    seen = [name for name, _ in ddp_result[mode]['median step']['grad']]
    assert sorted(seen) == sorted(ddp_names)


@pytest.mark.parametrize('mode', DDP_MODES)
def test_a_bucket_is_sent_only_after_its_gradients_are_ready(ddp_result, mode):
    step = ddp_result[mode]['median step']
    ready = dict(step['grad'])
    starts = {k: start for k, start, _ in step['allreduce']}
    assert sorted(starts) == list(range(len(ddp_result['buckets'])))  # every bucket, once
    for k, bucket in enumerate(ddp_result['buckets']):
        assert starts[k] >= max(ready[name] for name in bucket)
    assert list(starts.values()) == sorted(starts.values())  # DDP sends buckets in index order
    assert all(start <= end for _, start, end in step['allreduce'])


def test_ddp_starts_all_but_the_last_bucket_while_backward_computes(ddp_result):
    step = ddp_result['overlapped']['median step']
    *early, last = step['allreduce']
    assert all(start < step['computed'] for _, start, _ in early)
    assert last[1] >= step['computed']  # the last bucket holds the last gradient
    assert ddp_result['overlapped']['overlap'] > 0


def test_the_baseline_sends_nothing_before_backward_has_computed_everything(ddp_result):
    step = ddp_result['after backward']['median step']
    assert all(start >= step['computed'] for _, start, _ in step['allreduce'])
    assert ddp_result['after backward']['overlap'] == 0


@pytest.mark.parametrize('mode', DDP_MODES)
def test_ddp_phases_follow_each_other(ddp_result, mode):
    step = ddp_result[mode]['median step']
    assert 0 < step['forward'][1] == step['backward'][0] < step['computed'] <= step['backward'][1]
    assert step['backward'][1] == step['optimizer'][0] < step['optimizer'][1] == step['step_s']
    assert max(end for _, _, end in step['allreduce']) <= step['backward'][1]  # DDP waits for all
    assert step['all computed'] >= step['computed']


# -------------------------------------------------------------- section 07

def test_sync_time_reproduces_the_worked_example():
    MB, GB = 1e6, 1e9
    times = {s: common.sync_time(s, 160 * MB, 4, 16 * GB) for s in common.SYNC_STRATEGIES}
    assert times['gpu0'] == pytest.approx(0.060)   # 3 transfers of 10 ms to GPU 0, 3 back
    assert times['cpu'] == pytest.approx(0.080)    # 4 of 10 ms to the CPU, 4 back
    assert times['split'] == pytest.approx(0.015)  # 3 × 2.5 ms each way, on all links at once


def test_ring_time_barely_grows_with_the_ring():
    MB, GB = 1e6, 1e9
    eight = common.sync_time('ring', 160 * MB, 8, 18 * GB, links=3)  # two NVLink rings = 3 links
    assert eight == pytest.approx(2 * 7 / 8 * 160 * MB / (3 * 18 * GB))
    assert 0.005 < eight < 0.006  # the notes' "about 2·160 MB / (3·18 GB/s) ≈ 6 ms"
    times = [common.sync_time('ring', 160 * MB, n, 18 * GB) for n in (2, 4, 8, 64, 1024)]
    assert times == sorted(times) and times[-1] < 2 * times[0]
    gpu0 = [common.sync_time('gpu0', 160 * MB, n, 18 * GB) for n in (2, 64)]
    assert gpu0[1] > 50 * gpu0[0]


def test_sync_time_refuses_nonsense():
    with pytest.raises(ValueError, match='strategy must be one of'):
        common.sync_time('carrier-pigeon', 1, 2, 1)
    with pytest.raises(ValueError, match='bandwidth > 0'):
        common.sync_time('ring', 1, 2, 0)


@pytest.mark.parametrize('algorithm', sorted(common.RING_ALGORITHMS))
@pytest.mark.parametrize('world_size,numel', [(2, 10), (3, 1000), (4, 7)])
def test_ring_allreduce_equals_all_reduce(world_size, numel, algorithm):
    errors = common.launch(common.ring_check, world_size, numel, algorithm, timeout=120)
    assert max(errors) < 1e-5


def test_ring_check_can_fail():
    # A ring that forgets the all-gather leaves every rank with only one finished chunk.
    errors = common.launch(workers.check_a_broken_ring, 3, 999, timeout=120)
    assert min(errors) > 0.1


def test_comm_benchmark_measures_every_algorithm():
    sizes = [64, 4096, 65536]
    out = common.launch(common.comm_benchmark, 2, sizes, 2,
                        ('ring', 'ring both ways', 'all_reduce'), timeout=120)
    assert out[1] is None
    assert set(out[0]) == {'pingpong', 'exchange', 'ring', 'ring both ways', 'all_reduce'}
    assert all(len(v) == len(sizes) and min(v) > 0 for v in out[0].values())
    with pytest.raises(ValueError, match='unknown algorithm'):
        common.launch(common.comm_benchmark, 2, sizes, 1, ('carrier-pigeon',), timeout=60)


def test_fit_alpha_beta_recovers_a_known_line():
    sizes = np.array([16, 1024, 65536, 2 ** 20, 2 ** 24])
    alpha, beta = common.fit_alpha_beta(sizes, 50e-6 + sizes / 2e9)
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(0.5e-9, rel=1e-6)
    assert common.ring_model(2 ** 20, 4, alpha, beta) == pytest.approx(6 * (50e-6 + 2 ** 18 / 2e9))
    with pytest.raises(ValueError, match='at least two'):
        common.fit_alpha_beta([1], [1.0])


def test_parameter_server_and_hierarchical_costs():
    MB, GB = 1e6, 1e9
    one = common.ps_time(160 * MB, 8, 1, 10 * GB)
    assert one == pytest.approx(2 * 8 * 0.016)                      # 8 workers through one link
    assert common.ps_time(160 * MB, 8, 8, 10 * GB) == pytest.approx(0.032)  # as many servers: flat
    assert common.ps_time(160 * MB, 64, 64, 10 * GB) == common.ps_time(160 * MB, 8, 8, 10 * GB)
    hier = common.hierarchical_time(160 * MB, 32, 8, 3 * 18 * GB, 10 * GB, servers=32)
    assert hier == pytest.approx(2 * 7 / 8 * 160 * MB / (54 * GB) + 0.032)
    assert hier < common.ps_time(160 * MB, 256, 32, 10 * GB) / 5
    with pytest.raises(ValueError, match='servers >= 1'):
        common.ps_time(1, 2, 0, 1)
    with pytest.raises(ValueError, match='gpus >= 1'):
        common.hierarchical_time(1, 2, 0, 1, 1)


def test_sync_calculator_follows_its_sliders():
    box = common.sync_calculator()
    size, devices, bandwidth, rings, table = box.children
    assert '60.00 ms' in table.value and '80.00 ms' in table.value and '15.00 ms' in table.value
    devices.value = 8
    assert '140.00 ms' in table.value and '160.00 ms' in table.value   # 2·7·10 and 2·8·10
    rings.value = 3
    assert f'{2 * 7 / 8 * 10 / 3:,.2f} ms' in table.value


def test_kvstore_push_pull_and_updater():
    store = common.KVStore()
    store.init('w', torch.zeros(2))
    store.push('w', [torch.ones(2), torch.full((2,), 2.0)])
    assert torch.equal(store.pull('w'), torch.full((2,), 3.0))
    pulled = store.pull('w')
    pulled += 100                                           # a pull is a copy
    assert torch.equal(store.pull('w'), torch.full((2,), 3.0))
    sgd = common.KVStore(updater=lambda key, grad, weight: weight.sub_(0.5 * grad))
    sgd.init(3, torch.ones(2))
    sgd.push(3, torch.ones(2))
    sgd.push(3, [torch.ones(2), torch.ones(2)])
    assert torch.equal(sgd.pull(3), torch.full((2,), -0.5))
    with pytest.raises(KeyError, match='never initialised'):
        store.pull('b')
    with pytest.raises(KeyError, match='already initialised'):
        store.init('w', torch.zeros(2))
    with pytest.raises(ValueError, match=r'holds shape \(2,\)'):
        store.push('w', torch.zeros(3))


@pytest.mark.parametrize('servers,piece', [(1, None), (2, None), (3, 1000), (4, 16384)])
def test_shard_keys_covers_every_element_once(servers, piece):
    plan = common.shard_keys(common.LENET_SHAPES, servers, piece)
    for i, shape in enumerate(common.LENET_SHAPES):
        ranges = sorted((p['start'], p['stop']) for p in plan if p['param'] == i)
        assert ranges[0][0] == 0 and ranges[-1][1] == int(np.prod(shape))
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    load = [sum(p['stop'] - p['start'] for p in plan if p['server'] == s) for s in range(servers)]
    assert len(set(p['key'] for p in plan)) == len(plan) and min(load) > 0
    if piece:
        assert max(load) - min(load) <= piece
    with pytest.raises(ValueError, match='servers >= 1'):
        common.shard_keys(common.LENET_SHAPES, 0)


ROLES = ['server 0', 'server 1', 'worker 0', 'worker 1']
PS_RUN = dict(servers=2, steps=3, batch_size=64, lr=0.2, subset=512, piece=20000)


def test_parameter_server_step_equals_all_reduce_training(fashion_mnist):
    out = common.launch(common.ps_process, 4, PS_RUN, names=ROLES, timeout=120)
    servers, workers_ = out[:2], out[2:]
    assert [r['role'] for r in out] == ['server', 'server', 'worker', 'worker']
    assert all(w['allreduce_diff'] <= 1e-6 for w in workers_)
    assert [s['pushes'] for s in servers] == [2 * 3 * len(s['keys']) for s in servers]
    # three PS steps train exactly like three all-reduce steps (dp_worker, same data order)
    dp = common.launch(common.dp_worker, 2, dict(PS_RUN), timeout=120)[0]['params']
    for a, b in zip(workers_[0]['params'], dp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match='servers < processes'):
        common.launch(common.ps_process, 2, dict(PS_RUN, servers=2), timeout=60)


@pytest.mark.parametrize('role,noticed', [('worker', 'server'), ('server', 'worker')])
def test_parameter_server_names_a_killed_process(fashion_mnist, role, noticed, tmp_path):
    stamp = tmp_path / 'fault-time'   # the delay counts from the fault, not from start-up
    run = dict(PS_RUN, steps=4, fault=dict(role=role, index=1, step=2, kind='kill', stamp=str(stamp)))
    with pytest.raises(common.WorkerError, match=rf'\({role} 1\) exited with code -9 \(SIGKILL\)'
                                                 rf'.*noticed first.*PSFault: {noticed}'):
        common.launch(common.ps_process, 4, run, names=ROLES, timeout=60)
    assert time.time() - float(stamp.read_text()) < 20


def test_parameter_server_times_out_on_a_silent_worker(fashion_mnist, tmp_path):
    stamp = tmp_path / 'fault-time'
    run = dict(PS_RUN, steps=4, timeout=3,
               fault=dict(role='worker', index=1, step=1, kind='hang', stamp=str(stamp)))
    with pytest.raises(common.PSFault, match=r'from worker 1 \(rank 3\) at step 1.*Timed out'):
        common.launch(common.ps_process, 4, run, names=ROLES, timeout=60)
    assert 3 <= time.time() - float(stamp.read_text()) < 20


def test_parameter_server_resumes_from_a_checkpoint_exactly(fashion_mnist, tmp_path):
    run = dict(PS_RUN, steps=6)
    ckpt = dict(dir=str(tmp_path / 'ckpt'), every=2)
    clean = common.launch(common.ps_process, 4, run, names=ROLES, timeout=120)
    with pytest.raises(common.WorkerError, match='server 1'):
        common.launch(common.ps_process, 4, dict(run, checkpoint=ckpt,
                      fault=dict(role='server', index=1, step=3)), names=ROLES, timeout=60)
    # Server 0 may get one checkpoint further than the server that died (it can finish the
    # step the dead one had already sent out); only step 2 is certainly common.
    saved = {f.name for f in (tmp_path / 'ckpt').iterdir()}
    assert {'server0-step2.pt', 'server1-step2.pt'} <= saved <= \
        {'server0-step2.pt', 'server0-step4.pt', 'server1-step2.pt'}
    resumed = common.launch(common.ps_process, 4, dict(run, checkpoint=dict(ckpt, resume=True)),
                            names=ROLES, timeout=120)
    assert len(resumed[2]['losses']) == 4   # steps 2 … 5 only
    for a, b in zip(resumed[2]['params'], clean[2]['params']):
        assert torch.equal(a, b)


def test_launch_names_the_killed_process_not_the_peer_that_noticed():
    with pytest.raises(common.WorkerError, match=r'rank 0 \(first\) exited with code -9 \(SIGKILL\)'
                                                 r'.*rank 1 \(second\) noticed first'):
        common.launch(workers.killed_while_peer_waits, 2, names=['first', 'second'], timeout=60)
    with pytest.raises(ValueError, match='names has 1 entries for 2 processes'):
        common.launch(workers.rank_and_world, 2, names=['lonely'])


# asynchronous SGD with bounded staleness on the parameter server (07)

ASYNC_BASE = dict(servers=1, steps=20, batch_size=64, lr=0.1, seed=0, subset=2048, timeout=30)


def _ps_roles(servers, workers):
    return [f'server {s}' for s in range(servers)] + [f'worker {w}' for w in range(workers)]


def _by_case(results, servers):
    """[(server results, worker results)] per case, from launch's per-rank lists."""
    return [([r[i] for r in results[:servers]], [r[i] for r in results[servers:]])
            for i in range(len(results[0]))]


def test_s0_is_synchronous_sgd():
    # 2 servers, key pieces, 2 workers, one a straggler: s=0 must walk in lock-step
    # and do the arithmetic of the synchronous ps_process, one push at a time.
    run = dict(ASYNC_BASE, servers=2, steps=8, piece=16384, test_subset=None)
    names = _ps_roles(2, 2)
    results = common.launch(common.ps_in_turn, 4, [run, dict(run, staleness=0, slow={1: 0.01})],
                            names=names, timeout=120, threads=1)
    (_, sync), (servers, workers) = _by_case(results, 2)
    assert [s['pushes_per_worker'] for s in servers] == [[8, 8], [8, 8]]
    for a, b in zip(sync, workers):
        assert b['steps'] == 8 and b['staleness'] == [0] * 8   # lock-step
        assert b['updates'] == [2 * t for t in range(8)]       # all earlier steps of all workers
        assert b['max_delay'] <= 1                              # only the other push of its round
        assert max(abs(x - y) for x, y in zip(a['losses'], b['losses'])) < 1e-5
    diff = max(float((x - y).abs().max()) for x, y in zip(sync[0]['params'], workers[0]['params']))
    assert diff < 1e-5, f's=0 ends {diff:.1e} away from synchronous SGD'


def test_staleness_bound_and_straggler():
    # One server, two workers; worker 1 sleeps 60 ms a step. Then both hiccup in turn (80 ms).
    # Small batches and long sleeps, so that the sleeps, not the shared cores, set the pace
    # even on a loaded 2-core machine (where a step's computation takes several times longer).
    straggler, hiccups = {1: 0.06}, {0: [0.08, 0], 1: [0, 0.08]}
    runs = [dict(ASYNC_BASE, batch_size=32, staleness=s, slow=slow) for slow in (straggler, hiccups)
            for s in (0, 1, None)]
    results = common.launch(common.ps_in_turn, 3, runs, names=_ps_roles(1, 2), timeout=120, threads=1)
    seconds = {}
    for run, ([server], workers) in zip(runs, _by_case(results, 1)):
        s = run['staleness']
        assert server['pushes'] == 2 * run['steps'] == sum(w['steps'] for w in workers)
        for w in workers:
            assert len(w['losses']) == len(w['staleness']) == len(w['delay']) == w['steps']
            if s is not None:
                assert w['max_staleness'] <= s, (s, w['staleness'])
                assert w['max_delay'] <= 2 * s + 1, (s, w['delay'])   # (workers-1)(2s+1)
        seconds[s, run['slow'] is straggler] = server['seconds']
    # Asynchrony lets the fast worker do more of the updates: clearly faster.
    assert seconds[0, True] > 1.2 * seconds[None, True], seconds
    assert results[1][2]['steps'] > results[2][2]['steps']   # worker 0 did more steps
    # Hiccups that take turns cost a synchronous step every time, s=1 only half.
    assert seconds[0, False] > 1.1 * seconds[1, False], seconds


@pytest.mark.parametrize('kind, staleness', [('kill', 0), ('hang', None)])
def test_failed_worker_stops_the_job(kind, staleness):
    # With s=None the other worker finishes its steps; the server must still name worker 1.
    run = dict(ASYNC_BASE, staleness=staleness, timeout=2,
               fault=dict(role='worker', index=1, step=3, kind=kind))
    t0 = time.perf_counter()
    with pytest.raises((common.WorkerError, common.PSFault)) as error:
        common.launch(common.ps_async_process, 3, run, names=_ps_roles(1, 2), timeout=60, threads=1)
    message = str(error.value).splitlines()[0]
    assert 'worker 1' in message, message
    if kind == 'kill':
        assert 'SIGKILL' in message, message
    else:  # alive but silent: the server's timeout names the worker it waits for
        assert isinstance(error.value, common.PSFault) and 'server 0' in message, message
    assert time.perf_counter() - t0 < 30


# ------------------------------------------------------- figures in Chinese

def _tr_literals():
    import ast
    sys.path.insert(0, str(TESTS.parent / 'tools'))
    import nbpair
    found = set()
    for src in nbpair.sources():
        for cell in nbpair.parse(src):
            if cell['type'] != 'code':
                continue
            try:
                tree = ast.parse(cell['en'])
            except SyntaxError:  # IPython syntax (%%writefile, !cmd)
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'verdict':
                    texts = node.args[:1] + [case.elts[2] for case in getattr(
                        node.args[2] if len(node.args) > 2 else None, 'elts', [])
                        if isinstance(case, ast.Tuple) and len(case.elts) == 3]
                    found |= {t.value for t in texts if isinstance(t, ast.Constant)
                              and isinstance(t.value, str)}
                if isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'text' \
                        and getattr(node.func.value, 'id', None) == 'common' \
                        and node.args and isinstance(node.args[0], ast.Constant):
                    found.add(node.args[0].value)
                if isinstance(node, ast.Call) and getattr(node.func, 'attr', None) == 'tr' \
                        and node.args and isinstance(node.args[0], ast.Constant):
                    found.add(node.args[0].value)
    return found


def test_figure_text_has_no_key_twice():
    """A dict literal keeps the last of two equal keys silently; the first translation would be lost."""
    import ast
    tree = ast.parse((ROOT / 'common.py').read_text(encoding='utf-8'))
    table = next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                 and getattr(n.targets[0], 'id', None) == 'FIGURE_TEXT')
    keys = [k.value for k in table.keys]
    assert sorted({k for k in keys if keys.count(k) > 1}) == []


def test_every_figure_text_in_the_notebooks_has_a_chinese_translation():
    literals = _tr_literals()
    assert len(literals) > 40
    missing = sorted(literals - set(common.FIGURE_TEXT))
    assert not missing, f'add these to common.FIGURE_TEXT: {missing}'
    cjk = re.compile(r'[\u3400-\u9fff]')
    assert all(cjk.search(v) and not cjk.search(k) for k, v in common.FIGURE_TEXT.items()), \
        'keys are English, values Chinese'


def test_tr_keeps_english_in_english_notebooks(monkeypatch):
    monkeypatch.setenv('COURSE_LANG', 'en')
    assert common.tr('step {t}', t=3) == 'step 3'
    assert common.tr('not in the table') == 'not in the table'


def test_chinese_figure_text_renders_without_missing_glyphs(monkeypatch):
    import warnings
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    if common.cjk_font() is None:
        if os.environ.get('CI'):
            pytest.fail('no Chinese font: ./course setup installs fonts-wqy-microhei')
        pytest.skip('no Chinese font on this machine')
    monkeypatch.setenv('COURSE_LANG', 'zh')
    assert common.tr('step {t}', t=3) == '第 3 步'
    fig, ax = plt.subplots()
    ax.set(xlabel=common.tr('number of devices'), title=common.tr('memory pinned by the queue'))
    ax.plot([1, 2], [3, -4])
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # matplotlib warns "Glyph ... missing from font(s)"
        fig.canvas.draw()
    plt.close(fig)
    assert ax.get_xlabel() == '设备数'


def test_launch_op_timeout_bounds_a_receive():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match='Timed out'):
        common.launch(workers.receive_from_a_sleeper, 2, op_timeout=2, timeout=60)
    assert time.monotonic() - start < 30


# ------------------------------------------------------------ the module itself

def test_every_public_helper_is_used_and_documented():
    # common.py holds what the course uses: each public top-level name is used by a
    # notebook, a test, a tool or the set-up (or by common.py itself, outside its own
    # definition), and each public function or class says where it is used.
    import ast
    root = TESTS.parent
    source = (root / 'common.py').read_text(encoding='utf-8')
    tree = ast.parse(source)
    users = '\n'.join(p.read_text(encoding='utf-8') for pattern in
                      ('notebooks/src/*.txt', 'tests/*.py', 'tools/*.py')
                      for p in root.glob(pattern)) + (root / 'course').read_text(encoding='utf-8')
    unused, undocumented = [], []
    for node in tree.body:
        names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
            [t.id for t in getattr(node, 'targets', []) if isinstance(t, ast.Name)]
        for name in names:
            if name.startswith('_'):
                continue
            elsewhere = len(re.findall(rf'\b{name}\b', source)) > 1
            if f'common.{name}' not in users and not elsewhere:
                unused.append(name)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith('_'):
            doc = ast.get_docstring(node) or ''
            if not re.search(r'Used (in|by)', doc) and node.name not in DOC_EXEMPT:
                undocumented.append(node.name)
    assert not unused, f'public names nothing uses: {unused}'
    assert not undocumented, f'docstrings that do not say where they are used: {undocumented}'


DOC_EXEMPT = {'WorkerError', 'PSFault', 'KVStore'}  # exception types and a class used via its methods


# ---------------------------------------------------------------- 08: beyond data parallelism

SECTION_08 = definitions('08-beyond-data-parallelism', 'check_same_training', 'check_tensor_parallel',
                         'check_pipeline')


def test_zero_memory_reproduces_the_zero_paper_and_checks_its_input():
    # Rajbhandari et al. (ZeRO), Figure 1: 7.5B parameters, 64 GPUs, K = 12
    gb = [sum(common.zero_memory(7.5e9, 64, stage).values()) / 1e9 for stage in range(4)]
    assert [round(g, 1) for g in gb] == [120.0, 31.4, 16.6, 1.9]
    fp32 = common.zero_memory(1000, 4, 2, 'fp32')
    assert fp32 == {'parameters': 4000, 'gradients': 1000, 'optimizer state': 2000}
    for bad in (dict(params=0), dict(ranks=0), dict(ranks=2.5), dict(stage=4), dict(precision='fp8')):
        with pytest.raises(ValueError):
            common.zero_memory(**{'params': 10, **bad})


def test_memory_helpers_measure_what_training_holds():
    model = common.mlp([8, 16, 4])
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    opt = torch.optim.Adam(params)
    x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
    assert common.local_bytes([params[0], params[0], None]) == params[0].numel() * 4
    loss, saved = common.saved_activation_bytes(lambda: torch.nn.functional.cross_entropy(model(x), y),
                                                exclude=params)
    assert saved - (4 * 5 * (8 + 16 + 4) + 8 * 5) in range(0, 16)   # inputs, log-probs, labels (+ a scalar)
    loss.backward()
    opt.step()
    got = common.training_memory(model, opt)
    assert got['parameters'] == got['gradients'] == 4 * n
    assert got['optimizer state'] - 8 * n == 4 * len(params)         # m, v and one step counter per tensor


def test_memory_calculator_follows_its_sliders():
    box = common.memory_calculator()
    params, ranks, stage, precision, device, table = box.children
    assert '1.88 GB' in table.value and 'left' in table.value        # the paper's 1.875 GB at stage 3
    stage.value = 0
    assert '120.00 GB' in table.value and 'does not fit' in table.value
    precision.value = 'fp32'
    ranks.value, stage.value = 1, 3
    assert '30.00 GB' in table.value and '60.00 GB' in table.value   # 4 and 8 bytes of 7.5B


def test_ring_bytes_and_bubble_formulas():
    assert common.ring_bytes('all-reduce', 100, 4) == 150
    assert common.ring_bytes('all-gather', 100, 4) == common.ring_bytes('reduce-scatter', 100, 4) == 75
    assert common.bubble_fraction(2, 1) == 0.5 and common.bubble_fraction(4, 13) == 3 / 16
    with pytest.raises(ValueError):
        common.ring_bytes('broadcast', 1, 2)
    with pytest.raises(ValueError):
        common.bubble_fraction(2, 0)


@pytest.mark.parametrize('p,m', [(2, 1), (2, 4), (3, 5)])
def test_measured_bubble_of_an_ideal_gpipe_timeline_is_the_formula(p, m):
    tf, tb = 1.0, 2.0
    spans = [[('F', (s + i) * tf, (s + i + 1) * tf) for i in range(m)] for s in range(p)]
    backward_start = (m + p - 1) * tf
    for s in range(p):   # the last stage starts the backward, the first finishes it
        spans[s] += [('B', backward_start + (p - 1 - s + i) * tb, backward_start + (p - s + i) * tb)
                     for i in range(m)]
    assert common.measured_bubble(spans) == pytest.approx(common.bubble_fraction(p, m))


def test_sharded_training_equals_ddp_with_a_half_per_rank_and_the_check_catches_a_bad_start():
    run = dict(widths=[16, 32, 32, 4], batch_size=32, steps=4, lr=1e-2, count_step=2,
               modes=('ddp', 'zero1', 'fsdp', 'fsdp, no reshard'))
    results = common.launch(common.sharded_training, 2, run, threads=1)
    SECTION_08['check_same_training'](results)
    n = sum(p.numel() for p in common.mlp(run['widths']).parameters())
    for r in results:
        assert r['ddp']['memory']['parameters'] == 4 * n and r['fsdp']['memory']['parameters'] == 2 * n
        assert r['fsdp']['collectives'] == {'all-gather': 6, 'reduce-scatter': 3}
        assert r['fsdp, no reshard']['collectives'] == {'all-gather': 3, 'reduce-scatter': 3}
        assert set(r['ddp']['collectives']) == {'all-reduce'}
    bad = common.launch(common.sharded_training, 2, dict(run, seed_by_rank=True, modes=('ddp', 'fsdp')), threads=1)
    with pytest.raises(AssertionError, match='fsdp'):
        SECTION_08['check_same_training'](bad)


def test_tensor_parallel_block_equals_the_unsplit_block_and_the_check_catches_different_weights():
    run = dict(d=16, hidden=64, batch_size=8)
    good = common.launch(common.tensor_parallel_check, 2, run, threads=1)
    assert SECTION_08['check_tensor_parallel'](good) < 1e-5
    assert good[0]['forward'] == {'all-reduce': 1} == good[0]['backward']
    assert good[0]['shapes'] == {'first': ((32, 16), (64, 16)), 'second': ((16, 32), (16, 64))}
    bad = common.launch(common.tensor_parallel_check, 2, dict(run, seed_by_rank=True), threads=1)
    with pytest.raises(AssertionError, match='rank 1'):
        SECTION_08['check_tensor_parallel'](bad)


def test_pipeline_equals_the_unsplit_model_and_the_check_catches_summed_micro_batches():
    run = dict(hidden=32, layers=4, classes=10, batch_size=16, repeats=1,
               schedules=[('GPipe', 1), ('GPipe', 4), ('1F1B', 4)])
    good = common.launch(common.pipeline_run, 2, run, threads=1)
    assert SECTION_08['check_pipeline'](good) < 1e-5
    assert [r['peak_held'] for r in good[0]] == [1, 4, 2]             # 1F1B holds at most p
    assert all(kinds == {'F', 'B'} for kinds in ({k for k, *_ in r['spans'][0]} for r in good[0]))
    bad = common.launch(common.pipeline_run, 2, dict(run, scale_grads=False, schedules=[('GPipe', 4)]),
                        threads=1)
    with pytest.raises(AssertionError, match='gradients'):
        SECTION_08['check_pipeline'](bad)


def test_beyond_data_parallelism_workers_refuse_bad_settings():
    with pytest.raises(ValueError, match='shared evenly'):
        common.pipeline_stage_part(common.pipeline_model(8, 3, 2), 0, 2)
    with pytest.raises(ValueError, match='unknown mode'):
        common.launch(common.sharded_training, 2, dict(widths=[4, 4], batch_size=4, steps=1, lr=0.1,
                                                       count_step=0, modes=('zero9',)), threads=1)


def _gpipe_timeline(p, m, tf=1.0, tb=2.0, handover=0.0):
    """Spans of an ideal GPipe step; each hand-over between stages takes `handover` seconds."""
    f_end = [[0.0] * m for _ in range(p)]
    b_end = [[0.0] * m for _ in range(p)]
    spans = [[] for _ in range(p)]
    for s in range(p):
        for i in range(m):
            start = max(f_end[s][i - 1] if i else 0.0, f_end[s - 1][i] + handover if s else 0.0)
            f_end[s][i] = start + tf
            spans[s].append(('F', start, start + tf))
    for s in reversed(range(p)):
        for i in range(m):
            start = max(b_end[s][i - 1] if i else f_end[s][-1], b_end[s + 1][i] + handover if s < p - 1 else 0.0)
            b_end[s][i] = start + tb
            spans[s].append(('B', start, start + tb))
    return spans


@pytest.mark.parametrize('p,m', [(2, 1), (2, 8), (4, 5)])
def test_the_pipeline_replay_removes_hand_overs_and_nothing_else(p, m):
    replay = definitions('08-beyond-data-parallelism', 'replay_without_handovers')['replay_without_handovers']
    ideal, slow = _gpipe_timeline(p, m), _gpipe_timeline(p, m, handover=0.5)
    assert common.measured_bubble(ideal) == pytest.approx(common.bubble_fraction(p, m))
    assert replay(ideal) == pytest.approx(common.bubble_fraction(p, m))
    assert common.measured_bubble(slow) > common.bubble_fraction(p, m) + 0.01
    assert replay(slow) == pytest.approx(common.bubble_fraction(p, m))   # the hand-overs are gone
    uneven = [[(k, 2 * s_, 2 * e) if r == 0 and k == 'B' else (k, s_, e) for k, s_, e in spans]
              for r, spans in enumerate(ideal)]                         # stage 0's backward slower
    if m > 1:   # with one micro-batch nothing overlaps, whatever the stages' times
        assert replay(uneven) > common.bubble_fraction(p, m)
