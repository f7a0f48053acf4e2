"""Section 09, one training step made fast: what the page reads from the profiler (operator tables,
calls per step, the phases and the memory of an exported trace), a matrix-multiply peak in each
dtype, and the payoff chart.
"""
import json
import math
from pathlib import Path

import torch

from comp_perf.language import pad, tr
from comp_perf.machine import usable_cores
from comp_perf.measure import measure, paired_ratio, synchronize, verdict
from comp_perf.s04_hardware import cpu_facts, gpu_datasheet

PHASES = ('data', 'forward', 'backward', 'optimizer step')


SELF_CPU = 'self_cpu_time_total'   # what a CPU step's operators cost; on a GPU, 'self_device_time_total'


def operator_rows(prof, key=SELF_CPU):
    """The profiler's operator rows (key_averages), without the record_function phases, largest `key` first."""
    rows = [row for row in prof.key_averages() if row.key not in PHASES and not row.key.startswith('ProfilerStep')]
    return sorted(rows, key=lambda row: getattr(row, key), reverse=True)


def self_time_share(prof, names, key=SELF_CPU):
    """Share of all operators' self time (`key`) spent in the operators called `names` (a name or a tuple)."""
    names = (names,) if isinstance(names, str) else tuple(names)
    rows = operator_rows(prof, key)
    total = sum(getattr(row, key) for row in rows)
    return sum(getattr(row, key) for row in rows if row.key in names) / max(total, 1e-12)


def calls_per_step(prof, name, steps):
    """How often the operator `name` ran per recorded step."""
    return sum(row.count for row in prof.key_averages() if row.key == name) / steps


def top_operator(prof, key=SELF_CPU):
    """(name, share of the self time) of the ATen operator that took the most self time (`key`).

    Only aten:: rows compete: the profiler also books self time to the autograd engine's wrapper
    rows (autograd::engine::evaluate_function: ...), which in a small step can outweigh every
    operator while naming none. The share is of all rows' self time, wrappers included.
    """
    rows = operator_rows(prof, key)   # by device time (GPU) only kernels have any: then the top row
    top = next((row for row in rows if row.key.startswith('aten::') and getattr(row, key) > 0), rows[0])
    return top.key, self_time_share(prof, top.key, key)


def self_time_per_call(prof, name, key=SELF_CPU):
    """Mean self time, in µs, of one call of the operator `name`; None where it never ran."""
    rows = [row for row in prof.key_averages() if row.key == name]
    calls = sum(row.count for row in rows)
    return sum(getattr(row, key) for row in rows) / calls if calls else None


# measured gain ÷ the gain the checks' own rows promise (1 / (1 - their share))
OWN_ROWS_ONLY = [
    (1.3, 'rows', 'the gain is what the checks\' own rows took: the share rule reads them right'),
    (math.inf, 'everything', 'the gain is larger than the checks\' own rows: the mode slowed every operator '
                             '(see the per-call time), and the profiler booked that time to each of them'),
]


def debug_mode_cost(before, after, checks, seconds, trivial='aten::view'):
    """What switching a debugging mode off bought, against what the profile with it (before) promised.

    The share rule says removing work of share s shortens the step 1 / (1 - s) times. A mode
    that slows every operator (anomaly detection records a Python stack for each) hides most
    of its cost inside the other operators' self time; a call that only relabels a tensor
    (`trivial`, aten::view) shows it, since it takes about a microsecond when nothing rides on
    it. seconds: {'on': [...], 'off': [...]}, the step timed in turns with the mode and without
    (common.interleaved), not under the profiler, which inflates the mode's cost further.
    Returns the verdict's case.
    """
    share = self_time_share(before, checks)
    promised = 1 / max(1 - share, 1e-12)
    measured = paired_ratio(seconds['on'], seconds['off'])[0]   # round by round, as every interleaved ratio
    print(tr('the checks\' own rows: {s:.0%} of the operators\' time, so removing only them would shorten the step '
             '{p:.2f}×', s=share, p=promised))
    print(tr('the step timed in turns, with the mode ÷ without: {m:.2f}×', m=measured))
    per_call = [self_time_per_call(prof, trivial) for prof in (before, after)]
    if None not in per_call:
        print(tr('{op}, which moves no data, per call under the profiler: {a:.1f} µs with the mode, {b:.1f} µs '
                 'without', op=trivial, a=per_call[0], b=per_call[1]))
    return verdict('measured gain ÷ the gain of the checks\' own rows', measured / promised, OWN_ROWS_ONLY)


def input_types(prof, name):
    """{dtype tuple: calls} of the operator `name`, as the profiler recorded them (record_shapes=True)."""
    seen = {}
    for dtypes in _recorded_dtypes(prof, name):
        key = tuple(t for t in dtypes if t)
        seen[key] = seen.get(key, 0) + 1
    return seen


def _recorded_dtypes(prof, name):
    # FunctionEvent.input_dtypes is recent: torch 2.11 (the GPU machine's) keeps the dtypes
    # only on the kineto events the FunctionEvents are made from
    events = [e for e in prof.events() if e.name == name]
    if all(hasattr(e, 'input_dtypes') for e in events):
        return [e.input_dtypes for e in events]
    return [e.dtypes() for e in prof.profiler.kineto_results.events() if e.name() == name]


def trace_spans(trace_file, phases=PHASES):
    """(phase, start s, end s, '') spans of the named phases, read back from an exported Chrome trace."""
    events = [e for e in json.loads(Path(trace_file).read_text())['traceEvents']
              if e.get('ph') == 'X' and e.get('cat') == 'user_annotation' and e['name'] in phases]
    if not events:
        raise ValueError(f'{trace_file} holds none of the phases {phases}: was the step profiled with them?')
    start = min(e['ts'] for e in events)
    return [(e['name'], (e['ts'] - start) / 1e6, (e['ts'] + e['dur'] - start) / 1e6, '') for e in events]


def phase_shares(spans, phases=PHASES):
    """{phase: share of the time covered by all phases}, from trace_spans()."""
    seconds = {p: sum(end - start for lane, start, end, _ in spans if lane == p) for p in phases}
    total = sum(seconds.values())
    return {p: s / max(total, 1e-12) for p, s in seconds.items()}


def step_peak_bytes(trace_file, device='cpu'):
    """Largest memory the profiled steps allocated on `device` above what it held when recording began.

    The profiler's '[memory]' events (profile_memory=True) carry a running total of
    the bytes allocated, per device (on the CPU counted from when the profiler
    started, on a GPU the allocator's own total); the first event's total less its
    own bytes is the level the step started from, so this is the step's own peak.
    """
    device = torch.device(device)
    kind, index = (1, device.index or 0) if device.type == 'cuda' else (0, None)   # kineto: CPU 0, CUDA 1
    events = [e['args'] for e in json.loads(Path(trace_file).read_text())['traceEvents']
              if e.get('name') == '[memory]' and e['args'].get('Device Type', 0) == kind
              and (index is None or e['args'].get('Device Id') == index)]
    if not events:
        raise ValueError(f'{trace_file} has no memory events for {device}: profile with profile_memory=True.')
    before = events[0]['Total Allocated'] - events[0]['Bytes']   # allocated just before the first event
    return max(e['Total Allocated'] for e in events) - before


def matmul_peak(dtype, device):
    """FLOP/s of one large matrix product in `dtype` on `device`: the measured peak a row of that dtype is held to.

    4096² on a GPU (a 1024² product leaves most of a large GPU idle), 1024² on a CPU.
    """
    n = 4096 if torch.device(device).type == 'cuda' else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    return 2 * n ** 3 / measure(lambda: a @ a, device=None)


def cpu_theoretical_peak(cpu, dtype, cores):
    """04's estimate, cores × clock × lanes × 2 (FMA) × 2 FMA units, for fp32 and fp64; None where unknown.

    No estimate is made for 16-bit types: their rate depends on units (AVX-512 BF16,
    AMX) whose throughput the operating system does not report.
    """
    width = {torch.float32: 32, torch.float64: 64}.get(dtype)
    if not (width and cpu.get('clock_ghz') and cpu.get('vector_bits')):
        return None
    return cores * cpu['clock_ghz'] * 1e9 * cpu['vector_bits'] / width * 2 * 2


def wait_for_device(device):
    """Synchronise `device` when it is a GPU: a profiled or timed phase then ends when its kernels end."""
    if torch.device(device).type == 'cuda':
        synchronize(device)


def plot_payoff(names, seconds, mfu, title):
    """Bars of step time per variant (first draft on top) with each bar's MFU written beside it."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 0.7 + 0.42 * len(names)))
    ms = [s * 1e3 for s in seconds]
    ax.barh(range(len(names)), ms, color=['tab:red'] + ['tab:blue'] * (len(names) - 2) + ['tab:green'])
    for row, (value, share) in enumerate(zip(ms, mfu)):
        ax.text(value, row, '  ' + tr('MFU {m:.0%}', m=share) if share is not None else '', va='center', fontsize=8)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlim(0, max(ms) * 1.25)
    ax.set(xlabel=tr('ms per step (median of the interleaved rounds)'), title=title)
    fig.tight_layout()
    return ax


def print_rows(rows, widths):
    """Print a table's rows, each cell padded to its display width (Chinese lines up too)."""
    for row in rows:
        print('  '.join(pad(cell, width, right=i > 0) for i, (cell, width) in enumerate(zip(row, widths))))



def datasheet_peak(dtype, device):
    """The peak FLOP/s a datasheet gives for products in `dtype`: a GPU's row of GPU_DATASHEETS, else 04's CPU
    estimate; None where neither has one (float64 on a GPU, 16-bit types on a CPU, an unlisted GPU)."""
    device = torch.device(device)
    if device.type == 'cuda':
        row = gpu_datasheet(torch.cuda.get_device_name(device)) or {}
        key = {torch.float32: 'fp32', torch.bfloat16: 'bf16', torch.float16: 'bf16'}.get(dtype)
        return row[key] * 1e12 if key and row.get(key) else None
    return cpu_theoretical_peak(cpu_facts(), dtype, min(cpu_facts()['cores'], usable_cores()))
