"""Section 06, the piece you build: gradients all-reduced in buckets while the backward pass runs.

BucketedAllReduce is the reference solution of 06's exercise (what DDP's reducer does, written
with autograd hooks); check_bucketed_allreduce() runs anyone's version of it in gloo processes
beside DDP and says pass or fail, part by part: the same start on every rank, the same gradients
and parameters as DDP, also when gradients are accumulated over two backward passes and when a
parameter gets no gradient, all-reduces that run while the backward pass goes on, and fewer
all-reduces than parameters.
"""
import copy
import html
import importlib
import inspect
import os
import re
import sys

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

    Use it as DDP is used: build it once (it copies rank 0's parameters and buffers to every
    rank), then call loss.backward() as often as you accumulate, then optimizer.step(). A hook on
    each parameter counts the gradients of its bucket; buckets are sent in bucket order, each as
    soon as it and every bucket before it are full, as one flat tensor whose all-reduce starts at
    once (async_op=True) while the backward pass goes on. When the pass ends, autograd runs
    finish(), which sends any bucket a parameter without a gradient held back (zeros in its
    place), waits, and writes the averages into .grad. Every rank sends the same buckets in the
    same order, as collectives must.
    """

    def __init__(self, model, bucket_mb=25):
        self.world_size = dist.get_world_size()
        self.buckets = make_buckets([p for p in model.parameters() if p.requires_grad], bucket_mb)
        self.bucket_of = {p: k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)   # gradients ready in each bucket, this backward pass
        self.pending = []                      # (handle, flat tensor, bucket) of each bucket sent, in bucket order
        self.in_backward = False               # has this backward pass queued finish() yet?
        for p in self.bucket_of:
            p.register_post_accumulate_grad_hook(self.gradient_ready)
        for t in [*model.parameters(), *model.buffers()]:   # start every rank from rank 0's model, as DDP does
            dist.broadcast(t.detach(), src=0)

    def gradient_ready(self, p):
        """Autograd calls this when p.grad holds this pass's local gradient, added to any earlier one."""
        if not self.in_backward:   # the pass's first gradient: have autograd call finish() when the pass ends
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.ready[self.bucket_of[p]] += 1
        while len(self.pending) < len(self.buckets) and self._full(len(self.pending)):
            self.send(len(self.pending))   # the next bucket in order, and any full ones behind it

    def _full(self, k):
        return self.ready[k] == len(self.buckets[k])

    def send(self, k):
        """Start the all-reduce of bucket k without waiting; a missing gradient is sent as zeros."""
        flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).flatten()
                          for q in self.buckets[k]])
        self.pending.append((dist.all_reduce(flat, async_op=True), flat, self.buckets[k]))

    def finish(self):
        """Send the buckets still held back, wait for every all-reduce, write the averages into .grad."""
        for k in range(len(self.pending), len(self.buckets)):   # a parameter got no gradient this pass
            self.send(k)
        for handle, flat, bucket in self.pending:
            handle.wait()
            flat /= self.world_size
            for q, average in zip(bucket, flat.split([q.numel() for q in bucket])):
                q.grad = average.view_as(q)   # also where this rank had no gradient: the others may have
        self.ready = [0] * len(self.buckets)
        self.pending = []
        self.in_backward = False


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
PARTS = ('same_start', 'grads', 'accumulation', 'unused', 'overlap', 'buckets')
# The skeleton's gaps (number, method) whose work each part checks, for the line that says where to look.
PART_GAPS = {'same_start': [(2, '__init__')], 'grads': [(4, 'send'), (5, 'finish')], 'accumulation': [(5, 'finish')],
             'unused': [(4, 'send')], 'overlap': [(3, 'gradient_ready'), (4, 'send')], 'buckets': [(1, 'make_buckets')]}


def _gap(mine, theirs):
    """Largest |a − b| over tensors, relative to the largest |b|; a missing gradient counts as zeros."""
    pairs = [(torch.zeros(()) if a is None else a, torch.zeros(()) if b is None else b) for a, b in zip(mine, theirs)]
    largest = max(float(b.detach().abs().max()) for _, b in pairs)
    return max(float((a - b).detach().abs().max()) for a, b in pairs) / max(largest, 1e-30)


class _Watched:
    """A Work handle (or its Future) that notes when someone waits for it, and otherwise behaves as it."""

    def __init__(self, inner, note):
        self._inner, self._note = inner, note

    def wait(self, *args, **kwargs):
        self._note()
        return self._inner.wait(*args, **kwargs)

    def value(self):   # a Future's value() waits too
        self._note()
        return self._inner.value()

    def get_future(self):
        return _Watched(self._inner.get_future(), self._note)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _record_all_reduce(events, recording):
    """A stand-in for dist.all_reduce that appends ('all-reduce', n, elements) when it starts and
    ('wait', n) when it is first waited for; a synchronous call (async_op False) waits at once."""
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        work = real_all_reduce(tensor, *args, **kwargs)
        if not recording[0]:
            return work
        n = sum(kind == 'all-reduce' for kind, *_ in events)
        events.append(('all-reduce', n, tensor.numel()))
        waited = []

        def note():
            if not waited:
                waited.append(True)
                events.append(('wait', n))
        if work is None:
            note()
            return None
        return _Watched(work, note)
    return all_reduce


class _WithUnusedLayer(torch.nn.Module):
    """The check's network with a layer that forward() skips: its parameters never get a gradient."""

    def __init__(self, net):
        super().__init__()
        self.skipped = torch.nn.Linear(8, 8)   # registered first, so it sits in the last bucket
        self.net = net

    def forward(self, x):
        return self.net(x)


def bucketed_check(rank, world_size, module, folder, run=None):
    """Worker for launch(): train `module`.BucketedAllReduce beside DDP and record what it does.

    Every rank seeds its model differently, so DDP and the class must both bring rank 0's to
    every rank: 'same_start' is their gap right after construction, and then DDP's weights are loaded
    into the class's model, so that no other part depends on it. Then, each step from DDP's
    parameters (see _step), run['steps'] SGD steps of one backward pass each ('grads', with the
    parameters after them), one step that accumulates two micro-batches ('accumulation'), and one
    step of a model with a skipped layer against DDP
    with find_unused_parameters=True ('unused'); each rank sees its own batches. Each of these is
    this rank's largest difference from DDP, relative to the largest value. On rank 0, 'passes'
    holds, per backward pass of the first model, the order of events: ('gradient', name) when a
    gradient is ready (our hook, registered before the class's, fires first), ('all-reduce', n,
    elements) when the n-th all-reduce starts and ('wait', n) when it is first waited for (by
    wrapping torch.distributed.all_reduce and its handle). A class that raises
    NotImplementedError returns {'not built': its message}.
    """
    run_keys(run or {}, (), tuple(CHECK_RUN))   # each key changes one of CHECK_RUN's values
    run = {**CHECK_RUN, **(run or {})}
    if folder not in sys.path:
        sys.path.insert(0, folder)
    events, recording = [], [False]
    real_all_reduce = dist.all_reduce
    dist.all_reduce = _record_all_reduce(events, recording)   # before the import, so `from … import` gets it
    try:
        gen = torch.Generator().manual_seed(100 + rank)
        batches = [(torch.randn(run['batch_size'], 1, 28, 28, generator=gen),
                    torch.randint(0, 10, (run['batch_size'],), generator=gen)) for _ in range(run['steps'] + 3)]
        out = {'passes': []}
        try:
            cls = importlib.import_module(module).BucketedAllReduce
            torch.manual_seed(rank)   # the ranks start apart: only a broadcast from rank 0 brings them together
            ddp, mine = _pair(cls, resnet18(width=run['width']), run, out, events, recording)
            out['params'] = len(list(mine.parameters()))
            gaps = [_step(ddp, mine, batches[k:k + 1], run['lr'], events, recording, out['passes'])
                    for k in range(run['steps'])]
            out['grads'] = max(gaps + [_gap(list(mine.parameters()), list(ddp.module.parameters()))])
            out['accumulation'] = _step(ddp, mine, batches[run['steps']:run['steps'] + 2], run['lr'], events,
                                        recording, out['passes'])
            torch.manual_seed(rank)
            ddp, mine = _pair(cls, _WithUnusedLayer(resnet18(width=run['width'])), run, {}, [], [False],
                              find_unused_parameters=True)
            out['unused'] = _step(ddp, mine, batches[-1:], run['lr'], [], [False], [])
        except NotImplementedError as gap:
            return {'not built': str(gap) or type(gap).__name__}
        if rank:
            del out['passes']
        return out
    finally:
        dist.all_reduce = real_all_reduce


def _pair(cls, net, run, out, events, recording, **ddp_options):
    """DDP and the class's model, each a copy of `net`; out['same_start'] is their gap after construction."""
    ddp = DDP(copy.deepcopy(net), bucket_cap_mb=run['bucket_mb'], **ddp_options)
    mine = copy.deepcopy(net)
    for name, p in mine.named_parameters():   # registered before the class's hooks, so it fires first
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: events.append(('gradient', name)) if recording[0] else None)
    cls(mine, bucket_mb=run['bucket_mb'])   # its hooks keep it alive
    out['same_start'] = _gap([*mine.parameters(), *mine.buffers()], [*ddp.module.parameters(), *ddp.module.buffers()])
    mine.load_state_dict(ddp.module.state_dict())   # the other parts start equal, whatever 'same_start' found
    return ddp, mine


def _step(ddp, mine, micro_batches, lr, events, recording, passes):
    """One SGD step of both models from DDP's parameters, one backward pass per micro-batch (the class's
    passes recorded into `passes`); returns the gradients' gap before the step.

    Each step starts the class's model from DDP's parameters and buffers, because two correct
    versions round the average differently (DDP divides before the sum, the reference after it;
    with three ranks the order of the sum matters too). After a step their float32 parameters
    differ by a rounding, which can move some ReLU input across zero: that position's share of a
    gradient is then in one model and not in the other. Trained apart, a correct class and DDP
    reached 1e-3 of the largest gradient within three steps with 3 processes (on an Intel Xeon),
    while in float64 the reference stays within 1e-12 of a plain average for several steps
    (tests/test_s06_bucketed.py). From equal parameters, one step differs only by the
    all-reduce's rounding, about 1e-7 of the largest gradient on any CPU, well inside TOLERANCE.
    """
    loss_fn = torch.nn.functional.cross_entropy
    mine.load_state_dict(ddp.module.state_dict())   # in place: the class's hooks stay on the same tensors
    for model in (ddp, mine):
        model.zero_grad()
    for X, y in micro_batches:
        loss_fn(ddp(X), y).backward()
        loss = loss_fn(mine(X), y)
        events.clear()
        recording[0] = True
        loss.backward()
        recording[0] = False
        passes.append(list(events))
    gap = _gap([p.grad for p in mine.parameters()], [p.grad for p in ddp.module.parameters()])
    for model in (ddp, mine):
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= lr * p.grad
    return gap


def combine(results):
    """One result from every rank's: the largest of each gap, rank 0's passes and parameter count."""
    if any('not built' in r for r in results):
        return next(r for r in results if 'not built' in r)
    gaps = ('same_start', 'grads', 'accumulation', 'unused')
    return {**results[0], **{key: max(r[key] for r in results) for key in gaps}}


def overlapping(events):
    """How many all-reduces of one backward pass started before its last gradient was ready and
    were not waited for before it, and how many there were."""
    last = max((i for i, (kind, *_) in enumerate(events) if kind == 'gradient'), default=-1)
    waited_early = {n for kind, n, *_ in events[:last] if kind == 'wait'}
    started = [(i, n) for i, (kind, n, *_) in enumerate(events) if kind == 'all-reduce']
    return sum(i < last and n not in waited_early for i, n in started), len(started)


def bucketed_parts(result):
    """{part: (passed, numbers)} for PARTS, from combine()'s result.

    start, grads, accumulation, unused: the gap from DDP within TOLERANCE (start: the parameters
    and buffers after construction; grads: the gradients of each one-pass step and the
    parameters after them; accumulation: the gradients after two backward passes; unused: the
    gradients when a layer is skipped). overlap: in every backward pass at least one all-reduce
    started before the last gradient was ready and was not waited for before it. buckets: in
    every pass more than one and fewer all-reduces than there are parameters.
    """
    parts = {part: (result[part] < TOLERANCE, result[part]) for part in PARTS[:4]}
    counted = [overlapping(events) for events in result['passes']] or [(0, 0)]
    counts = [n for _, n in counted]
    parts['overlap'] = (bool(result['passes']) and min(counted)[0] >= 1, min(counted))
    parts['buckets'] = (bool(result['passes']) and all(1 < n < result['params'] for n in counts),
                        (min(counts), max(counts), result['params']))
    return parts


def _part_lines(parts):
    """One line per part, in the reader's language, each ending with pass or fail."""
    mark = {True: tr('pass'), False: tr('fail')}
    # Chinese opens the note with a full-width parenthesis, which needs no space before it
    allowed = {part: tr('(allowed {tol:.0e}): {mark}', tol=TOLERANCE, mark=mark[ok]).replace('(', ' (')
               for part, (ok, _) in parts.items()}
    gap = {part: numbers for part, (_, numbers) in parts.items()}
    (early, count), (fewest, most, params) = gap['overlap'], gap['buckets']
    return [
        tr('start: parameters and buffers after construction against rank 0\'s (DDP broadcasts them), largest '
           'difference {gap:.1e} of the largest value', gap=gap['same_start']) + allowed['same_start'],
        tr('gradients and parameters, one backward pass per step, against DDP: largest difference {gap:.1e} of '
           'the largest value', gap=gap['grads']) + allowed['grads'],
        tr('gradient accumulation, two backward passes before a step, against DDP: largest difference {gap:.1e} '
           'of the largest value', gap=gap['accumulation']) + allowed['accumulation'],
        tr('a layer that gets no gradient, against DDP with find_unused_parameters=True: largest difference '
           '{gap:.1e} of the largest value', gap=gap['unused']) + allowed['unused'],
        tr('overlap: in the worst backward pass, {early} of {n} all-reduces started before the last gradient and '
           'were not waited for before it (at least 1 needed in every pass): {mark}',
           early=early, n=count, mark=mark[parts['overlap'][0]]),
        tr('buckets: all-reduces per backward pass, fewest {lo}, most {hi}, for {p} parameters (more than 1 and '
           'fewer than {p} needed): {mark}', lo=fewest, hi=most, p=params, mark=mark[parts['buckets'][0]]),
    ]


def _not_built_line(why):
    """The line for a gap still raising NotImplementedError('gap N: name'), in the form 08-10 print."""
    gap = re.fullmatch(r'gap (\d+): (\S+)', why)
    if not gap:
        return tr('not built yet: {why}', why=why)
    return tr('not built yet: gap {n} ({name}) still raises NotImplementedError; fill it in and run the check again',
              n=gap.group(1), name=gap.group(2))


def check_bucketed_allreduce(module='my_buckets', folder=None, run=None, procs=2):
    """Check `module`.BucketedAllReduce in `procs` gloo processes against DDP; print pass or fail.

    `module` is a module name, importable from `folder` (default: this folder), such as
    the my_buckets.py a notebook cell writes. Prints, in the notebook's language, one line per
    part of bucketed_parts() with pass or fail, and a Result line; or that the class is not built
    yet. Returns 'pass', 'fail' or 'not built' (a string that a notebook does not echo).
    """
    run_keys(run or {}, (), tuple(CHECK_RUN))   # here, before any process starts
    if not isinstance(procs, int) or procs < 2:
        raise ValueError(f'procs must be an integer of at least 2, got {procs!r}')
    run = {**CHECK_RUN, **(run or {})}
    result = combine(launch(bucketed_check, procs, module, os.path.abspath(folder or os.getcwd()), run,
                            threads=1, timeout=120, op_timeout=60))
    print(tr('Check of {module}.BucketedAllReduce: {procs} processes (gloo), ResNet-18 of width {w}, '
             '{steps} steps and one of two micro-batches, buckets of {mb} MiB', module=module, procs=procs,
             w=run['width'], steps=run['steps'], mb=run['bucket_mb']))
    if 'not built' in result:
        print(_not_built_line(result['not built']))
        return Case('not built')
    parts = bucketed_parts(result)
    for line in _part_lines(parts):
        print('  ' + line)
    names = {'same_start': tr('the start'), 'grads': tr('the gradients'), 'accumulation': tr('the accumulation'),
             'unused': tr('the unused layer'), 'overlap': tr('the overlap'), 'buckets': tr('the buckets')}
    failed = [part for part, (ok, _) in parts.items() if not ok]
    print(tr('Result: pass') if not failed else
          tr('Result: fail ({parts})', parts=', '.join(names[part] for part in failed)))
    for part in failed:
        print('  ' + tr('{part}: the work of {gaps}', part=names[part], gaps=tr(' and ').join(
            tr('gap {n} ({name})', n=n, name=name) for n, name in PART_GAPS[part])))
    return Case('fail' if failed else 'pass')
