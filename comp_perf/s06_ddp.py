"""Section 06, concise multi-GPU training: a ResNet-18 for 28×28 inputs, and when DDP
all-reduces its gradient buckets during the backward pass (two communication hooks
and the worker that times them on CPU processes).
"""
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from comp_perf.language import tr
from comp_perf.measure import covered_seconds
from comp_perf.processes import run_keys


class Residual(torch.nn.Module):
    """A ResNet basic block: two 3×3 convolutions with batch norm, plus a (projected) shortcut.

    d2l: takes its input channels explicitly (no lazy layers), so that DDP can wrap the model at once;
    its convolutions have no bias (a batch norm follows each) and its 1×1 shortcut is batch-normalised,
    where d2l's convolutions have biases and its shortcut is a bare 1×1 convolution.
    """

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity() if stride == 1 and in_channels == out_channels else \
            nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                          nn.BatchNorm2d(out_channels))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(num_classes=10, width=64, in_channels=1):
    """ResNet-18 for 28×28 inputs: a 3×3 stem without max-pool, stages of width w, 2w, 4w, 8w.

    d2l: has a width parameter (the CPU settings use a narrow one), where d2l's widths are fixed
    (64 to 512); its stem convolution has no bias.
    """
    nn = torch.nn
    layers = [nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    channels = width
    for stage in range(4):
        out = width * 2 ** stage
        layers += [Residual(channels, out, stride=1 if stage == 0 else 2), Residual(out, out)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def overlapped_hook(log, bucket):
    """DDP's way: all-reduce a bucket of gradients the moment DDP hands it over.

    DDP calls a communication hook with a bucket it has just filled, while the
    backward pass goes on computing the next gradients, and expects a Future
    of the bucket's new values. Dividing by the world size first is what DDP's
    built-in all-reduce does. `log` (the hook's state) records when each
    bucket's all-reduce started and finished, in seconds from log['t0'].
    """
    start = time.perf_counter() - log['t0']
    work = dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True)

    def record(fut):  # runs when the all-reduce has finished
        log['allreduce'].append((bucket.index(), start, time.perf_counter() - log['t0']))
        log['buckets'][bucket.index()] = ([log['names'][p] for p in bucket.parameters()],
                                          bucket.buffer().nbytes)
        return fut.value()[0]
    return work.get_future().then(record)


def after_backward_hook(log, bucket):
    """The baseline: send nothing during backward, then all-reduce every bucket, one by one.

    Each bucket gets a promise of its result. DDP hands the buckets over in
    order, so when the last one arrives every gradient is computed; only then
    are the held buckets sent, as a loop of all-reduces after loss.backward()
    would send them.
    """
    mine = torch.futures.Future()
    log['held'].append((bucket, mine))
    if bucket.is_last():
        for held, promise in log['held']:
            promise.set_result(overlapped_hook(log, held).wait())
        log['held'] = []
    return mine


def ddp_timeline(rank, world_size, run):
    """Worker for launch(): when DDP all-reduces its gradient buckets during the backward pass.

    `run` is a dict with width (of common.resnet18), batch_size (per process),
    bucket_cap_mb, warmup and steps. The model is trained in two modes, by two DDP
    communication hooks that do the same all-reduce: overlapped_hook sends each bucket
    the moment DDP hands it over (what DDP always does); after_backward_hook holds every
    bucket until the last one is ready and then sends them one by one. The modes take turns, step by step.
    Each step records, in seconds from its start, when each parameter's gradient was
    accumulated, when each bucket's all-reduce started and finished, when the slowest
    rank had all its gradients, and the forward, backward and optimiser phases.
    Rank 0 returns, per mode, the events of the median step and medians over steps of
    the step time, the gradient computation, the all-reduce time and the overlap: the
    share of all-reduce time that passed while backward was still computing
    gradients; also each bucket's parameter names and size in bytes, and whether both
    hooks give exactly the gradients of DDP's built-in all-reduce. Runs over gloo on
    CPU processes.
    """
    run_keys(run, ('width', 'batch_size', 'bucket_cap_mb', 'warmup', 'steps'))
    clock = time.perf_counter
    torch.manual_seed(0)
    net = resnet18(width=run['width'])
    gen = torch.Generator().manual_seed(rank)  # each rank has its own (random) batch
    X = torch.randn(run['batch_size'], 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (run['batch_size'],), generator=gen)

    def make(hook):  # a DDP replica of the same model, with its own event log
        model = DDP(copy.deepcopy(net), bucket_cap_mb=run['bucket_cap_mb'])
        log = {'held': [], 'buckets': {}, 'names': {p: n for n, p in model.module.named_parameters()}}
        if hook:
            model.register_comm_hook(log, hook)
        for p in model.parameters():  # fires once p.grad holds this step's local gradient
            p.register_post_accumulate_grad_hook(
                lambda p: log['grad'].append((log['names'][p], clock() - log['t0'])))
        return model, log, torch.optim.SGD(model.parameters(), lr=0.01)

    def step(model, log, opt):  # one training step; returns its events, in s from its start
        dist.barrier()  # all ranks start the step together
        log.update(t0=clock(), grad=[], allreduce=[])
        loss = torch.nn.functional.cross_entropy(model(X), y)
        forward_end = clock() - log['t0']
        opt.zero_grad()
        loss.backward()  # returns once DDP has the last bucket's all-reduce back
        backward_end = clock() - log['t0']
        opt.step()
        end = clock() - log['t0']
        computed = max(t for _, t in log['grad'])  # the last local gradient is ready
        # A bucket's all-reduce cannot finish before the slowest rank has handed it over:
        # when did the last rank finish its gradients? (perf_counter is machine-wide.)
        slowest = torch.tensor([log['t0'] + computed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        spans = [(a, b) for _, a, b in log['allreduce']]
        return {'forward': (0.0, forward_end), 'backward': (forward_end, backward_end),
                'computed': computed, 'all computed': slowest.item() - log['t0'],
                'optimizer': (backward_end, end), 'step_s': end, 'grad': log['grad'],
                'allreduce': sorted(log['allreduce']), 'compute_s': computed - forward_end,
                'allreduce_s': covered_seconds(spans),
                'overlap': covered_seconds(spans, forward_end, computed) / max(covered_seconds(spans), 1e-12)}

    modes = {'built-in': make(None), 'overlapped': make(overlapped_hook),
             'after backward': make(after_backward_hook)}
    for replica in modes.values():  # the first step, on the same batch, must give the same gradients
        step(*replica)
    grads = {mode: [p.grad for p in model.parameters()] for mode, (model, _, _) in modes.items()}
    out = {'same_grads': all(torch.equal(a, b) for mode in ('overlapped', 'after backward')
                             for a, b in zip(grads[mode], grads['built-in']))}
    del modes['built-in']
    # Alternate the two modes step by step, so that a busy machine slows both alike.
    # DDP re-orders its buckets after the first step; the warm-up steps are dropped.
    steps = {mode: [] for mode in modes}
    for _ in range(run['warmup'] + run['steps']):
        for mode, replica in modes.items():
            steps[mode].append(step(*replica))
    for mode, seen in steps.items():
        seen = seen[run['warmup']:]
        out[mode] = {key: statistics.median(s[key] for s in seen)
                     for key in ('step_s', 'compute_s', 'allreduce_s', 'overlap')}
        out[mode]['median step'] = sorted(seen, key=lambda s: s['step_s'])[len(seen) // 2]
        out[mode]['steps_s'] = [s['step_s'] for s in seen]
    buckets = modes['overlapped'][1]['buckets']
    out['buckets'] = [buckets[k][0] for k in sorted(buckets)]
    out['bucket_bytes'] = [buckets[k][1] for k in sorted(buckets)]
    return out if rank == 0 else None


_DDP_MODES = (('overlapped', 'DDP: each bucket is all-reduced as soon as it is ready'),
              ('after backward', 'baseline: all buckets are all-reduced after backward'))


def plot_ddp_timeline(result, unit='ms'):
    """Draw the median step of both modes of ddp_timeline() on one time axis; return the figure.

    One row of lanes per mode: forward, backward (a tick per parameter when its gradient
    is ready, coloured by its bucket; hatched while backward() waits for the all-reduce),
    one lane per bucket's all-reduce, and the optimiser step. Labels go through tr().
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    scale = {'s': 1, 'ms': 1e3}[unit]
    buckets = result['buckets']
    bucket_of = {name: k for k, names in enumerate(buckets) for name in names}
    colors = plt.get_cmap('tab10').colors
    lanes = ([tr('forward'), tr('backward (gradients ready)')]
             + [tr('all-reduce (bucket {k}, {kb:.0f} kB)', k=k, kb=size / 1e3)
                for k, size in enumerate(result['bucket_bytes'])]
             + [tr('optimiser step')])
    fig, axes = plt.subplots(2, 1, figsize=(8, 1.6 + 0.5 * len(lanes)), sharex=True)
    for ax, (mode, title) in zip(axes, _DDP_MODES):
        step = result[mode]['median step']

        def bar(row, start, end, **style):
            ax.broken_barh([(start * scale, (end - start) * scale)], (row - 0.35, 0.7), **style)

        bar(0, *step['forward'], color='0.7')
        bar(1, step['backward'][0], step['computed'], color='0.88')
        bar(1, step['computed'], step['backward'][1], facecolor='white', edgecolor='0.55', hatch='////')
        for name, t in step['grad']:  # one tick per parameter, when its gradient is ready
            ax.vlines(t * scale, 0.65, 1.35, color=colors[bucket_of[name] % 10], lw=1.2)
        for k, start, end in step['allreduce']:
            bar(2 + k, start, end, color=colors[k % 10])
        bar(len(lanes) - 1, *step['optimizer'], color='0.35')
        ax.axvline(step['computed'] * scale, color='k', ls='--', lw=0.8)
        if step['all computed'] - step['computed'] > 0.01 * step['step_s']:
            ax.axvline(step['all computed'] * scale, color='tab:red', ls=':', lw=1)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.invert_yaxis()
        ax.grid(True, axis='x', alpha=0.3)
        stats = result[mode]
        ax.set_title(tr(title) + '\n' + tr('step {step:.0f} ms, {overlap:.0%} of all-reduce time '
                                            'during backward (median of {n} steps)',
                                            step=stats['step_s'] * 1e3, overlap=stats['overlap'],
                                            n=len(stats['steps_s'])), fontsize=9)
    axes[-1].set_xlabel(tr('time since the step began ({unit}); rank 0', unit=unit))
    axes[-1].set_xlim(0, 1.02 * scale * max(result[m]['median step']['step_s'] for m, _ in _DDP_MODES))
    fig.legend(handles=[
        Line2D([], [], color=colors[0], lw=1.2, ls='', marker='|', markersize=10,
               label=tr("a parameter's gradient is ready (colour: its bucket)")),
        Patch(facecolor='white', edgecolor='0.55', hatch='////',
              label=tr('backward() waits for the all-reduce')),
        Line2D([], [], color='k', ls='--', lw=0.8, label=tr('all gradients of rank 0 computed')),
        Line2D([], [], color='tab:red', ls=':', lw=1, label=tr('... and of the slowest rank')),
    ], loc='lower center', ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig
