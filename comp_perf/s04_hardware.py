"""Section 04, hardware: what the OS says about the CPU, the steps of a cache sweep,
C programs compiled for the latency and false-sharing experiments, the plots and
print-outs of the section's measurements, and datasheet figures of common GPUs.
"""
import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import psutil
import torch

from comp_perf.language import pad, tr
from comp_perf.machine import num_gpus


def cpu_facts():
    """What the operating system says about the CPU (Linux; best effort elsewhere).

    A dict: model, cores (physical), threads, clock_ghz and clock_source (the
    maximum clock from cpufreq where Linux reports it, else the current one
    from /proc/cpuinfo), vector_bits (from the flags), fma, and caches
    ({'L1': bytes, ...}, data and unified caches of CPU 0).
    """
    facts = {'model': platform.processor() or platform.machine(),
             'cores': psutil.cpu_count(logical=False) or os.cpu_count(), 'threads': os.cpu_count(),
             'clock_ghz': None, 'clock_source': None, 'vector_bits': None, 'fma': False, 'caches': {}}
    cpuinfo = Path('/proc/cpuinfo')
    if cpuinfo.exists():
        text = cpuinfo.read_text()
        model = re.search(r'model name\s*:\s*(.+)', text)
        mhz = re.search(r'cpu MHz\s*:\s*([\d.]+)', text)
        flag_line = re.search(r'(?:flags|Features)\s*:\s*(.+)', text)
        flags = set(flag_line.group(1).split()) if flag_line else set()
        facts['model'] = model.group(1) if model else facts['model']
        if mhz:
            facts['clock_ghz'], facts['clock_source'] = float(mhz.group(1)) / 1000, 'current, /proc/cpuinfo'
        facts['vector_bits'] = 512 if 'avx512f' in flags else 256 if 'avx2' in flags else 128 if flags else None
        facts['fma'] = 'fma' in flags or 'asimd' in flags
    max_khz = Path('/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq')
    if max_khz.exists():   # the maximum clock; /proc/cpuinfo shows the current one, low on an idle laptop
        facts['clock_ghz'], facts['clock_source'] = int(max_khz.read_text()) / 1e6, 'maximum, cpufreq'
    for index in sorted(Path('/sys/devices/system/cpu/cpu0/cache').glob('index*')):
        kind = (index / 'type').read_text().strip()
        if kind != 'Instruction':
            size = (index / 'size').read_text().strip()
            kib = int(size[:-1]) * (1024 if size.endswith('M') else 1)
            facts['caches'][f"L{(index / 'level').read_text().strip()}"] = kib * 1024
    return facts



def describe_cpu(cpu):
    """Print a cpu_facts() dict, and the GPUs, as a reader wants to see them."""
    clock = f"{cpu['clock_ghz']:.2f}" if cpu['clock_ghz'] else '-'
    print(tr('CPU: {model}, {cores} physical cores ({threads} hardware threads), clock {clock} GHz ({source})',
             model=cpu['model'], cores=cpu['cores'], threads=cpu['threads'], clock=clock,
             source=tr(cpu['clock_source']) if cpu['clock_source'] else '-'))
    print(tr('vector units: {bits}-bit, fused multiply-add: {fma}', bits=cpu['vector_bits'],
             fma=tr('supported') if cpu['fma'] else tr('not supported')))
    print(tr('data caches: {caches}',
             caches=tr(', ').join(f'{k} {_human_size(v)}' for k, v in cpu['caches'].items()) or '-'))
    print(tr('GPU: {names}', names=tr(', ').join(torch.cuda.get_device_name(i) for i in range(num_gpus()))
             or tr('none')))

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


# --- Plots and print-outs of the section's measurements -------------------------------------

def _human_size(nbytes):
    return f'{nbytes / 2**20:g} MiB' if nbytes >= 2**20 else f'{nbytes / 1024:g} KiB'


def _headroom(ax, log_y, share=0.15):
    """Raise the top of the y axis so that the data stay out of its top `share`, where the cache labels go."""
    low, high = ax.get_ylim()
    if log_y:
        ax.set_ylim(low, high * (high / low) ** (share / (1 - share)))
    else:
        ax.set_ylim(low, high + (high - low) * share / (1 - share))


def _human_time(seconds):
    return f'{seconds * 1e9:.1f} ns' if seconds < 1e-6 else f'{seconds * 1e6:.1f} µs' if seconds < 1e-3 \
        else f'{seconds * 1e3:.1f} ms'


def plot_by_size(sizes, values, caches, label, ylabel, title, log_y=False, color=None):
    """Values against working-set size (log axis), with a dotted line at each cache the OS reports."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.plot(sizes, values, 'o-', color=color, label=label)
    ax.set(xscale='log', yscale='log' if log_y else 'linear', xlabel=tr('working set (bytes)'), ylabel=ylabel,
           title=title)
    _headroom(ax, log_y)
    for level, size in caches.items():
        ax.axvline(size, color='gray', linestyle=':')
        ax.text(size, 0.98, f' {level}', va='top', fontsize=8, transform=ax.get_xaxis_transform())   # in the headroom
    ax.grid(True, which='both' if log_y else 'major', alpha=0.3)
    ax.legend(loc='lower right' if log_y else 'lower left')
    plt.show()


def report_cache_sweep(sizes, rates, knees, caches):
    """Print the knees of a throughput sweep, the caches the OS reports, and the rate just inside and
    just outside each of them (the sweep must hold half and twice the cache's size)."""
    print(tr('knees found (first size that is clearly slower): {sizes}',
             sizes=tr(', ').join(map(_human_size, knees)) or '-'))
    print(tr('caches the OS reports: {caches}',
             caches=tr(', ').join(f'{k} {_human_size(v)}' for k, v in caches.items()) or '-'))
    for level, size in caches.items():
        if size // 2 in sizes and 2 * size in sizes:
            inside, outside = rates[sizes.index(size // 2)], rates[sizes.index(2 * size)]
            print(tr('  {level}: {inside:5.1f} GB/s at {small} (fits) -> {outside:5.1f} GB/s at {large} '
                     '(does not): {change:+.0%}', level=level, inside=inside, small=_human_size(size // 2),
                     outside=outside, large=_human_size(2 * size), change=outside / inside - 1))


def plot_strides(strides, per_element):
    """Time per element read against the stride, with the stride at which each element needs its own line."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot(strides, np.array(per_element) * 1e9, 'o-')
    ax.axvline(16, color='gray', linestyle=':')
    ax.text(16, max(per_element) * 1e9 * 0.95, tr(' one element per 64-byte line'), fontsize=8, va='top')
    ax.set(xscale='log', xticks=strides, xticklabels=strides, xlabel=tr('stride (elements)'),
           ylabel=tr('ns per element read'), title=tr('reading every k-th float32'))
    ax.grid(True, alpha=0.3)
    plt.show()
    print(tr('ns per element, by stride: {values}', values=tr(', ').join(
        tr('{s}: {t:.2f}', s=s, t=t * 1e9) for s, t in zip(strides, per_element))))


def _kernel_label(name):
    """A roofline kernel's name in the reader's language ('matmul 2048' keeps its size)."""
    return tr('matmul {n}', n=name.split()[1]) if name.startswith('matmul ') else tr(name)


def plot_roofline(points, compute_roof, bandwidth, peak=None):
    """Print each kernel's intensity, rate and share of its roof, and draw the roofline with the kernels.

    points: {name: (FLOP per byte, GFLOP/s)}; compute_roof in GFLOP/s, bandwidth in GB/s;
    peak, if given, is drawn as a dashed line (the estimated peak).
    """
    import matplotlib.pyplot as plt
    ridge = compute_roof / bandwidth
    print(tr('roofs: memory {m:.1f} GB/s, compute {c:.0f} GFLOP/s; ridge at {r:.1f} FLOP/byte',
             m=bandwidth, c=compute_roof, r=ridge))
    for name, (intensity, gflops) in points.items():
        roof = min(compute_roof, bandwidth * intensity)
        bound = tr('memory-bound' if intensity < ridge else 'compute-bound')
        print(tr('  {name} {i:8.2f} FLOP/byte {g:8.1f} GFLOP/s = {s:4.0%} of its roof ({bound})',
                 name=pad(_kernel_label(name), 16), i=intensity, g=gflops, s=gflops / roof, bound=bound))
    fig, ax = plt.subplots(figsize=(6.2, 3.8))
    intensities = np.logspace(-2, 3, 200)
    ax.loglog(intensities, np.minimum(compute_roof, bandwidth * intensities), 'k-', lw=2,
              label=tr("roofline from this notebook's measurements"))
    if peak:
        ax.axhline(peak, color='grey', ls='--', lw=1, label=tr('estimated peak'))
    for name, (intensity, gflops) in points.items():
        ax.plot(intensity, gflops, 'o', ms=7)
        ax.annotate(_kernel_label(name), (intensity, gflops), xytext=(6, -10), textcoords='offset points',
                    fontsize=8)
    ax.axvline(ridge, color='tab:red', ls=':', lw=1)
    ax.set(xlabel=tr('arithmetic intensity (FLOP per byte)'), ylabel='GFLOP/s',
           title=tr('the roofline of this machine'))
    ax.grid(True, which='both', alpha=0.3)
    ax.legend(fontsize=8, loc='lower right')
    plt.show()


_GPU_RATE_LABELS = {'fp32': ('matmul FP32 (CUDA cores)', 'TFLOP/s'),
                    'tf32': ('matmul TF32 (tensor cores)', 'TFLOP/s'),
                    'bf16': ('matmul BF16 (tensor cores)', 'TFLOP/s'),
                    'memory_gbs': ('copy in device memory', 'GB/s'),
                    'pageable': ('host → device, pageable', 'GB/s'), 'pinned': ('host → device, pinned', 'GB/s')}


def gpu_rate_table(name, rates, sheet):
    """Print measured GPU rates ({key of _GPU_RATE_LABELS: value}) beside the datasheet's (a gpu_datasheet row)."""
    print(name, '|', tr('measured | datasheet | share') if sheet else
          tr('not in common.GPU_DATASHEETS: compare with its datasheet by hand'))
    for key, value in rates.items():
        label, unit = _GPU_RATE_LABELS[key]
        peak = (sheet or {}).get(key)
        print(f'  {pad(tr(label), 28)} {value:8.1f} {unit:<8}' + (f' {peak:>8} {value / peak:5.0%}' if peak else ''))


def plot_ladder(ladder, n):
    """Draw the latency ladder and print this machine's rungs.

    ladder: [(action, textbook seconds or None, this machine's seconds or None)], sorted;
    an action may hold {n}, the size of the matrix product.
    """
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for y, (name, book, here) in enumerate(ladder):
        if book and here:
            ax.plot([book, here], [y, y], color='lightgray', lw=3, zorder=1)
        if book:
            ax.plot(book, y, 's', color='gray', ms=7, label=tr('textbook (Eshelman)') if y == 0 else None)
        if here:
            ax.plot(here, y, 'o', color='tab:red', ms=7)
    ax.plot([], [], 'o', color='tab:red', label=tr('this machine'))
    ax.set_yticks(range(len(ladder)), [tr(name, n=n) for name, _, _ in ladder], fontsize=8)
    ax.set_xscale('log')
    ax.set_xticks([1e-9, 1e-6, 1e-3, 1], ['1 ns', '1 µs', '1 ms', '1 s'])
    ax.set(title=tr('the latency ladder'))
    ax.grid(True, axis='x', which='major', alpha=0.3)
    ax.legend(loc='lower right', fontsize=8)
    plt.show()
    for name, book, here in ladder:
        if here:
            print(f"  {pad(tr(name, n=n), 38)} {_human_time(here):>10}   "
                  + (tr('textbook {t}').format(t=_human_time(book)) if book else ''))


def plot_busy_cells(frames, title):
    """One small picture per cycle of a systolic array: which cells did a multiply-add."""
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(frames), figsize=(1.1 * len(frames), 1.5))
    for t, (ax, frame) in enumerate(zip(axes, frames)):
        ax.imshow(frame, cmap='Oranges', vmin=0, vmax=1.3)
        ax.set_title(tr('cycle {t}', t=t), fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(title, fontsize=9, y=1.05)
    plt.show()


def plot_utilisation(sides, utilisations, array):
    """Utilisation of an array×array systolic array against the side n of an n×n product."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 2.8))
    ax.plot(sides, np.array(utilisations) * 100, 'o-')
    ax.set(xlabel=tr('matrix side n'), ylabel=tr('utilisation (%)'),
           title=tr('{p}×{p} systolic array, n×n product', p=array))
    ax.grid(True, alpha=0.3)
    plt.show()
