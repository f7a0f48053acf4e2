"""Section 08: memory (comp_perf/s08_memory.py), sharded, tensor and pipeline parallelism
(comp_perf/s08_beyond_data_parallel.py)."""

import pytest
import torch
from notebook_code import definitions

import common
from comp_perf.s08_beyond_data_parallel import pipeline_model, pipeline_stage_part
from comp_perf.s08_memory import local_bytes


@pytest.fixture(scope='module')
def page():
    """The checks and the pipeline replay section 08 defines on its page: the tests run that code."""
    return definitions('08-beyond-data-parallelism', 'check_same_training', 'check_tensor_parallel',
                       'check_pipeline', 'replay_without_handovers')


def gpipe_timeline(p, m, tf=1.0, tb=2.0, handover=0.0):
    """Spans of a GPipe step (forward tf, backward tb per micro-batch); each hand-over between stages
    takes `handover` seconds, none in the ideal one."""
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
    assert local_bytes([params[0], params[0], None]) == params[0].numel() * 4
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
    assert common.measured_bubble(gpipe_timeline(p, m)) == pytest.approx(common.bubble_fraction(p, m))


@pytest.mark.procs
def test_sharded_training_equals_ddp_with_a_half_per_rank_and_the_check_catches_a_bad_start(page):
    run = dict(widths=[16, 32, 32, 4], batch_size=32, steps=4, lr=1e-2, count_step=2,
               modes=('ddp', 'zero1', 'fsdp', 'fsdp, no reshard'))
    results = common.launch(common.sharded_training, 2, run, threads=1)
    page['check_same_training'](results)
    n = sum(p.numel() for p in common.mlp(run['widths']).parameters())
    for r in results:
        assert r['ddp']['memory']['parameters'] == 4 * n and r['fsdp']['memory']['parameters'] == 2 * n
        assert r['fsdp']['collectives'] == {'all-gather': 6, 'reduce-scatter': 3}
        assert r['fsdp, no reshard']['collectives'] == {'all-gather': 3, 'reduce-scatter': 3}
        assert set(r['ddp']['collectives']) == {'all-reduce'}
    bad = common.launch(common.sharded_training, 2, dict(run, seed_by_rank=True, modes=('ddp', 'fsdp')), threads=1)
    with pytest.raises(AssertionError, match='fsdp'):
        page['check_same_training'](bad)


@pytest.mark.procs
def test_tensor_parallel_block_equals_the_unsplit_block_and_the_check_catches_different_weights(page):
    run = dict(d=16, hidden=64, batch_size=8)
    good = common.launch(common.tensor_parallel_check, 2, run, threads=1)
    assert page['check_tensor_parallel'](good) < 1e-5
    assert good[0]['forward'] == {'all-reduce': 1} == good[0]['backward']
    assert good[0]['shapes'] == {'first': ((32, 16), (64, 16)), 'second': ((16, 32), (16, 64))}
    bad = common.launch(common.tensor_parallel_check, 2, dict(run, seed_by_rank=True), threads=1)
    with pytest.raises(AssertionError, match='rank 1'):
        page['check_tensor_parallel'](bad)


@pytest.mark.procs
def test_pipeline_equals_the_unsplit_model_and_the_check_catches_summed_micro_batches(page):
    run = dict(hidden=32, layers=4, classes=10, batch_size=16, repeats=1,
               schedules=[('GPipe', 1), ('GPipe', 4), ('1F1B', 4)])
    good = common.launch(common.pipeline_run, 2, run, threads=1)
    assert page['check_pipeline'](good) < 1e-5
    assert [r['peak_held'] for r in good[0]] == [1, 4, 2]             # 1F1B holds at most p
    assert all(kinds == {'F', 'B'} for kinds in ({k for k, *_ in r['spans'][0]} for r in good[0]))
    bad = common.launch(common.pipeline_run, 2, dict(run, scale_grads=False, schedules=[('GPipe', 4)]),
                        threads=1)
    with pytest.raises(AssertionError, match='gradients'):
        page['check_pipeline'](bad)


@pytest.mark.procs
def test_beyond_data_parallelism_workers_refuse_bad_settings():
    with pytest.raises(ValueError, match='shared evenly'):
        pipeline_stage_part(pipeline_model(8, 3, 2), 0, 2)
    with pytest.raises(ValueError, match='unknown mode'):
        common.launch(common.sharded_training, 2, dict(widths=[4, 4], batch_size=4, steps=1, lr=0.1,
                                                       count_step=0, modes=('zero9',)), threads=1)


@pytest.mark.parametrize('p,m', [(2, 1), (2, 8), (4, 5)])
def test_the_pipeline_replay_removes_hand_overs_and_nothing_else(page, p, m):
    replay = page['replay_without_handovers']
    ideal, slow = gpipe_timeline(p, m), gpipe_timeline(p, m, handover=0.5)
    assert common.measured_bubble(ideal) == pytest.approx(common.bubble_fraction(p, m))
    assert replay(ideal) == pytest.approx(common.bubble_fraction(p, m))
    assert common.measured_bubble(slow) > common.bubble_fraction(p, m) + 0.01
    assert replay(slow) == pytest.approx(common.bubble_fraction(p, m))   # the hand-overs are gone
    uneven = [[(k, 2 * s_, 2 * e) if r == 0 and k == 'B' else (k, s_, e) for k, s_, e in spans]
              for r, spans in enumerate(ideal)]                         # stage 0's backward slower
    if m > 1:   # with one micro-batch nothing overlaps, whatever the stages' times
        assert replay(uneven) > common.bubble_fraction(p, m)


# One 1F1B step on 2 stages, m = 3, forward 1 s, backward 2 s, free hand-overs, worked out by hand:
# stage 0 runs F0 F1 B0 F2 B1 B2, stage 1 (the last) F0 B0 F1 B1 F2 B2; the step lasts 12 s, 9 s busy per stage.
ONE_F_ONE_B = [[('F', 0, 1), ('F', 1, 2), ('B', 4, 6), ('F', 6, 7), ('B', 7, 9), ('B', 10, 12)],
               [('F', 1, 2), ('B', 2, 4), ('F', 4, 5), ('B', 5, 7), ('F', 7, 8), ('B', 8, 10)]]


def test_the_pipeline_replay_follows_each_stage_s_own_order(page):
    replay = page['replay_without_handovers']
    assert common.measured_bubble(ONE_F_ONE_B) == pytest.approx(0.25)
    assert replay(ONE_F_ONE_B) == pytest.approx(common.bubble_fraction(2, 3))     # 1/4, as for GPipe
    late = [[(k, 1.5 * s, 1.5 * s + e - s) for k, s, e in spans] for spans in ONE_F_ONE_B]  # waits for data
    assert common.measured_bubble(late) > 0.3
    assert replay(late) == pytest.approx(0.25)
    with pytest.raises(ValueError, match='wait for each other'):   # stage 0 cannot run B0 before stage 1 has
        replay([[('B', 0, 2), ('F', 2, 3)], [('F', 3, 4), ('B', 4, 6)]])
