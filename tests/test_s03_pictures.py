"""Section 03's pictures: the task graph (common.plot_dependency_graph) and the CPU compute/copy timeline's spans."""
import matplotlib
import networkx as nx
import pytest

import common

matplotlib.use('Agg')


def _graph(edges, resources):
    graph = nx.DiGraph()
    for task, resource in resources.items():
        graph.add_node(task, resource=resource)
    graph.add_edges_from(edges)
    return graph


def test_tasks_sit_at_their_depth_on_their_resource_row():
    lanes = ['CPU', 'bus', 'GPU']
    graph = _graph([('split', 'send'), ('send', 'forward'), ('send', 'copy'), ('forward', 'sum')],
                   {'split': 'CPU', 'send': 'bus', 'forward': 'GPU', 'copy': 'GPU', 'sum': 'CPU'})
    ax = common.plot_dependency_graph(graph, lanes, title='t', xlabel='depth')
    where = dict(zip(graph, ax.collections[0].get_offsets().tolist()))      # node centres, in graph order
    assert where['split'] == [0, 0] and where['send'] == [1, -1] and where['sum'] == [3, 0]
    assert sorted([where['forward'], where['copy']]) == [[2, -2], [2.35, -2.35]]   # one depth, one row: stepped aside
    assert [t.get_text() for t in ax.get_yticklabels()] == lanes
    assert len([p for p in ax.patches if isinstance(p, matplotlib.patches.FancyArrowPatch)]) == 4


def test_labels_are_the_names_a_reader_sees_broken_and_clear_of_the_edges():
    lanes = ['CPU', 'GPU']
    graph = _graph([('split', 'forward 1 (GPU)'), ('forward 1 (GPU)', 'send grad from GPU')],
                   {'split': 'CPU', 'forward 1 (GPU)': 'GPU', 'send grad from GPU': 'CPU'})
    names = {'split': '拆分', 'forward 1 (GPU)': '前向 1（GPU）', 'send grad from GPU': 'send grad from GPU'}
    ax = common.plot_dependency_graph(graph, lanes, names=names.get)
    labels = {t.get_text(): t for t in ax.texts}
    assert set(labels) == {'拆分', '前向 1\n（GPU）', 'send grad\nfrom GPU'}
    assert labels['拆分'].get_va() == 'bottom' and labels['前向 1\n（GPU）'].get_va() == 'top'   # top row: above
    assert all(t.get_zorder() > 2 and t.get_bbox_patch() is not None for t in ax.texts)        # over the edges


def test_a_task_on_an_unknown_resource_or_a_cycle_is_refused():
    with pytest.raises(ValueError, match="not lanes: \\['disk'\\]"):
        common.plot_dependency_graph(_graph([('a', 'b')], {'a': 'CPU', 'b': 'disk'}), ['CPU'])
    with pytest.raises(nx.NetworkXUnfeasible):
        common.plot_dependency_graph(_graph([('a', 'b'), ('b', 'a')], {'a': 'CPU', 'b': 'CPU'}), ['CPU'])


def test_a_wrong_position_would_be_seen():
    """The check above reads the drawing itself: a graph whose 'send' sits on another resource fails it."""
    graph = _graph([('split', 'send')], {'split': 'CPU', 'send': 'GPU'})         # planted: send on the GPU row
    where = dict(zip(graph, common.plot_dependency_graph(graph, ['CPU', 'bus', 'GPU']).collections[0]
                     .get_offsets().tolist()))
    assert where['send'] != [1, -1]


def _overlap_code(monkeypatch_pool):
    """The page's job and run_jobs, with small inputs, and the pool's in_threads."""
    from concurrent.futures import ThreadPoolExecutor

    import torch
    from notebook_code import definitions
    ns = definitions('03-automatic-parallelism', 'job', 'run_jobs')
    pool = ThreadPoolExecutor(max_workers=2)
    monkeypatch_pool.append(pool)
    ns.update(eight=[torch.rand(64, 64) for _ in range(8)], source=torch.rand(2**16), traces={},
              in_threads=lambda *fns: [f.result() for f in [pool.submit(fn) for fn in fns]])
    ns['target'] = torch.empty_like(ns['source'])
    return ns


def test_the_overlap_timeline_records_every_product_and_copy_in_order():
    pools = []
    ns = _overlap_code(pools)
    try:
        for way in ('serial', 'overlapped'):
            ns['run_jobs'](way, 'compute', 'copy')
            spans = ns['traces'][way]
            for lane, count in (('compute', 8), ('copy', 10)):
                mine = sorted((start, end) for name, start, end, _ in spans if name == lane)
                assert len(mine) == count and all(0 <= s <= e for s, e in mine)
                assert all(e <= s for (_, e), (s, _) in zip(mine, mine[1:]))   # one job runs its steps in turn
        serial = ns['traces']['serial']
        last_compute = max(end for lane, _, end, _ in serial if lane == 'compute')
        assert min(start for lane, start, _, _ in serial if lane == 'copy') >= last_compute   # one after the other
        ns['run_jobs']('serial', 'copy')
        assert {lane for lane, *_ in ns['traces']['serial']} == {'copy'}    # each run replaces the way's spans
    finally:
        pools[0].shutdown()


def test_the_pages_task_names_read_in_the_notebooks_language(monkeypatch):
    from notebook_code import definitions
    shown = definitions('03-automatic-parallelism', 'shown')['shown']
    tasks = ['split batch', 'send X to GPU 2', 'forward 1 (GPU 1)', 'backward 2 (GPU 2)', 'send grad 2 from GPU 1',
             'sum grad 1', 'update W2', 'my own task']
    monkeypatch.setenv('COURSE_LANG', 'en')
    assert [shown(t) for t in tasks] == tasks
    monkeypatch.setenv('COURSE_LANG', 'zh')
    assert [shown(t) for t in tasks] == ['拆分批量', '把 X 发往 GPU 2', '前向 1（GPU 1）', '反向 2（GPU 2）',
                                         '发送梯度 2（来自 GPU 1）', '汇总梯度 1', '更新 W2', 'my own task']
