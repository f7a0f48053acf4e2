"""Section 09, the piece you build: a slow training step made at least 2× faster (fast_step, the reference),
and check_faster_step(), which holds anyone's fast_step to slow_step's results and to a speed-up clear of the noise.
"""
import importlib
import importlib.util
import re
import statistics
from pathlib import Path

import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from comp_perf.language import name_list, tr
from comp_perf.measure import interleaved, paired_ratio

SAMPLES, FEATURES, HIDDEN, CLASSES = 128, 784, 256, 10
MAX_NORM = 0.25  # below the first steps' gradient norm (about 0.5): the clipping acts, and a step without it fails


def slow_setup(seed=0):
    """(model, optimizer, batch): a fresh 784→256→256→10 MLP, SGD with momentum, one fixed synthetic batch.

    The same seed gives the same weights and batch, without touching the caller's random state.
    The inputs are 128 images of 784 pixels (0 to 255) in 10 classes, so standardising them matters.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(),
                                    torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                                    torch.nn.Linear(HIDDEN, CLASSES))
        x = torch.rand(SAMPLES, FEATURES) * 255
        y = torch.randint(0, CLASSES, (SAMPLES,))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), (x, y)


def standardise_each(x):
    """Mistake 1: each image standardised (mean 0, standard deviation 1) in a Python loop, one by one."""
    x = x.clone()                                   # the batch itself stays as it is, for the next step
    for i in range(len(x)):
        x[i] = (x[i] - x[i].mean()) / (x[i].std() + 1e-5)
    return x


def loss_sample_by_sample(model, x, y):
    """Mistake 2: the model applied to one sample at a time and the losses summed in Python."""
    total = 0
    for i in range(len(y)):
        total = total + F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
    return total / len(y)


def clip_row_by_row(model):
    """Mistake 3: the gradient norm summed row by row in Python, one .item() (a wait, on a GPU) per row."""
    squares = 0.0
    for p in model.parameters():
        for row in p.grad.reshape(len(p.grad), -1):
            squares += row.pow(2).sum().item()
    scale = MAX_NORM / (squares ** 0.5 + 1e-6)      # clip_grad_norm_'s formula
    if scale < 1:
        for p in model.parameters():
            p.grad.mul_(scale)


def slow_step(model, optimizer, batch):
    """One training step as a first draft writes it; returns the loss. Right, but slow three times over."""
    x, y = batch
    x = standardise_each(x)
    optimizer.zero_grad()
    loss = loss_sample_by_sample(model, x, y)
    loss.backward()
    clip_row_by_row(model)
    optimizer.step()
    return loss.item()


# The skeleton's three gaps, each the whole-tensor version of one of slow_step's parts.
FAST_STEP_GAPS = {'standardise': (1, standardise_each), 'batch_loss': (2, loss_sample_by_sample),
        'clip_gradients': (3, clip_row_by_row)}


def show_slow_step():
    """The slow step and its three mistakes, as the page shows them."""
    from comp_perf.pictures import show_source
    show_source(standardise_each, loss_sample_by_sample, clip_row_by_row, slow_step)


def standardise(x):
    """Gap 1, the reference: every image standardised at once, one number per row broadcast over its columns."""
    return (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True) + 1e-5)


def batch_loss(model, x, y):
    """Gap 2, the reference: one batched forward pass; cross_entropy already averages over the batch."""
    return F.cross_entropy(model(x), y)


def clip_gradients(model):
    """Gap 3, the reference: the total norm of all gradients and one scaling, in PyTorch's own function."""
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def fast_step(model, optimizer, batch):
    """slow_step's result with whole-tensor operations, written as the notebook's skeleton is."""
    x, y = batch
    x = standardise(x)
    optimizer.zero_grad()
    loss = batch_loss(model, x, y)
    loss.backward()
    clip_gradients(model)
    optimizer.step()
    return loss.item()


def show_fast_step_solution():
    """The reference, folded as a solution is: the three gaps' functions and the step."""
    from comp_perf.s06_bucketed import show_solution
    show_solution(standardise, batch_loss, clip_gradients, fast_step)


def _load(source):
    """The module of a student's file (a path ending in .py, loaded afresh each time) or of a module name."""
    if str(source).endswith('.py'):
        path = Path(source).resolve()
        if not path.is_file():
            raise FileNotFoundError(str(source))
        # a module of its own, kept out of sys.modules and compiled from the text (no cached bytecode):
        # a file edited and written again is read again at the next check
        module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(f'_step_{path.stem}', path))
        exec(compile(path.read_text(encoding='utf-8'), str(path), 'exec'), module.__dict__)
        return module
    return importlib.import_module(source)


def _in_float64(model, optimizer, batch):
    """slow_setup()'s state in float64; the optimiser keeps its parameters (.double() converts them in place)."""
    x, y = batch
    return model.double(), optimizer, (x.double(), y)


def _relative(got, want):
    """Largest |got - want| over the largest |want|, for tensors or numbers."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    return ((got - want).abs().max() / want.abs().max()).item()


def _same_result(fast, steps):
    """Largest relative difference of the losses, and of the parameters (of the largest one), after `steps`.

    Both run in float64. Trained apart, two right steps round differently, and the check's
    trajectory brings a ReLU input within 4e-6 of its layer's largest one, over sums of 784
    products: close enough for some CPU's float32 rounding to move it across zero and change a gradient.
    Float64's roundings (about 1e-16) cannot, so `tol` then measures the step, not the CPU.
    """
    slow_state, fast_state = _in_float64(*slow_setup()), _in_float64(*slow_setup())
    slow_losses = [slow_step(*slow_state) for _ in range(steps)]
    fast_losses = [float(fast(*fast_state)) for _ in range(steps)]
    loss_diff = max(abs(a - b) / abs(a) for a, b in zip(slow_losses, fast_losses))
    pairs = list(zip(slow_state[0].parameters(), fast_state[0].parameters()))
    scale = max(a.abs().max().item() for a, _ in pairs)
    return loss_diff, max((a - b).abs().max().item() for a, b in pairs) / scale


def _gap_functions(module):
    """{name: (number, the student's function, slow_step's part)} for the skeleton's gaps the file still has."""
    return {name: (number, getattr(module, name), slow) for name, (number, slow) in FAST_STEP_GAPS.items()
            if callable(getattr(module, name, None))}


def _gap_differences(gaps):
    """{name: relative difference} of each gap's function from slow_step's part, on the same float64 inputs."""
    model, _, (x, y) = _in_float64(*slow_setup())
    ready, found = standardise_each(x), {}
    if 'standardise' in gaps:
        found['standardise'] = _relative(gaps['standardise'][1](x.clone()), ready)
    params = list(model.parameters())
    wanted = loss_sample_by_sample(model, ready, y)
    wanted_grads = torch.autograd.grad(wanted, params)
    if 'batch_loss' in gaps:
        loss = gaps['batch_loss'][1](model, ready, y)
        found['batch_loss'] = max([_relative(loss.detach(), wanted.detach())] +
                                  [_relative(g, w) for g, w in zip(torch.autograd.grad(loss, params), wanted_grads)])
    if 'clip_gradients' in gaps:
        clipped = []
        for clip in (gaps['clip_gradients'][1], clip_row_by_row):   # the same gradients, clipped both ways
            for p, g in zip(params, wanted_grads):
                p.grad = g.clone()
            clip(model)
            clipped.append([p.grad.clone() for p in params])
        found['clip_gradients'] = max(_relative(a, b) for a, b in zip(*clipped))
    return found


def _same_part(fast, module, steps, tol):
    """Part (a), printed, and where it fails, which gap computes something else; True when it passes."""
    loss_diff, param_diff = _same_result(fast, steps)
    same = loss_diff <= tol and param_diff <= tol
    print(tr('{verdict} (a) same result: over {k} steps the losses differ from the slow step\'s by {dl:.1e} '
             '(relative) and the parameters by {dp:.1e} of the largest parameter (allowed {tol:.0e})',
             verdict=tr('pass') if same else tr('FAIL'), k=steps, dl=loss_diff, dp=param_diff, tol=tol))
    if same:
        return True
    gaps = _gap_functions(module)
    if not gaps:
        print(tr('    your file has none of the skeleton\'s functions, so the check cannot say which part differs'))
        return False
    wrong = [(gaps[name][0], name, diff) for name, diff in _gap_differences(gaps).items() if not diff <= tol]
    for number, name, diff in wrong:
        print(tr('    gap {n} ({name}) computes something other than slow_step\'s part: {d:.1e} of its largest value',
                 n=number, name=name, d=diff))
    if not wrong:
        print(tr('    each gap computes what slow_step\'s part does: the difference is in how fast_step puts them '
                 'together (their order, zero_grad or the optimiser step)'))
    return False


def _batch_part(fast):
    """Part (b), printed: the step must leave the batch it is given as it was; True when it does."""
    state = slow_setup()
    x, y = state[2]
    before = (x.clone(), y.clone())
    fast(*state)
    change = max((a.double() - b.double()).abs().max().item() for a, b in zip((x, y), before))
    if change == 0:
        print(tr('{verdict} (b) the batch: your step left the batch it was given as it was', verdict=tr('pass')))
        return True
    print(tr('{verdict} (b) the batch: your step changed the batch it was given (by up to {d:.2g}); work on a new '
             'tensor instead of in place, since the caller trains on the same batch again', verdict=tr('FAIL'),
             d=change))
    return False


class _Operations(TorchDispatchMode):
    """Counts the operations PyTorch runs while it is active (views and .item() included)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def operations(fn):
    """How many PyTorch operations fn() runs: a Python loop over rows or samples runs hundreds."""
    with _Operations() as counter:
        fn()
    return counter.count


def _gap_work(gap_or_slow):
    """{name: operations} of each gap's function (or of slow_step's parts: gap_or_slow = None) on slow_setup's
    float32 state, the clipping on gradients already there."""
    model, _, (x, y) = slow_setup()
    ready = standardise_each(x)
    loss_sample_by_sample(model, ready, y).backward()   # gradients for the clipping to scale
    calls = {'standardise': lambda f: f(x.clone()), 'batch_loss': lambda f: f(model, ready, y),
             'clip_gradients': lambda f: f(model)}
    return {name: operations(lambda: calls[name](gap_or_slow(name))) for name in FAST_STEP_GAPS}


WORK_PER_GAP = 64   # a gap done with whole tensors runs at most about 15 operations; slow_step's loops run hundreds


def _work_part(fast, module):
    """Part (c), printed: each gap's operations, so that a loop left in one gap fails by name; True when none."""
    gaps = _gap_functions(module)
    if len(gaps) < len(FAST_STEP_GAPS):   # the skeleton's functions renamed or inlined: count the step as a whole
        state = slow_setup()
        count, most = operations(lambda: fast(*state)), 3 * WORK_PER_GAP
        ok = count <= most
        print(tr('{verdict} (c) whole-tensor work: your file lacks some of {names}, so fast_step was counted as a '
                 'whole: {ops:,} operations (at most {most} allowed)', verdict=tr('pass') if ok else tr('FAIL'),
                 names=name_list(FAST_STEP_GAPS), ops=count, most=most))
        return ok
    mine, slow = _gap_work(lambda name: gaps[name][1]), _gap_work(lambda name: FAST_STEP_GAPS[name][1])
    loops = [name for name in FAST_STEP_GAPS if mine[name] > WORK_PER_GAP]
    if not loops:
        print(tr('{verdict} (c) whole-tensor work: gaps 1, 2 and 3 run {a}, {b} and {c} operations (at most {most} '
                 'each; slow_step\'s parts run {sa:,}, {sb:,} and {sc:,})', verdict=tr('pass'), most=WORK_PER_GAP,
                 a=mine['standardise'], b=mine['batch_loss'], c=mine['clip_gradients'], sa=slow['standardise'],
                 sb=slow['batch_loss'], sc=slow['clip_gradients']))
    for name in loops:
        print(tr('{verdict} (c) whole-tensor work: gap {n} ({name}) still runs {ops:,} operations (at most {most} '
                 'allowed; slow_step\'s part runs {slow:,}): a Python loop is still there', verdict=tr('FAIL'),
                 n=FAST_STEP_GAPS[name][0], name=name, ops=mine[name], most=WORK_PER_GAP, slow=slow[name]))
    return not loops


def _speed_line(median, low, high, need):
    """(passed, the printed line) for the per-round speed-ups' median and quartiles."""
    numbers = dict(m=median, lo=low, hi=high, need=need)
    if median >= need and low > 1:
        return True, tr('{verdict} (d) faster: your step is {m:.2f}× as fast as the slow one '
                        '(quartiles {lo:.2f}–{hi:.2f}; {need:g}× needed)', verdict=tr('pass'), **numbers)
    if low <= 1 <= high:   # some rounds faster, some slower: this run cannot name a winner
        return False, tr('{verdict} (d) faster: {m:.2f}× (quartiles {lo:.2f}–{hi:.2f}) is within the noise of '
                         'this run: it cannot tell your step from the slow one', verdict=tr('FAIL'), **numbers)
    if high < 1:
        return False, tr('{verdict} (d) faster: your step is slower than the slow one: {m:.2f}× '
                         '(quartiles {lo:.2f}–{hi:.2f})', verdict=tr('FAIL'), **numbers)
    return False, tr('{verdict} (d) faster: your step is faster, {m:.2f}× (quartiles {lo:.2f}–{hi:.2f}), '
                     'but below the {need:g}× needed', verdict=tr('FAIL'), **numbers)


def _speed_part(fast, rounds, min_speedup):
    """Part (d), printed: the two steps timed in turns, each on a state of its own; True when it passes."""
    slow_state, fast_state = slow_setup(), slow_setup()
    times = interleaved({'slow': lambda: slow_step(*slow_state), 'fast': lambda: fast(*fast_state)},
                        rounds=rounds, warmup=1)
    faster, line = _speed_line(*paired_ratio(times['slow'], times['fast']), need=min_speedup)
    print(tr('median times: slow step {slow:.1f} ms, your step {fast:.1f} ms ({n} rounds)',
             slow=1e3 * statistics.median(times['slow']), fast=1e3 * statistics.median(times['fast']), n=rounds))
    print(line)
    return faster


def _checked(fast, module, steps, rounds, min_speedup, tol):
    """Parts (a) to (d) of check_faster_step, each printed; True when all pass."""
    results = [_same_part(fast, module, steps, tol), _batch_part(fast), _work_part(fast, module),
               _speed_part(fast, rounds, min_speedup)]
    return all(results)


def check_faster_step(source='my_fast_step.py', rounds=9, min_speedup=2.0, tol=1e-5, steps=3):
    """Hold the function fast_step of `source` to slow_step; print pass or fail, and return True when it passes.

    source: the path of a student's file ('my_fast_step.py') or a module name ('comp_perf.s09_faster_step').
    Passes when (a) from the same fresh set-up, `steps` steps give the slow step's losses within `tol`
    (relative) and its parameters within `tol` of the largest parameter (where not, each of the
    skeleton's gap functions is compared with slow_step's part, and the ones that differ are named);
    (b) a step leaves the batch it is given unchanged; (c) each gap's function runs at most
    WORK_PER_GAP operations (all three: fast_step counted as a whole, if the file lacks them), so a
    Python loop left in any gap fails by name; and (d) timed in turns with the slow step, each from a
    state of its own, the median speed-up is at least `min_speedup` and its lower quartile above 1.
    A file whose gaps still raise NotImplementedError prints "not built yet".
    """
    try:
        module = _load(source)
    except FileNotFoundError:
        print(tr('fail: there is no file {path} (run its %%writefile cell first)', path=source))
        return False
    except Exception as error:   # a syntax error, or any error while the file runs: say which, no traceback
        print(tr('fail: {source} could not be loaded:', source=source), f'{type(error).__name__}: {error}')
        return False
    fast = getattr(module, 'fast_step', None)
    if not callable(fast):
        print(tr('fail: {source} defines no function fast_step', source=source))
        return False
    try:
        ok = _checked(fast, module, steps, rounds, min_speedup, tol)
    except NotImplementedError as gap:
        number = re.fullmatch(r'gap (\d+)', str(gap))
        print(tr('not built yet: gap {n} still raises NotImplementedError (fill it in, run the %%writefile '
                 'cell again, then this one)', n=number.group(1)) if number else
              tr('not built yet: {gap}', gap=str(gap) or 'NotImplementedError'))
        return False
    except Exception as error:   # the student's step failed: show the error, not a traceback
        print(tr('fail: your fast_step raised an error:'), f'{type(error).__name__}: {error}')
        return False
    print(tr('faster step: pass') if ok else tr('faster step: fail'))
    return ok
