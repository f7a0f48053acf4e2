"""Section 09: the page's first draft and its fixes, the checks that they compute the same step,
what the page reads from the profiler, the peaks and the GPU decisions (faked)."""
import json
import types

import numpy as np
import pytest
import torch
from notebook_code import definitions
from torch.nn import functional as F

import comp_perf.s09_training_step as s09
import common

PAGE_NAMES = ('looped_attention', 'Block', 'ViT', 'new_model', 'batch_plan', 'per_sample_batch', 'whole_batch',
              'phase', 'make_step', 'largest_difference', 'same_step', 'profiled', 'autocast_dtype', 'gradients')


@pytest.fixture(scope='module')
def page():
    """The page's own functions, with small settings and an 8-bit image set in place of Fashion-MNIST."""
    ns = definitions('09-one-training-step', *PAGE_NAMES)
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (64, 28, 28), dtype=np.uint8)
    ns.update(cfg=types.SimpleNamespace(d=32, heads=2, layers=2, patch=7, batch=8, lr=1e-3),
              device=torch.device('cpu'), images=images, labels=rng.integers(0, 10, 64),
              MEAN=float(images.mean() / 255), STD=float(images.std() / 255),
              activities=[torch.profiler.ProfilerActivity.CPU], profiling=False)
    return ns


DRAFT = dict(data='per sample', dtype=torch.float64, anomaly=True, attention='loop')
FIX1 = dict(DRAFT, dtype=torch.float32)
FIX2 = dict(FIX1, anomaly=False)
FIX3 = dict(FIX2, data='whole batch')
FINAL = dict(FIX3, attention='sdpa')


def test_looped_attention_is_attention(page):
    q, k, v = torch.randn(3, 4, 2, 9, 8).unbind(0)
    assert torch.allclose(page['looped_attention'](q, k, v), F.scaled_dot_product_attention(q, k, v), atol=1e-6)


def test_both_data_paths_give_the_same_batch(page):
    a, ya = page['per_sample_batch'](3, torch.float64)
    b, yb = page['whole_batch'](3, torch.float64)
    assert a.dtype == torch.float64 and torch.equal(ya, yb)
    assert (a - b).abs().max() < 1e-12
    c, _ = page['whole_batch'](4, torch.float64)
    assert (c - b).abs().max() > 0.1          # another step, other samples and warps


@pytest.mark.filterwarnings('ignore:Anomaly Detection has been enabled')
@pytest.mark.parametrize('before, after, tol', [(DRAFT, FIX1, 1e-4), (FIX1, FIX2, 0), (FIX2, FIX3, 1e-5),
                                                (FIX3, FINAL, 1e-5)])
def test_each_fix_computes_the_same_step(page, capsys, before, after, tol):
    page['same_step'](before, after, tol)
    assert 'same step?' in capsys.readouterr().out


@pytest.mark.filterwarnings('ignore:Anomaly Detection has been enabled')
def test_the_same_step_check_fails_on_planted_bugs(page, monkeypatch):
    same_step, whole_batch, new_model = page['same_step'], page['whole_batch'], page['new_model']
    # a batched data path that draws the warps of another step
    monkeypatch.setitem(page, 'whole_batch', lambda step, dtype: whole_batch(step + 1, dtype))
    with pytest.raises(AssertionError, match='same step'):
        same_step(FIX2, FIX3, 1e-5)
    monkeypatch.setitem(page, 'whole_batch', whole_batch)
    # a float32 model that starts from other weights than the float64 one
    def reseeded(attention='sdpa', dtype=torch.float32, **changes):
        model = new_model(attention, dtype, **changes)
        if dtype == torch.float32:
            torch.nn.init.normal_(model.head.weight)
        return model
    monkeypatch.setitem(page, 'new_model', reseeded)
    with pytest.raises(AssertionError, match='same step'):
        same_step(DRAFT, FIX1, 1e-4)
    monkeypatch.setitem(page, 'new_model', new_model)
    # a fused attention that forgets it is not causal here
    monkeypatch.setattr(F, 'scaled_dot_product_attention',
                        lambda q, k, v, sdpa=F.scaled_dot_product_attention: sdpa(q, k, v, is_causal=True))
    with pytest.raises(AssertionError, match='same step'):
        same_step(FIX3, FINAL, 1e-5)


@pytest.mark.filterwarnings('ignore:Anomaly Detection has been enabled')
def test_anomaly_detection_off_is_checked_exactly(page, monkeypatch):
    make_step = page['make_step']
    def smoothing(**settings):   # planted: the "fix" also changes the loss a little
        step = make_step(**settings)
        if not settings['anomaly']:
            step.model.head.bias.data += 1e-6
        return step
    monkeypatch.setitem(page, 'make_step', smoothing)
    with pytest.raises(AssertionError, match='same step'):
        page['same_step'](FIX1, FIX2, 0)


@pytest.mark.filterwarnings('ignore:Anomaly Detection has been enabled')
def test_the_profile_shows_each_mistake_and_its_fix(page, tmp_path):
    def profile(settings, stack=False):
        trace = str(tmp_path / f'{len(list(tmp_path.iterdir()))}.json')
        return page['profiled'](page['make_step'](**settings), trace, stack=stack), trace
    draft, draft_trace = profile(DRAFT)
    per_sample, _ = profile(FIX2, stack=True)      # as the page does: stacks where the line is the clue
    final, final_trace = profile(FINAL)
    assert set(common.input_types(draft, 'aten::addmm')) == {('double', 'double', 'double', 'Scalar', 'Scalar')}
    assert all(t[0] == 'float' for t in common.input_types(final, 'aten::addmm'))
    assert common.calls_per_step(draft, 'aten::isnan', 2) > 10 and common.calls_per_step(final, 'aten::isnan', 2) == 0
    assert common.calls_per_step(per_sample, 'aten::grid_sampler_2d', 2) == 8      # once per sample
    assert common.calls_per_step(final, 'aten::grid_sampler_2d', 2) == 1           # once per batch
    assert common.calls_per_step(draft, 'aten::softmax', 2) == 2 * 2               # heads × layers
    assert common.calls_per_step(final, 'aten::softmax', 2) == 0
    warp = next(row for row in per_sample.key_averages(group_by_stack_n=5) if row.key == 'aten::grid_sampler_2d')
    assert any(line.endswith(': per_sample_batch') for line in warp.stack), warp.stack   # needs verbose in 2.14
    assert set(common.phase_shares(common.trace_spans(draft_trace))) == set(common.PHASES)
    assert common.step_peak_bytes(draft_trace) > 1.5 * common.step_peak_bytes(final_trace)   # float64


def test_anomaly_mode_slows_a_view_and_is_found_beyond_its_own_rows(page, tmp_path, capsys):
    # real profiles: with anomaly detection on, a view (metadata only) costs several times its plain time
    def profile(settings):
        return page['profiled'](page['make_step'](**settings), str(tmp_path / f'{id(settings)}.json'))
    on, off = profile(FIX1), profile(FIX2)
    assert common.self_time_per_call(on, 'aten::view') > 2 * common.self_time_per_call(off, 'aten::view')
    assert common.self_time_per_call(off, 'aten::no_such_operator') is None


class _Rows:
    """A profile's key_averages() from (name, calls, self µs) rows, for debug_mode_cost's arithmetic."""
    def __init__(self, *rows):
        self.rows = [types.SimpleNamespace(key=k, count=n, self_cpu_time_total=us) for k, n, us in rows]

    def key_averages(self):
        return self.rows


@pytest.mark.parametrize('on_seconds, case', [(2.0, 'rows'), (2.4, 'rows'), (8.0, 'everything')])
def test_debug_mode_cost_weighs_the_timed_gain_against_the_checks_rows(on_seconds, case, capsys):
    # the checks' rows are half the operators' time: removing them promises 2x; a 2x step gain is theirs,
    # an 8x gain is the mode slowing everything (planted: a rule that reads only the rows would say 'rows')
    before = _Rows(('aten::isnan', 100, 500.0), ('aten::mm', 10, 400.0), ('aten::view', 50, 100.0))
    after = _Rows(('aten::mm', 10, 400.0), ('aten::view', 50, 50.0))
    seconds = {'on': [on_seconds] * 3, 'off': [1.0] * 3}
    assert common.debug_mode_cost(before, after, ('aten::isnan',), seconds) == case
    out = capsys.readouterr().out
    assert '50% of the operators' in out and 'shorten the step 2.00×' in out and '2.0 µs with the mode, 1.0 µs' in out


def test_autocast_dtype_does_not_count_emulated_bf16(page, monkeypatch):
    choose = page['autocast_dtype']
    assert choose(torch.device('cpu')) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda including_emulation=True: True)   # an A100 or H100
    assert choose(torch.device('cuda:0')) == torch.bfloat16
    # a T4 or V100: bf16 tensors work (emulated), bf16 tensor cores do not
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda including_emulation=True: including_emulation)
    assert choose(torch.device('cuda:0')) == torch.float16


def test_a_phase_waits_for_the_gpu_only_while_profiling_on_a_gpu(page, monkeypatch):
    waited = []
    monkeypatch.setattr(s09, 'synchronize', lambda device=None: waited.append(device))
    monkeypatch.setitem(page, 'profiling', True)
    with page['phase']('data'):
        pass
    assert waited == []                                     # a CPU: nothing to wait for
    monkeypatch.setitem(page, 'device', torch.device('cuda:0'))
    with page['phase']('data'):
        pass
    assert waited == [torch.device('cuda:0')]               # profiling on a GPU: the span ends with its kernels
    monkeypatch.setitem(page, 'profiling', False)
    with page['phase']('data'):
        pass
    assert waited == [torch.device('cuda:0')]               # a timed step keeps the queue full


@pytest.mark.filterwarnings('ignore:Anomaly Detection has been enabled')
def test_checkpointing_and_accumulation_give_the_plain_gradients(page):
    x, y = page['whole_batch'](0, torch.float32)
    reference = page['gradients'](page['new_model'](), x, y)
    checkpointed = page['gradients'](page['new_model'](checkpointed=True), x, y)
    assert page['largest_difference'](checkpointed, reference) < 1e-6
    assert page['largest_difference'](page['gradients'](page['new_model'](), x, y, parts=4), reference) < 1e-5
    net = page['new_model']()
    net.zero_grad(set_to_none=True)
    for xp, yp in zip(x.chunk(4), y.chunk(4)):        # planted: the micro-batch losses are not divided by 4
        F.cross_entropy(net(xp), yp).backward()
    assert page['largest_difference']([p.grad for p in net.parameters()], reference) > 1


@pytest.mark.procs
def test_compiled_gradients_equal_eager_and_the_check_catches_other_weights(page):
    x, y = page['whole_batch'](0, torch.float32)
    eager = page['gradients'](page['new_model'](), x, y)
    assert page['largest_difference'](page['gradients'](torch.compile(page['new_model']()), x, y), eager) < 1e-4
    other = page['new_model']()
    torch.nn.init.normal_(other.head.weight)     # planted: the compiled model starts from other weights
    assert page['largest_difference'](page['gradients'](torch.compile(other), x, y), eager) > 0.1


def test_trace_spans_and_shares_read_an_exported_trace(tmp_path):
    trace = tmp_path / 't.json'
    events = [dict(ph='X', cat='user_annotation', name=n, ts=t, dur=d)
              for n, t, d in [('data', 0, 10), ('forward', 10, 30), ('backward', 40, 60), ('other', 0, 500)]]
    trace.write_text(json.dumps({'traceEvents': events}))
    spans = common.trace_spans(trace)
    assert spans[0] == ('data', 0.0, 1e-5, '')
    shares = common.phase_shares(spans)
    assert shares == pytest.approx({'data': 0.1, 'forward': 0.3, 'backward': 0.6, 'optimizer step': 0.0})
    trace.write_text(json.dumps({'traceEvents': events[3:]}))
    with pytest.raises(ValueError, match='none of the phases'):
        common.trace_spans(trace)


def test_step_peak_is_counted_from_when_recording_began_on_its_own_device(tmp_path):
    trace = tmp_path / 'm.json'
    cpu = [dict(name='[memory]', args={'Total Allocated': total, 'Bytes': b, 'Device Type': 0, 'Device Id': -1})
           for total, b in [(1000, 100), (1500, 500), (700, -800), (1200, 500)]]
    gpu = [dict(name='[memory]', args={'Total Allocated': total, 'Bytes': b, 'Device Type': 1, 'Device Id': 0})
           for total, b in [(9_000_000, 1000), (9_004_000, 4000)]]   # the GPU also holds the weights
    trace.write_text(json.dumps({'traceEvents': cpu[:2] + gpu + cpu[2:]}))
    assert common.step_peak_bytes(trace) == 1500 - 900
    assert common.step_peak_bytes(trace, 'cuda:0') == 9_004_000 - 8_999_000
    with pytest.raises(ValueError, match='cuda:1'):
        common.step_peak_bytes(trace, 'cuda:1')
    trace.write_text(json.dumps({'traceEvents': []}))
    with pytest.raises(ValueError, match='profile_memory'):
        common.step_peak_bytes(trace)


def test_input_types_read_the_kineto_events_where_torch_keeps_them_only_there(monkeypatch):
    # torch 2.11, the GPU machine's, has no FunctionEvent.input_dtypes: 09 stopped there in the rehearsal
    from torch.autograd.profiler_util import FunctionEvent
    lin = torch.nn.Linear(8, 8).double()
    with common.quiet_native_stderr(), torch.profiler.profile(record_shapes=True) as prof:
        lin(torch.randn(4, 8, dtype=torch.float64))
    monkeypatch.delattr(FunctionEvent, 'input_dtypes', raising=False)
    for event in prof.events():
        event.__dict__.pop('input_dtypes', None)
    assert not hasattr(next(e for e in prof.events() if e.name == 'aten::addmm'), 'input_dtypes')
    assert common.input_types(prof, 'aten::addmm') == {('double', 'double', 'double', 'Scalar', 'Scalar'): 1}


def test_operator_shares_and_calls_come_from_the_profile():
    lin = torch.nn.Linear(64, 64).double()
    x = torch.randn(32, 64, dtype=torch.float64)
    with common.quiet_native_stderr(), torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(3):
            lin(x).sum().backward()
    assert common.calls_per_step(prof, 'aten::addmm', 3) == 1
    assert common.input_types(prof, 'aten::addmm') == {('double', 'double', 'double', 'Scalar', 'Scalar'): 3}
    name, share = common.top_operator(prof)
    assert 0 < share <= 1 and name.startswith('aten::')
    assert common.self_time_share(prof, name) == share
    assert common.self_time_share(prof, 'no such operator') == 0
    # on a GPU the page ranks by device time: the key is the caller's (here the call count, to see it used)
    most_called = max((row for row in s09.operator_rows(prof) if row.key.startswith('aten::')),
                      key=lambda row: row.count).key
    assert common.top_operator(prof, 'count')[0] == most_called


def test_the_largest_operator_is_an_aten_operator_even_where_a_wrapper_row_took_more():
    from types import SimpleNamespace
    rows = [SimpleNamespace(key='autograd::engine::evaluate_function: AddmmBackward0', self_cpu_time_total=90.0),
            SimpleNamespace(key='aten::addmm', self_cpu_time_total=60.0),
            SimpleNamespace(key='aten::view', self_cpu_time_total=50.0)]
    prof = SimpleNamespace(key_averages=lambda: rows)
    assert common.top_operator(prof) == ('aten::addmm', 0.3)


def test_by_device_time_the_largest_row_is_a_kernel_where_no_aten_row_has_any():
    # a faked GPU profile: ATen rows carry CPU time only, the kernels carry the device time
    from types import SimpleNamespace
    rows = [SimpleNamespace(key='aten::addmm', self_device_time_total=0.0),
            SimpleNamespace(key='ampere_sgemm_128x64_tn', self_device_time_total=30.0),
            SimpleNamespace(key='vectorized_elementwise_kernel', self_device_time_total=10.0)]
    prof = SimpleNamespace(key_averages=lambda: rows)
    assert common.top_operator(prof, 'self_device_time_total') == ('ampere_sgemm_128x64_tn', 0.75)


def test_peaks_in_each_dtype_and_from_datasheets(monkeypatch):
    assert common.matmul_peak(torch.float32, 'cpu') > 1e8
    cpu = dict(clock_ghz=2.0, vector_bits=512, cores=2)
    monkeypatch.setattr(s09, 'cpu_facts', lambda: cpu)
    monkeypatch.setattr(s09, 'usable_cores', lambda: 2)
    assert common.datasheet_peak(torch.float32, 'cpu') == 2 * 2e9 * 16 * 2 * 2
    assert common.datasheet_peak(torch.float64, 'cpu') == 2 * 2e9 * 8 * 2 * 2
    assert common.datasheet_peak(torch.bfloat16, 'cpu') is None            # no estimate for 16-bit units
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'NVIDIA H100 80GB HBM3')
    assert common.datasheet_peak(torch.bfloat16, 'cuda:0') == pytest.approx(989.5e12)
    assert common.datasheet_peak(torch.float32, 'cuda:0') == pytest.approx(67e12)
    assert common.datasheet_peak(torch.float64, 'cuda:0') is None
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'Some Future GPU')
    assert common.datasheet_peak(torch.bfloat16, 'cuda:0') is None


def test_payoff_chart_draws_a_bar_per_variant():
    import matplotlib
    matplotlib.use('Agg')
    ax = common.plot_payoff(['a', 'b', 'c'], [0.3, 0.2, 0.1], [0.1, 0.2, None], 'title')
    assert len(ax.patches) == 3 and [t.get_text() for t in ax.get_yticklabels()] == ['a', 'b', 'c']


@pytest.mark.parametrize('dense,flops,first', [(90.0, 100.0, 'no attention'),    # the CPU tier: attention 10 %
                                               (358.15, 369.48, 'fewer'),         # the H200 run's T1 model: 3 %
                                               (99.5, 100.0, 'fewer')])
def test_the_flop_verdicts_cases_increase_whatever_share_attention_has(dense, flops, first, capsys):
    """The GPU run's settings made attention 3 % of the step, and the cases' bounds fell out of order."""
    cases = definitions('09-one-training-step', 'flop_cases')['flop_cases'](dense, flops)
    assert cases[0][1] == first
    for value, key in ((dense / flops, 'no attention' if first == 'no attention' else None), (1.0, 'agree')):
        found = common.verdict('FLOPs counted / formula', value, cases)
        assert key is None or found == key
