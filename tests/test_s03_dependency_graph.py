"""Section 03's task graph, drawn by common.plot_dependency_graph: each task at its depth, on its resource's row."""
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
