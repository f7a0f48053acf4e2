"""Section 05, multi-GPU training from scratch: LeNet from raw tensors, d2l's training
helpers, and dp_worker, the section's data-parallel step written for processes.

get_params, allreduce, split_batch and train_batch are on 05's page; what is
here is what 06 and 07, or a new process, must import too.
"""
import contextlib
import time

import numpy as np
import torch
import torch.distributed as dist

from comp_perf.fashion_mnist import fashion_mnist_datasets
from comp_perf.language import in_notebook
from comp_perf.machine import num_gpus, try_gpu
from comp_perf.measure import synchronize
from comp_perf.processes import run_keys, worker_device


@contextlib.contextmanager
def full_fp32():
    """Inside the block, float32 matrix products and convolutions on GPUs use full FP32, no TF32.

    On Ampere and newer GPUs PyTorch lets cuDNN convolutions use TF32 by
    default (10-bit mantissa inputs), which changes results at about 1e-3
    relative. Equivalence checks ("one data-parallel step equals one
    single-device step") compare two computations that should agree to
    float32 rounding, so they run inside this block. Uses PyTorch's
    fp32_precision settings and restores them afterwards; no effect on CPUs.
    While it is in force, reading the legacy flag torch.backends.cudnn.allow_tf32
    raises (PyTorch refuses a mix of the legacy and the new API), and
    torch.compile reads such flags: compile outside the block.
    """
    knobs = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    saved = [k.fp32_precision for k in knobs]
    try:
        for k in knobs:
            k.fp32_precision = 'ieee'
        yield
    finally:
        for k, v in zip(knobs, saved):
            k.fp32_precision = v


def step_difference(before, after_a, after_b):
    """How far apart two training steps are: max |Δa − Δb| / max |Δb| over the parameter tensors.

    Δ is a parameter's change in the step (after − before). Dividing by the
    largest change of each tensor makes the number comparable across tensors
    and runs: 0 means the same step; a real algorithmic difference (a
    gradient not summed, a wrong batch size) shows up as 0.5 or more.
    """
    worst = 0.0
    for p, a, b in zip(before, after_a, after_b):
        p, a, b = (t.detach().double().cpu() for t in (p, a, b))
        worst = max(worst, float((a - b).abs().max() / (b - p).abs().max().clamp_min(1e-30)))
    return worst


def step_tolerance(dtype=torch.float32, device='cpu'):
    """The largest step_difference that two correct computations of one step may show.

    Splitting a batch changes the order of floating-point additions, never the
    maths, so the tolerance follows the dtype's rounding. On GPUs it is far
    larger: even with TF32 off (full_fp32), cuDNN picks its convolution
    algorithms by shape, and some trade precision for speed. Measured on an
    H200 (the course's GPU check, see tools/gpu_precision.py): a LeNet step on
    two shards of 128 and on one batch of 256 differed by 4e-3 of the step in
    one bias, and by 6e-6 on a CPU.
    """
    dtype = torch.tensor([], dtype=dtype).dtype
    table = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
    if dtype not in table:
        raise ValueError(f'no tolerance for {dtype}; use a floating-point dtype.')
    on_cpu = torch.device(device).type == 'cpu'
    return table[dtype] if on_cpu else max(2e-2, table[dtype])


def accuracy(y_hat, y):
    """Number of correct predictions (y_hat holds logits or class indices).

    d2l: the same count as d2l's; kept so that worker processes need not import d2l (pandas, scipy).
    """
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


class Animator:
    """A live line plot: call add(x, ys) during training; the figure redraws in place.

    In JupyterLab the figure updates in place (display handle); in a script
    or under torchrun nothing is shown and .fig can be saved at the end.
    Outside a notebook it draws on a plain matplotlib Figure, so it never
    changes matplotlib's backend behind the caller's back.
    d2l: redraws one figure in place and never changes matplotlib's output format; d2l's switches every figure
         to SVG (use_svg_display).
    """

    def __init__(self, xlabel=None, ylabel=None, legend=(), xlim=None, ylim=None,
                 yscale='linear', figsize=(4.5, 3)):
        if in_notebook():
            import matplotlib.pyplot as plt  # pyplot sets up the notebook's figure display
            self.fig, self.ax = plt.subplots(figsize=figsize)
            plt.close(self.fig)  # we display it ourselves, once, through a handle
        else:
            from matplotlib.figure import Figure
            self.fig = Figure(figsize=figsize)
            self.ax = self.fig.subplots()
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
        if in_notebook():
            from IPython.display import display
            if self._handle is None:
                self._handle = display(self.fig, display_id=True)
            else:
                self._handle.update(self.fig)


def sgd(params, lr, batch_size):
    """One SGD step in place, for gradients summed over `batch_size` examples; zero the gradients.

    d2l: the same update as d2l's; kept so that worker processes need not import d2l (pandas, scipy).
    """
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad.zero_()


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


def batch_indices(order, step, batch_size, part=0, parts=1):
    """Indices of `part` (of `parts`) of global minibatch number `step`.

    Every rank walks the same `order` (a seeded permutation), cyclically, so
    every global batch has exactly batch_size examples; each rank then takes
    its own slice of it. Data-parallel workers and parameter-server workers
    use this one rule, which is why their training steps can be compared.
    """
    batch = order[(step * batch_size + torch.arange(batch_size)) % len(order)]
    return torch.tensor_split(batch, parts)[part]


def replica_devices(k):
    """Devices for k replicas: k distinct GPUs if the machine has them, else k times the best one.

    On one GPU all k replicas share cuda:0; on a CPU-only machine they share the CPU.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f'the number of replicas must be a whole number >= 1, got {k!r}.')
    return [torch.device(f'cuda:{i}') for i in range(k)] if num_gpus() >= k else [try_gpu()] * k


def dp_worker(rank, world_size, run):
    """Worker for launch(): data-parallel LeNet training, gradients summed with dist.all_reduce.

    `run` is a dict with batch_size (global), lr, steps, and optionally seed, subset
    and full_fp32 (True: no TF32 on GPUs, for comparing with another device).
    Every rank walks the same shuffled global batches and trains on its slice of each.
    Runs on the CPU over gloo, or on cuda:<rank> when launched with backend='nccl'.
    Returns the device, throughput and a checksum of the parameters (rank 0 also
    returns them).
    """
    run_keys(run, ('batch_size', 'lr', 'steps'), ('seed', 'subset', 'full_fp32'))
    batch_size, lr, steps = run['batch_size'], run['lr'], run['steps']
    seed, subset = run.get('seed', 0), run.get('subset')
    device = worker_device()
    X_all, y_all = fashion_mnist_datasets(subset=subset, download=False)[0].tensors
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(seed))
    params = [p.to(device).requires_grad_() for p in lenet_params(seed)]   # this rank's replica
    precision = full_fp32() if run.get('full_fp32') else contextlib.nullcontext()
    dist.barrier()
    start = time.perf_counter()
    with precision:
        for step in range(steps):
            mine = batch_indices(order, step, batch_size, rank, world_size)
            X, y = X_all[mine].to(device), y_all[mine].to(device)
            torch.nn.functional.cross_entropy(lenet(X, params), y, reduction='sum').backward()
            for p in params:
                dist.all_reduce(p.grad)
            sgd(params, lr, batch_size)
    synchronize(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {'device': str(device), 'images_per_s': steps * batch_size / elapsed, 'seconds': elapsed,
            'checksum': float(sum(p.detach().double().sum() for p in params)),
            'params': [p.detach().cpu() for p in params] if rank == 0 else None}
