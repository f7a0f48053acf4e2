"""Section 07's pictures, drawn from its runs: the ring all-reduce step by step (from
ring_trace), a parameter server's pushes and pulls (from ps_process's results), and the
asynchronous runs' losses. (The calculator's static figure sits with the calculator, in
s07_ring.py.)

Each helper checks that the data it is given tells one consistent story (the chunk a
rank received is the one its neighbour sent, the bytes a server received are what its
keys hold) and refuses to draw otherwise.
"""
import numpy as np

from comp_perf.language import tr


def _contributors(value, n):
    """The ranks whose 2**rank a traced chunk value holds (see ring_trace)."""
    mask = int(round(value))
    if mask != value or not 0 < mask < 2 ** n:
        raise ValueError(f'a traced chunk holds {value!r}, which is no sum of distinct 2**rank for {n} ranks.')
    return [r for r in range(n) if mask >> r & 1]


def ring_steps(traces):
    """Check ring_trace's output and return, per step, (sent, received, held) lists over ranks.

    held[rank][chunk] is the list of ranks whose contribution that chunk holds.
    Step 0 is the start: every chunk holds its own rank only.
    """
    n = len(traces)
    if n < 2 or any(len(t) != 2 * (n - 1) for t in traces):
        raise ValueError(f'need 2(n-1) traced steps from each of n >= 2 ranks; got {[len(t) for t in traces]}.')
    steps = [(None, None, [[[r] for _ in range(n)] for r in range(n)])]
    for t in range(2 * (n - 1)):
        sent = [traces[r][t]['sent'] for r in range(n)]
        received = [traces[r][t]['received'] for r in range(n)]
        for r in range(n):
            if received[r] != sent[(r - 1) % n]:
                raise ValueError(f'step {t + 1}: rank {r} received chunk {received[r]}, but its left '
                                 f'neighbour, rank {(r - 1) % n}, sent chunk {sent[(r - 1) % n]}.')
        steps.append((sent, received, [[_contributors(v, n) for v in traces[r][t]['held']] for r in range(n)]))
    return steps


def plot_ring_steps(traces):
    """Small multiples of a traced ring all-reduce: one panel per step, arrows for what each rank sent.

    Top row: the start and the reduce-scatter; bottom row: the all-gather. Each rank
    is a row of its n chunks (numbered), shaded by how many ranks' contributions the
    chunk holds (darkest: all n); the chunk that just arrived is outlined in red, and
    each arrow is labelled with the chunk it carried. Returns the figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle
    steps = ring_steps(traces)
    n = len(traces)
    fig, grid = plt.subplots(2, n, figsize=(2.9 * n, 5.6))
    axes = list(grid[0]) + list(grid[1][1:])
    pos = [(1.1 * np.sin(2 * np.pi * r / n), 1.1 * np.cos(2 * np.pi * r / n)) for r in range(n)]
    cmap, side = plt.get_cmap('Blues'), 0.26
    for t, (ax, (sent, received, held)) in enumerate(zip(axes, steps)):
        for r, (x, y) in enumerate(pos):
            for c in range(n):
                share = len(held[r][c]) / n
                left = x + (c - n / 2) * side
                fresh = received is not None and received[r] == c
                ax.add_patch(Rectangle((left, y - side / 2), side, side, facecolor=cmap(0.1 + 0.9 * share),
                                       edgecolor='red' if fresh else 'grey', linewidth=2 if fresh else 0.5,
                                       zorder=3 if fresh else 2))
                ax.text(left + side / 2, y, c, ha='center', va='center', fontsize=7, zorder=4,
                        color='white' if share > 0.6 else 'black')
            ax.text(x, y + 0.7 * side, tr('rank {r}', r=r), ha='center', va='bottom', fontsize=8)
            if sent is not None:
                (x1, y1) = pos[(r + 1) % n]
                ax.add_patch(FancyArrowPatch((x, y), (x1, y1), arrowstyle='-|>', mutation_scale=12,
                                             shrinkA=24, shrinkB=24, color='tab:orange', linewidth=1.5,
                                             connectionstyle='arc3,rad=-0.3'))
                label = ax.text(0.72 * (x + x1), 0.72 * (y + y1), sent[r], ha='center', va='center',
                                fontsize=10, color='tab:orange')
                label.set_gid('sent')
        phase = tr('start') if t == 0 else ('reduce-scatter' if t < n else 'all-gather')
        ax.set_title(tr('step {t}', t=t) + f' · {phase}', fontsize=9)
    for ax in list(grid[0]) + list(grid[1]):
        ax.set(xlim=(-1.75, 1.75), ylim=(-1.5, 1.6), aspect='equal')
        ax.axis('off')
    grid[1][0].text(0, 0, tr('as run on {n} processes\n\norange number: the chunk\neach rank sent to its right'
                             '\n\nshade: how many ranks\' parts\nthe chunk holds (dark: all)'
                             '\n\nred outline: just arrived', n=n), ha='center', va='center', fontsize=8)
    fig.tight_layout()
    return fig


def _push_pull_traffic(servers, workers):
    """Check a ps_process run's results and return its traffic and timeline.

    Returns (steps, per-server bytes pushed and pulled per worker and step, spans):
    spans are (step, lane, start, end, label) in seconds from the workers' start, one
    compute and one push-and-pull span per worker and step, one update-and-send
    span per server and step.
    """
    steps = len(workers[0]['events'])
    traffic = {}
    for s in servers:
        per_step = 4 * s['elements']   # float32 values of its keys
        if s['pushed_bytes'] != per_step * len(workers) * steps or len(s['events']) != steps:
            raise ValueError(f"server {s['index']} received {s['pushed_bytes']:,} bytes in {len(s['events'])} "
                             f'steps; its keys hold {per_step:,} bytes per worker, over {steps} steps.')
        for w in workers:
            if w['pulled_bytes'][s['index']] != per_step * (steps + 1):   # the first pull included
                raise ValueError(f"worker {w['index']} pulled {w['pulled_bytes'][s['index']]:,} bytes from "
                                 f"server {s['index']}; its keys hold {per_step:,} bytes, {steps + 1} pulls.")
        traffic[s['index']] = (per_step, per_step)
    zero = min(w['started'] for w in workers)
    spans = []
    for w in workers:
        begin = w['started']
        for step, (pushed, pulled) in enumerate(w['events']):
            if not begin <= pushed <= pulled:
                raise ValueError(f"worker {w['index']}: a step pushed at {pushed} and pulled at {pulled}, "
                                 f'after computing from {begin}: times out of order.')
            lane = tr('worker {i}', i=w['index'])
            spans += [(step, lane, begin - zero, pushed - zero, tr('compute')),
                      (step, lane, pushed - zero, pulled - zero, tr('push, pull'))]
            begin = pulled
    for s in servers:
        lane, begin = tr('server {i}', i=s['index']), None
        for step, (all_in, sent) in enumerate(s['events']):
            if begin is not None:   # from the last pull sent to the last push in
                spans.append((step, lane, begin - zero, all_in - zero, tr('wait for pushes')))
            spans.append((step, lane, all_in - zero, sent - zero, tr('update, send')))
            begin = sent
    return steps, traffic, spans


def plot_push_pull(servers, workers, show_steps=(1, 2, 3)):
    """A ps_process run as a picture: who pushes to and pulls from whom, with the measured bytes
    per worker and step, and a timeline of some steps. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch
    steps, traffic, spans = _push_pull_traffic(servers, workers)
    fig, (net, line) = plt.subplots(1, 2, figsize=(11.5, 3.6), gridspec_kw={'width_ratios': [1, 1.5]})
    spot = {('s', s['index']): ((i + 0.5) / len(servers), 1) for i, s in enumerate(servers)}
    spot.update({('w', w['index']): ((i + 0.5) / len(workers), 0) for i, w in enumerate(workers)})
    for (kind, i), (x, y) in spot.items():
        name = tr('server {i}', i=i) if kind == 's' else tr('worker {i}', i=i)
        if kind == 's':
            s = next(s for s in servers if s['index'] == i)
            name += '\n' + tr('{k} keys, {e:,} elements', k=len(s['keys']), e=s['elements'])
        net.text(x, y, name, ha='center', va='center', fontsize=8, zorder=3,
                 bbox=dict(boxstyle='round', facecolor='#fff3d6' if kind == 's' else '#dbe9f6'))
    for s in servers:
        push, pull = traffic[s['index']]
        xs, ys = spot['s', s['index']]
        for w in workers:
            xw, yw = spot['w', w['index']]
            at = 0.35 if xs == xw else 0.2   # where the label sits along the arrow, apart from the others
            for a, b, color, size, gid in (((xw - 0.02, yw), (xs - 0.02, ys), 'tab:red', push, 'push'),
                                           ((xs + 0.02, ys), (xw + 0.02, yw), 'tab:green', pull, 'pull')):
                net.add_patch(FancyArrowPatch(a, b, arrowstyle='-|>', mutation_scale=10, shrinkA=16,
                                              shrinkB=16, color=color))
                label = net.text(a[0] + at * (b[0] - a[0]), a[1] + at * (b[1] - a[1]), f'{size / 1e3:.1f} KB',
                                 color=color, fontsize=7, ha='center', va='center', zorder=2,
                                 bbox=dict(facecolor='white', edgecolor='none', pad=0.3))
                label.set_gid(gid)
    net.set(xlim=(-0.05, 1.05), ylim=(-0.25, 1.25))
    net.axis('off')
    net.set_title(tr('bytes per worker and step, measured:\npush (red, gradients), pull (green, parameters)'),
                  fontsize=8)
    lanes = [tr('server {i}', i=s['index']) for s in servers] + [tr('worker {i}', i=w['index']) for w in workers]
    colors = {tr('compute'): 'tab:blue', tr('push, pull'): 'tab:orange', tr('wait for pushes'): '0.85',
              tr('update, send'): 'tab:red'}
    for step, lane, start, end, what in spans:
        if step in show_steps:
            line.broken_barh([(1e3 * start, 1e3 * (end - start))], (lanes.index(lane) - 0.38, 0.76),
                             facecolors=colors[what], edgecolor='white', linewidth=0.5)
    line.set_yticks(range(len(lanes)), lanes)
    line.invert_yaxis()
    line.set_xlabel(tr('time (ms)'))
    line.grid(True, axis='x', alpha=0.3)
    line.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], fontsize=7, ncol=4,
                loc='upper center', bbox_to_anchor=(0.5, -0.25))
    line.set_title(tr('steps {a} to {b} of {n}, as run', a=min(show_steps), b=max(show_steps), n=steps),
                   fontsize=8)
    fig.tight_layout()
    return fig


def _by_update(workers):
    # Every step's loss, ordered by the number of updates its parameters held.
    return [loss for _, loss in sorted((u, loss) for w in workers for u, loss in zip(w['updates'], w['losses']))]


def plot_async_runs(runs, names, window=10):
    """The asynchronous runs' training loss against time and against updates applied (means of `window` steps).

    runs maps a name to (server result, worker results) of ps_async_process; one line per name.
    """
    import matplotlib.pyplot as plt
    fig, (by_time, by_count) = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)

    def smooth(v):
        return np.convolve(v, np.ones(window) / window, mode='valid')

    for name in names:
        ws = runs[name][1]
        steps = sorted((t, loss) for w in ws for t, loss in zip(w['times'], w['losses']))
        by_time.plot([t for t, _ in steps][window - 1:], smooth([loss for _, loss in steps]), label=tr(name))
        by_count.plot(range(window, len(steps) + 1), smooth(_by_update(ws)), label=tr(name))
    by_time.set(xlabel=tr('seconds since the start'), ylabel=tr('training loss (mean of 10 steps)'),
                title=tr('against time'))
    by_count.set(xlabel=tr('updates applied'), title=tr('against updates'))
    by_count.legend(fontsize=8)
    return fig
