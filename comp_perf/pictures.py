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


def show_source(obj):
    """Show the source code of a function or class of the course's package, highlighted in a notebook.

    For code a section teaches that must live in an importable file (a
    worker process's entry point). A first comment line names the file.
    """
    path = Path(inspect.getsourcefile(obj))
    code = f'# {path.parent.name}/{path.name}\n' + inspect.getsource(obj)
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
