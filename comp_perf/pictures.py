"""Pictures shared by several sections: timelines, a helper's source shown on its page, bar tables."""
import inspect
from pathlib import Path

from comp_perf.language import tr


def plot_timeline(spans, lanes=None, ax=None, title=None, unit='ms'):
    """Draw (lane, start, end, label) spans as a timeline, one row per lane; return ax.

    Times are in seconds and drawn in `unit` ('s', 'ms' or 'us'); lane names are
    shown through tr(), so a Chinese notebook labels its lanes in Chinese.
    """
    import matplotlib.pyplot as plt
    scale = {'s': 1, 'ms': 1e3, 'us': 1e6}[unit]
    lanes = list(lanes or dict.fromkeys(lane for lane, *_ in spans))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.45 * len(lanes)))
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for lane, start, end, label in spans:
        row = lanes.index(lane)
        width = (end - start) * scale
        ax.broken_barh([(start * scale, width)], (row - 0.38, 0.76),
                       facecolors=colors[row % len(colors)], edgecolor='white', linewidth=0.5)
        if label:
            ax.text(start * scale + width / 2, row, label, ha='center', va='center',
                    fontsize=7, clip_on=True)
    ax.set_yticks(range(len(lanes)), [tr(lane) for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel(tr('time ({unit})', unit=unit))
    ax.grid(True, axis='x', alpha=0.3)
    if title:
        ax.set_title(title)
    return ax


def show_source(*objs):
    """Show the source code of functions or classes of the course's package, highlighted in a notebook.

    For code a section teaches that must live in an importable file (a
    worker process's entry point). A first comment line names the file (the first object's).
    """
    path = Path(inspect.getsourcefile(objs[0]))
    code = f'# {path.parent.name}/{path.name}\n' + '\n\n'.join(inspect.getsource(obj) for obj in objs)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(f'```python\n{code}```'))
            return
    except ImportError:
        pass
    print(code)


def bar_rows(rows, longest):
    """HTML table rows (label, shown value, bar) for the calculators; bars scale to `longest`."""
    longest = longest or 1
    return ''.join(f'<tr><td style="text-align:left">{label}</td><td>{shown}</td>'
                   f'<td style="text-align:left"><div style="background:#4c72b0;height:0.9em;'
                   f'width:{max(1, round(240 * value / longest))}px"></div></td></tr>'
                   for label, shown, value in rows)


def plot_dependency_graph(graph, lanes, title=None, xlabel=None, ax=None, names=None):
    """Draw a task graph (a networkx DiGraph whose nodes have a 'resource' in `lanes`); return ax.

    A task sits at x = its dependency depth and on the row of its resource (tasks that
    share both are stepped aside); edges are dependencies; lane names go through tr().
    names(task) is the label a reader sees (the task itself by default), broken
    before its parenthesis or its 'from'.
    """
    import matplotlib.pyplot as plt
    import networkx as nx
    unknown = {graph.nodes[t].get('resource') for t in graph} - set(lanes)
    if unknown:
        raise ValueError(f'tasks on resources that are not lanes: {sorted(map(str, unknown))}')
    depth = {task: level for level, tasks in enumerate(nx.topological_generations(graph)) for task in tasks}
    position, taken = {}, {}
    for task in nx.topological_sort(graph):
        row = lanes.index(graph.nodes[task]['resource'])
        offset = 0.35 * taken.get((depth[task], row), 0)
        taken[depth[task], row] = taken.get((depth[task], row), 0) + 1
        position[task] = (depth[task] + offset, -row - offset)
    if ax is None:
        _, ax = plt.subplots(figsize=(12, 5))
    nx.draw_networkx_nodes(graph, position, ax=ax, node_size=260, cmap='tab10', vmin=0, vmax=9,
                           node_color=[lanes.index(graph.nodes[t]['resource']) for t in graph])
    nx.draw_networkx_edges(graph, position, ax=ax, node_size=260, arrowsize=9, edge_color='gray')
    names = names or str
    for task, (x, y) in position.items():
        above = y == 0          # the top row's edges all come from below, so its labels go above its nodes
        # over the edges and on white, so that an edge crossing a label hides none of its letters
        ax.text(x, y + 0.13 if above else y - 0.13, _wrapped(names(task)), ha='center', fontsize=7,
                va='bottom' if above else 'top', zorder=3,
                bbox=dict(facecolor='white', edgecolor='none', alpha=0.85, pad=0.4))
    ax.set_yticks([-i for i in range(len(lanes))], [tr(lane) for lane in lanes])
    ax.set_xticks(range(max(depth.values(), default=0) + 1))
    ax.set_ylim(-len(lanes) + 0.4, 0.6)
    ax.tick_params(left=True, labelleft=True, bottom=True, labelbottom=True)
    ax.set_xlabel(xlabel or '')
    if title:
        ax.set_title(title)
    return ax


def _wrapped(label):
    """A graph label on two lines, broken before its parenthesis or its 'from', so that labels side by side fit."""
    for mark in (' (', '（', ' from '):
        if mark in label:
            head, tail = label.split(mark, 1)
            return f'{head}\n{mark.strip()}{" " if mark == " from " else ""}{tail}'
    return label


def plot_device_rows(stages, moves, titles, rows, ax=None, fmt='{:g}'):
    """Draw what each device holds, stage by stage, and what moves between stages; return ax.

    stages: one list per stage of one vector per device (the same length everywhere),
    drawn as a row of coloured, labelled cells per device (one colour scale for all);
    moves[j]: (from device, to device) pairs, each an arrow from stage j to stage j + 1;
    titles: one per stage; rows: the devices' names.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    vectors = [[np.asarray(v, dtype=float).ravel() for v in stage] for stage in stages]
    if {len(stage) for stage in vectors} != {len(rows)} or len({len(v) for stage in vectors for v in stage}) != 1:
        raise ValueError(f'every stage needs one vector per device ({len(rows)}), all of one length: '
                         f'got lengths {[[len(v) for v in stage] for stage in vectors]}')
    values = [np.stack(stage) for stage in vectors]
    if len(moves) != len(stages) - 1 or len(titles) != len(stages):
        raise ValueError(f'{len(stages)} stages need {len(stages) - 1} lists of moves and {len(stages)} titles')
    devices, width = values[0].shape
    step = width + 2.5                      # a stage's cells, then room for the arrows
    low, high = min(v.min() for v in values), max(v.max() for v in values)
    cmap, norm = plt.get_cmap('coolwarm'), plt.Normalize(min(low, -high), max(high, -low))
    if ax is None:
        _, ax = plt.subplots(figsize=(2.2 * len(stages) + 0.35 * width * len(stages), 0.9 + 0.45 * devices))
    for j, (stage, title) in enumerate(zip(values, titles)):
        for d in range(devices):
            for i, value in enumerate(stage[d]):
                ax.add_patch(plt.Rectangle((j * step + i, d - 0.4), 1, 0.8, color=cmap(norm(value))))
                ax.text(j * step + i + 0.5, d, fmt.format(value), ha='center', va='center', fontsize=8)
        ax.text(j * step + width / 2, -0.75, title, ha='center', va='bottom', fontsize=9)
    for j, pairs in enumerate(moves):
        for source, target in pairs:
            ax.annotate('', xy=((j + 1) * step - 0.1, target), xytext=(j * step + width + 0.1, source),
                        arrowprops=dict(arrowstyle='->', color='black', lw=1))
    ax.set(xlim=(-0.2, len(stages) * step - 2.3), ylim=(devices - 0.5, -1.4), xticks=[])
    ax.set_yticks(range(devices), rows)
    ax.spines[:].set_visible(False)
    return ax
