"""Diagnostic for GPU runs: how far apart are one data-parallel step and one single-device step?

    python tools/gpu_precision.py            # on a GPU machine; on a CPU it measures the CPU rows only

Prints, for each LeNet parameter tensor, the largest difference between the
parameter *updates* of two computations, divided by the largest update, for:
k=2 replicas vs one device (CPU fp32, GPU full fp32, GPU TF32), and each of
those against a float64 computation of the same step. It runs section 05's own
get_params and train_batch, read from the section's page. Its GPU numbers are
where common.step_tolerance's GPU tolerance comes from.
"""
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / 'tools')]
import common  # noqa: E402
from notebook_code import definitions  # noqa: E402

SECTION_05 = definitions('05-multi-gpu-from-scratch', 'get_params', 'allreduce', 'split_batch',
                         'train_batch')


def step(params, X, y, devices, dtype=torch.float32):
    """The parameter updates of one step of section 05's train_batch, on each replica."""
    replicas = [SECTION_05['get_params']([p.to(dtype) for p in params], d) for d in devices]
    SECTION_05['train_batch'](X.to(dtype), y, replicas, devices, lr=0.2)
    return [[(q.detach().double().cpu() - p.double()) for q, p in zip(r, params)] for r in replicas]


def rel(a, b):
    return max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30)) for x, y in zip(a, b))


def main(examples=256):
    """Print the comparisons; return {(device, mode): k=2 vs k=1 relative difference}."""
    torch.manual_seed(0)
    train, _ = common.fashion_mnist_datasets(subset=max(2048, examples), download=False)
    X, y = train.tensors[0][:examples], train.tensors[1][:examples]
    params = common.lenet_params(seed=0)
    devs = {'cpu': torch.device('cpu')}
    if torch.cuda.is_available():
        devs['cuda'] = torch.device('cuda:0')
    ref = step(params, X, y, [torch.device('cpu')], torch.float64)[0]
    out = {}
    for name, d in devs.items():
        modes = [('full fp32', True)] + ([('tf32', False)] if d.type == 'cuda' else [])
        for mode, full in modes:
            # 'tf32' runs with PyTorch's defaults, under which cuDNN convolutions may use TF32
            with common.full_fp32() if full else contextlib.nullcontext():
                one = step(params, X, y, [d])[0]
                two = step(params, X, y, [d, d])[0]
            out[name, mode] = rel(two, one)
            print(f'{name:>4} {mode:>9}: k=2 vs k=1 {rel(two, one):.1e}; '
                  f'k=1 vs float64 {rel(one, ref):.1e}; k=2 vs float64 {rel(two, ref):.1e}; '
                  f'per tensor k=2 vs k=1: ' + ' '.join(f'{rel([a], [b]):.0e}' for a, b in zip(two, one)))
            abs_diff = max(float((a - b).abs().max()) for a, b in zip(two, one))
            print(f'      largest absolute difference of the updates: {abs_diff:.1e}')
    return out


if __name__ == '__main__':
    main()
