"""Devices, hardware tiers and each notebook's settings (every section).

num_gpus/try_gpu/gpu/try_all_gpus are d2l's device helpers; every decision about
GPUs goes through torch.cuda.is_available() and device_count(), where the tests
fake a GPU count. detect_tier names the machine's tier (T0 CPU only … T3 several
machines), environment_report is section 00's check, and settings() is the one
visible place near the top of a notebook where sizes follow the tier.
"""
import ast
import os
import platform
import shutil
import subprocess
import warnings
from types import SimpleNamespace

import torch

from comp_perf.fashion_mnist import find_fashion_mnist
from comp_perf.language import display_width, pad, tr

# Import-time adjustments (the other one is the Chinese font, in language.py). Where PyTorch
# cannot use a GPU that is there (a driver older than this CUDA build needs), it warns once,
# on stderr, in every process that asks: the warning is kept here, and environment_report
# says what it means, instead of every notebook and worker printing it.
with warnings.catch_warnings(record=True) as _caught:
    warnings.simplefilter('always')
    _CUDA_USABLE = torch.cuda.is_available()
CUDA_WARNINGS = [str(w.message) for w in _caught if 'CUDA' in str(w.message)]
if not _CUDA_USABLE:
    # A CUDA build of PyTorch on a machine without CUDA logs a timestamped
    # "No CUDA runtime is found" at its first compilation; it is irrelevant here.
    import logging
    logging.getLogger('torch.utils.cpp_extension').setLevel(logging.ERROR)


def usable_cores():
    """How many CPUs this process may run on: its affinity mask, not the machine's count.

    A container's cpuset, taskset or Slurm often lets a process run on fewer CPUs than
    os.cpu_count() reports; every decision about processes and threads goes by this number.
    A CPU quota without a mask (docker --cpus, a Kubernetes CPU limit) does not show here.
    """
    if hasattr(os, 'sched_getaffinity'):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def num_gpus():
    """Number of CUDA GPUs this process can see.

    Every decision the course makes about GPUs goes through torch.cuda's
    is_available() and device_count(): the tests fake a GPU count there.
    d2l: the same count as d2l's, read through torch.cuda.is_available() first.
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_index(i):
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ValueError(f'GPU index must be a whole number >= 0, got {i!r}.')


def try_gpu(i=0):
    """Return cuda:i if it exists, otherwise the CPU.

    d2l: the same choice as d2l's; a negative index gets a clear message (d2l's fails inside torch.device).
    """
    _check_index(i)
    return torch.device(f'cuda:{i}') if i < num_gpus() else torch.device('cpu')


def gpu(i=0):
    """Return cuda:i, or raise a clear error when this machine has no such GPU.

    d2l: raises a clear error for a GPU this machine does not have; d2l's returns the device unchecked.
    """
    _check_index(i)
    n = num_gpus()
    if i >= n:
        have = tr('no GPU') if n == 0 else tr('{n} GPU(s): cuda:0..cuda:{last}', n=n, last=n - 1)
        raise RuntimeError(tr('cuda:{i} was requested, but this machine has {have}. Use common.try_gpu({i}) to '
                              'fall back to the CPU, or check CUDA_VISIBLE_DEVICES and nvidia-smi.', i=i, have=have))
    return torch.device(f'cuda:{i}')


def try_all_gpus():
    """All GPUs as a list; [cpu] when there is none (never empty).

    d2l: returns [cpu] on a machine without a GPU, where d2l's returns an empty list.
    """
    return [torch.device(f'cuda:{i}') for i in range(num_gpus())] or [torch.device('cpu')]


TIER_TEXT = {
    'T0': 'CPU only',
    'T1': 'one GPU',
    'T2': 'two or more GPUs',
    'T3': 'several machines (torchrun multi-node)',
}
# What each tier measures for real, and what it can only simulate or quote.
TIER_REAL = {
    'T0': 'Real here: compilation, CPU timing, threads, several CPU processes over '
          'torch.distributed (gloo).\nSimulated or quoted: GPU asynchrony, streams, '
          'multi-GPU speed-ups (reference figures are labelled with their hardware).',
    'T1': 'Real here: everything on one GPU (asynchrony, streams, copies).\n'
          'Simulated or quoted: two-GPU parallelism (two CUDA streams or CPU processes '
          'stand in).',
    'T2': 'Real here: multi-GPU training with NCCL. Quoted: multi-machine runs.',
    'T3': 'Real here: multi-machine training with torchrun.',
}


def detect_tier():
    """The hardware tier: 'T0' (CPU only), 'T1' (one GPU), 'T2' (several GPUs), 'T3' (several machines).

    T3 is recognised under torchrun when WORLD_SIZE exceeds LOCAL_WORLD_SIZE.
    """
    world = int(os.environ.get('WORLD_SIZE', '1'))
    local = int(os.environ.get('LOCAL_WORLD_SIZE', world))
    if world > local:
        return 'T3'
    n = num_gpus()
    return 'T0' if n == 0 else 'T1' if n == 1 else 'T2'


def hardware_summary():
    """A dict describing this machine: Python, PyTorch, CPU, GPUs, tier.
    """
    gpus = [torch.cuda.get_device_name(i) for i in range(num_gpus())]
    return {
        'python': platform.python_version(),
        'torch': torch.__version__,
        'os': f'{platform.system()} {platform.machine()}',
        'cpu_cores': usable_cores(),
        'torch_threads': torch.get_num_threads(),
        'gpus': gpus,
        'tier': detect_tier(),
    }


def unusable_gpus():
    """The GPUs nvidia-smi lists that this PyTorch cannot use, as 'name, driver' lines ([] if none).

    The usual cause is a driver older than the CUDA version this PyTorch was built for.
    """
    tool = shutil.which('nvidia-smi')
    if torch.cuda.is_available() or tool is None:
        return []
    try:
        done = subprocess.run([tool, '--query-gpu=name,driver_version', '--format=csv,noheader'],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def _d2l_version():
    """The installed d2l release (the book's package), or None; read without importing it."""
    import importlib.metadata
    try:
        return importlib.metadata.version('d2l')
    except importlib.metadata.PackageNotFoundError:
        return None


def environment_report(data_root=None):
    """Print what this machine is and what the course can do for real on it."""
    info = hardware_summary()
    tier = info['tier']
    try:
        data = str(find_fashion_mnist(data_root, download=False))
    except FileNotFoundError:
        data = None
    gpus = ', '.join(info['gpus']) or tr('none')
    unusable = unusable_gpus()
    if unusable:
        gpus = tr('none usable: nvidia-smi sees {gpus} (name, driver), but this PyTorch, built for CUDA '
                  '{cuda}, cannot use them: install a newer NVIDIA driver, or a PyTorch build for an older '
                  'CUDA. PyTorch says: {why}', gpus='; '.join(unusable), cuda=torch.version.cuda,
                  why=(CUDA_WARNINGS or ['torch.cuda.is_available() is False'])[0].strip().splitlines()[0][:200])
    compiler = next(filter(None, map(shutil.which, ('c++', 'g++', 'clang++', 'cl'))), None)
    rows = [
        ('Python', info['python']),
        ('PyTorch', info['torch']),
        (tr('system'), info['os']),
        (tr('CPU cores'), tr('{cores} (PyTorch threads: {threads})', cores=info['cpu_cores'],
                             threads=info['torch_threads'])),
        ('GPU', gpus),
        ('Fashion-MNIST', data or tr('NOT FOUND (the sections that train on it say how to get it; see README)')),
        ('d2l', _d2l_version() or tr("NOT INSTALLED (the book's helpers; './course setup' installs them, see README)")),
        (tr('C++ compiler'), compiler or tr(
            'NOT FOUND: torch.compile cannot build CPU kernels (see README)')),
        (tr('tier'), tr('{tier}: {name}', tier=tier, name=tr(TIER_TEXT[tier]))),
    ]
    width = max(display_width(k) for k, _ in rows)
    for k, v in rows:
        print(f'{pad(k, width)}  {v}')
    print(tr(TIER_REAL[tier]))
    return info


SETTINGS_ENV = 'COURSE_SETTINGS'


def _split_top_level(text):
    # "T0, sizes=[1, 2], lr=0.1" -> ['T0', 'sizes=[1, 2]', 'lr=0.1']: commas inside brackets stay.
    parts, depth, current = [], 0, ''
    for ch in text:
        depth += (ch in '([{') - (ch in ')]}')
        if ch == ',' and depth == 0:
            parts.append(current)
            current = ''
        else:
            current += ch
    return [p.strip() for p in parts + [current] if p.strip()]


def _parse_override(text):
    tier, values = None, {}
    for part in _split_top_level(text):
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


def _kind(value):
    # The kinds an override is checked against: an int may stand where a float is
    # expected, a list where a tuple is, and bool is not a number here.
    if isinstance(value, bool) or value is None:
        return type(value).__name__.replace('NoneType', 'None')
    return {int: 'number', float: 'number', list: 'list', tuple: 'list'}.get(type(value), type(value).__name__)


def _fits(value, examples):
    # Does an override have the kind of the notebook's own values for that key?
    # A whole-number setting refuses a float (epochs=2.5); a float setting takes an int.
    if isinstance(value, float) and all(isinstance(e, int) and not isinstance(e, bool) for e in examples):
        return False
    return _kind(value) in {_kind(e) for e in examples}


def _type_names(examples):
    return ' or '.join(sorted({'int' if isinstance(e, int) and not isinstance(e, bool)
                                else _kind(e) for e in examples}))


def settings(**per_tier):
    """Pick this notebook's settings by hardware tier, apply COURSE_SETTINGS, print them.

    Call as settings(T0=dict(...), T1=dict(...), ...). T0 is required and
    names every setting with its CPU value; a higher tier lists only what
    changes there and inherits the rest from the tiers below it. So a
    CPU-sized experiment (threads, CPU processes) keeps its T0 size on a
    machine with GPUs unless a tier changes it on purpose.

    COURSE_SETTINGS may name a tier and/or change values, for example
    COURSE_SETTINGS="T0,epochs=3"; each value must have the type the notebook
    uses for that key. The printed line says which tier's settings were used
    and, only when there was one, what the override changed.
    """
    if 'T0' not in per_tier or set(per_tier) - set(TIER_TEXT):
        raise ValueError('settings() needs T0=dict(...) and accepts only T0..T3.')
    keys = set(per_tier['T0'])
    for name, values in per_tier.items():
        extra = set(values) - keys
        if extra:
            raise ValueError(f'settings(): {name} sets {sorted(extra)}, which T0 lacks; '
                             'T0 must name every setting (with its CPU value).')
    forced, overrides = _parse_override(os.environ.get(SETTINGS_ENV, ''))
    tier = forced or detect_tier()
    order = list(TIER_TEXT)
    values, used = {}, []
    for name in order[:order.index(tier) + 1]:
        if name in per_tier:
            values.update(per_tier[name])
            used.append(name)
    unknown = set(overrides) - keys
    if unknown:
        raise ValueError(f'{SETTINGS_ENV}: unknown setting(s) {sorted(unknown)}; '
                         f'this notebook has {sorted(keys)}.')
    for key, value in overrides.items():
        examples = [v[key] for v in per_tier.values() if key in v]
        if not _fits(value, examples):
            raise ValueError(f'{SETTINGS_ENV}: {key}={value!r} is not a {_type_names(examples)} '
                             f'(this notebook uses {key}={per_tier["T0"][key]!r} on T0).')
        if isinstance(value, (list, tuple)) and isinstance(examples[0], (list, tuple)):
            value = type(examples[0])(value)
        values[key] = value
    shown = ', '.join(f'{k}={v!r}' for k, v in values.items())
    source = used[-1] if len(used) == 1 else ' + '.join(reversed(used))
    line = tr('tier {tier} ({name}), settings of {source}: {shown}',
              tier=tier, name=tr(TIER_TEXT[tier]), source=source, shown=shown)
    if forced or overrides:
        changed = ([f'tier={forced}'] if forced else []) + [f'{k}={v!r}' for k, v in overrides.items()]
        line += tr('  [override: {env} {changed}]', env=SETTINGS_ENV, changed=', '.join(changed))
    print(line)
    return SimpleNamespace(tier=tier, **values)
