"""Section 08, FSDP's per-layer all-gather, free and reduce-scatter, recorded in a real fully_shard step:
the worker that records them on each rank and the figure drawn from its record.
"""
import math
import time
import warnings

import torch
import torch.distributed as dist

from comp_perf.language import tr
from comp_perf.processes import run_keys
from comp_perf.s08_beyond_data_parallel import mlp, teacher_batches

# The names FSDP calls, newest first (torch 2.14 calls the *_single ones; older releases the others).
_COLLECTIVES = {'all_gather_single': 'all-gather', 'all_gather_into_tensor': 'all-gather',
                'reduce_scatter_single': 'reduce-scatter', 'reduce_scatter_tensor': 'reduce-scatter'}


def _held_bytes(layers):
    """Bytes of parameters the layers hold now: a whole (unsharded) one in full, a sharded one its shard."""
    total = 0
    for layer in layers:
        for p in layer.parameters():
            t = p.to_local() if hasattr(p, 'to_local') else p
            total += t.numel() * t.element_size()
    return total


def fsdp_timeline(rank, world_size, run):
    """Worker for launch(): one MLP with fully_shard on each Linear, its last step recorded.

    `run` has widths (of common.mlp), batch_size and steps. The layers' forward and
    backward are timed with module hooks; each all-gather and reduce-scatter that
    FSDP calls is timed by wrapping torch.distributed's function for this worker,
    and assigned to a layer by its size. At every event the parameter bytes the
    layers hold are sampled. Returns the last step's spans (kind, layer, start, end),
    samples (time, bytes) and the layers' whole and shard sizes in bytes; times in
    seconds from a barrier at the step's start.
    """
    run_keys(run, ('widths', 'batch_size', 'steps'))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module')
    mesh = init_device_mesh('cpu', (world_size,))
    model = mlp(run['widths'])
    layers = [m for m in model if isinstance(m, torch.nn.Linear)]
    whole = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    for layer in layers[:-1]:
        fully_shard(layer, mesh=mesh)       # one unit per layer
    fully_shard(model, mesh=mesh)           # the root: the last layer
    spans, samples, t0 = [], [], [0.0]

    def now():
        return time.perf_counter() - t0[0]

    def sample():
        samples.append((now(), _held_bytes(layers)))

    # each layer's size as FSDP gathers it: every tensor's first dimension padded to a multiple of the ranks
    padded = [sum(-(-p.shape[0] // world_size) * world_size * math.prod(p.shape[1:]) for p in layer.parameters())
              for layer in layers]

    def layer_of(numel):
        return next((i for i, n in enumerate(padded) if n == numel), None)

    def timed(name, kind, fn):
        def call(*args, **kwargs):
            output = kwargs.get('output', args[0] if args else None)
            source = kwargs.get('input', args[1] if len(args) > 1 else None)
            full = output if kind == 'all-gather' else source
            sample()
            start = now()
            result = fn(*args, **kwargs)
            if result is not None:          # an asynchronous call: it ends when it is waited for
                result.wait()
            spans.append((kind, layer_of(full.numel()), start, now()))
            sample()
            return result
        return call

    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, timed(name, _COLLECTIVES[name], fn))
    open_spans = {}

    def begin(kind, i):
        sample()
        open_spans[kind, i] = now()

    def end(kind, i):
        spans.append((kind, i, open_spans.pop((kind, i)), now()))
        sample()

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: begin('F', i))
        layer.register_forward_hook(lambda m, a, o, i=i: end('F', i))
        layer.register_full_backward_pre_hook(lambda m, g, i=i: begin('B', i))
        layer.register_full_backward_hook(lambda m, gi, go, i=i: end('B', i))
    try:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for x, y in teacher_batches(run['steps'], run['batch_size'], run['widths'][0], run['widths'][-1]):
            x, y = x.chunk(world_size)[rank].requires_grad_(), y.chunk(world_size)[rank]  # so that
            spans.clear()                   # the first layer's backward hook fires after its backward
            samples.clear()
            dist.barrier()
            t0[0] = time.perf_counter()
            sample()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            sample()
            end_of_backward = now()
            opt.step()
            opt.zero_grad()
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    bytes_per = next(model.parameters()).element_size()
    return dict(spans=spans, samples=samples, end=end_of_backward,
                whole=[n * bytes_per for n in whole], shard=[-(-n // world_size) * bytes_per for n in whole])


def _without(start, end, gaps):
    """The parts of [start, end] outside the (start, end) gaps: a layer's span less the collectives that FSDP
    ran from inside its hooks (one thread runs both, in turn)."""
    pieces = [(start, end)]
    for g0, g1 in gaps:
        pieces = [piece for s, e in pieces for piece in ((s, min(e, g0)), (max(s, g1), e)) if piece[1] > piece[0]]
    return pieces


def plot_fsdp_timeline(results, title=None):
    """Timeline per rank (a compute and a communication lane, each span named by its layer) above the
    parameter bytes each rank held, sampled at every event. Returns the figure."""
    import matplotlib.pyplot as plt
    from comp_perf.pictures import plot_timeline
    names = {'F': 'F{i}', 'B': 'B{i}', 'all-gather': 'AG{i}', 'reduce-scatter': 'RS{i}'}
    lanes, shown = [], []
    for rank, r in enumerate(results):
        compute, comm = tr('rank {r}: compute', r=rank), tr('rank {r}: communication', r=rank)
        lanes += [compute, comm]
        collectives = [(s, e) for kind, _, s, e in r['spans'] if kind not in 'FB']
        for kind, i, start, end in r['spans']:
            label = names[kind].format(i='?' if i is None else i)
            pieces = [(start, end)] if kind not in 'FB' else _without(start, end, collectives)
            shown += [(compute if kind in 'FB' else comm, s, e, label) for s, e in pieces]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.6), sharex=True, height_ratios=(3, 2))
    plot_timeline(shown, lanes, ax=top, title=title)
    top.set_xlabel('')
    for rank, r in enumerate(results):
        t, held = zip(*r['samples'])
        bottom.step([1e3 * s for s in t], [b / 1e3 for b in held], where='post', color=f'C{2 * rank}',
                    label=tr('rank {r}, held', r=rank))
    bottom.axhline(sum(results[0]['shard']) / 1e3, color='grey', ls=':', lw=1)
    # the label sits in the right margin, beside its dotted line, clear of the lines that start at 0
    bottom.text(1.01, sum(results[0]['shard']) / 1e3, tr('all layers sharded'), color='grey', fontsize=7,
                va='center', ha='left', transform=bottom.get_yaxis_transform(), clip_on=False)
    bottom.set(xlabel=tr('time ({unit})', unit='ms'), ylabel=tr('parameter KB held'))
    bottom.legend(fontsize=7, loc='upper right')
    bottom.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig
