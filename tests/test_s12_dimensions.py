"""Section 12, part 6 (comp_perf/s12_dimensions.py): 08's three workers run in turn in one group, with the
counts the page asserts beside its formulas.
"""
import pytest

import common

SMALL = dict(
    sharded=dict(widths=[8, 12, 4], batch_size=12, steps=5, lr=1e-3, count_step=3, modes=('ddp', 'fsdp')),
    tensor=dict(d=8, hidden=12, batch_size=4),
    pipeline=dict(hidden=12, layers=2, classes=4, batch_size=8, repeats=1, schedules=[('GPipe', 1), ('GPipe', 2)]),
)


@pytest.mark.procs
def test_one_group_returns_each_workers_result_with_the_counts_the_page_asserts():
    ranks = common.launch(common.dimensions_measured, 2, SMALL, threads=1)
    assert len(ranks) == 2 and all(set(r) == {'sharded', 'tensor', 'pipeline'} for r in ranks)
    first = ranks[0]
    assert set(first['sharded']['ddp']['collectives']) == {'all-reduce'}
    assert first['sharded']['fsdp']['collectives'] == {'all-gather': 4, 'reduce-scatter': 2}   # two Linears
    assert first['tensor']['forward'] == first['tensor']['backward'] == {'all-reduce': 1}
    assert [(p['schedule'], p['m']) for p in first['pipeline']] == [('GPipe', 1), ('GPipe', 2)]
    # DDP's and FSDP's first two losses agree: the two trainings in one group did not disturb each other (only
    # two steps, so that rounding, which differs between CPUs, has no room to grow)
    assert first['sharded']['fsdp']['losses'][:2] == pytest.approx(first['sharded']['ddp']['losses'][:2], rel=1e-5)


def test_the_pages_sizes_split_evenly_over_two_three_and_four_processes():
    run = common.DIMENSIONS_RUN
    for procs in (2, 3, 4):
        assert run['tensor']['hidden'] % procs == 0 and run['pipeline']['layers'] % procs == 0
