"""Section 04, hardware: the steps of a cache sweep, C programs compiled for the
latency and false-sharing experiments, and datasheet figures of common GPUs.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from comp_perf.language import tr


def cache_knees(sizes, rates, drop=0.8):
    """Working-set sizes at which read throughput falls clearly: the first size of each step down.

    On a 3-point running median (one noisy point is not a knee), a knee is
    where the rate falls below `drop` times the best rate since the last knee.
    A knee closer than a factor of 4 to the previous one belongs to the same
    step. Heuristic, for the print-out beside the plot.
    """
    if len(sizes) != len(rates) or len(sizes) < 3:
        raise ValueError(f'need as many rates as sizes, at least 3; got {len(sizes)} and {len(rates)}.')
    smooth = [rates[0]] + [float(np.median(rates[i - 1:i + 2])) for i in range(1, len(rates) - 1)] \
        + [rates[-1]]
    knees, plateau = [], smooth[0]
    for size, rate in zip(sizes[1:], smooth[1:]):
        if rate < drop * plateau:
            if not knees or size >= 4 * knees[-1]:
                knees.append(size)
            plateau = rate
        else:
            plateau = max(plateau, rate)
    return knees


def compile_c(source, *flags):
    """Compile a C file with the machine's compiler; return the path of the program.

    The program is written next to the source. Tries cc, gcc and clang, then
    the C++ compiler the course already needs for torch.compile (the course's
    C files are valid C++ too). A failed compilation raises with the
    compiler's own message.
    """
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f'no C source at {source}.')
    compiler = next(filter(None, map(shutil.which, ('cc', 'gcc', 'clang', 'c++', 'g++', 'clang++'))), None)
    if compiler is None:
        raise RuntimeError(tr('No C or C++ compiler found; install one (sudo apt-get install g++) '
                              'and run this cell again.'))
    program = source.with_suffix('.exe' if os.name == 'nt' else '')
    done = subprocess.run([compiler, '-O2', str(source), '-o', str(program), *flags],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f'{Path(compiler).name} could not compile {source}:\n{done.stderr[-3000:]}')
    return program


# Datasheet figures of common NVIDIA GPUs (source: NVIDIA's datasheets). Tensor-core rates are
# dense: datasheets quote them "with sparsity", twice the dense rate. The first matching row wins.
GPU_DATASHEETS = [  # (pattern in the device name, FP32, TF32, BF16 in TFLOP/s, memory GB/s)
    (r'GH200', 67, 494.7, 989.5, 4000),             # the 96 GB HBM3 Grace Hopper; 4900 with HBM3e
    (r'H200.*NVL', 60, 417.5, 835.5, 4800),
    (r'H200', 67, 494.7, 989.5, 4800),
    (r'H100.*NVL', 60, 417.5, 835.5, 3900),
    (r'H100.*PCIe', 51, 378, 756, 2000),
    (r'H100', 67, 494.7, 989.5, 3350),
    (r'A100.*(80GB.*PCIe|PCIE.*80GB)', 19.5, 156, 312, 1935),
    (r'A100.*80GB', 19.5, 156, 312, 2039),
    (r'A100', 19.5, 156, 312, 1555),
    (r'L4\b', 30.3, 60, 121, 300),
    (r'V100', 15.7, None, None, 900),
    (r'T4\b', 8.1, None, None, 320),
]


def gpu_datasheet(name):
    """The datasheet row for a GPU name as torch.cuda.get_device_name reports it, or None.

    Returns a dict with fp32, tf32, bf16 (TFLOP/s; None where the chip has no
    such tensor-core mode) and memory_gbs.
    """
    for pattern, fp32, tf32, bf16, memory in GPU_DATASHEETS:
        if re.search(pattern, name, re.IGNORECASE):
            return {'fp32': fp32, 'tf32': tf32, 'bf16': bf16, 'memory_gbs': memory}
    return None
