"""Timing and verdicts (comp_perf/measure.py and the timeline of comp_perf/pictures.py)."""
import math
import subprocess
import sys
import time

import pytest
import torch

import common
import comp_perf.fashion_mnist
import comp_perf.language
import comp_perf.measure


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


@pytest.mark.procs
def test_quiet_native_stderr_hides_fd2_then_restores_it(tmp_path):
    code = ('import os, common\n'
            'with common.quiet_native_stderr():\n'
            '    os.write(2, b"hidden\\n")\n'
            'os.write(2, b"shown\\n")\n')
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, timeout=60)
    assert out.stderr.decode().splitlines()[-1] == 'shown' and b'hidden' not in out.stderr


def test_quiet_native_stderr_catches_the_profilers_note_from_its_start():
    # torch 2.11 warns "Profiler clears events ..." as a profiler starts: the filter must already be on
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        with common.quiet_native_stderr():
            warnings.warn('Profiler clears events at the end of each cycle.')
            warnings.warn('another note')
        warnings.warn('Profiler clears events again, outside')
    assert [str(w.message) for w in caught] == ['another note', 'Profiler clears events again, outside']


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
    monkeypatch.setattr(comp_perf.measure, 'synchronize', lambda device=None: calls.append(device))
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
    with pytest.raises(ValueError, match='several devices need repeats'):
        common.measure(lambda: None, device=['cuda:0', 'cuda:1'])


@pytest.fixture
def fake_cuda(monkeypatch, fake_gpus):
    """Three visible GPUs; returns (waited, set_initialised): torch.cuda.synchronize's calls, and a switch."""
    fake_gpus(3)
    state = {'initialised': False}
    waited = []
    monkeypatch.setattr(torch.cuda, 'is_initialized', lambda: state['initialised'])
    monkeypatch.setattr(torch.cuda, 'synchronize', lambda device=None: waited.append(device))
    return waited, lambda value: state.update(initialised=value)


def test_synchronize_touches_no_gpu_before_cuda_is_initialised(fake_cuda):
    # waiting on a GPU creates a CUDA context there: a process that never used CUDA must not
    waited, initialised = fake_cuda
    initialised(False)
    common.synchronize()
    common.synchronize('cuda:1')
    common.synchronize(['cuda:0', 'cuda:1'])
    common.measure(lambda: None, repeats=2)
    with common.Benchmark(verbose=False):
        pass
    assert waited == []


def test_measure_of_cpu_work_on_a_gpu_machine_asks_no_accelerator_to_wait(fake_cuda, monkeypatch):
    # torch.utils.benchmark's default clock synchronises torch.accelerator whenever a GPU is visible,
    # creating a CUDA context to time a CPU sum; measure() passes a clock that waits like synchronize()
    waited, initialised = fake_cuda
    initialised(False)
    accelerator = []
    monkeypatch.setattr(torch.accelerator, 'is_available', lambda: True)
    monkeypatch.setattr(torch.accelerator, 'synchronize', lambda *a: accelerator.append(a))
    common.measure(sum, [1, 2], min_run_time=0.01)
    assert waited == [] and accelerator == []
    initialised(True)   # once the process computes on a GPU, every block of the clock waits for it
    common.measure(sum, [1, 2], min_run_time=0.01)
    assert len(waited) >= 3 and accelerator == []


def test_synchronize_waits_for_the_current_gpu_only_unless_told_more(fake_cuda):
    waited, initialised = fake_cuda
    initialised(True)
    common.synchronize()
    assert waited == [None]              # torch.cuda.synchronize(None): the current device
    waited.clear()
    common.synchronize('cuda:1')
    common.synchronize('cpu')
    assert waited == [torch.device('cuda:1')]
    waited.clear()
    common.synchronize([torch.device('cuda', 0), 'cpu', 2])  # a list: each GPU in it, CPU skipped
    assert waited == [torch.device('cuda:0'), torch.device('cuda:2')]


def test_measure_passes_several_devices_on_to_synchronize(fake_cuda):
    # 03's two-device branch times work on two GPUs: both must be waited for
    waited, initialised = fake_cuda
    initialised(True)
    common.measure(lambda: None, repeats=1, device=['cuda:0', 'cuda:1'])
    assert waited == [torch.device('cuda:0'), torch.device('cuda:1')] * 3


CASES = [(0.9, 'slower', 'compile is slower'), (1.1, 'same', 'no difference'),
         (math.inf, 'faster', 'compile is faster')]


@pytest.fixture
def case_texts(monkeypatch):
    # Chinese for the test's own texts, added to the catalog for this test only
    for english, chinese in [('compile is slower', '编译版更慢'), ('no difference', '没有差别'),
                             ('compile is faster', '编译版更快'), ('compile/eager', '编译/eager'),
                             ('threads / intra-op', '线程 / 算子内')]:
        monkeypatch.setitem(comp_perf.language.zh_text(), english, chinese)


@pytest.mark.parametrize('value,key', [(0.64, 'slower'), (0.9, 'same'), (1.0, 'same'), (9.6, 'faster')])
def test_verdict_picks_the_case_and_prints_the_number(monkeypatch, capsys, case_texts, value, key):
    monkeypatch.setenv('COURSE_LANG', 'en')
    assert common.verdict('compile/eager', value, CASES) == key
    text = dict((k, t) for _, k, t in CASES)[key]
    assert capsys.readouterr().out == f'Verdict: compile/eager: {value:.2f}× → {text}\n'


def test_verdict_speaks_chinese_and_can_show_a_comparison(monkeypatch, capsys, case_texts):
    monkeypatch.setenv('COURSE_LANG', 'zh')
    common.verdict('threads / intra-op', 1.6 / 1.98, CASES, shown='1.60× vs 1.98×')
    assert capsys.readouterr().out == '结论：线程 / 算子内为 1.60× vs 1.98× → 编译版更慢\n'   # no stacked colons
    # a notebook's texts come from the catalog
    common.verdict('time of sum(list) over torch.sum', 100.0,
                   [(math.inf, 'x', 'sum(list) handles one Python object per number: overhead-bound')])
    assert capsys.readouterr().out.endswith('100.00× → sum(list) 每个数都要处理一个 Python 对象，开销受限\n')


def test_verdict_refuses_cases_that_cannot_decide():
    with pytest.raises(ValueError, match='math.inf'):
        common.verdict('r', 5.0, CASES[:2])
    with pytest.raises(ValueError, match='must increase'):
        common.verdict('r', 1.0, CASES[::-1])
    with pytest.raises(ValueError, match='measured number'):
        common.verdict('r', float('nan'), CASES)


def test_measure_reports_median_not_first_call():
    calls = []

    def slow_first(x):
        calls.append(x)
        time.sleep(0.2 if len(calls) == 1 else 0.001)

    median = common.measure(slow_first, 1, min_run_time=0.05)
    assert len(calls) > 3
    assert 0.001 <= median < 0.1  # the 0.2 s first call is the warm-up, not measured


def test_interleaved_runs_the_variants_in_turns_and_drops_the_warm_up(monkeypatch):
    order, waited = [], []
    monkeypatch.setattr(comp_perf.measure, 'synchronize', lambda device=None: waited.append(device))
    times = common.interleaved({'a': lambda: order.append('a'), 'b': lambda: order.append('b')},
                               rounds=3, warmup=2, device='cuda:0')
    assert order == ['a', 'b'] * 5
    assert {name: len(seconds) for name, seconds in times.items()} == {'a': 3, 'b': 3}
    assert waited == ['cuda:0'] * 20            # before and after every call
    for bad in (dict(rounds=0), dict(warmup=-1), dict(rounds=True), dict(rounds=2.0)):
        with pytest.raises(ValueError, match='whole number'):
            common.interleaved({'a': lambda: None}, **bad)
    with pytest.raises(ValueError, match='at least one'):
        common.interleaved({})


def test_a_busy_patch_hits_both_variants_of_a_round_alike():
    # the machine gets twice as slow half way: A is always 2× B within a round, whatever the round
    clock = {'calls': 0}

    def work(units):
        clock['calls'] += 1
        time.sleep(0.01 * units * (2 if clock["calls"] > 6 else 1))
    times = common.interleaved({'slow': lambda: work(2), 'fast': lambda: work(1)}, rounds=6, warmup=0)
    median, low, high = common.paired_ratio(times['slow'], times['fast'])
    assert 1.5 < low <= median <= high < 2.6


def test_paired_ratio_gives_the_median_and_quartiles_of_the_per_round_ratios():
    assert common.paired_ratio([2, 4, 6, 8, 10], [1, 1, 1, 1, 1]) == (6.0, 4.0, 8.0)
    assert common.paired_ratio([3, 3, 3], [1, 3, 1]) == (3.0, 2.0, 3.0)
    with pytest.raises(ValueError, match='equally long'):
        common.paired_ratio([1, 2], [1])
    with pytest.raises(ValueError, match='equally long'):
        common.paired_ratio([], [])


NOISE_CASES = [(0.95, 'slower', 'slower'), (1.1, 'same', 'about the same'), (math.inf, 'faster', 'faster')]


def test_noise_verdict_names_no_winner_inside_the_noise(capsys):
    # quartiles 0.9–1.2 straddle 1: the run cannot tell, even though the median says "faster"
    assert common.noise_verdict('ratio', [1.2, 0.9, 1.15, 0.8, 1.3], [1, 1, 1, 1, 1], NOISE_CASES) == 'noise'
    assert 'within the noise of this run' in capsys.readouterr().out
    assert common.noise_verdict('ratio', [2.0, 2.1, 1.9, 2.2, 2.0], [1, 1, 1, 1, 1], NOISE_CASES) == 'faster'
    out = capsys.readouterr().out
    assert '2.00× (quartiles 2.00–2.10)' in out and 'faster' in out
    assert common.noise_verdict('ratio', [0.5, 0.6, 0.55], [1, 1, 1], NOISE_CASES) == 'slower'   # clearly slower
