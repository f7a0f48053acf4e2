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

from comp_perf.language import tr
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


def slow_step(model, optimizer, batch):
    """One training step as a first draft writes it; returns the loss. Right, but slow three times over."""
    x, y = batch
    # mistake 1: each image standardised (mean 0, standard deviation 1) in a Python loop, one by one
    x = x.clone()                                   # the batch itself stays as it is, for the next step
    for i in range(len(x)):
        x[i] = (x[i] - x[i].mean()) / (x[i].std() + 1e-5)
    # mistake 2: the model applied to one sample at a time and the losses summed in Python
    optimizer.zero_grad()
    total = 0
    for i in range(len(y)):
        total = total + F.cross_entropy(model(x[i:i + 1]), y[i:i + 1])
    loss = total / len(y)
    loss.backward()
    # mistake 3: the gradient norm summed row by row in Python, one .item() (a wait, on a GPU) per row
    squares = 0.0
    for p in model.parameters():
        for row in p.grad.reshape(len(p.grad), -1):
            squares += row.pow(2).sum().item()
    scale = MAX_NORM / (squares ** 0.5 + 1e-6)      # clip_grad_norm_'s formula
    if scale < 1:
        for p in model.parameters():
            p.grad.mul_(scale)
    optimizer.step()
    return loss.item()


def fast_step(model, optimizer, batch):
    """slow_step's result with whole-tensor operations: one call of the model, one loss, one clipping."""
    x, y = batch
    x = (x - x.mean(dim=1, keepdim=True)) / (x.std(dim=1, keepdim=True) + 1e-5)   # every image at once
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)                      # one batched forward; the mean over the batch
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    optimizer.step()
    return loss.item()


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


def _speed_line(median, low, high, need):
    """(passed, the printed line) for the per-round speed-ups' median and quartiles."""
    numbers = dict(m=median, lo=low, hi=high, need=need)
    if median >= need and low > 1:
        return True, tr('{verdict} (b) faster: your step is {m:.2f}× as fast as the slow one '
                        '(quartiles {lo:.2f}–{hi:.2f}; {need:g}× needed)', verdict=tr('pass'), **numbers)
    if low <= 1 <= high:   # some rounds faster, some slower: this run cannot name a winner
        return False, tr('{verdict} (b) faster: {m:.2f}× (quartiles {lo:.2f}–{hi:.2f}) is within the noise of '
                         'this run: it cannot tell your step from the slow one', verdict=tr('FAIL'), **numbers)
    if high < 1:
        return False, tr('{verdict} (b) faster: your step is slower than the slow one: {m:.2f}× '
                         '(quartiles {lo:.2f}–{hi:.2f})', verdict=tr('FAIL'), **numbers)
    return False, tr('{verdict} (b) faster: your step is faster, {m:.2f}× (quartiles {lo:.2f}–{hi:.2f}), '
                     'but below the {need:g}× needed', verdict=tr('FAIL'), **numbers)


def _checked(fast, steps, rounds, min_speedup, tol):
    """Parts (a) and (b) of check_faster_step, printed; True when both pass."""
    loss_diff, param_diff = _same_result(fast, steps)
    same = loss_diff <= tol and param_diff <= tol
    print(tr('{verdict} (a) same result: over {k} steps the losses differ from the slow step\'s by {dl:.1e} '
             '(relative) and the parameters by {dp:.1e} of the largest parameter (allowed {tol:.0e})',
             verdict=tr('pass') if same else tr('FAIL'), k=steps, dl=loss_diff, dp=param_diff, tol=tol))
    slow_state, fast_state = slow_setup(), slow_setup()      # each variant steps a state of its own
    times = interleaved({'slow': lambda: slow_step(*slow_state), 'fast': lambda: fast(*fast_state)},
                        rounds=rounds, warmup=1)
    faster, line = _speed_line(*paired_ratio(times['slow'], times['fast']), need=min_speedup)
    print(tr('median times: slow step {slow:.1f} ms, your step {fast:.1f} ms ({n} rounds)',
             slow=1e3 * statistics.median(times['slow']), fast=1e3 * statistics.median(times['fast']), n=rounds))
    print(line)
    return same and faster


def check_faster_step(source='my_fast_step.py', rounds=9, min_speedup=2.0, tol=1e-5, steps=3):
    """Hold the function fast_step of `source` to slow_step; print pass or fail, and return True when it passes.

    source: the path of a student's file ('my_fast_step.py') or a module name ('comp_perf.s09_faster_step').
    Passes when (a) from the same fresh set-up, `steps` steps give the slow step's losses within `tol`
    (relative) and its parameters within `tol` of the largest parameter, and (b) timed in turns with the
    slow step, each from a state of its own, the median speed-up is at least `min_speedup` and its lower
    quartile above 1. A file whose gaps still raise NotImplementedError prints "not built yet".
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
        ok = _checked(fast, steps, rounds, min_speedup, tol)
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
