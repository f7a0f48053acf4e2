"""Shared helpers for the course 计算性能 · Computational Performance.

Grouped in the order the notebooks meet them: language, devices and tiers,
settings by hardware, timing, data, training, and worker processes.
Every notebook does ``import common``; the set-up installs this file into the
course's environment, so that works in JupyterLab, under nbval, and in
processes started by ``torch.multiprocessing`` or ``torchrun``.
"""
import ast
import gzip
import os
import platform
import shutil
import socket
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
if not torch.cuda.is_available():
    # A CUDA build of PyTorch on a machine without CUDA logs a timestamped
    # "No CUDA runtime is found" at its first compilation; it is irrelevant here.
    import logging
    logging.getLogger('torch.utils.cpp_extension').setLevel(logging.ERROR)

# ---------------------------------------------------------------- language


def course_language():
    """'zh' when run from a notebooks/zh folder (or COURSE_LANG=zh), else 'en'."""
    lang = os.environ.get('COURSE_LANG')
    if lang in ('en', 'zh'):
        return lang
    return 'zh' if 'zh' in Path.cwd().parts[-2:] else 'en'


def say(en, zh):
    """Pick the English or the Chinese text by course_language()."""
    return zh if course_language() == 'zh' else en


# ---------------------------------------------------------- devices, tiers


def num_gpus():
    """Number of CUDA GPUs this process can see."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_index(i):
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ValueError(f'GPU index must be a whole number >= 0, got {i!r}.')


def try_gpu(i=0):
    """Return cuda:i if it exists, otherwise the CPU."""
    _check_index(i)
    return torch.device(f'cuda:{i}') if i < num_gpus() else torch.device('cpu')


def gpu(i=0):
    """Return cuda:i, or raise a clear error when this machine has no such GPU."""
    _check_index(i)
    n = num_gpus()
    if i >= n:
        have = 'no GPU' if n == 0 else f'{n} GPU(s): cuda:0..cuda:{n - 1}'
        raise RuntimeError(
            f'cuda:{i} was requested, but this machine has {have}. '
            f'Use common.try_gpu({i}) to fall back to the CPU, or check '
            'CUDA_VISIBLE_DEVICES and nvidia-smi.')
    return torch.device(f'cuda:{i}')


def try_all_gpus():
    """All GPUs as a list; [cpu] when there is none (never empty)."""
    return [torch.device(f'cuda:{i}') for i in range(num_gpus())] or [torch.device('cpu')]


TIER_TEXT = {
    'T0': ('CPU only', '仅 CPU'),
    'T1': ('one GPU', '单 GPU'),
    'T2': ('two or more GPUs', '两块及以上 GPU'),
    'T3': ('several machines (torchrun multi-node)', '多台机器（torchrun 多节点）'),
}


def detect_tier():
    """The hardware tier of this machine: 'T0', 'T1', 'T2' or 'T3' (see COURSE.md)."""
    world = int(os.environ.get('WORLD_SIZE', '1'))
    local = int(os.environ.get('LOCAL_WORLD_SIZE', world))
    if world > local:
        return 'T3'
    n = num_gpus()
    return 'T0' if n == 0 else 'T1' if n == 1 else 'T2'


def hardware_summary():
    """A dict describing this machine: Python, PyTorch, CPU, GPUs, tier."""
    gpus = [torch.cuda.get_device_name(i) for i in range(num_gpus())]
    mps = getattr(torch.backends, 'mps', None)
    return {
        'python': platform.python_version(),
        'torch': torch.__version__,
        'os': f'{platform.system()} {platform.machine()}',
        'cpu_cores': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'gpus': gpus,
        'mps': bool(mps and mps.is_available()),
        'tier': detect_tier(),
    }


def environment_report(data_root=None):
    """Print what this machine is and what the course can do for real on it."""
    info = hardware_summary()
    tier = info['tier']
    try:
        data = str(find_fashion_mnist(data_root, download=False))
    except FileNotFoundError:
        data = None
    gpus = ', '.join(info['gpus']) or say('none', '无')
    compiler = next(filter(None, map(shutil.which, ('c++', 'g++', 'clang++', 'cl'))), None)
    rows = [
        ('Python', info['python']),
        ('PyTorch', info['torch']),
        (say('system', '系统'), info['os']),
        (say('CPU cores', 'CPU 核数'), f"{info['cpu_cores']} ({say('PyTorch threads', 'PyTorch 线程')}: "
                                        f"{info['torch_threads']})"),
        ('GPU', gpus),
        ('Fashion-MNIST', data or say('NOT FOUND (sections 05-06 need it; see README)',
                                      '未找到（第 05–06 节需要，见 README）')),
        (say('C++ compiler', 'C++ 编译器'), compiler or say(
            'NOT FOUND: torch.compile cannot build CPU kernels (see README)',
            '未找到：torch.compile 无法生成 CPU 内核（见 README）')),
        (say('tier', '档位'), f"{tier}: {TIER_TEXT[tier][course_language() == 'zh']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f'{k:<{width}}  {v}')
    real = {
        'T0': say('Real here: compilation, CPU timing, threads, several CPU processes over '
                  'torch.distributed (gloo).\nSimulated or quoted: GPU asynchrony, streams, '
                  'multi-GPU speed-ups (reference figures are labelled with their hardware).',
                  '本机真实可测：编译、CPU 计时、多线程、基于 torch.distributed（gloo）的多个 CPU 进程。\n'
                  '模拟或引用：GPU 异步、CUDA 流、多 GPU 加速（引用的参考数据都注明了硬件）。'),
        'T1': say('Real here: everything on one GPU (asynchrony, streams, copies).\n'
                  'Simulated or quoted: two-GPU parallelism (two CUDA streams or CPU processes '
                  'stand in).',
                  '本机真实可测：单 GPU 上的一切（异步、CUDA 流、数据拷贝）。\n'
                  '模拟或引用：双 GPU 并行（由两个 CUDA 流或多个 CPU 进程代替）。'),
        'T2': say('Real here: multi-GPU training with NCCL. Quoted: multi-machine runs.',
                  '本机真实可测：基于 NCCL 的多 GPU 训练。引用：多机运行。'),
        'T3': say('Real here: multi-machine training with torchrun.',
                  '本机真实可测：用 torchrun 进行多机训练。'),
    }
    print(real[tier])
    return info


# ------------------------------------------------------ settings by hardware

SETTINGS_ENV = 'COURSE_SETTINGS'


def _parse_override(text):
    tier, values = None, {}
    for part in filter(None, (p.strip() for p in text.split(','))):
        if '=' not in part:
            if part.upper() not in TIER_TEXT:
                raise ValueError(
                    f'{SETTINGS_ENV}={text!r}: {part!r} is neither a tier '
                    f'({", ".join(TIER_TEXT)}) nor key=value.')
            tier = part.upper()
            continue
        key, value = (s.strip() for s in part.split('=', 1))
        try:
            values[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            values[key] = value
    return tier, values


def settings(**per_tier):
    """Pick this notebook's settings by hardware tier, apply COURSE_SETTINGS, print them.

    Call as settings(T0=dict(...), T1=dict(...), ...); T0 is required and a
    missing tier falls back to the next lower one. COURSE_SETTINGS may name a
    tier and/or override values, e.g. COURSE_SETTINGS="T0,epochs=3".
    """
    if 'T0' not in per_tier or set(per_tier) - set(TIER_TEXT):
        raise ValueError('settings() needs T0=dict(...) and accepts only T0..T3.')
    tier, overrides = _parse_override(os.environ.get(SETTINGS_ENV, ''))
    tier = tier or detect_tier()
    order = list(TIER_TEXT)
    chosen = next(t for t in reversed(order[:order.index(tier) + 1]) if t in per_tier)
    values = dict(per_tier[chosen])
    unknown = set(overrides) - set(values)
    if unknown:
        raise ValueError(f'{SETTINGS_ENV}: unknown setting(s) {sorted(unknown)}; '
                         f'this notebook has {sorted(values)}.')
    values.update(overrides)
    shown = ', '.join(f'{k}={v!r}' for k, v in values.items())
    print(f'tier {tier} ({TIER_TEXT[tier][0]}), settings of {chosen}: {shown}'
          f'  [override: {SETTINGS_ENV}]')
    return SimpleNamespace(tier=tier, **values)


# ------------------------------------------------------------------ timing


def synchronize(device=None):
    """Wait for queued kernels on a CUDA device, or on every GPU when device is None (no-op on the CPU)."""
    if device is None:
        for i in range(num_gpus()):
            torch.cuda.synchronize(i)
    elif torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


class Timer:
    """Record several running times."""

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

    def cumsum(self):
        """Running total of the recorded times."""
        return np.cumsum(self.times).tolist()


class Benchmark:
    """Context manager that times its block, synchronising the device at both ends.

    sync=False stops the clock without waiting for queued GPU work: it then
    measures how long it took to *submit* the work (notebook 02 shows why).
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
            print(f'{self.description}: {self.elapsed:.4f} sec')


def median_time(fn, repeats=3, sync=True, device=None):
    """Median seconds of fn() over `repeats` calls after one warm-up call.

    With sync=True the clock stops once the device (every GPU if device is None)
    has finished; with sync=False it stops as soon as fn returns.
    """
    fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn()
        if sync:
            synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure(fn, *args, min_run_time=0.2):
    """Median seconds per call of fn(*args), after a warm-up, device synchronised.

    Uses torch.utils.benchmark, which synchronises CUDA around each block of
    calls; we give it all of PyTorch's threads (its default is one).
    """
    from torch.utils import benchmark
    fn(*args)  # warm-up: first-call costs (allocation, compilation) stay out
    timer = benchmark.Timer(stmt='fn(*args)', globals={'fn': fn, 'args': args},
                            num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


class quiet_native_stderr:
    """Context manager: silence what C++ libraries (e.g. the profiler's kineto) print to fd 2."""

    def __enter__(self):
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)
        return self

    def __exit__(self, *exc):
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)


def plot_timeline(spans, lanes=None, ax=None, title=None, unit='ms'):
    """Draw (lane, start, end, label) spans as a timeline, one row per lane; return ax.

    Times are in seconds and drawn in `unit` ('s', 'ms' or 'us').
    """
    import matplotlib.pyplot as plt
    scale = {'s': 1, 'ms': 1e3, 'us': 1e6}[unit]
    lanes = list(lanes or dict.fromkeys(lane for lane, *_ in spans))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.45 * len(lanes)))
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for lane, start, end, label in spans:
        row = lanes.index(lane)
        width = (end - start) * scale
        ax.broken_barh([(start * scale, width)], (row - 0.38, 0.76),
                       facecolors=colors[row % len(colors)], edgecolor='white', linewidth=0.5)
        if label:
            ax.text(start * scale + width / 2, row, label, ha='center', va='center',
                    fontsize=7, clip_on=True)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.invert_yaxis()
    ax.set_xlabel(f'time ({unit})')
    ax.grid(True, axis='x', alpha=0.3)
    if title:
        ax.set_title(title)
    return ax


# -------------------------------------------------------------------- data

DATA_DIR = ROOT / 'data'
DEBIAN_DIR = Path('/usr/share/datasets/fashion-mnist')
FASHION_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
FASHION_LABELS = ['t-shirt', 'trouser', 'pullover', 'dress', 'coat',
                  'sandal', 'shirt', 'sneaker', 'bag', 'ankle boot']


def _fashion_dirs(root):
    root = Path(root) if root is not None else DATA_DIR
    return [root / 'fashion-mnist', root / 'FashionMNIST' / 'raw', DEBIAN_DIR]


def _find_file(folder, name):
    for candidate in (folder / name, folder / f'{name}.gz'):
        if candidate.is_file():
            return candidate
    return None


def _complete(folder):
    names = [n for pair in FASHION_FILES.values() for n in pair]
    return all(_find_file(folder, n) for n in names)


def _read_idx(path):
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rb') as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big') for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _missing_data_message(root, reason):
    root = Path(root) if root is not None else DATA_DIR
    return (
        'Fashion-MNIST was not found on this machine'
        + (f' and could not be downloaded ({reason})' if reason else '') + '.\n'
        'Get it in one of three ways:\n'
        '  1. Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist\n'
        f'     (installs the four files into {DEBIAN_DIR})\n'
        '  2. Copy train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,\n'
        '     t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz into\n'
        f'     {root / "fashion-mnist"}\n'
        '  3. With internet access: load_data_fashion_mnist(..., download=True)\n'
        f'     lets torchvision download them into {root / "FashionMNIST" / "raw"}')


def find_fashion_mnist(root=None, download=True, timeout=15):
    """Folder that holds Fashion-MNIST: data/, then Debian's package, then a download.

    With none of them available it raises FileNotFoundError within about
    `timeout` seconds, naming the three ways to get the data.
    """
    for folder in _fashion_dirs(root):
        if _complete(folder):
            return folder
    reason = 'download=False'
    if download:
        import torchvision
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            torchvision.datasets.FashionMNIST(root=str(root or DATA_DIR), train=True, download=True)
            torchvision.datasets.FashionMNIST(root=str(root or DATA_DIR), train=False, download=True)
            reason = None
        except Exception as e:  # no network, proxy, mirror down, ...
            reason = f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'
        finally:
            socket.setdefaulttimeout(old)
        folder = _fashion_dirs(root)[1]
        if reason is None and _complete(folder):
            return folder
    raise FileNotFoundError(_missing_data_message(root, reason))


_ARRAYS = {}


def fashion_mnist_arrays(split='train', root=None, download=True):
    """(images uint8 N×28×28, labels int64 N) of one split, read once per process."""
    folder = find_fashion_mnist(root, download)
    key = (str(folder), split)
    if key not in _ARRAYS:
        img_name, lbl_name = FASHION_FILES[split]
        images = _read_idx(_find_file(folder, img_name))
        labels = _read_idx(_find_file(folder, lbl_name)).astype(np.int64)
        if len(images) != len(labels):
            raise ValueError(f'{folder}: {len(images)} images but {len(labels)} labels.')
        _ARRAYS[key] = images, labels
    return _ARRAYS[key]


def fashion_mnist_datasets(subset=None, root=None, download=True, seed=0):
    """(train, test) TensorDatasets of float images in [0, 1], shape N×1×28×28.

    `subset` keeps that many training examples, drawn at random with `seed`.
    """
    out = []
    for split in ('train', 'test'):
        images, labels = fashion_mnist_arrays(split, root, download)
        X = torch.from_numpy(images.copy()).unsqueeze(1).float().div_(255)
        y = torch.from_numpy(labels.copy())
        if split == 'train' and subset is not None:
            if not 0 < subset <= len(y):
                raise ValueError(f'subset must be between 1 and {len(y)}, got {subset}.')
            keep = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))[:subset]
            X, y = X[keep], y[keep]
        out.append(torch.utils.data.TensorDataset(X, y))
    return tuple(out)


def default_num_workers():
    """Loader processes worth starting here: 0 where processes are costly or cores few."""
    if sys.platform in ('win32', 'darwin') or (os.cpu_count() or 1) <= 2:
        return 0
    return min(4, os.cpu_count() // 2)


def load_data_fashion_mnist(batch_size, resize=None, subset=None, num_workers=None,
                            root=None, download=True):
    """(train_iter, test_iter) DataLoaders for Fashion-MNIST, offline first.

    `resize` scales each batch to resize×resize; `subset` keeps that many
    training examples; `num_workers=None` picks default_num_workers() when
    resizing and 0 otherwise (the data already sits in memory).
    """
    train, test = fashion_mnist_datasets(subset, root, download)
    collate = None
    if resize:
        def collate(batch):
            X, y = torch.utils.data.default_collate(batch)
            return torch.nn.functional.interpolate(X, size=resize, mode='bilinear'), y
    if num_workers is None:
        num_workers = default_num_workers() if resize else 0
    kw = dict(batch_size=batch_size, num_workers=num_workers, collate_fn=collate,
              persistent_workers=num_workers > 0)
    return (torch.utils.data.DataLoader(train, shuffle=True, **kw),
            torch.utils.data.DataLoader(test, shuffle=False, **kw))


# ---------------------------------------------------------------- training


def accuracy(y_hat, y):
    """Number of correct predictions (y_hat holds logits or class indices)."""
    if y_hat.ndim > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(dim=1)
    return float((y_hat.type(y.dtype) == y).sum())


def evaluate_accuracy(net, data_iter, device=None):
    """Fraction of correct predictions of `net` over `data_iter`, computed on `device`."""
    if device is None:
        device = next(iter(net.parameters())).device if isinstance(net, torch.nn.Module) else 'cpu'
    if isinstance(net, torch.nn.Module):
        net.eval()
    correct = total = 0
    with torch.no_grad():
        for X, y in data_iter:
            X, y = X.to(device), y.to(device)
            correct += accuracy(net(X), y)
            total += y.numel()
    return correct / total


def _in_notebook():
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and 'IPKernelApp' in shell.config


class Animator:
    """A live line plot: call add(x, ys) during training; the figure redraws in place.

    In JupyterLab the figure updates in place (display handle); in a script
    or under torchrun nothing is shown and .fig can be saved at the end.
    """

    def __init__(self, xlabel=None, ylabel=None, legend=(), xlim=None, ylim=None,
                 yscale='linear', figsize=(4.5, 3)):
        import matplotlib
        if not _in_notebook():
            matplotlib.use('Agg')
        import matplotlib.pyplot as plt
        self.fig, self.ax = plt.subplots(figsize=figsize)
        plt.close(self.fig)  # we display it ourselves, once, through a handle
        self.legend, self.xlabel, self.ylabel = list(legend), xlabel, ylabel
        self.xlim, self.ylim, self.yscale = xlim, ylim, yscale
        self.X, self.Y, self._handle = None, None, None

    def add(self, x, ys):
        """Append one point per line (ys: a number or a list, None to skip a line)."""
        ys = list(ys) if hasattr(ys, '__len__') else [ys]
        if self.X is None:
            self.X, self.Y = [[] for _ in ys], [[] for _ in ys]
        if len(ys) != len(self.Y):
            raise ValueError(f'Animator got {len(ys)} values, expected {len(self.Y)}.')
        for i, y in enumerate(ys):
            if y is not None:
                self.X[i].append(x)
                self.Y[i].append(y)
        self._draw()

    def _draw(self):
        ax = self.ax
        ax.cla()
        for x, y, fmt in zip(self.X, self.Y, ('-', 'm--', 'g-.', 'r:', 'b-', 'c--')):
            ax.plot(x, y, fmt)
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel(self.ylabel)
        ax.set_yscale(self.yscale)
        if self.xlim:
            ax.set_xlim(self.xlim)
        if self.ylim:
            ax.set_ylim(self.ylim)
        if self.legend:
            ax.legend(self.legend)
        ax.grid(True)
        self.fig.tight_layout()
        if _in_notebook():
            from IPython.display import display
            if self._handle is None:
                self._handle = display(self.fig, display_id=True)
            else:
                self._handle.update(self.fig)


# -------------------------------------------- data parallelism by hand (05-07)

LENET_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def lenet_params(seed=0):
    """LeNet parameters [W1, b1, W2, b2, W3, b3, W4, b4]: He-initialised weights, zero biases."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in LENET_SHAPES:
        fan_in = int(np.prod(shape[1:])) if len(shape) == 4 else shape[0]
        params.append(torch.zeros(shape) if len(shape) == 1
                      else torch.randn(shape, generator=gen) * (2 / fan_in) ** 0.5)
    return params


def lenet(X, params):
    """LeNet on raw tensors: conv(3×3)-ReLU-avgpool, conv(5×5)-ReLU-avgpool, dense-ReLU, dense."""
    F = torch.nn.functional
    h = F.avg_pool2d(F.relu(F.conv2d(X, params[0], params[1])), kernel_size=2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, params[2], params[3])), kernel_size=2)
    h = F.relu(h.reshape(h.shape[0], -1) @ params[4] + params[5])
    return h @ params[6] + params[7]


def get_params(params, device):
    """Copies of `params` on `device` that record gradients (always copies, even on the same device)."""
    return [p.detach().to(device, copy=True).requires_grad_() for p in params]


def allreduce(data):
    """Sum tensors that live on several devices; afterwards every one holds the sum.

    The naive way: add everything into data[0] on its device, then copy it back out.
    """
    for i in range(1, len(data)):
        data[0][:] += data[i].to(data[0].device)
    for i in range(1, len(data)):
        data[i][:] = data[0].to(data[i].device)


def split_batch(X, y, devices):
    """Split a minibatch over devices: shard sizes differ by at most one example."""
    if X.shape[0] != y.shape[0]:
        raise ValueError(f'X has {X.shape[0]} examples but y has {y.shape[0]}: they must match.')
    if X.shape[0] < len(devices):
        raise ValueError(f'cannot split {X.shape[0]} examples over {len(devices)} devices: each '
                         'needs at least one. Use a larger batch or fewer devices.')
    return ([x.to(d) for x, d in zip(torch.tensor_split(X, len(devices)), devices)],
            [t.to(d) for t, d in zip(torch.tensor_split(y, len(devices)), devices)])


def sgd(params, lr, batch_size):
    """One SGD step in place, for gradients summed over `batch_size` examples; zero the gradients."""
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad.zero_()


def train_batch(X, y, device_params, devices, lr):
    """One data-parallel step: split the batch, backprop on each replica, allreduce, update."""
    X_shards, y_shards = split_batch(X, y, devices)
    for X_shard, y_shard, params in zip(X_shards, y_shards, device_params):
        torch.nn.functional.cross_entropy(lenet(X_shard, params), y_shard, reduction='sum').backward()
    with torch.no_grad():
        for i in range(len(device_params[0])):
            allreduce([params[i].grad for params in device_params])
    for params in device_params:
        sgd(params, lr, X.shape[0])  # the whole minibatch's size: gradients are sums over all of it


def replica_devices(k):
    """Devices for k replicas: k distinct GPUs if the machine has them, else k times the best one."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f'the number of replicas must be a whole number >= 1, got {k!r}.')
    return [torch.device(f'cuda:{i}') for i in range(k)] if num_gpus() >= k else [try_gpu()] * k


def dp_worker(rank, world_size, run):
    """Worker for launch(): data-parallel LeNet training, gradients summed with dist.all_reduce.

    `run` is a dict with batch_size (global), lr, steps, and optionally seed and subset.
    Every rank walks the same shuffled global batches and trains on its slice of each.
    Returns throughput and a checksum of the parameters (rank 0 also returns them).
    """
    import torch.distributed as dist
    batch_size, lr, steps = run['batch_size'], run['lr'], run['steps']
    seed, subset = run.get('seed', 0), run.get('subset')
    device = torch.device(f'cuda:{rank}') if dist.get_backend() == 'nccl' else torch.device('cpu')
    X_all, y_all = fashion_mnist_datasets(subset=subset, download=False)[0].tensors
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(seed))
    params = get_params(lenet_params(seed), device)
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        batch = order[(step * batch_size) % len(order):][:batch_size]
        mine = torch.tensor_split(batch, world_size)[rank]
        X, y = X_all[mine].to(device), y_all[mine].to(device)
        torch.nn.functional.cross_entropy(lenet(X, params), y, reduction='sum').backward()
        for p in params:
            dist.all_reduce(p.grad)
        sgd(params, lr, len(batch))
    synchronize(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {'images_per_s': steps * batch_size / elapsed, 'seconds': elapsed,
            'checksum': float(sum(p.detach().double().sum() for p in params)),
            'params': [p.detach().cpu() for p in params] if rank == 0 else None}


# ----------------------------------------------- concise multi-GPU training (06)


class Residual(torch.nn.Module):
    """A ResNet basic block: two 3×3 convolutions with batch norm, plus a (projected) shortcut."""

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
    """ResNet-18 for 28×28 inputs: a 3×3 stem without max-pool, stages of width w, 2w, 4w, 8w."""
    nn = torch.nn
    layers = [nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    channels = width
    for stage in range(4):
        out = width * 2 ** stage
        layers += [Residual(channels, out, stride=1 if stage == 0 else 2), Residual(out, out)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def torchrun(script, *args, nproc_per_node=1, nnodes=1, timeout=300):
    """Run `script` with torchrun as `nnodes` launchers on this host; return each launcher's output.

    One node uses --standalone (torchrun picks a free port). Several nodes meet through c10d
    rendezvous on 127.0.0.1, as separate machines would. A failing script raises RuntimeError
    with the end of its output; past `timeout` seconds everything is killed and TimeoutError
    raised. No launcher or worker outlives the call.
    """
    import subprocess
    import tempfile
    import uuid
    base = [sys.executable, '-m', 'torch.distributed.run', f'--nproc-per-node={nproc_per_node}']
    if nnodes == 1:
        commands = [base + ['--standalone', str(script), *map(str, args)]]
    else:
        rendezvous = [f'--nnodes={nnodes}', '--rdzv-backend=c10d', f'--rdzv-id={uuid.uuid4().hex[:8]}',
                      f'--rdzv-endpoint=127.0.0.1:{free_port()}']
        commands = [base + rendezvous + [str(script), *map(str, args)]] * nnodes
    logs = [tempfile.TemporaryFile(mode='w+') for _ in commands]
    procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                              start_new_session=hasattr(os, 'killpg')) for cmd, log in zip(commands, logs)]
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f'torchrun {script} did not finish within {timeout} s; stopped it.')
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
        for node, (p, out) in enumerate(zip(procs, outputs)):
            if p.returncode:
                raise RuntimeError(f'torchrun {script} (node {node}) exited with code {p.returncode}:\n'
                                   + '\n'.join(out.splitlines()[-60:]))
        return outputs
    finally:
        for p in procs:
            if p.poll() is None:
                _stop_tree(p)
        for log in logs:
            log.close()


def _stop_tree(popen, grace=5):
    # torchrun starts its workers in sessions of their own: stop the whole tree, not a group.
    import psutil
    try:
        root = psutil.Process(popen.pid)
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    popen.wait()


# ----------------------------------------------------- parameter servers (07)

SYNC_STRATEGIES = ('gpu0', 'cpu', 'split', 'ring')


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


def ring_allreduce(tensor):
    """Sum `tensor` over all ranks in place with a ring: reduce-scatter, then all-gather.

    Each of the 2(n-1) steps sends one n-th of the tensor to the right neighbour and
    receives one from the left, so every link carries the same, small amount at once.
    """
    import torch.distributed as dist
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (rank + 1) % n, (rank - 1) % n
    for step in range(2 * (n - 1)):
        send_index = (rank - step) % n
        recv_index = (rank - step - 1) % n
        incoming = torch.empty_like(chunks[recv_index])
        request = dist.isend(chunks[send_index].contiguous(), right)
        dist.recv(incoming, left)
        request.wait()
        if step < n - 1:
            chunks[recv_index] += incoming       # reduce-scatter: accumulate
        else:
            chunks[recv_index].copy_(incoming)   # all-gather: take the finished sum
    return tensor


def ring_check(rank, world_size, numel):
    """Worker for launch(): ring_allreduce against dist.all_reduce on the same random data."""
    import torch.distributed as dist
    data = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    mine, reference = data.clone(), data.clone()
    ring_allreduce(mine)
    dist.all_reduce(reference)
    return float((mine - reference).abs().max())


# ---------------------------------------------------------- worker processes


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its rank and traceback."""


class _RemoteTraceback(Exception):
    def __str__(self):
        return self.args[0]


def _watch_parent(parent_pid):
    # Exit if the launching process disappears (kernel killed): no orphans.
    import threading

    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True).start()


def _worker_main(rank, world_size, port, backend, threads, fn, args, results, parent_pid):
    """Entry point of a worker process started by launch()."""
    import pickle
    import torch.distributed as dist
    _watch_parent(parent_pid)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    joined = False
    try:
        if backend == 'nccl':
            torch.cuda.set_device(rank)
        store = dist.TCPStore('127.0.0.1', port, world_size + 1, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        joined = True
        outcome = (rank, 'ok', fn(rank, world_size, *args))
    except BaseException as e:
        tb = traceback.format_exc()
        try:
            pickle.dumps(e)
            exc = e
        except Exception:
            exc = None
        outcome = (rank, 'error', (exc, tb, time.time()))
    # Report before leaving the group: leaving makes peers fail, and their
    # secondary errors must not arrive ahead of this one. Plain pickle copies
    # tensors by value (torch's queue would share them through this process,
    # which is about to exit).
    try:
        message = pickle.dumps(outcome)
    except Exception:
        message = pickle.dumps((rank, 'error', (None, f'result of rank {rank} cannot be pickled:\n'
                                                   f'{traceback.format_exc()}', time.time())))
    results.put(message)
    if joined:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def launch(fn, world_size, *args, backend=None, timeout=120, threads=None):
    """Run fn(rank, world_size, *args) in `world_size` processes joined by torch.distributed.

    fn must live in an importable module (common.py or a .py file), not in a
    notebook. Returns the list of return values by rank. A worker's exception
    is re-raised here with its traceback; a hang raises TimeoutError after
    `timeout` seconds. No process or port outlives the call.
    """
    import torch.distributed as dist
    import torch.multiprocessing as mp
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f'world_size must be a whole number >= 1, got {world_size!r}.')
    if getattr(fn, '__module__', None) == '__main__':
        raise ValueError(
            f'{fn.__name__} is defined in the notebook (module __main__); worker '
            'processes cannot import it. Put the function in common.py or a .py file.')
    backend = backend or ('nccl' if num_gpus() >= world_size else 'gloo')
    if backend not in dist.Backend.backend_list:
        raise ValueError(f'backend must be one of {dist.Backend.backend_list}, got {backend!r}.')
    if backend == 'nccl' and num_gpus() < world_size:
        raise ValueError(f'backend nccl needs one GPU per process: {world_size} processes, '
                         f'{num_gpus()} GPU(s). Use backend="gloo" or fewer processes.')
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context('spawn')
    results = ctx.Queue()
    # The store lives here, on a port the OS picks, so parallel notebooks never collide.
    store = dist.TCPStore('127.0.0.1', 0, world_size + 1, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(rank, world_size, store.port, backend, threads, fn, args,
                                  results, os.getpid()))
            p.start()
            procs.append(p)
        return _collect(procs, results, timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store


def allreduce_check(rank, world_size):
    """Worker for launch(): all-reduce each rank's number; every rank returns the sum."""
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _raise_first_error(rank, payload, results, grace=1.0):
    # Peers of a failed worker fail too (connection closed): wait a moment for
    # their reports and raise the error that happened first, the root cause.
    import pickle
    import queue
    errors = [(payload[2], rank, payload)]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            r, status, p = pickle.loads(results.get(timeout=max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            break
        if status == 'error':
            errors.append((p[2], r, p))
    _, rank, (exc, tb, _) = min(errors, key=lambda e: e[0])
    remote = _RemoteTraceback(f'\n--- worker rank {rank} ---\n{tb}')
    if exc is None:
        raise WorkerError(f'worker rank {rank} failed:\n{tb}')
    raise exc from remote


def _collect(procs, results, timeout):
    import pickle
    import queue
    deadline = time.monotonic() + timeout
    done = {}
    while len(done) < len(procs):
        try:
            rank, status, payload = pickle.loads(results.get(timeout=0.2))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in done and p.exitcode is not None]
            if dead:
                time.sleep(0.5)  # a message sent just before exit may still be in flight
                if results.empty():
                    r = dead[0]
                    raise WorkerError(f'worker rank {r} exited with code {procs[r].exitcode} '
                                      'without reporting a result (killed or crashed).')
                continue
            if time.monotonic() > deadline:
                waiting = sorted(set(range(len(procs))) - set(done))
                raise TimeoutError(f'worker rank(s) {waiting} did not finish within '
                                   f'{timeout} s; all workers were stopped.')
            continue
        if status == 'error':
            _raise_first_error(rank, payload, results)
        done[rank] = payload
    return [done[r] for r in range(len(procs))]
