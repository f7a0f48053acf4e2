"""Section 06, the piece you build: gradients all-reduced in buckets while the backward pass runs.

BucketedAllReduce is the reference solution of 06's exercise (what DDP's reducer does, written
with autograd hooks); check_bucketed_allreduce() runs anyone's version of it in two gloo
processes and says pass or fail: the same gradients and parameters as DDP, all-reduces that start
before the backward pass has computed its last gradient, and fewer all-reduces than parameters.
"""
import copy
import html
import importlib
import inspect
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from comp_perf.language import tr
from comp_perf.measure import Case
from comp_perf.processes import launch, run_keys
from comp_perf.s06_ddp import resnet18


def make_buckets(params, bucket_mb):
    """Group parameters into buckets of at most about `bucket_mb` MiB, last parameter first.

    The backward pass computes the last layers' gradients first, so the buckets
    are filled in reverse order: bucket 0 holds the last layers. A parameter
    larger than a bucket gets a bucket of its own.
    """
    buckets, size = [[]], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if buckets[-1] and size + nbytes > bucket_mb * 2**20:
            buckets.append([])
            size = 0
        buckets[-1].append(p)
        size += nbytes
    return buckets


class BucketedAllReduce:
    """Average every gradient over the ranks, bucket by bucket, while the backward pass runs.

    After loss.backward() call finish(), then optimizer.step(). A hook on each parameter
    counts the gradients of its bucket; when the bucket's last gradient is ready, the bucket
    is flattened into one tensor and its all-reduce starts at once (async_op=True), while
    the backward pass goes on with earlier layers. Every rank fills the buckets in the same
    order, so every rank starts the same all-reduces in the same order, as collectives must.
    """

    def __init__(self, model, bucket_mb=25):
        self.world_size = dist.get_world_size()
        self.buckets = make_buckets([p for p in model.parameters() if p.requires_grad], bucket_mb)
        self.bucket_of = {p: k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)   # gradients ready in each bucket, this step
        self.pending = []                      # (handle, flat tensor, bucket) of each all-reduce started
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self.gradient_ready)

    def gradient_ready(self, p):
        """Autograd calls this when p.grad holds this step's local gradient."""
        k = self.bucket_of[p]
        self.ready[k] += 1
        if self.ready[k] == len(self.buckets[k]):   # the bucket is full: send it now
            flat = torch.cat([q.grad.flatten() for q in self.buckets[k]])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[k]))

    def finish(self):
        """Wait for every all-reduce, write the averages into .grad, and get ready for the next step."""
        for handle, flat, bucket in self.pending:
            handle.wait()
            flat /= self.world_size
            for q, average in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad.copy_(average.view_as(q.grad))
        self.ready = [0] * len(self.buckets)
        self.pending = []


def show_solution(*objs):
    """Show the source of functions or classes of the package folded in a <details> block, as a solution is.

    The summary line names the file; the code is highlighted (Pygments, inline styles, so that
    exported pages and decks show it too). Outside a notebook it prints the code.
    """
    path = inspect.getsourcefile(objs[0])
    code = '\n\n'.join(inspect.getsource(obj) for obj in objs)
    summary = tr('Solution: the reference, in comp_perf/{file}', file=os.path.basename(path))
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
        if get_ipython() is None:
            raise ImportError
    except ImportError:
        print(summary + '\n' + code)
        return
    try:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import PythonLexer
        body = highlight(code, PythonLexer(), HtmlFormatter(noclasses=True))
    except ImportError:
        body = f'<pre>{html.escape(code)}</pre>'
    display(HTML(f'<details><summary>{html.escape(summary)}</summary>{body}</details>'))


CHECK_RUN = dict(width=8, batch_size=16, bucket_mb=0.1, steps=2, lr=0.1)
TOLERANCE = 1e-5   # largest difference from DDP, relative to the largest gradient (or parameter)


def _gap(mine, theirs):
    """Largest |a − b| over tensors, relative to the largest |b|."""
    largest = max(float(b.detach().abs().max()) for b in theirs)
    return max(float((a - b).detach().abs().max()) for a, b in zip(mine, theirs)) / max(largest, 1e-30)


def bucketed_check(rank, world_size, module, folder, run=None):
    """Worker for launch(): train `module`.BucketedAllReduce beside DDP and record what it does.

    Both start from the same ResNet-18 and see the same batches (each rank its own) for
    run['steps'] SGD steps. Returns, on rank 0, the largest gradient and parameter
    differences from DDP, relative to the largest value, and per step the order of
    events: ('gradient', name, time) when a gradient is ready (our hook, which fires before the
    class's own) and ('all-reduce', elements, time, async_op) when an all-reduce starts (recorded
    by wrapping torch.distributed.all_reduce). A class
    that raises NotImplementedError returns {'not built': its message}.
    """
    run_keys(run or {}, (), tuple(CHECK_RUN))   # each key changes one of CHECK_RUN's values
    run = {**CHECK_RUN, **(run or {})}
    if folder not in sys.path:
        sys.path.insert(0, folder)
    events, recording = [], [False]
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):   # note when each all-reduce starts and whether it waits
        if recording[0]:
            waits_here = not kwargs.get('async_op', args[2] if len(args) > 2 else False)
            events.append(('all-reduce', tensor.numel(), time.perf_counter(), not waits_here))
        return real_all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce   # before the import, so that `from … import all_reduce` gets it too
    try:
        torch.manual_seed(0)
        net = resnet18(width=run['width'])
        gen = torch.Generator().manual_seed(rank)
        batches = [(torch.randn(run['batch_size'], 1, 28, 28, generator=gen),
                    torch.randint(0, 10, (run['batch_size'],), generator=gen)) for _ in range(run['steps'])]
        ddp = DDP(copy.deepcopy(net), bucket_cap_mb=run['bucket_mb'])
        mine = copy.deepcopy(net)
        for name, p in mine.named_parameters():   # registered first, so it fires first
            p.register_post_accumulate_grad_hook(
                lambda p, name=name: events.append(('gradient', name, time.perf_counter())))
        ddp_opt = torch.optim.SGD(ddp.parameters(), lr=run['lr'])
        my_opt = torch.optim.SGD(mine.parameters(), lr=run['lr'])
        loss_fn = torch.nn.functional.cross_entropy
        out = {'grad_gap': 0.0, 'steps': [], 'params': len(list(mine.parameters()))}
        try:
            sync = importlib.import_module(module).BucketedAllReduce(mine, bucket_mb=run['bucket_mb'])
            for X, y in batches:
                ddp_opt.zero_grad()
                loss_fn(ddp(X), y).backward()
                ddp_opt.step()
                my_opt.zero_grad()
                loss = loss_fn(mine(X), y)
                events.clear()
                recording[0] = True
                loss.backward()
                sync.finish()
                recording[0] = False
                my_opt.step()
                out['steps'].append(list(events))
                out['grad_gap'] = max(out['grad_gap'], _gap([p.grad for p in mine.parameters()],
                                                            [p.grad for p in ddp.module.parameters()]))
        except NotImplementedError as gap:
            return {'not built': str(gap) or type(gap).__name__}
        out['param_gap'] = _gap(list(mine.parameters()), list(ddp.module.parameters()))
        return out if rank == 0 else None
    finally:
        dist.all_reduce = real_all_reduce


def bucketed_parts(result):
    """{'grads': …, 'overlap': …, 'buckets': …}, each (passed, numbers), from bucketed_check()'s result.

    grads: gradients and parameters within TOLERANCE of DDP's in every step. overlap: in every
    step at least one all-reduce started with async_op=True (so that backward did not wait for it)
    before the last gradient was ready. buckets: in every step
    more than one and fewer all-reduces than there are parameters.
    """
    gap = max(result['grad_gap'], result['param_gap'])
    early, counts = [], []
    for events in result['steps']:
        last = max((i for i, (kind, *_) in enumerate(events) if kind == 'gradient'), default=-1)
        launches = [i for i, (kind, *_) in enumerate(events) if kind == 'all-reduce']
        early.append(sum(i < last and events[i][3] for i in launches))
        counts.append(len(launches))
    return {'grads': (gap < TOLERANCE, gap),
            'overlap': (bool(early) and min(early) >= 1, (min(early, default=0), min(counts, default=0))),
            'buckets': (bool(counts) and all(1 < n < result['params'] for n in counts),
                        (max(counts, default=0), result['params']))}


def check_bucketed_allreduce(module='my_buckets', folder=None, run=None):
    """Check `module`.BucketedAllReduce in two gloo processes against DDP; print pass or fail.

    `module` is a module name, importable from `folder` (default: this folder), such as
    the my_buckets.py a notebook cell writes. Prints, in the notebook's language, whether the
    gradients and parameters equal DDP's, whether some all-reduce started before the backward
    pass ended, and whether the gradients went in buckets; or that the class is not built yet.
    Returns 'pass', 'fail' or 'not built' (a string that a notebook does not echo).
    """
    run_keys(run or {}, (), tuple(CHECK_RUN))   # here, before any process starts
    run = {**CHECK_RUN, **(run or {})}
    result = launch(bucketed_check, 2, module, os.path.abspath(folder or os.getcwd()), run,
                    threads=1, timeout=120, op_timeout=60)[0]
    print(tr('Check of {module}.BucketedAllReduce: 2 processes (gloo), ResNet-18 of width {w}, {steps} steps, '
             'buckets of {mb} MiB', module=module, w=run['width'], steps=run['steps'], mb=run['bucket_mb']))
    if 'not built' in result:
        print(tr('not built yet: {why}; fill in the gaps marked GAP and run the check again', why=result['not built']))
        return Case('not built')
    parts = bucketed_parts(result)
    mark = {True: tr('pass'), False: tr('fail')}
    ok, gap = parts['grads']
    print('  ' + tr('gradients and parameters against DDP: largest difference {gap:.1e} of the largest value '
                    '(allowed {tol:.0e}): {mark}', gap=gap, tol=TOLERANCE, mark=mark[ok]))
    ok, (early, count) = parts['overlap']
    print('  ' + tr('overlap: {early} of {n} all-reduces started without waiting (async_op=True) before backward '
                    'had its last gradient (at least 1 needed): {mark}', early=early, n=count, mark=mark[ok]))
    ok, (count, params) = parts['buckets']
    print('  ' + tr('buckets: {n} all-reduces per step for {p} parameters (more than 1, fewer than {p} needed): '
                    '{mark}', n=count, p=params, mark=mark[ok]))
    names = {'grads': tr('the gradients'), 'overlap': tr('the overlap'), 'buckets': tr('the buckets')}
    failed = [names[part] for part, (ok, _) in parts.items() if not ok]
    print(tr('Result: pass') if not failed else tr('Result: fail ({parts})', parts=', '.join(failed)))
    return Case('fail' if failed else 'pass')
