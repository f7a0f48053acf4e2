"""Section 08, combining strategies: the 2-D (dp, tp) mesh and the design review's arithmetic
(comp_perf/s08_combining.py)."""

import pytest
from notebook_code import definitions

import common
from comp_perf import s08_combining


@pytest.fixture(scope='module')
def page():
    """The 2-D mesh check section 08 defines on its page: the tests run that code."""
    return definitions('08-beyond-data-parallelism', 'check_mesh_2d')


RUN = dict(dp=2, tp=2, d=16, hidden=64, batch_size=16, steps=2, lr=0.1)


@pytest.mark.procs
def test_fsdp_over_dp_with_tp_equals_the_unsplit_block_and_the_check_catches_two_planted_bugs(page):
    good = common.launch(common.mesh_2d_training, 4, RUN, threads=1)
    assert page['check_mesh_2d'](good) < 1e-5
    assert sorted(r['coords'] for r in good) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r['collectives'] == {'all-gather': 1, 'all-reduce': 1, 'reduce-scatter': 1} for r in good)
    placements = good[0]['placements']
    assert placements['0.weight'] == {'dp': '_StridedShard(dim=0, sf=2)', 'tp': 'Shard(dim=0)',
                                      'local': (16, 16), 'whole': (64, 16)}
    assert placements['2.weight'] == {'dp': 'Shard(dim=0)', 'tp': 'Shard(dim=1)', 'local': (8, 32), 'whole': (16, 64)}
    assert placements['2.bias'] == {'dp': 'Shard(dim=0)', 'tp': 'Replicate()', 'local': (8,), 'whole': (16,)}
    for bug in ('same data', 'sum over dp'):   # both pass every shape and count above; the check fails them
        bad = common.launch(common.mesh_2d_training, 4, dict(RUN, bug=bug), threads=1)
        assert bad[0]['placements'] == placements and bad[0]['collectives'] == good[0]['collectives']
        assert page['check_mesh_2d'](bad) > 1e-2, bug


@pytest.mark.procs
def test_the_mesh_worker_refuses_a_mesh_that_is_not_the_processes():
    with pytest.raises(ValueError, match='needs 4 processes'):
        common.launch(common.mesh_2d_training, 2, RUN, threads=1)


# A small case worked out by hand: 1e9 parameters, 4 layers of width 1000, sequences of 100 tokens,
# 8 sequences per step, one per micro-batch; 2 nodes of 2 GPUs, NVLink 100 GB/s, network 10 GB/s,
# 100 TFLOP/s at 50 %.
MODEL = dict(params=1e9, layers=4, hidden=1000, seq=100, batch=8, micro_batch=1)
CLUSTER = dict(nodes=2, gpus_per_node=2, memory_gb=80, nvlink_gbs=100, network_gbs=10, peak_tflops=100, mfu=0.5)
COMPUTE = 6e9 * 8 * 100 / (4 * 100e12 * 0.5)            # 6 FLOPs per parameter and token over 4 GPUs: 0.024 s
TP_RING = 2 * (2 - 1) / 2 * (2 * 100 * 1000) / 100e9     # one bf16 micro-batch of activations over tp = 2: 2 µs
HAND = {
    # dp = 2 across the nodes (dp·tp = 4 > 2 GPUs per node), tp = 2, FSDP: 16 bytes / 4 ranks; m = 8 / 2 = 4
    # micro-batches; 3 ring halves per micro-batch of the 1e9 bf16 bytes per tp rank, (2-1)/2 each, at 10 GB/s
    'tp 2 x fsdp 2': (dict(dp=2, tp=2, zero=3),
                      dict(states=4e9, activations=4 * 100 * 1000 * (10 + 24 / 2), micro_batches=4,
                           bubble=0.0, dp_comm=12 * 0.5 * 1e9 / 10e9, tp_comm=4 * 4 * 4 * TP_RING, pp_comm=0.0,
                           exposed_step=COMPUTE + 0.6 + 4 * 4 * 4 * TP_RING)),
    # dp = 4 over both nodes, ZeRO-1: 2 + 2 bytes whole, 12 / 4 sharded; one all-reduce of 2e9 bytes per step
    'zero-1 over 4': (dict(dp=4, zero=1),
                      dict(states=4e9 + 3e9, activations=4 * 100 * 1000 * 34, micro_batches=2, bubble=0.0,
                           dp_comm=2 * 3 / 4 * 2e9 / 10e9, tp_comm=0.0, pp_comm=0.0,
                           exposed_step=COMPUTE + 0.3)),
    # tp = 2 inside a node, pp = 2 across: 2 layers per stage, m = 8, 1F1B holds 2 micro-batches; bubble 1/9;
    # a micro-batch's activations sent forward and its gradient back over the network
    'tp 2 x pp 2': (dict(dp=1, tp=2, pp=2),
                    dict(states=4e9, activations=2 * 2 * 100 * 1000 * 22, micro_batches=8, bubble=1 / 9,
                         dp_comm=0.0, tp_comm=4 * 2 * 8 * TP_RING, pp_comm=2 * 8 * 2e5 / 10e9,
                         exposed_step=COMPUTE * 9 / 8 + 4 * 2 * 8 * TP_RING + 2 * 8 * 2e5 / 10e9)),
}


def agrees_with_the_hand_worked_cases():
    for name, (layout, expected) in HAND.items():
        got = common.plan_estimate(MODEL, CLUSTER, **layout)
        assert got['compute'] == pytest.approx(COMPUTE), name
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, abs=1e-12), f'{name}: {key}'


def test_the_plan_s_arithmetic_equals_the_hand_worked_cases():
    agrees_with_the_hand_worked_cases()
    assert common.plan_estimate(MODEL, dict(CLUSTER, memory_gb=8), dp=4, zero=1)['fits'] is True
    assert common.plan_estimate(MODEL, dict(CLUSTER, memory_gb=7), dp=4, zero=1)['fits'] is False


@pytest.mark.parametrize('wrong', ['zero-3 shards no weights', 'bubble p/(m+p)', 'no ring over tp'])
def test_a_planted_wrong_formula_fails_the_hand_worked_cases(monkeypatch, wrong):
    if wrong == 'zero-3 shards no weights':
        right = s08_combining.zero_memory
        monkeypatch.setattr(s08_combining, 'zero_memory',
                            lambda params, ranks, stage, precision: right(params, ranks, min(stage, 2), precision))
    elif wrong == 'bubble p/(m+p)':
        monkeypatch.setattr(s08_combining, 'bubble_fraction', lambda p, m: p / (m + p) if p > 1 else 0.0)
    else:
        monkeypatch.setattr(s08_combining, 'sync_time', lambda *args: 0.0)   # tp's ring forgotten
    with pytest.raises(AssertionError):
        agrees_with_the_hand_worked_cases()


def test_the_plan_refuses_a_layout_that_is_not_the_cluster():
    for layout in (dict(dp=3), dict(dp=1, tp=4), dict(dp=1, tp=2, pp=3)):
        with pytest.raises(ValueError):
            common.plan_estimate(MODEL, CLUSTER, **layout)
    with pytest.raises(ValueError, match='micro-batches'):
        common.plan_estimate(dict(MODEL, batch=6), CLUSTER, dp=4)


def test_the_pictures_draw_the_mesh_and_cut_the_bars_above_twice_the_device():
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig = common.draw_mesh_2d()
    assert sum(text.get_text().startswith('rank ') for text in fig.axes[0].texts) == 4
    fig, ax = plt.subplots()
    plans = {name: common.plan_estimate(MODEL, dict(CLUSTER, memory_gb=3), **HAND[name][0]) for name in HAND}
    common.plot_plan_memory(ax, plans, 3, 'hand-worked')
    assert [t.get_text() for t in ax.texts] == ['7 GB']          # ZeRO-1 over 4 holds 7 GB, above 2 × 3
    assert ax.get_ylim() == (0, 6)
    plt.close('all')
