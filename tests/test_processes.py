"""Worker processes (comp_perf/processes.py): real process groups, errors, timeouts, no orphans."""
import datetime
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import workers
from process_checks import alive, children, wait_until

import common
from comp_perf import processes

TESTS = Path(__file__).resolve().parent


@pytest.mark.procs
def test_launch_runs_real_process_group():
    assert common.launch(workers.rank_and_world, 2, backend='gloo') == [
        (0, 2, 0, 2, '0'), (1, 2, 1, 2, '1')]
    assert common.launch(common.allreduce_check, 3) == [6.0, 6.0, 6.0]


@pytest.mark.procs
def test_workers_see_the_launchers_environment_as_it_is_now(monkeypatch):
    # On Linux workers are forked from a server started at the first launch, which holds the
    # environment of that moment; a variable set since (a notebook's COURSE_LANG) must reach them.
    common.launch(workers.rank_and_world, 2)
    monkeypatch.setenv('COURSE_PROBE', 'set after the first launch')
    assert common.launch(workers.environment_variable, 2, 'COURSE_PROBE') == ['set after the first launch'] * 2


# Counts, in a fresh interpreter, the calls that start CUDA's driver while `modules` are imported.
ASKS_CUDA = """
import sys, torch
asked = []
count, init = torch._C._cuda_getDeviceCount, torch.cuda._lazy_init
torch._C._cuda_getDeviceCount = lambda: asked.append('device count') or count()
torch.cuda._lazy_init = lambda: asked.append('lazy init') or init()
for name in sys.argv[1:]:
    __import__(name)
print(asked)
"""


@pytest.mark.procs
@pytest.mark.parametrize('modules, asks', [(processes.FORK_SERVER_PRELOAD, False), (('common',), True)])
def test_the_fork_server_imports_nothing_that_asks_cuda(modules, asks):
    # A worker forked from a process whose CUDA driver has started cannot use CUDA (an NCCL
    # worker on a GPU machine would fail). The second case shows the check can fail: the
    # course's own import asks torch.cuda.is_available(), so it stays out of the preload.
    out = subprocess.run([sys.executable, '-c', ASKS_CUDA, *modules], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert (out.strip() != '[]') is asks, out


def test_workers_are_forked_from_a_server_on_linux_and_spawned_elsewhere(monkeypatch):
    assert processes._context().get_start_method() == ('forkserver' if sys.platform.startswith('linux') else 'spawn')
    monkeypatch.setattr(sys, 'platform', 'darwin')
    assert processes._context().get_start_method() == 'spawn'


@pytest.mark.parametrize('gpus', [1, 2, 8])
@pytest.mark.procs
def test_launch_never_picks_nccl_by_itself(fake_gpus, gpus):
    # The old rule chose NCCL whenever there were as many GPUs as processes, and
    # every CPU tensor then failed ("No backend type associated with device type cpu").
    fake_gpus(gpus)
    for world_size in sorted({1, 2, min(gpus, 3)}):
        assert common.launch(workers.backend_and_device, world_size) == [('gloo', 'cpu')] * world_size


def test_worker_device_follows_the_backend_it_was_given(monkeypatch):
    monkeypatch.setattr(torch.distributed, 'get_rank', lambda: 3)
    monkeypatch.setattr(torch.distributed, 'get_backend', lambda: 'nccl')
    assert common.worker_device() == torch.device('cuda:3')
    monkeypatch.setattr(torch.distributed, 'get_backend', lambda: 'gloo')
    assert common.worker_device() == torch.device('cpu')


def test_nccl_is_checked_against_the_gpu_count(fake_gpus):
    fake_gpus(2)
    with pytest.raises(ValueError, match='nccl needs one GPU per process: 3 processes, 2 GPU'):
        common.launch(common.allreduce_check, 3, backend='nccl')


# Two GPUs for two processes: the count the old rule turned into NCCL. launch's choice for 1, 2 and 8
# GPUs is tested above; here every worker runs once under the count that broke them.
@pytest.mark.parametrize('gpus', [2])
@pytest.mark.procs
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


@pytest.mark.procs
def test_beyond_data_parallelism_workers_stay_on_the_cpu_in_processes_that_see_gpus():
    # 08's workers run over gloo; fully_shard's default mesh would be CUDA wherever CUDA exists.
    # Spawned processes see the real machine, so the worker fakes a GPU inside each process.
    for result in common.launch(workers.beyond_data_parallelism_seeing_gpus, 2, threads=1):
        assert result['devices'] == {'ddp': 'cpu', 'fsdp': 'cpu'} and result['same']
        assert result['tp'] < 1e-5 and result['pipe'] < 1e-5


@pytest.mark.procs
def test_workers_can_return_tensors_that_outlive_them():
    out = common.launch(workers.return_tensor, 2)
    assert [t.tolist() for t in out] == [[0.0] * 3, [1.0] * 3]


@pytest.mark.procs
def test_a_worker_that_leaves_at_once_still_delivers_a_large_result():
    results = common.launch(workers.large_result, 2)
    assert [r.sum().item() for r in results] == [0.0, 250_000.0]


def test_a_worker_flushes_its_result_before_it_exits_without_the_teardown(monkeypatch):
    # gloo's teardown at exit sometimes aborts a finished worker (exit -6): workers end with os._exit,
    # and os._exit drops what the queue's feeder thread has not written yet, so the queue is joined first
    calls = []
    queue = type('Queue', (), {'close': lambda self: calls.append('close'),
                               'join_thread': lambda self: calls.append('flushed')})()
    monkeypatch.setattr(processes.os, '_exit', lambda code: calls.append(('exit', code)))
    processes._leave(queue)
    assert calls == ['close', 'flushed', ('exit', 0)]


def test_leave_process_group_destroys_the_group_then_exits_at_once(monkeypatch):
    calls = []
    monkeypatch.setattr(processes.dist, 'destroy_process_group', lambda: calls.append('destroy'))
    monkeypatch.setattr(processes.os, '_exit', lambda code: calls.append(('exit', code)))
    common.leave_process_group()
    assert calls == ['destroy', ('exit', 0)]


@pytest.mark.procs
def test_worker_exception_is_reraised_with_traceback():
    with pytest.raises(ZeroDivisionError, match='on purpose') as info:
        common.launch(workers.fail_on_rank_one, 2, timeout=60)
    remote = str(info.value.__cause__)
    assert 'worker rank 1' in remote and 'fail_on_rank_one' in remote


@pytest.mark.procs
def test_worker_that_dies_is_named():
    with pytest.raises(common.WorkerError, match='rank 0 exited with code 7'):
        common.launch(workers.die_hard, 2, timeout=60)


@pytest.mark.procs
def test_hanging_worker_times_out_and_leaves_no_process(tmp_path):
    # Readiness does not matter here: on a loaded machine the 4 s may pass before a worker has
    # even written its pid. Whatever state they reached, no process may outlive the call.
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r'rank\(s\) \[0, 1\] did not finish within 4 s'):
        common.launch(workers.report_pid_then_hang, 2, str(tmp_path), timeout=4)
    assert time.monotonic() - start < 30
    pids = [int(p.read_text()) for p in tmp_path.glob('*.pid')]
    assert len(pids) <= 2 and not any(alive(pid) for pid in pids)
    assert wait_until(lambda: not children(), 10), children()


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
@pytest.mark.procs
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
        assert wait_until(lambda: len(list(tmp_path.glob('*.pid'))) == 2, 60), 'workers did not start'
        pids = [int(p.read_text()) for p in tmp_path.glob('*.pid')]
        parent.send_signal(signal.SIGINT if how == 'interrupt' else signal.SIGKILL)
        try:
            parent.wait(60)
        except subprocess.TimeoutExpired:
            pytest.fail(f'launcher did not exit after {how}:\n{log.read_text()[-4000:]}')
        assert wait_until(lambda: not any(alive(pid) for pid in pids), 15), \
            f'workers {pids} outlived their launcher ({how})'
    finally:
        parent.kill()
        parent.wait()


@pytest.mark.procs
def test_launch_op_timeout_bounds_a_receive():
    start = time.monotonic()
    with pytest.raises(RuntimeError, match='Timed out'):
        common.launch(workers.receive_from_a_sleeper, 2, op_timeout=2, timeout=60)
    assert time.monotonic() - start < 30


def test_nccl_groups_are_bound_to_the_ranks_gpu_and_gloo_groups_to_none():
    from comp_perf.processes import _group_options
    assert _group_options('nccl', 2, None) == {'device_id': torch.device('cuda', 2)}
    assert _group_options('gloo', 2, None) == {}
    assert _group_options('gloo', 0, 5) == {'timeout': datetime.timedelta(seconds=5)}


@pytest.mark.procs
def test_launch_gives_each_process_its_share_of_the_usable_cores():
    share = max(1, common.usable_cores() // 2)
    assert common.launch(workers.intra_op_threads, 2) == [share, share]


# Joining under load: a rendezvous that fails because the processes could not connect is tried once more

def _fake_group_failing(times, monkeypatch):
    """Make processes._run_group raise ConnectionFailed `times` times, then return 'result'; count the calls."""
    calls = []

    def run_group(group, timeout, names):
        calls.append(group)
        if len(calls) <= times:
            raise processes.ConnectionFailed('worker rank 1 could not connect to its peers', 'connectFullMesh')
        return 'result'
    monkeypatch.setattr(processes, '_run_group', run_group)
    return calls


def test_launch_tries_once_more_when_the_workers_could_not_connect_and_says_so(monkeypatch, capsys):
    calls = _fake_group_failing(1, monkeypatch)
    assert common.launch(workers.rank_and_world, 2) == 'result'
    assert len(calls) == 2 and calls[0] == calls[1]
    err = capsys.readouterr().err
    assert 'could not connect to each other (connectFullMesh); starting them once more' in err


def test_launch_gives_up_after_a_second_failed_connection(monkeypatch):
    from comp_perf.processes import ConnectionFailed
    calls = _fake_group_failing(2, monkeypatch)
    with pytest.raises(ConnectionFailed, match='could not connect to its peers'):
        common.launch(workers.rank_and_world, 2)
    assert len(calls) == 2


class _Finished:
    exitcode = None


def _messages(*outcomes):
    import pickle
    import queue
    q = queue.Queue()
    for outcome in outcomes:
        q.put(pickle.dumps(outcome))
    return q


def test_only_a_connection_failure_while_joining_counts_as_one():
    from comp_perf.processes import ConnectionFailed, WorkerError, _collect
    mesh = 'RuntimeError: Gloo connectFullMesh failed with ... Connection closed by peer [127.0.0.1]:4242'
    procs = [_Finished(), _Finished()]
    with pytest.raises(ConnectionFailed) as failed:
        _collect(procs, _messages((1, 'join-error', (None, mesh, time.time()))), timeout=5)
    assert failed.value.why == 'connectFullMesh'
    # the same words from a worker whose group had formed: its peer died while fn ran, no retry
    with pytest.raises(WorkerError) as failed:
        _collect(procs, _messages((1, 'error', (None, mesh, time.time()))), timeout=5)
    assert not isinstance(failed.value, ConnectionFailed)
    # failing to join for another reason (a wrong device, say) is that reason, no retry
    with pytest.raises(WorkerError) as failed:
        _collect(procs, _messages((0, 'join-error', (None, 'ValueError: no such device', time.time()))), timeout=5)
    assert not isinstance(failed.value, ConnectionFailed)


def test_torchrun_tries_once_more_with_a_fresh_rendezvous_when_its_processes_never_met(monkeypatch, capsys):
    seen = []

    def run_launchers(script, commands, visible, timeout):
        seen.append(commands)
        if len(seen) == 1:
            raise processes.ConnectionFailed('torchrun x.py (node 1) exited with code 1', 'RendezvousConnectionError')
        return ['out0', 'out1']
    monkeypatch.setattr(processes, '_run_launchers', run_launchers)
    assert common.torchrun('x.py', nnodes=2) == ['out0', 'out1']
    endpoint = [[arg for arg in commands[0] if arg.startswith('--rdzv-')] for commands in seen]
    assert endpoint[0] != endpoint[1], 'the second try must meet on a new port with a new id'
    assert 'could not connect to each other (RendezvousConnectionError)' in capsys.readouterr().err


@pytest.mark.procs
def test_torchrun_tells_a_failed_join_from_a_failing_script():
    from comp_perf.processes import ConnectionFailed, _run_launchers
    joined_never = [sys.executable, '-c', "print('RuntimeError: Gloo connectFullMesh failed'); raise SystemExit(1)"]
    with pytest.raises(ConnectionFailed):
        _run_launchers('x.py', [joined_never], [None], timeout=30)
    script_failed = [sys.executable, '-c', "print('ZeroDivisionError; Connection closed by peer'); raise SystemExit(1)"]
    with pytest.raises(RuntimeError) as failed:
        _run_launchers('x.py', [script_failed], [None], timeout=30)
    assert not isinstance(failed.value, ConnectionFailed)
