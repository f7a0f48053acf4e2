#!/usr/bin/env python3
"""What the GPU smoke run learns of the machine before it starts, and whether that is enough.

As a module: machine_facts() and
import_failures() run this same file as a child program, so that a torch that
crashes or hangs on import cannot take the runner with it, and read the one JSON
line it prints; preflight() decides whether the chosen notebooks can run at all.
Run as that child program:

    python3 tools/gpu_facts.py imports NAME...   prints IMPORTS {module: error} for each
                                                 module that cannot be imported
    python3 tools/gpu_facts.py facts ROOT        prints FACTS {torch, CUDA, devices, cuDNN,
                                                 NCCL, torchvision, where Fashion-MNIST is}

Every failure is recorded as a fact, never raised. Standard library only at module
level, like the runner: torch is imported in the child only.
"""
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from gpu_kit import ROOT
from gpu_runner import now_utc, one_line

RUNNER_MODULES = ('nbformat', 'nbclient', 'jupyter_client', 'ipykernel')   # the run needs them
WIDGET_MODULES = ('ipywidgets',)                                           # some cells need them
# a notebook that calls one of the course's Fashion-MNIST loaders needs the data
READS_DATA = re.compile(r'common\.\w*fashion_mnist\w*\(')


# ------------------------------------------------------------------ in the runner's process

def import_failures(names):
    """{module: error} of the modules this interpreter cannot import (checked in a child process)."""
    try:
        out = subprocess.run([sys.executable, __file__, 'imports', *names],
                             capture_output=True, text=True, timeout=120)
        found = [line for line in out.stdout.splitlines() if line.startswith('IMPORTS ')]
        if found:
            return json.loads(found[-1][len('IMPORTS '):])
        return {name: f'exit {out.returncode}: {one_line(out.stderr[-300:])}' for name in names}
    except Exception as e:   # the child could not run at all: then none of them can be counted on
        return {name: f'{type(e).__name__}: {e}' for name in names}


def reads_data(path):
    """Whether a notebook's code calls one of the course's Fashion-MNIST loaders."""
    try:
        nb = json.loads(Path(path).read_text(encoding='utf-8'))
    except (OSError, ValueError):
        return False
    for cell in nb.get('cells', []):
        source = cell.get('source', '')
        if cell.get('cell_type') == 'code' and READS_DATA.search(
                ''.join(source) if isinstance(source, list) else source):
            return True
    return False


def preflight(chosen, facts, failures):
    """(notes, fatal): what keeps the run from being worth starting, before any notebook runs."""
    notes, fatal = [], False
    runner = {name: error for name, error in failures.items() if name in RUNNER_MODULES}
    if runner:
        fatal = True
        notes.append('cannot run notebooks: ' + '; '.join(f'{n}: {one_line(e, 120)}' for n, e in runner.items())
                     + '. Build the wheel kit here (python3 tools/gpu_smoke.py --make-kit), carry .whl '
                     'and install it first (see MAINTAINING.md)')
    for name in WIDGET_MODULES:
        if name in failures:
            notes.append(f'{name} missing ({one_line(failures[name], 120)}): its cells will raise')
    wants = [name for name, path in chosen if reads_data(path)]
    if wants and facts.get('fashion_mnist') is None and 'fashion_mnist_error' not in facts:
        fatal = True
        notes.append(f'no Fashion-MNIST, which {", ".join(wants)} read: put the four *-ubyte.gz files '
                     'into data/fashion-mnist/ and add "data/fashion-mnist" to carry, or leave those '
                     'notebooks out')
    elif wants and 'fashion_mnist_error' in facts:
        notes.append('could not check for Fashion-MNIST: ' + one_line(facts['fashion_mnist_error'], 200))
    return notes, fatal


def machine_facts():
    """What the summary records of the machine: Python, CPUs, nvidia-smi, torch and CUDA, the kit."""
    facts = {'date_utc': now_utc(), 'python': sys.version.split()[0],
             'python_executable': sys.executable, 'cpu_count': os.cpu_count(),
             'pythonpath': os.environ.get('PYTHONPATH', '')}
    for name in ('COURSE_SETTINGS', 'COURSE_LANG', 'CUDA_VISIBLE_DEVICES'):
        if name in os.environ:
            facts[name] = os.environ[name]
    facts['nvidia_smi'] = nvidia_smi()
    try:
        out = subprocess.run([sys.executable, __file__, 'facts', str(ROOT)],
                             capture_output=True, text=True, timeout=300)
        found = [line for line in out.stdout.splitlines() if line.startswith('FACTS ')]
        if found:
            facts.update(json.loads(found[-1][len('FACTS '):]))
        else:
            facts['torch_error'] = f'exit {out.returncode}: {out.stderr.strip()[-1500:]}'
    except Exception as e:   # the child did not finish (a hung CUDA driver, say): that is the fact
        facts['torch_error'] = f'{type(e).__name__}: {e}'
    facts['kit'] = kit_versions()
    return facts


def nvidia_smi():
    """nvidia-smi's name, driver and memory line per GPU; None without nvidia-smi."""
    smi = shutil.which('nvidia-smi')
    if not smi:
        return None
    try:
        out = subprocess.run([smi, '--query-gpu=name,driver_version,memory.total', '--format=csv,noheader'],
                             capture_output=True, text=True, timeout=60)
        return (out.stdout.strip() or out.stderr.strip())[:2000]
    except Exception as e:   # a fact, not a failure
        return f'{type(e).__name__}: {e}'


def kit_versions():
    """{package: version or None} of the Jupyter packages this run uses."""
    from importlib import metadata
    versions = {}
    for name in ('ipykernel', 'ipython', 'jupyter_client', 'nbclient', 'nbformat', 'ipywidgets'):
        try:
            versions[name] = metadata.version(name)
        except Exception:   # not installed, or broken metadata: either way no version to report
            versions[name] = None
    return versions


# ------------------------------------------------------------------ in the child process

def _error(e):
    return f'{type(e).__name__}: {e}'


def failed_imports(names):
    """{module: error} of the modules that cannot be imported here."""
    failed = {}
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as e:   # any error on import means the module is unusable: record which
            failed[name] = _error(e)
    return failed


def torch_facts():
    """torch's and CUDA's versions, the first device and its memory, cuDNN's and NCCL's versions."""
    facts = {}
    try:
        import torch
        facts['torch'] = torch.__version__
        facts['torch_cuda'] = torch.version.cuda
        facts['cuda_available'] = torch.cuda.is_available()
        facts['device_count'] = torch.cuda.device_count()
        if facts['device_count']:
            facts['device_name'] = torch.cuda.get_device_name(0)
            facts['capability'] = '.'.join(map(str, torch.cuda.get_device_capability(0)))
            facts['device_memory_gib'] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        facts['cudnn'] = _or_why(lambda: torch.backends.cudnn.version())
        facts['nccl'] = _or_why(lambda: '.'.join(map(str, torch.cuda.nccl.version())))
    except Exception as e:   # no usable torch, or CUDA failed when asked: keep what was learnt, say why
        facts['torch_error'] = _error(e)
    return facts


def _or_why(version):
    try:
        return version()
    except Exception as e:   # a CPU-only build or a broken library: the reason is the fact
        return repr(e)


def other_facts(root):
    """torchvision's version and where the course's loader finds Fashion-MNIST (None: nowhere)."""
    facts = {}
    try:
        import torchvision
        facts['torchvision'] = torchvision.__version__
    except Exception as e:   # the course runs without it: a fact, not a failure
        facts['torchvision'] = _error(e)
    sys.path.insert(0, root)   # the repo root, for comp_perf
    try:
        from comp_perf.fashion_mnist import find_fashion_mnist
        facts['fashion_mnist'] = str(find_fashion_mnist(download=False))
    except FileNotFoundError:
        facts['fashion_mnist'] = None
    except Exception as e:   # the check itself failed (a broken package): the runner notes it
        facts['fashion_mnist_error'] = _error(e)
    return facts


def main(argv):
    if argv[:1] == ['imports']:
        print('IMPORTS ' + json.dumps(failed_imports(argv[1:])))
    elif argv[:1] == ['facts'] and len(argv) == 2:
        print('FACTS ' + json.dumps({**torch_facts(), **other_facts(argv[1])}))
    else:
        raise SystemExit('usage: gpu_facts.py imports NAME... | gpu_facts.py facts ROOT')


if __name__ == '__main__':
    main(sys.argv[1:])
