"""Section 07: cost models (on its page), ring all-reduce and the parameter servers (comp_perf/s07_*.py)."""
import time

import numpy as np
import pytest
import torch
import workers
from notebook_code import definitions

import common
from comp_perf import s07_pictures
from comp_perf.s07_ring import RING_ALGORITHMS


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


@pytest.mark.parametrize('world_size,numel', [(2, 10), (3, 1000), (4, 7)])
@pytest.mark.procs
def test_ring_allreduce_equals_all_reduce(world_size, numel):
    # every algorithm in one process group per size: a group costs seconds to start, a ring milliseconds
    per_rank = common.launch(workers.every_ring_check, world_size, numel, timeout=120)
    assert all(set(errors) == set(RING_ALGORITHMS) for errors in per_rank)
    assert max(max(errors.values()) for errors in per_rank) < 1e-5, per_rank


@pytest.mark.procs
def test_ring_check_can_fail():
    # A ring that forgets the all-gather leaves every rank with only one finished chunk.
    errors = common.launch(workers.check_a_broken_ring, 3, 999, timeout=120)
    assert min(errors) > 0.1


@pytest.mark.procs
def test_comm_benchmark_measures_every_algorithm():
    sizes = [64, 4096, 65536]
    out = common.launch(common.comm_benchmark, 2, sizes, 2,
                        ('ring', 'ring both ways', 'all_reduce'), timeout=120)
    assert out[1] is None
    assert set(out[0]) == {'pingpong', 'exchange', 'ring', 'ring both ways', 'all_reduce'}
    assert all(len(v) == len(sizes) and min(v) > 0 for v in out[0].values())
    with pytest.raises(ValueError, match='unknown algorithm'):
        common.launch(common.comm_benchmark, 2, sizes, 1, ('carrier-pigeon',), timeout=60)


@pytest.fixture(scope='module')
def page():
    """The cost models section 07 defines on its page: the tests run that code."""
    return definitions('07-parameter-servers', 'fit_alpha_beta', 'ring_model', 'ps_time', 'hierarchical_time')


def test_fit_alpha_beta_recovers_a_known_line(page):
    fit_alpha_beta, ring_model = page['fit_alpha_beta'], page['ring_model']
    sizes = np.array([16, 1024, 65536, 2 ** 20, 2 ** 24])
    alpha, beta = fit_alpha_beta(sizes, 50e-6 + sizes / 2e9)
    assert alpha == pytest.approx(50e-6, rel=1e-6) and beta == pytest.approx(0.5e-9, rel=1e-6)
    assert ring_model(2 ** 20, 4, alpha, beta) == pytest.approx(6 * (50e-6 + 2 ** 18 / 2e9))
    with pytest.raises(ValueError, match='at least two'):
        fit_alpha_beta([1], [1.0])


def test_parameter_server_and_hierarchical_costs(page):
    ps_time, hierarchical_time = page['ps_time'], page['hierarchical_time']
    MB, GB = 1e6, 1e9
    one = ps_time(160 * MB, 8, 1, 10 * GB)
    assert one == pytest.approx(2 * 8 * 0.016)                      # 8 workers through one link
    assert ps_time(160 * MB, 8, 8, 10 * GB) == pytest.approx(0.032)  # as many servers: flat
    assert ps_time(160 * MB, 64, 64, 10 * GB) == ps_time(160 * MB, 8, 8, 10 * GB)
    hier = hierarchical_time(160 * MB, 32, 8, 3 * 18 * GB, 10 * GB, servers=32)
    assert hier == pytest.approx(2 * 7 / 8 * 160 * MB / (54 * GB) + 0.032)
    assert hier < ps_time(160 * MB, 256, 32, 10 * GB) / 5
    with pytest.raises(ValueError, match='servers >= 1'):
        ps_time(1, 2, 0, 1)
    with pytest.raises(ValueError, match='gpus >= 1'):
        hierarchical_time(1, 2, 0, 1, 1)


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


@pytest.mark.procs
def test_parameter_server_step_equals_all_reduce_training(fashion_mnist):
    out = common.launch(common.ps_process, 4, PS_RUN, names=ROLES, timeout=120)
    servers, workers_ = out[:2], out[2:]
    assert [r['role'] for r in out] == ['server', 'server', 'worker', 'worker']
    assert all(w['allreduce_diff'] <= 1e-6 for w in workers_)
    assert [s['pushes'] for s in servers] == [2 * 3 * len(s['keys']) for s in servers]
    # what the loops record for 07's picture: every push's and pull's bytes, a time for each step
    steps, traffic, _ = s07_pictures._push_pull_traffic(servers, workers_)
    assert steps == 3 and traffic == {s['index']: (4 * s['elements'],) * 2 for s in servers}
    # three PS steps train exactly like three all-reduce steps (dp_worker, same data order)
    dp_run = {key: PS_RUN[key] for key in ('batch_size', 'lr', 'steps', 'subset')}   # dp_worker's keys
    dp = common.launch(common.dp_worker, 2, dp_run, timeout=120)[0]['params']
    for a, b in zip(workers_[0]['params'], dp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match='servers < processes'):
        common.launch(common.ps_process, 2, dict(PS_RUN, servers=2), timeout=60)


@pytest.mark.parametrize('role,noticed', [('worker', 'server'), ('server', 'worker')])
@pytest.mark.procs
def test_parameter_server_names_a_killed_process(fashion_mnist, role, noticed, tmp_path):
    stamp = tmp_path / 'fault-time'   # the delay counts from the fault, not from start-up
    run = dict(PS_RUN, steps=4, fault=dict(role=role, index=1, step=2, kind='kill', stamp=str(stamp)))
    with pytest.raises(common.WorkerError, match=rf'\({role} 1\) exited with code -9 \(SIGKILL\)'
                                                 rf'.*noticed first.*PSFault: {noticed}'):
        common.launch(common.ps_process, 4, run, names=ROLES, timeout=60)
    assert time.time() - float(stamp.read_text()) < 20


@pytest.mark.procs
def test_parameter_server_times_out_on_a_silent_worker(fashion_mnist, tmp_path):
    stamp = tmp_path / 'fault-time'
    run = dict(PS_RUN, steps=4, timeout=3,
               fault=dict(role='worker', index=1, step=1, kind='hang', stamp=str(stamp)))
    with pytest.raises(common.PSFault, match=r'from worker 1 \(rank 3\) at step 1.*Timed out'):
        common.launch(common.ps_process, 4, run, names=ROLES, timeout=60)
    assert 3 <= time.time() - float(stamp.read_text()) < 20


@pytest.mark.procs
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


@pytest.mark.procs
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


@pytest.mark.procs
def test_staleness_zero_is_synchronous_sgd():
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


@pytest.mark.procs
def test_staleness_bound_and_straggler():
    # One server, two workers; worker 1 sleeps 60 ms a step. Then both hiccup in turn (80 ms).
    # Small batches and long sleeps, so that the sleeps, not the shared cores, set the pace
    # even on a loaded 2-core machine (where a step's computation takes several times longer).
    straggler, hiccups = {1: 0.06}, {0: [0.08, 0], 1: [0, 0.08]}
    runs = [dict(ASYNC_BASE, batch_size=32, staleness=s, slow=slow) for slow in (straggler, hiccups)
            for s in (0, 1, None)]
    results = common.launch(common.ps_in_turn, 3, runs, names=_ps_roles(1, 2), timeout=120, threads=1)
    seconds = {}
    for run, ([server], worker_results) in zip(runs, _by_case(results, 1)):
        s = run['staleness']
        assert server['pushes'] == 2 * run['steps'] == sum(w['steps'] for w in worker_results)
        for w in worker_results:
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
@pytest.mark.procs
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
