"""Section 08, beyond data parallelism: the workers that train one model with DDP,
ZeroRedundancyOptimizer and fully_shard, split a block with tensor parallelism and run
pipeline stages, with the helpers they share (the MLPs, their batches, the collectives
counted). Memory per parameter and its calculator are in s08_memory.py.
"""
import contextlib
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from comp_perf.measure import covered_seconds
from comp_perf.processes import run_keys
from comp_perf.s08_memory import training_memory

# Every worker below runs on CPU processes over gloo (launch's default): 08 uses
# no GPU code path. On GPUs the same calls run over NCCL (see 08's last part).


def count_collectives(comm_mode):
    """{'all-reduce': 1, ...}: the collectives a torch.distributed.tensor.debug.CommDebugMode saw."""
    names = (('reduce_scatter', 'reduce-scatter'), ('allgather', 'all-gather'), ('all_gather', 'all-gather'),
             ('allreduce', 'all-reduce'), ('all_reduce', 'all-reduce'), ('broadcast', 'broadcast'))
    out = {}
    for op, count in comm_mode.get_comm_counts().items():
        name = next((label for key, label in names if key in str(op)), str(op))
        out[name] = out.get(name, 0) + count
    return out


def ring_bytes(collective, size_bytes, n):
    """Bytes each of n ranks sends in a ring all-reduce, all-gather or reduce-scatter of size_bytes.

    A ring all-reduce is a reduce-scatter followed by an all-gather (07):
    each half sends (n-1)/n of the data.
    """
    steps = {'all-reduce': 2, 'all-gather': 1, 'reduce-scatter': 1}
    if collective not in steps or n < 1:
        raise ValueError(f'collective must be one of {sorted(steps)}, and n >= 1.')
    return steps[collective] * (n - 1) / n * size_bytes


def mlp(widths, seed=0):
    """Linear layers of the given widths with ReLU between them, initialised from `seed`.

    mlp([256, 512, 10]) is Linear(256, 512), ReLU, Linear(512, 10).
    """
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers)


def teacher_batches(steps, batch_size, d_in, classes, seed=0):
    """`steps` batches (x, y) of a synthetic task: y is the best class of a fixed random linear map.

    Every process that calls it with the same arguments gets the same batches.
    """
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, classes, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(batch_size, d_in, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


def sharded_training(rank, world_size, run):
    """Worker for launch(): one model and one data stream trained with DDP, ZeRO-1 and fully_shard.

    `run` has widths (of common.mlp), batch_size (global), steps, lr, modes (from
    'ddp', 'zero1', 'fsdp', 'fsdp, no reshard') and count_step. Every mode starts
    from the same initial weights (seed run['seed'], or seed + rank when
    run['seed_by_rank'] is set, the bug a test plants) and sees the same batches;
    each rank trains on its half of every batch. Returns, per mode, this rank's
    losses, the measured bytes of parameters, gradients and optimiser state after
    the last step, the collectives of step count_step, and the median step time.
    """
    run_keys(run, ('widths', 'batch_size', 'steps', 'lr', 'modes', 'count_step'), ('seed', 'seed_by_rank'))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.debug import CommDebugMode
    # fully_shard's own default is a CUDA mesh wherever CUDA exists: say CPU, as the process group is gloo
    mesh = init_device_mesh('cpu', (world_size,))
    # fully_shard warns that its output is a view, in case the caller changes it in place; we never do
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module')
    batches = teacher_batches(run['steps'], run['batch_size'], run['widths'][0], run['widths'][-1])
    seed = run.get('seed', 0) + (rank if run.get('seed_by_rank') else 0)
    out = {}
    for mode in run['modes']:
        model = mlp(run['widths'], seed)
        if mode in ('ddp', 'zero1'):
            model = DDP(model)                       # broadcasts rank 0's weights to every rank
        elif mode in ('fsdp', 'fsdp, no reshard'):
            keep = mode == 'fsdp, no reshard'        # keep gathered weights from forward to backward
            for layer in model[:-1]:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)   # a unit per layer
            fully_shard(model, mesh=mesh, reshard_after_forward=not keep)           # root: last layer
        else:
            raise ValueError(f"unknown mode {mode!r}: use 'ddp', 'zero1', 'fsdp' or 'fsdp, no reshard'.")
        if mode == 'zero1':
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=run['lr'])
        else:
            opt = torch.optim.Adam(model.parameters(), lr=run['lr'])
        losses, times, counts, memory = [], [], {}, None
        for step, (x, y) in enumerate(batches):
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]   # this rank's half
            counting = step == run['count_step']
            comm = CommDebugMode() if counting else contextlib.nullcontext()
            dist.barrier()
            start = time.perf_counter()
            with comm:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            times.append(time.perf_counter() - start)
            if counting:
                counts = count_collectives(comm)
            if step == len(batches) - 1:
                memory = training_memory(model, opt)
            opt.zero_grad()
            losses.append(loss.item())
        timed = [t for i, t in enumerate(times) if i >= 2 and i != run['count_step']] or times
        out[mode] = dict(losses=losses, memory=memory, collectives=counts,
                         step_time=float(np.median(timed)), device=str(next(model.parameters()).device))
    return out


def mlp_block(d, hidden, seed=0):
    """A transformer's MLP block: Linear(d, hidden), GELU, Linear(hidden, d)."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d))


def tensor_parallel_check(rank, world_size, run):
    """Worker for launch(): an MLP block split Megatron-style over the ranks, against the unsplit block.

    `run` has d, hidden, batch_size and seed (seed_by_rank plants a bug: each
    rank starts from different weights). The first Linear is split by columns
    (each rank computes hidden/world_size of the hidden units, GELU included),
    the second by rows (each rank adds its part of every output). Returns the
    largest differences from the unsplit block (output, input gradient, weight
    gradients), the collectives of forward and backward, and the local shapes.
    """
    run_keys(run, ('d', 'hidden', 'batch_size'), ('seed', 'seed_by_rank'))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    mesh = init_device_mesh('cpu', (world_size,))
    seed = run.get('seed', 0) + (rank if run.get('seed_by_rank') else 0)
    block, reference = mlp_block(run['d'], run['hidden'], seed), mlp_block(run['d'], run['hidden'], seed)
    parallelize_module(block, mesh, {'0': ColwiseParallel(), '2': RowwiseParallel()})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(run['batch_size'], run['d'], generator=g)
    x_split, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    with CommDebugMode() as forward:
        y = block(x_split)
    with CommDebugMode() as backward:
        y.square().sum().backward()
    y_ref = reference(x_ref)
    y_ref.square().sum().backward()
    full = lambda t: t.full_tensor() if hasattr(t, 'full_tensor') else t  # noqa: E731
    weight_grads = [(full(block[i].weight.grad) - reference[i].weight.grad).abs().max().item() for i in (0, 2)]
    return dict(output=(y.detach() - y_ref.detach()).abs().max().item(),
                input_grad=(x_split.grad - x_ref.grad).abs().max().item(),
                weight_grad=max(weight_grads),
                scale=y_ref.detach().abs().max().item(),
                forward=count_collectives(forward), backward=count_collectives(backward),
                shapes={name: (tuple(block[i].weight.to_local().shape), tuple(reference[i].weight.shape))
                        for name, i in (('first', 0), ('second', 2))})


class _TimedStage(torch.nn.Module):
    """A pipeline stage that records when each micro-batch's forward and backward run."""

    def __init__(self, inner, log):
        super().__init__()
        self.inner, self.log = inner, log
        first = next(inner.parameters())
        # the first layer's weight gets its gradient last: the end of this stage's backward
        first.register_post_accumulate_grad_hook(lambda p: self._backward_end())

    def forward(self, x):
        start = time.perf_counter()
        y = self.inner(x)
        self.log.append(['F', start, time.perf_counter()])
        if y.requires_grad:
            y.register_hook(self._backward_start)
        return y

    def _backward_start(self, grad):
        self.log.append(['B', time.perf_counter(), None])

    def _backward_end(self):
        open_spans = [s for s in self.log if s[0] == 'B' and s[2] is None]
        if open_spans:
            open_spans[-1][2] = time.perf_counter()


def pipeline_model(hidden, layers, classes, seed=0):
    """`layers` blocks of Linear(hidden, hidden) + ReLU, then Linear(hidden, classes)."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU()) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, classes))


def pipeline_stage_part(model, rank, world_size):
    """The consecutive blocks of `model` that stage `rank` of `world_size` holds (the last one the head).

    The hidden blocks are shared out evenly; the small output layer joins the last stage.
    """
    blocks = len(model) - 1
    if blocks % world_size:
        raise ValueError(f'{blocks} blocks cannot be shared evenly by {world_size} stages.')
    per = blocks // world_size
    part = list(model[rank * per:(rank + 1) * per]) + ([model[-1]] if rank == world_size - 1 else [])
    return torch.nn.Sequential(*part)


def bubble_fraction(p, m):
    """Idle fraction of a GPipe or 1F1B schedule with p equal stages and m micro-batches: (p-1)/(m+p-1)."""
    if min(p, m) < 1:
        raise ValueError('need p >= 1 stages and m >= 1 micro-batches.')
    return (p - 1) / (m + p - 1)


def pipeline_run(rank, world_size, run):
    """Worker for launch(): one model split into world_size pipeline stages, run with micro-batches.

    `run` has hidden, layers, classes, batch_size, repeats and schedules, a list of
    (name, m) with name 'GPipe' or '1F1B' and m micro-batches (scale_grads=False
    plants a bug: gradients summed over micro-batches instead of averaged).
    Returns for each schedule the largest difference of this stage's gradients
    from the unsplit model's (and grad_scale, their largest size) and of the
    last stage's micro-batch losses, the
    forward ('F') and backward ('B') spans of every repeat (seconds, from a
    common barrier), and the most micro-batches whose activations were held
    at once.
    """
    run_keys(run, ('hidden', 'layers', 'classes', 'batch_size', 'repeats', 'schedules'), ('scale_grads',))
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    schedules = {'GPipe': ScheduleGPipe, '1F1B': Schedule1F1B}
    last = rank == world_size - 1
    x, y = teacher_batches(1, run['batch_size'], run['hidden'], run['classes'], seed=2)[0]
    reference = pipeline_model(run['hidden'], run['layers'], run['classes'])
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    mine = pipeline_stage_part(reference, rank, world_size)
    grad_scale = max(p.grad.abs().max().item() for p in mine.parameters())
    out = []
    for name, m in run['schedules']:
        if name not in schedules:
            raise ValueError(f'unknown schedule {name!r}: use one of {sorted(schedules)}.')
        log = []
        part = pipeline_stage_part(pipeline_model(run['hidden'], run['layers'], run['classes']),
                                   rank, world_size)
        stage = PipelineStage(_TimedStage(part, log), rank, world_size, torch.device('cpu'))
        schedule = schedules[name](stage, n_microbatches=m, loss_fn=torch.nn.functional.cross_entropy,
                                   scale_grads=run.get('scale_grads', True))
        spans = []
        for repeat in range(run['repeats'] + 1):     # the first one is a warm-up
            part.zero_grad()
            log.clear()
            losses = []
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            if repeat == 0:
                grad_diff = max((a.grad - b.grad).abs().max().item()
                                for a, b in zip(part.parameters(), mine.parameters()))
                loss_diff = max(abs(loss.item() - torch.nn.functional.cross_entropy(reference(xs), ys).item())
                                for loss, xs, ys in zip(losses, x.chunk(m), y.chunk(m))) if last else 0.0
            else:
                spans.append([(kind, s - start, e - start) for kind, s, e in log])
        held = peak = 0
        for kind, *_ in sorted(spans[-1], key=lambda s: s[1]):
            held += 1 if kind == 'F' else -1
            peak = max(peak, held)
        out.append(dict(schedule=name, m=m, grad_diff=grad_diff, grad_scale=grad_scale, loss_diff=loss_diff,
                        spans=spans, peak_held=peak))
    return out


def measured_bubble(spans_by_rank):
    """Idle fraction of a pipeline step from every stage's (kind, start, end) spans.

    The step lasts from the first span's start to the last span's end, over all
    stages; each stage is idle whenever it computes nothing. Returns the mean over
    the stages.
    """
    start = min(s for spans in spans_by_rank for _, s, _ in spans)
    end = max(e for spans in spans_by_rank for _, _, e in spans)
    busy = [covered_seconds([(s, e) for _, s, e in spans]) for spans in spans_by_rank]
    return 1 - sum(busy) / len(busy) / (end - start)
