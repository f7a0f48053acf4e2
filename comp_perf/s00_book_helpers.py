"""The book's helpers (the d2l package) beside the course's helpers of the same name (00).

Students who read *Dive into Deep Learning* next to the course know `d2l.try_all_gpus`,
`d2l.Benchmark`, `d2l.load_data_fashion_mnist` … The set-up installs d2l 1.0.3 without its
2023 pins (`pip install --no-deps`), so `from d2l import torch as d2l` works. Where the
course has its own helper of the same name, its docstring says in one line, starting with
'd2l:', how it differs; DIFFERENCES holds those lines (a test keeps both equal), and each
claim about d2l's version is checked against d2l's own source or behaviour by CHECKS.
"""
import contextlib
import inspect
import io

import torch

from comp_perf.language import tr
from comp_perf.machine import try_gpu
from comp_perf.measure import Benchmark, synchronize

D2L_VERSION = '1.0.3'   # the release the course installs (requirements-d2l.txt)

# name: how the course's helper differs from d2l's (the 'd2l:' line of its docstring)
DIFFERENCES = {
    'try_all_gpus': "returns [cpu] on a machine without a GPU, where d2l's returns an empty list",
    'try_gpu': "the same choice as d2l's; a negative index gets a clear message (d2l's fails inside torch.device)",
    'gpu': "raises a clear error for a GPU this machine does not have; d2l's returns the device unchecked",
    'num_gpus': "the same count as d2l's, read through torch.cuda.is_available() first",
    'Timer': "time.perf_counter (monotonic, fine-grained) instead of d2l's time.time (wall clock)",
    'Benchmark': "synchronises the device at both ends; d2l's stops the clock while GPU work may still be queued",
    'load_data_fashion_mnist': "finds an installed copy first and never starts worker processes; "
                               "d2l's downloads into ../data and reads with 4 workers",
    'sgd': "the same update as d2l's; kept so that worker processes need not import d2l (pandas, scipy)",
    'accuracy': "the same count as d2l's; kept so that worker processes need not import d2l (pandas, scipy)",
    'Animator': "redraws one figure in place and never changes matplotlib's output format; "
                "d2l's switches every figure to SVG (use_svg_display)",
    'Residual': "takes its input channels explicitly (no lazy layers), so that DDP can wrap the model at once; "
                "its convolutions have no bias (a batch norm follows each) and its 1×1 shortcut is "
                "batch-normalised, where d2l's convolutions have biases and its shortcut is a bare 1×1 convolution",
    'resnet18': "has a width parameter (the CPU settings use a narrow one), where d2l's widths are fixed "
                "(64 to 512); its stem convolution has no bias",
}


def d2l_torch():
    """The book's module `d2l.torch`, or a clear error when the set-up has not installed it."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            from d2l import torch as d2l
    except ImportError as error:
        raise ImportError(tr("d2l is not installed ({error}). './course setup' installs it; by hand: "
                             "pip install --no-deps d2l=={version} pandas scipy requests",
                             error=error, version=D2L_VERSION)) from None
    return d2l


def _source(d2l, name):
    return inspect.getsource(getattr(d2l, name))


# name: a check, on d2l's own source or behaviour, that the difference above is still true
CHECKS = {
    'try_all_gpus': lambda d2l: d2l.try_all_gpus() == [] if torch.cuda.device_count() == 0
    else len(d2l.try_all_gpus()) == torch.cuda.device_count(),
    'try_gpu': lambda d2l: d2l.try_gpu() == try_gpu(),
    'gpu': lambda d2l: 'device_count' not in _source(d2l, 'gpu') and 'raise' not in _source(d2l, 'gpu'),
    'num_gpus': lambda d2l: d2l.num_gpus() == torch.cuda.device_count(),
    'Timer': lambda d2l: 'time.time()' in _source(d2l, 'Timer'),
    'Benchmark': lambda d2l: 'synchronize' not in _source(d2l, 'Benchmark'),
    'load_data_fashion_mnist': lambda d2l: 'download=True' in _source(d2l, 'load_data_fashion_mnist')
    and d2l.get_dataloader_workers() == 4,
    'sgd': lambda d2l: 'lr * param.grad / batch_size' in _source(d2l, 'sgd'),
    'accuracy': lambda d2l: 'argmax' in _source(d2l, 'accuracy'),
    'Animator': lambda d2l: 'use_svg_display' in _source(d2l, 'Animator'),
    'Residual': lambda d2l: 'LazyConv2d' in _source(d2l, 'Residual'),
    'resnet18': lambda d2l: 'width' not in inspect.signature(d2l.resnet18).parameters,
}


def compare_with_d2l(d2l=None):
    """Print each helper the course shares with d2l, how the course's differs, and whether
    d2l's source (or a call) confirms it; return {name: confirmed}."""
    d2l = d2l or d2l_torch()
    confirmed = {}
    for name, text in DIFFERENCES.items():
        try:
            confirmed[name] = bool(CHECKS[name](d2l))
        except (AttributeError, OSError, TypeError):
            confirmed[name] = False
        mark = tr('checked in d2l') if confirmed[name] else tr("d2l's version differs: read its source")
        print(f'{name:<24} {tr(text)}  [{mark}]')
    return confirmed


def products_size(device):
    """Side of the square matrices benchmark_side_by_side multiplies on `device`."""
    return 4096 if torch.device(device).type == 'cuda' else 1024


def benchmark_side_by_side(device=None, size=None, repeats=8):
    """Time the same matrix products with d2l.Benchmark and common.Benchmark; return (d2l's, ours) seconds.

    The products are large enough on a GPU (4096²) that queueing them takes far less time
    than running them, and small enough on a CPU (1024²) to take a fraction of a second.
    d2l's prints its own English line, so its output is captured and the time read from its timer.
    """
    d2l = d2l_torch()
    device = torch.device(device) if device is not None else try_gpu()
    size = size or products_size(device)
    a = torch.randn(size, size, device=device)
    (a @ a).sum().item()                      # warm-up: kernels loaded, memory allocated
    synchronize(device)
    with contextlib.redirect_stdout(io.StringIO()):
        with d2l.Benchmark() as theirs:
            for _ in range(repeats):
                b = a @ a
    synchronize(device)                       # let the queued products finish before ours starts
    with Benchmark(device=device, verbose=False) as ours:
        for _ in range(repeats):
            b = a @ a
    del b
    return theirs.timer.times[-1], ours.elapsed
