"""Section 09, exercise 8: a mystery step. write_mystery_step(seed) writes a first draft of a training step
whose mistakes, drawn from the seed, are named nowhere on the page or in the file; check_mystery_step() says
how many of them a student's fixed file no longer makes, whether it still computes the same step, and how
much faster it is, without naming the ones left: finding them is the exercise.
"""
import random
import statistics
import warnings
import zlib
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comp_perf.language import tr
from comp_perf.measure import interleaved, paired_ratio
from comp_perf.s09_faster_step import _load, _relative, slow_setup

# What a first draft gets wrong, each in its own place of the step; a seed draws PER_SEED of them.
MISTAKES = ('float64', 'per_sample_data', 'anomaly', 'extra_forward', 'item_per_sample')
PER_SEED = 3
SAME_STEP_TOL = 1e-4   # a float64 draft against a float32 fix: rounding of about 1e-7, grown over three steps


def seed_number(seed):
    """The seed as a number: an int as it is, a str (a student's name or id) by its CRC-32."""
    if isinstance(seed, bool) or not isinstance(seed, (int, str)):
        raise TypeError(f'the seed must be an int or a str (a student id), not {type(seed).__name__}')
    return seed if isinstance(seed, int) else zlib.crc32(seed.encode('utf-8'))


def mistakes_of(seed):
    """The seed's mistakes, in MISTAKES' order."""
    drawn = set(random.Random(seed_number(seed)).sample(MISTAKES, PER_SEED))
    return tuple(name for name in MISTAKES if name in drawn)


def draft_source(mistakes):
    """The text of a module whose mystery_step(model, optimizer, batch) makes exactly `mistakes`."""
    unknown = set(mistakes) - set(MISTAKES)
    if unknown:
        raise ValueError(f'no such mistake: {sorted(unknown)}; there are {MISTAKES}')
    has = set(mistakes)
    lines = ['import numpy as np' if 'float64' in has else None,
             'import torch', 'from torch.nn import functional as F', '',
             'from comp_perf.s09_faster_step import slow_setup as fresh_state   # a model, optimiser and batch',
             '', 'FEATURES = 784',
             'MEAN = np.full(FEATURES, 0.5)' if 'float64' in has else 'MEAN = torch.full((FEATURES,), 0.5)',
             'LOG = []   # (loss, accuracy) of every step', '', '',
             'def mystery_step(model, optimizer, batch):',
             '    """One training step on batch = (images with pixels 0 to 255, labels); returns the loss."""',
             '    x, y = batch',
             '    mean = torch.from_numpy(MEAN)' if 'float64' in has else '    mean = MEAN',
             '    x = torch.stack([row / 255 - mean for row in x])' if 'per_sample_data' in has
             else '    x = x / 255 - mean']
    if 'float64' in has:
        lines += ['    if x.dtype != next(model.parameters()).dtype:', '        model.to(x.dtype)']
    lines.append('    optimizer.zero_grad()')
    body = ['logits = model(x)', 'loss = F.cross_entropy(logits, y)', 'loss.backward()']
    if 'anomaly' in has:
        lines += ['    with torch.autograd.detect_anomaly():'] + [f'        {line}' for line in body]
    else:
        lines += [f'    {line}' for line in body]
    lines.append('    optimizer.step()')
    scores = 'logits'
    if 'extra_forward' in has:   # the accuracy of the weights just updated, from a forward pass of its own
        lines.append('    scores = model(x)')
        scores = 'scores'
    lines.append(f'    accuracy = sum(({scores}[i].argmax() == y[i]).item() for i in range(len(y))) / len(y)'
                 if 'item_per_sample' in has else f'    accuracy = ({scores}.argmax(1) == y).float().mean().item()')
    lines += ['    LOG.append((loss.item(), accuracy))', '    return loss.item()', '']
    return '\n'.join(line for line in lines if line is not None)


def _step_of(source, name='draft'):
    """mystery_step from module text, in a module of its own."""
    namespace = {'__name__': f'_mystery_{name}'}
    exec(compile(source, f'<mystery {name}>', 'exec'), namespace)
    return namespace['mystery_step']


def write_mystery_step(seed, path='my_mystery_step.py'):
    """Write the seed's first draft to `path`, to profile and fix there; never over a file already there."""
    path = Path(path)
    if path.exists():
        print(tr('{path} is there already (your work, perhaps): delete it to start again from the draft',
                 path=path))
        return path
    path.write_text(draft_source(mistakes_of(seed)), encoding='utf-8')
    print(tr('wrote {path}: the first draft of seed {seed}, with {n} mistakes to find', path=path, seed=seed,
             n=PER_SEED))
    return path


class _Trace(TorchDispatchMode):
    """What a step runs: every operation's name, whether anomaly mode was on, whether float64 came in."""

    def __init__(self):
        super().__init__()
        self.names, self.anomaly, self.float64 = [], False, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        anomaly = torch.is_anomaly_enabled()
        # anomaly mode's own nan checks read values too: counted under a name of their own
        self.names.append(func.overloadpacket.__name__ + (' (anomaly mode)' if anomaly else ''))
        self.anomaly |= anomaly
        self.float64 |= any(isinstance(a, torch.Tensor) and a.dtype == torch.float64
                            for a in torch.utils._pytree.tree_leaves((args, kwargs)))
        return func(*args, **(kwargs or {}))


def mistakes_made(step):
    """The MISTAKES one call of step makes on slow_setup's state, read from what it runs (not its text)."""
    state = slow_setup()
    with warnings.catch_warnings(), _Trace() as trace:
        warnings.simplefilter('ignore')   # anomaly mode warns that it is on
        step(*state)
    products = [i for i, name in enumerate(trace.names) if name.split(' ')[0] == 'addmm']
    found = {'float64': trace.float64, 'anomaly': trace.anomaly,
             'per_sample_data': (products or [len(trace.names)])[0] > 20,   # whole-batch data work: a handful
             'extra_forward': len(products) > 3,                           # three linear layers, once
             'item_per_sample': trace.names.count('_local_scalar_dense') > 4}
    return {name for name, made in found.items() if made}


def _same_step(step, steps=3):
    """Largest relative difference of losses and parameters from the draft without mistakes, after `steps`."""
    clean, state = _step_of(draft_source(()), 'clean'), slow_setup()
    mine = slow_setup()
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        pairs = [(clean(*state), float(step(*mine))) for _ in range(steps)]
    losses = max(abs(a - b) / abs(a) for a, b in pairs)
    params = max(_relative(b, a) for a, b in zip(state[0].parameters(), mine[0].parameters()))
    return max(losses, params)


def _speed(step, draft, rounds):
    """(median, low, high) of draft time / step time, timed in turns, each on a state of its own."""
    states = {'draft': slow_setup(), 'fixed': slow_setup()}
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        times = interleaved({'draft': lambda: draft(*states['draft']), 'fixed': lambda: step(*states['fixed'])},
                            rounds=rounds, warmup=1)
    return paired_ratio(times['draft'], times['fixed']), statistics.median(times['draft'])


def check_mystery_step(source='my_mystery_step.py', seed=0, rounds=7):
    """Grade a fixed mystery step: how many of the seed's mistakes it no longer makes, whether it computes the
    draft's step (losses and parameters within SAME_STEP_TOL after three steps), and its speed-up over the draft.

    Prints the three; never names a mistake left (the profiler is for that). True when every mistake of
    the seed is gone and the step is the same. A file that cannot be loaded or raises gets one line.
    """
    planted = mistakes_of(seed)
    try:
        step = getattr(_load(source), 'mystery_step')
    except FileNotFoundError:
        print(tr('fail: there is no file {path} (write it with common.write_mystery_step first)', path=source))
        return False
    except Exception as error:
        print(tr('fail: {source} could not be loaded:', source=source), f'{type(error).__name__}: {error}')
        return False
    try:
        left = mistakes_made(step) & set(planted)
        difference = _same_step(step)
        (median, low, high), _ = _speed(step, _step_of(draft_source(planted)), rounds)
    except Exception as error:
        print(tr('fail: your mystery_step raised an error:'), f'{type(error).__name__}: {error}')
        return False
    fixed = len(planted) - len(left)
    same = difference <= SAME_STEP_TOL
    print(tr('seed {seed}: the draft makes {n} mistakes; your step no longer makes {k} of them', seed=seed,
             n=len(planted), k=fixed))
    print(tr('{verdict} same step: losses and parameters after 3 steps within {d:.1e} of the draft\'s '
             '(allowed {tol:.0e})', verdict=tr('pass') if same else tr('FAIL'), d=difference, tol=SAME_STEP_TOL))
    print(tr('speed-up over the draft: {m:.2f}× (quartiles {lo:.2f}–{hi:.2f})', m=median, lo=low, hi=high)
          + (tr(', within the noise of this run') if low <= 1 <= high else ''))
    ok = same and not left
    print(tr('mystery step: all fixed') if ok else
          tr('mystery step: {k} of {n} fixed; the profiler shows where the rest is', k=fixed, n=len(planted)))
    return ok
