"""Timing and verdicts (every section): synchronize, Timer, Benchmark, measure, verdict.

Every time the course prints is a median over repeats after a warm-up, with the
device synchronised; verdict() prints which case a measurement falls in, in the
reader's language, so that the prose never copies a number from one run.
"""
import contextlib
import math
import os
import sys
import time
import warnings

import numpy as np
import torch

from comp_perf.language import tr


def synchronize(device=None):
    """Wait for the kernels queued on the GPU(s) this process computes on (a no-op on the CPU).

    device=None waits for the current CUDA device (cuda:0 unless the process
    changed it), and only once this process has initialised CUDA: before that it
    cannot have queued any work, and waiting on a GPU creates a CUDA context
    there, some hundreds of MB of that GPU's memory. A device ('cuda:1', a
    torch.device, an index) or a list of them waits for exactly those; pass every
    GPU in play when work runs on several (03's two-device branch, 05's
    replicas). CPU devices in the list are skipped.
    """
    if not torch.cuda.is_initialized():
        return
    if device is None:
        torch.cuda.synchronize()
        return
    for each in device if isinstance(device, (list, tuple)) else [device]:
        each = torch.device('cuda', each) if isinstance(each, int) else torch.device(each)
        if each.type == 'cuda':
            torch.cuda.synchronize(each)


class Timer:
    """Record several running times (d2l's Timer).

    d2l: time.perf_counter (monotonic, fine-grained) instead of d2l's time.time (wall clock).
    """

    def __init__(self):
        self.times = []
        self.start()

    def start(self):
        """Start the clock."""
        self.tik = time.perf_counter()

    def stop(self):
        """Stop the clock, record and return the time since start()."""
        self.times.append(time.perf_counter() - self.tik)
        return self.times[-1]

    def avg(self):
        """Average of the recorded times."""
        return sum(self.times) / len(self.times)

    def sum(self):
        """Sum of the recorded times."""
        return sum(self.times)


class Benchmark:
    """Context manager that times its block, synchronising the device at both ends.

    sync=False stops the clock without waiting for queued GPU work: it then
    measures how long it took to *submit* the work (notebook 02 shows why).
    The description is printed as given: pass it through tr().
    d2l: synchronises the device at both ends; d2l's stops the clock while GPU work may still be queued.
    """

    def __init__(self, description='Done', device=None, verbose=True, sync=True):
        self.description, self.device, self.verbose = description, device, verbose
        self.sync, self.elapsed = sync, None

    def __enter__(self):
        synchronize(self.device)
        self.timer = Timer()
        return self

    def __exit__(self, *exc):
        if self.sync:
            synchronize(self.device)
        self.elapsed = self.timer.stop()
        if self.verbose and exc[0] is None:
            print(tr('{what}: {seconds:.4f} sec', what=self.description, seconds=self.elapsed))


def measure(fn, *args, repeats=None, sync=True, device=None, min_run_time=0.2):
    """Median seconds per call of fn(*args), after a warm-up call, device synchronised.

    Without `repeats`, torch.utils.benchmark's blocked_autorange runs fn in
    blocks until `min_run_time` seconds have passed, synchronising the current
    GPU around each block (once this process uses one: timing CPU work creates
    no CUDA context), and returns the median time per call. We give it all of
    PyTorch's threads: its own default is ONE thread, which would quietly time
    a different program than the one you run.

    With `repeats`, each of `repeats` calls is timed on its own (everything
    synchronised before each call) and the median returned. sync=False then
    stops the clock as soon as fn returns, without waiting for the device:
    notebook 02 uses that to see asynchrony. `device` is what synchronize()
    waits for: by default the current GPU; a list of devices when fn computes
    on several (with `repeats` only, since blocked_autorange waits for the
    current GPU alone).
    """
    if repeats is None:
        if not sync:
            raise ValueError('sync=False needs repeats=...: blocked_autorange always synchronises.')
        if isinstance(device, (list, tuple)):
            raise ValueError('several devices need repeats=...: blocked_autorange waits for the current GPU only.')
        from torch.utils import (
            benchmark,  # imported late: it loads cpp_extension, which logs
        )
        fn(*args)  # warm-up: first-call costs (allocation, compilation) stay out
        synchronize(device)

        def clock():
            # benchmark's own clock synchronises any accelerator torch can see, which creates a CUDA
            # context (hundreds of MB of GPU memory) even to time CPU work; ours waits only for a GPU
            # this process has used, as synchronize() does
            synchronize(device)
            return time.perf_counter()

        timer = benchmark.Timer(stmt='fn(*args)', globals={'fn': fn, 'args': args}, timer=clock,
                                num_threads=torch.get_num_threads())
        return timer.blocked_autorange(min_run_time=min_run_time).median
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f'repeats must be a whole number >= 1, got {repeats!r}.')
    fn(*args)
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn(*args)
        if sync:
            synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


class Case(str):
    """The key of the case verdict() chose: an ordinary string that a notebook does not echo.

    A cell that ends with common.verdict(...) shows only the printed verdict line.
    """

    def _ipython_display_(self):
        pass


def verdict(what, value, cases, unit='×', digits=2, shown=None):
    """Print the conclusion a measurement supports, in the notebook's language; return its case.

    `what` names the measured quantity and each case's text says what it
    means, in English; a Chinese notebook prints their entries in the catalog
    (tr; a test checks that every text the notebooks pass has one). `cases` is a list of
    (upper_bound, key, text) with increasing bounds: the first case whose
    bound exceeds `value` applies (use math.inf for the last). `shown`
    replaces the printed number, e.g. to show both sides of a comparison.

        verdict('compile/eager at batch 1', 0.64,
                [(0.9, 'slower', 'compile is slower: overhead-bound'),
                 (1.1, 'same', 'no difference'),
                 (math.inf, 'faster', 'compile is faster')])
        # Verdict: compile/eager at batch 1: 0.64× → compile is slower: overhead-bound

    The prose then explains the cases and points at the verdict, so it never
    has to copy a number from one particular run.
    """
    if not cases:
        raise ValueError('verdict() needs at least one case.')
    bounds = [bound for bound, _, _ in cases]
    if bounds != sorted(bounds):
        raise ValueError(f'the cases\' upper bounds must increase, got {bounds}.')
    if not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f'verdict() needs a measured number, got {value!r}.')
    for bound, key, case_text in cases:
        if value < bound:
            break
    else:
        raise ValueError(f'{value!r} is not below any case bound {bounds}: add a last case '
                         'with math.inf.')
    # round(...) or 0.0: a value that rounds to zero prints as 0.00, never as -0.00
    number = shown if shown is not None else f'{round(value, digits) or 0.0:.{digits}f}{unit}'
    print(tr('Verdict: {what}: {number} → {case}', what=tr(what), number=number, case=tr(case_text)))
    return Case(key)


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what C++ libraries (the profiler's kineto, say) print straight to fd 2.

    Also the profiler's Python note that it clears events at the end of each
    cycle: torch 2.11 prints it whenever a profiler starts, 2.14 on GPUs only.
    Enter this before the profiler, so that the note of its start is caught too.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings('ignore', message='.*Profiler clears events')
        with _native_stderr_closed():
            yield


@contextlib.contextmanager
def _native_stderr_closed():
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def covered_seconds(spans, lo=-float('inf'), hi=float('inf')):
    """Seconds covered by the union of (start, end) spans, counting only the part in [lo, hi]."""
    total, reach = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total, reach = total + end - start, end
    return total


def interleaved(variants, rounds=7, warmup=1, device=None):
    """Time several variants in turns (A, B, C, A, B, C, ...) and return {name: [seconds per call]}.

    `variants` maps a name to a function of no arguments. Each round calls every
    variant once, so that a machine that gets busier or quieter during the run
    slows or speeds all of them alike; the `warmup` rounds are dropped. The
    device is synchronised before and after each call (a no-op on the CPU).
    """
    if not variants:
        raise ValueError('interleaved() needs at least one variant.')
    for name, value in (('rounds', rounds), ('warmup', warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == 'rounds' else 0):
            raise ValueError(f'{name} must be a whole number (rounds >= 1, warmup >= 0), got {value!r}.')
    times = {name: [] for name in variants}
    for i in range(warmup + rounds):
        for name, fn in variants.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def paired_ratio(slow, fast):
    """(median, low, high) of the per-round ratios slow[i] / fast[i] of two interleaved timings.

    low and high are the lower and upper quartiles: the spread of the ratio in
    this run. A ratio is compared round by round, so a slow patch of the machine
    that hit both variants of a round cancels out.
    """
    if len(slow) != len(fast) or not slow:
        raise ValueError(f'need two equally long, non-empty timings, got {len(slow)} and {len(fast)}.')
    ratios = np.array(slow) / np.array(fast)
    low, median, high = np.percentile(ratios, [25, 50, 75])
    return float(median), float(low), float(high)


def noise_verdict(what, slow, fast, cases):
    """verdict() for the speed-up slow/fast of two interleaved timings, or 'within the noise of this run'.

    When the quartiles of the per-round ratio straddle 1, this run cannot tell
    the two apart, and the verdict says so instead of naming a winner; else the
    median ratio picks one of `cases` as verdict() does. The printed number
    shows the median and its spread.
    """
    median, low, high = paired_ratio(slow, fast)
    shown = tr('{m:.2f}× (quartiles {lo:.2f}–{hi:.2f})', m=median, lo=low, hi=high)
    if low <= 1 <= high:
        return verdict(what, median, [(math.inf, 'noise', 'within the noise of this run: it cannot tell the two '
                                                        'apart')], shown=shown)
    return verdict(what, median, cases, shown=shown)
