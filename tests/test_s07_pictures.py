"""Section 07's pictures (comp_perf/s07_pictures.py) draw what their data says, and refuse data that disagrees."""
import copy

import matplotlib
import pytest

import common
from comp_perf import s07_pictures, s07_ring

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # noqa: E402


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close('all')


def test_the_calculators_static_figure_shows_its_starting_values():
    before = set(plt.get_fignums())
    common.sync_calculator(size_mb=160, devices=8, bandwidth_gbs=16, links=3)
    new = set(plt.get_fignums()) - before
    assert len(new) == 1, 'the calculator draws one static figure'
    ax = plt.figure(new.pop()).axes[0]
    widths = [bar.get_width() for bar in ax.patches]
    expected = [1e3 * common.sync_time(k, 160e6, 8, 16e9, 3 if k == 'ring' else 1) for k in common.SYNC_STRATEGIES]
    assert widths == pytest.approx(expected)
    assert widths != pytest.approx([1e3 * common.sync_time(k, 160e6, 4, 16e9) for k in common.SYNC_STRATEGIES])
    assert '8 devices' in ax.get_title()
    common.sync_calculator(static=False)
    assert len(plt.get_fignums()) == len(before) + 1, 'static=False draws nothing'


def sent_labels(fig):
    """The chunk numbers on the arrows of each step's panel, in drawing order (one per rank)."""
    return [[int(t.get_text()) for t in ax.texts if t.get_gid() == 'sent'] for ax in fig.axes]


@pytest.mark.parametrize('world_size', [3, 4])
@pytest.mark.procs
def test_the_ring_picture_is_drawn_from_the_traced_run(world_size):
    traces = common.launch(common.ring_trace, world_size, timeout=120)
    n = world_size
    steps = common.ring_steps(traces)
    assert len(steps) == 2 * (n - 1) + 1
    for r in range(n):   # what ring_allreduce's indexing says each rank sends, and that it ends complete
        assert [traces[r][t]['sent'] for t in range(2 * (n - 1))] == [(r - t) % n for t in range(2 * (n - 1))]
        assert steps[-1][2][r] == [list(range(n))] * n
        assert steps[n - 1][2][r][(r + 1) % n] == list(range(n)), 'reduce-scatter: rank r owns chunk r + 1'
    fig = common.plot_ring_steps(traces)
    labels = [panel for panel in sent_labels(fig) if panel]
    assert labels == [[traces[r][t]['sent'] for r in range(n)] for t in range(2 * (n - 1))]


def fake_ring_trace(n=3):
    """A correct trace, written out from the schedule, as ring_trace would return it."""
    held = [[1 << r] * n for r in range(n)]
    traces = [[] for _ in range(n)]
    for t in range(2 * (n - 1)):
        before = copy.deepcopy(held)
        for r in range(n):
            chunk = (r - t - 1) % n
            incoming = before[(r - 1) % n][chunk]
            held[r][chunk] = held[r][chunk] + incoming if t < n - 1 else incoming
            traces[r].append({'sent': (r - t) % n, 'received': chunk, 'held': [float(v) for v in held[r]]})
    return traces


def test_the_ring_picture_refuses_a_trace_that_disagrees_with_itself():
    good = fake_ring_trace()
    assert sent_labels(common.plot_ring_steps(good))[1] == [0, 1, 2]
    planted = copy.deepcopy(good)
    planted[1][2]['sent'] = (planted[1][2]['sent'] + 1) % 3      # rank 1 claims another chunk
    with pytest.raises(ValueError, match='rank 2 received chunk .* rank 1, sent chunk'):
        common.plot_ring_steps(planted)
    planted = copy.deepcopy(good)
    planted[0][0]['held'][0] = 2.5                                 # no sum of distinct 2**rank
    with pytest.raises(ValueError, match='no sum of distinct'):
        common.plot_ring_steps(planted)
    with pytest.raises(ValueError, match='2\\(n-1\\) traced steps'):
        common.plot_ring_steps([t[:-1] for t in good])


def fake_ps_run(steps=4, elements=(100, 60), workers=2):
    """Results shaped like ps_process's: consistent bytes, and times a step apart."""
    servers = [{'role': 'server', 'index': s, 'keys': [f'{s}.0'], 'elements': e,
                'pushed_bytes': 4 * e * workers * steps,
                'events': [(10.0 + t + 0.8, 10.0 + t + 0.9) for t in range(steps)]} for s, e in enumerate(elements)]
    workers_ = [{'role': 'worker', 'index': w, 'started': 10.0, 'pulled_bytes': [4 * e * (steps + 1) for e in elements],
                 'events': [(10.0 + t + 0.5, 10.0 + t + 1.0) for t in range(steps)]} for w in range(workers)]
    return servers, workers_


def test_the_push_pull_picture_labels_its_arrows_with_the_measured_bytes():
    servers, workers_ = fake_ps_run()
    steps, traffic, spans = s07_pictures._push_pull_traffic(servers, workers_)
    assert steps == 4 and traffic == {0: (400, 400), 1: (240, 240)}
    assert (1, 'worker 0', 1.0, 1.5, 'compute') in spans and (1, 'worker 0', 1.5, 2.0, 'push, pull') in spans
    assert (2, 'server 1', pytest.approx(1.9), pytest.approx(2.8), 'wait for pushes') in spans
    fig = common.plot_push_pull(servers, workers_)
    net, timeline = fig.axes
    for gid in ('push', 'pull'):
        shown = sorted(t.get_text() for t in net.texts if t.get_gid() == gid)
        assert shown == ['0.2 KB', '0.2 KB', '0.4 KB', '0.4 KB']   # one arrow per worker and server
    # steps 1-3: per worker a compute and a push-pull span (12), per server a wait and an update (12)
    assert len(timeline.collections) == 24


def test_the_push_pull_picture_refuses_bytes_or_times_that_do_not_add_up():
    servers, workers_ = fake_ps_run()
    planted = copy.deepcopy(servers)
    planted[1]['pushed_bytes'] -= 4                               # a push lost one element
    with pytest.raises(ValueError, match='server 1 received'):
        common.plot_push_pull(planted, workers_)
    planted = copy.deepcopy(workers_)
    planted[0]['pulled_bytes'][0] += 4
    with pytest.raises(ValueError, match='worker 0 pulled'):
        common.plot_push_pull(servers, planted)
    planted = copy.deepcopy(workers_)
    planted[1]['events'][2] = (planted[1]['events'][2][1], planted[1]['events'][2][0])   # pulled before pushed
    with pytest.raises(ValueError, match='worker 1: a step pushed'):
        common.plot_push_pull(servers, planted)


def test_the_async_picture_draws_one_line_per_run_and_panel():
    worker = {'times': [0.1 * i for i in range(20)], 'losses': [2.0 - 0.05 * i for i in range(20)],
              'updates': list(range(20))}
    runs = {'s=0, straggler': (None, [worker]), 's=2, hiccups': (None, [dict(worker, losses=[1.0] * 20)])}
    fig = common.plot_async_runs(runs, list(runs))
    by_time, by_count = fig.axes
    assert len(by_time.lines) == len(by_count.lines) == 2
    assert list(by_count.lines[1].get_ydata()) == pytest.approx([1.0] * 11)
    assert by_time.lines[0].get_ydata()[0] == pytest.approx(sum(worker['losses'][:10]) / 10)


def test_the_calculator_and_its_figure_share_one_computation():
    times = s07_ring._strategy_times(160, 4, 16)
    assert times == pytest.approx({'gpu0': 60, 'cpu': 80, 'split': 15, 'ring': 15})
