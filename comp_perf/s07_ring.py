"""Section 07, synchronisation costs: the strategies' cost model, its calculator and the
calculator's static figure, and a ring all-reduce over torch.distributed point-to-point
messages, checked against all_reduce and timed. The α-β models fitted to those timings
are on 07's page.
"""
import time

import numpy as np
import torch
import torch.distributed as dist

from comp_perf.language import tr
from comp_perf.measure import synchronize
from comp_perf.pictures import bar_rows
from comp_perf.processes import worker_device


SYNC_STRATEGIES = ('gpu0', 'cpu', 'split', 'ring')
# How figures and the calculator name them (through tr: Chinese in text_zh.json).
SYNC_LABELS = {'gpu0': 'via GPU 0', 'cpu': 'via the CPU', 'split': 'split over all', 'ring': 'ring'}


def sync_time(strategy, size_bytes, devices, bandwidth, links=1):
    """Seconds to sum `size_bytes` of gradients over `devices` and return the sum to all of them.

    bandwidth is bytes/s per link and direction. The strategies:
      gpu0  - all send to device 0 over its one link, it sends the sum back: 2(n-1)·s/b
      cpu   - all n send to the CPU over its one link, it sends back: 2n·s/b
      split - cut into n parts, each summed on a different device at once: 2(n-1)·(s/n)/b
      ring  - reduce-scatter then all-gather round a ring of `links` parallel rings:
              2(n-1)/n · s/(links·b), which barely grows with n
    """
    n = devices
    if strategy not in SYNC_STRATEGIES:
        raise ValueError(f'strategy must be one of {SYNC_STRATEGIES}, got {strategy!r}.')
    if n < 1 or size_bytes < 0 or bandwidth <= 0 or links < 1:
        raise ValueError('need devices >= 1, size >= 0, bandwidth > 0 and links >= 1.')
    one = size_bytes / bandwidth
    return {'gpu0': 2 * (n - 1) * one, 'cpu': 2 * n * one, 'split': 2 * (n - 1) * one / n,
            'ring': 2 * (n - 1) / n * one / links}[strategy]


def ring_allreduce(tensor, trace=None):
    """Sum `tensor` over all ranks in place with a ring: reduce-scatter, then all-gather.

    Each of the 2(n-1) steps sends one n-th of the tensor to the right neighbour and
    receives one from the left, so every link carries the same, small amount at once.
    The send and the receive of a step go out as one batch: NCCL deadlocks on a send
    and a receive that must progress together unless they are fused (gloo takes both).
    A list as `trace` gets one entry per step: the chunks sent and received, and the
    first element of every chunk after the step (ring_trace draws the steps from it).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (rank + 1) % n, (rank - 1) % n
    buffer = torch.empty_like(chunks[0])  # the largest chunk; reused at every step
    for step in range(2 * (n - 1)):
        send_index = (rank - step) % n
        recv_index = (rank - step - 1) % n
        incoming = buffer[:chunks[recv_index].numel()]
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, chunks[send_index].contiguous(), right),
                                               dist.P2POp(dist.irecv, incoming, left)]):
            request.wait()
        if step < n - 1:
            chunks[recv_index] += incoming       # reduce-scatter: accumulate
        else:
            chunks[recv_index].copy_(incoming)   # all-gather: take the finished sum
        if trace is not None:
            trace.append({'sent': send_index, 'received': recv_index, 'held': [float(c[0]) for c in chunks]})
    return tensor


def ring_trace(rank, world_size):
    """Worker for launch(): ring_allreduce of one element per chunk, 2**rank, with its trace.

    A chunk's value after a step is the sum of 2**r over the ranks r whose
    contribution it holds: its bits say who has been added in.
    """
    trace = []
    ring_allreduce(torch.full((world_size,), 2.0 ** rank), trace)
    return trace


def ring_check(rank, world_size, numel, algorithm='ring'):
    """Worker for launch(): a ring all-reduce (RING_ALGORITHMS) against dist.all_reduce.

    Returns the largest difference. Runs over gloo or NCCL.
    """
    data = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(worker_device())
    mine, reference = data.clone(), data.clone()
    RING_ALGORITHMS[algorithm](mine)
    dist.all_reduce(reference)
    return float((mine - reference).abs().max())


def ring_allreduce_both_ways(tensor):
    """ring_allreduce with half of the tensor going clockwise and half counter-clockwise.

    Every link carries traffic in both of its directions at once, so on
    full-duplex links each half needs half the time. The worked solution of
    07's exercise 1 (named in its solution block; the tests run it).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    half = flat.numel() // 2
    rings = [(list(torch.tensor_split(flat[:half], n)), +1),   # to rank+1, from rank-1
             (list(torch.tensor_split(flat[half:], n)), -1)]   # to rank-1, from rank+1
    buffers = [torch.empty_like(chunks[0]) for chunks, _ in rings]
    for step in range(2 * (n - 1)):
        ops, arrivals = [], []
        for tag, ((chunks, d), buffer) in enumerate(zip(rings, buffers)):
            send_index, recv_index = (rank - d * step) % n, (rank - d * (step + 1)) % n
            incoming = buffer[:chunks[recv_index].numel()]
            ops.append(dist.P2POp(dist.isend, chunks[send_index], (rank + d) % n, tag=tag))
            ops.append(dist.P2POp(dist.irecv, incoming, (rank - d) % n, tag=tag))
            arrivals.append((chunks, recv_index, incoming))
        for request in dist.batch_isend_irecv(ops):   # all four at once (see ring_allreduce)
            request.wait()
        for chunks, i, incoming in arrivals:
            if step < n - 1:
                chunks[i] += incoming
            else:
                chunks[i].copy_(incoming)
    return tensor


RING_ALGORITHMS = {'ring': ring_allreduce, 'ring both ways': ring_allreduce_both_ways}


def comm_benchmark(rank, world_size, sizes, repeats=5, algorithms=('ring', 'all_reduce')):
    """Worker for launch(): median seconds of point-to-point and all-reduce messages.

    sizes are in bytes (float32 payloads). Returns, on rank 0, a dict with
    'pingpong' (one-way time between ranks 0 and 1: half a round trip),
    'exchange' (ranks 0 and 1 send to each other at once) and one list per
    algorithm ('ring', 'ring both ways', 'all_reduce'): medians over
    `repeats` after a warm-up (5 times more repeats below 1 MB), every rank
    starting together. Runs over gloo, or over NCCL on cuda:<rank> (each
    timing then waits for the GPU).
    """

    def pingpong(t):  # one message at a time: there and back
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    def exchange(t):  # both send at once, as in every step of a ring
        if rank < 2:
            incoming = torch.empty_like(t)
            for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1 - rank),
                                                   dist.P2POp(dist.irecv, incoming, 1 - rank)]):
                request.wait()

    device = worker_device()
    ops = {'pingpong': pingpong, 'exchange': exchange, 'all_reduce': dist.all_reduce,
           **RING_ALGORITHMS}
    unknown = set(algorithms) - set(ops)
    if unknown:
        raise ValueError(f'unknown algorithm(s) {sorted(unknown)}; choose from {sorted(ops)}.')
    out = {}
    for name in ('pingpong', 'exchange', *algorithms):
        out[name] = []
        for size in sizes:
            t = torch.ones(max(1, size // 4), device=device)
            samples = []
            for i in range(repeats * (5 if size < 2 ** 20 else 1) + 1):
                dist.barrier()
                synchronize(device)
                start = time.perf_counter()
                ops[name](t)
                synchronize(device)
                if i:  # the first round is the warm-up
                    samples.append(time.perf_counter() - start)
            median = float(np.median(samples))
            out[name].append(median / 2 if name == 'pingpong' else median)
    return out if rank == 0 else None


def _strategy_times(size_mb, devices, bandwidth_gbs, links=1):
    """Milliseconds of every strategy (SYNC_STRATEGIES) at the calculator's inputs; `links` rings for the ring."""
    return {k: 1e3 * sync_time(k, size_mb * 1e6, devices, bandwidth_gbs * 1e9, links if k == 'ring' else 1)
            for k in SYNC_STRATEGIES}


def _plot_sync_times(size_mb=160, devices=4, bandwidth_gbs=16, links=1, ax=None):
    """The calculator's bars as a figure: ms per strategy at these inputs (_strategy_times). Returns ax."""
    import matplotlib.pyplot as plt
    times = _strategy_times(size_mb, devices, bandwidth_gbs, links)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2.4))
    names = [tr(SYNC_LABELS[k]) for k in times]
    bars = ax.barh(names, list(times.values()), color='#4c72b0')
    ax.bar_label(bars, [f'{t:,.2f} ms' for t in times.values()], padding=3, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.25 * max(max(times.values()), 1e-9))
    ax.set_xlabel(tr('sync time (ms)'))
    ax.set_title(tr("static picture at the calculator's starting values: {s:g} MB, {n} devices, "
                    '{b:g} GB/s per link, {r} ring(s)', s=size_mb, n=devices, b=bandwidth_gbs, r=links),
                 fontsize=9)
    return ax


def sync_calculator(size_mb=160, devices=4, bandwidth_gbs=16, links=1, static=True):
    """An ipywidgets calculator: sliders for the sync_time inputs, a bar per strategy.

    With static=True it first draws the same bars at the starting values as a
    figure (_plot_sync_times), for decks and web pages, which have no kernel.
    """
    import ipywidgets as widgets
    if static:
        import matplotlib.pyplot as plt
        _plot_sync_times(size_mb, devices, bandwidth_gbs, links)
        plt.show()
    labels = {k: tr(label) for k, label in SYNC_LABELS.items()}
    style = {'description_width': '11em'}
    size = widgets.FloatLogSlider(value=size_mb, base=10, min=0, max=4, step=0.05, style=style,
                                  description=tr('gradients (MB)'))
    n = widgets.IntSlider(value=devices, min=2, max=64, style=style,
                          description=tr('devices'))
    bw = widgets.FloatLogSlider(value=bandwidth_gbs, base=10, min=-1, max=3, step=0.05, style=style,
                                description=tr('link bandwidth (GB/s)'))
    rings = widgets.IntSlider(value=links, min=1, max=6, style=style,
                              description=tr('parallel rings'))
    table = widgets.HTML()

    def update(_=None):
        times = _strategy_times(size.value, n.value, bw.value, rings.value)
        rows = bar_rows([(labels[k], f'{t:,.2f} ms', t) for k, t in times.items()], max(times.values()))
        table.value = f'<table>{rows}</table>'

    for w in (size, n, bw, rings):
        w.observe(update, names='value')
    update()
    return widgets.VBox([size, n, bw, rings, table])
