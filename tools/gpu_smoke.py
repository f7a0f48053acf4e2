#!/usr/bin/env python3
"""GPU smoke run: executes notebooks on a GPU machine and records what failed.

Used for the course's GPU checks (README, "GPU checks").

Each selected notebook runs in a fresh kernel inside a scratch copy of the
notebooks/ folder (the kernel's working directory is the copy's <lang>/ folder,
so `artifacts/`, relative links and comp_perf.language.course_language() behave as in
JupyterLab, and the repo's notebooks are never overwritten). Errors do not stop
a notebook (allow_errors). A cell that runs past its time limit is interrupted
(a KeyboardInterrupt, so its traceback shows where it was), and that ends its
notebook (the kernel is stopped); the run goes on with the next one.

Written under --out:
  summary.json   machine facts (nvidia-smi, torch, CUDA, devices, Python, CPUs,
                 UTC date, where Fashion-MNIST was found) and, per notebook,
                 seconds, every code cell (index, first source line, seconds,
                 error, stderr) and the errors; rewritten after every cell, so a
                 run killed mid-way keeps what it had done
  NAME.ipynb     each executed notebook with its outputs (with --zip, or when
                 they and the files already in --out would be more than 8: all
                 of them in executed.zip instead)
A compact report is printed at the end.

    python3 tools/gpu_smoke.py --out DIR [--notebooks 00 05 07] [--lang en]
        [--cell-timeout 300] [--budget SECONDS] [--hard-stop SECONDS]
        [--started-at UNIX_TIME] [--zip]
    python3 tools/gpu_smoke.py --make-kit

Time limits. --cell-timeout: seconds per cell. --budget: no notebook starts
after this many seconds of the run. --hard-stop: no cell runs past this many
seconds of the run: each cell's limit, and the kernel's start-up
(--startup-timeout), are cut to what is left, and no notebook starts with less
than 30 s left (those are recorded as skipped, with the reason). Interrupting
and stopping a kernel and writing the report take some seconds, so keep the hard
stop 30-60 s under the outer time limit. --started-at: count the budget and the
hard stop from this Unix time (`date +%s` at the start of the outer command)
instead of from this tool's start, so that what the command ran first counts
too. Notebooks run in the order given; instructors.ipynb only through
--notebooks instructors.

Before any notebook runs, the tool stops (exit status 2, the reason in
summary.json's notes, every notebook marked skipped) when nbformat, nbclient,
jupyter_client or ipykernel cannot be imported (no wheel kit), or when a
selected notebook reads Fashion-MNIST (00, 05, 06, 07) and the course's loader
finds none without downloading. A missing ipywidgets is only noted: the cells
with sliders (02, 07, 08) then raise.

On a borrowed GPU machine (Python 3.12 with torch, no Jupyter packages, no
network; the working tree travels, git-ignored paths only when named in a
`carry` list):

1. Here, where pip reaches an index: `python3 tools/gpu_smoke.py --make-kit`
   downloads the wheels pinned in tools/gpu_kit.txt (cp312, about 12 MB) into
   .whl/ (git-ignored). Put Fashion-MNIST's four *-ubyte.gz files (31 MB) into
   data/fashion-mnist/ (git-ignored too), e.g. from Debian's package:
   mkdir -p data/fashion-mnist && cp /usr/share/datasets/fashion-mnist/* data/fashion-mnist/
2. There, one command with carry [".whl", "data/fashion-mnist"] and a time
   limit of 600 s (about 5.5 MB tracked + 31 MB data + 12 MB kit travel):

    S=$(date +%s); python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
    timeout 150 python3 -m pytest -q tests/test_gpu.py --junitxml=$OUT/gpu-tests.xml;
    python3 tools/gpu_smoke.py --out $OUT --started-at $S --notebooks 02 03 01 04 05 06 09 00 \
        --cell-timeout 90 --hard-stop 540 --zip

   The tests take about a minute, the notebooks about 7 minutes on an H200;
   the GPU-heavy ones run first, so that the hard stop, counted from the
   command's start, cuts the cheapest. 07 and 08 are left out: their worker
   processes run on the CPU, on a GPU machine as anywhere. Read the whole
   output (no `| tail`): the report is its end.

PYTHONPATH (kit + repo root, for `import common`) and every other variable of
this process (e.g. COURSE_SETTINGS) reach the kernels and their workers. The
kernel is a private kernelspec written to a temporary JUPYTER_PATH entry that
runs this same interpreter with `-m ipykernel_launcher`.

Only the standard library is imported at module level; nbformat and nbclient
are imported when the notebooks run, torch only in a child process.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / 'notebooks'
KERNEL_NAME = 'gpu-smoke-python3'
ANSI = re.compile(r'\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07')
TRACEBACK_LINES = 15
STDERR_CHARS = 500
MAX_FILES_BACK = 8
MIN_NOTEBOOK_SECONDS = 30   # no notebook starts with less than this left before --hard-stop
KIT_FILE = ROOT / 'tools' / 'gpu_kit.txt'
KIT_DIR = ROOT / '.whl'
KIT_PYTHON = '3.12'
# manylinux tags pip may take for the kit's binary wheels (it matches each tag exactly):
# glibc 2.17 to 2.28, which any machine with glibc 2.28 or newer runs
KIT_PLATFORMS = ([f'manylinux_2_{n}_x86_64' for n in range(28, 16, -1)]
                 + ['manylinux2014_x86_64', 'manylinux1_x86_64'])
# what the kit's packages need but the kit leaves out: on the GPU image already, or not needed
KIT_ASSUMED = ('attrs', 'packaging', 'psutil', 'pygments', 'python-dateutil', 'typing-extensions')
KIT_LEFT_OUT = ('debugpy',)   # ipykernel's debugger only; the smoke kernelspec switches it off
RUNNER_MODULES = ('nbformat', 'nbclient', 'jupyter_client', 'ipykernel')   # the run needs them
WIDGET_MODULES = ('ipywidgets',)                                           # some cells need them
# a notebook that calls one of the course's Fashion-MNIST loaders needs the data
READS_DATA = re.compile(r'common\.\w*fashion_mnist\w*\(')
# what nbclient hands back, instead of waiting for the kernel's reply, once it has
# interrupted a cell that ran past its limit (error_on_timeout)
INTERRUPT_WAIT = 10   # s for an interrupted kernel to send its traceback (nbclient's iopub_timeout)
TIMEOUT_REPLY = {'ename': 'CellTimeoutError', 'evalue': 'gpu_smoke: cell time limit', 'traceback': []}

IMPORT_CODE = r'''
import importlib, json, sys
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print("IMPORTS " + json.dumps(failed))
'''

FACTS_CODE = r'''
import json, sys
facts = {}
try:
    import torch
    facts["torch"] = torch.__version__
    facts["torch_cuda"] = torch.version.cuda
    facts["cuda_available"] = torch.cuda.is_available()
    facts["device_count"] = torch.cuda.device_count()
    if facts["device_count"]:
        facts["device_name"] = torch.cuda.get_device_name(0)
        facts["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        facts["device_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        facts["cudnn"] = torch.backends.cudnn.version()
    except Exception as e:
        facts["cudnn"] = repr(e)
    try:
        facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        facts["nccl"] = repr(e)
except Exception as e:
    facts["torch_error"] = f"{type(e).__name__}: {e}"
try:
    import torchvision
    facts["torchvision"] = torchvision.__version__
except Exception as e:
    facts["torchvision"] = f"{type(e).__name__}: {e}"
try:
    sys.path.insert(0, sys.argv[1])   # the repo root, for comp_perf
    from comp_perf.fashion_mnist import find_fashion_mnist
    facts["fashion_mnist"] = str(find_fashion_mnist(download=False))
except FileNotFoundError:
    facts["fashion_mnist"] = None
except Exception as e:
    facts["fashion_mnist_error"] = f"{type(e).__name__}: {e}"
print("FACTS " + json.dumps(facts))
'''


class CellTimedOut(Exception):
    """A cell ran past its limit and was interrupted: its notebook ends here."""


class Terminated(BaseException):
    """SIGTERM (an outer time limit, say): stop, write summary.json, print the report."""


def on_sigterm(signum, frame):
    raise Terminated(f'signal {signum}')


def now_utc():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')


def first_line(source):
    for line in source.splitlines():
        if line.strip():
            return line.strip()[:120]
    return ''


def shown(path):
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def one_line(text, limit=160):
    text = ' '.join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + '...'


# ------------------------------------------------------------------ time limits

def cell_limit(elapsed, cell_timeout, hard_stop=None):
    """Seconds a cell starting `elapsed` s into the run may take: the cell timeout, cut to
    what is left before the hard stop (at least 1 s, as nbclient takes 0 for no limit)."""
    if hard_stop is None:
        return cell_timeout
    return max(1, min(cell_timeout, int(hard_stop - elapsed)))


def notebook_plan(elapsed, budget=None, hard_stop=None, startup_timeout=120,
                  minimum=MIN_NOTEBOOK_SECONDS):
    """Whether a notebook may start `elapsed` s into the run: (startup seconds, None) or (None, reason).

    No notebook starts once `budget` seconds have passed, nor with less than
    `minimum` seconds left before `hard_stop`; the kernel's start-up (nbclient's
    startup_timeout, which the cells' limits do not bound) gets at most what is left.
    """
    if budget is not None and elapsed >= budget:
        return None, f'{elapsed:.0f} s of the run had passed (budget {budget:.0f} s)'
    if hard_stop is None:
        return startup_timeout, None
    left = hard_stop - elapsed
    if left < minimum:
        return None, (f'{max(left, 0):.0f} s left before the hard stop at {hard_stop:.0f} s '
                      f'(a notebook needs {minimum} s)')
    return min(startup_timeout, int(left)), None


# ------------------------------------------------------------------ kit and data

def read_kit(path=KIT_FILE):
    """{name: version} of the kit's `name==version` lines."""
    kit = {}
    for line in Path(path).read_text(encoding='utf-8').splitlines():
        line = line.split('#', 1)[0].strip()
        if line:
            name, version = line.split('==')
            kit[canonical(name)] = version.strip()
    return kit


def canonical(name):
    """A distribution's name as pip compares it (PEP 503): nest_asyncio2 == nest-asyncio2."""
    return re.sub(r'[-_.]+', '-', name.strip()).lower()


def kit_command(dest=KIT_DIR, kit=KIT_FILE, python=sys.executable):
    """The pip download line of the kit: cp312 wheels for x86-64 Linux, nothing resolved."""
    platforms = [arg for tag in KIT_PLATFORMS for arg in ('--platform', tag)]
    return [python, '-m', 'pip', 'download', '--no-deps', '--only-binary=:all:',
            '--python-version', KIT_PYTHON, '--implementation', 'cp',
            '--abi', 'cp' + KIT_PYTHON.replace('.', ''), *platforms,
            '--dest', str(dest), '--requirement', str(kit)]


def make_kit(dest=KIT_DIR, kit=KIT_FILE):
    """Download the kit into `dest`; keep exactly one wheel per pinned package. Returns an exit status."""
    import shlex
    cmd = kit_command(dest, kit)
    print(shlex.join(cmd), flush=True)
    dest.mkdir(parents=True, exist_ok=True)
    status = subprocess.run(cmd).returncode
    pins, found, extra = read_kit(kit), {}, []
    for wheel in sorted(dest.glob('*.whl')):
        name, version = wheel.name.split('-')[:2]
        name = canonical(name)
        if name in pins and version != pins[name]:
            wheel.unlink()   # an earlier kit's: two versions of one package stop the install
        elif name in pins:
            found[name] = wheel
        else:
            extra.append(wheel.name)
    missing = sorted(set(pins) - set(found))
    size = sum(w.stat().st_size for w in dest.glob('*.whl')) / 1e6
    print(f'[gpu_smoke] {shown(dest)}: {len(found)} of {len(pins)} kit wheels, {size:.1f} MB in all')
    if extra:
        print(f'[gpu_smoke] not in {shown(kit)} (they travel and are installed too): {extra}')
    if missing:
        print(f'[gpu_smoke] missing: {missing}')
    return 1 if status or missing else 0


def import_failures(names):
    """{module: error} of the modules this interpreter cannot import (checked in a child process)."""
    try:
        out = subprocess.run([sys.executable, '-c', IMPORT_CODE, *names],
                             capture_output=True, text=True, timeout=120)
        found = [line for line in out.stdout.splitlines() if line.startswith('IMPORTS ')]
        if found:
            return json.loads(found[-1][len('IMPORTS '):])
        return {name: f'exit {out.returncode}: {one_line(out.stderr[-300:])}' for name in names}
    except Exception as e:  # noqa: BLE001
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
                     'and install it first (see the docstring)')
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


# ------------------------------------------------------------------ facts

def machine_facts():
    facts = {'date_utc': now_utc(), 'python': sys.version.split()[0],
             'python_executable': sys.executable, 'cpu_count': os.cpu_count(),
             'pythonpath': os.environ.get('PYTHONPATH', '')}
    for name in ('COURSE_SETTINGS', 'COURSE_LANG', 'CUDA_VISIBLE_DEVICES'):
        if name in os.environ:
            facts[name] = os.environ[name]
    smi = shutil.which('nvidia-smi')
    if smi:
        try:
            out = subprocess.run([smi, '--query-gpu=name,driver_version,memory.total',
                                  '--format=csv,noheader'],
                                 capture_output=True, text=True, timeout=60)
            facts['nvidia_smi'] = (out.stdout.strip() or out.stderr.strip())[:2000]
        except Exception as e:  # noqa: BLE001 - a fact, not a failure
            facts['nvidia_smi'] = f'{type(e).__name__}: {e}'
    else:
        facts['nvidia_smi'] = None
    try:
        out = subprocess.run([sys.executable, '-c', FACTS_CODE, str(ROOT)],
                             capture_output=True, text=True, timeout=300)
        found = [line for line in out.stdout.splitlines() if line.startswith('FACTS ')]
        if found:
            facts.update(json.loads(found[-1][len('FACTS '):]))
        else:
            facts['torch_error'] = f'exit {out.returncode}: {out.stderr.strip()[-1500:]}'
    except Exception as e:  # noqa: BLE001
        facts['torch_error'] = f'{type(e).__name__}: {e}'
    try:
        from importlib import metadata
        facts['kit'] = {}
        for name in ('ipykernel', 'ipython', 'jupyter_client', 'nbclient', 'nbformat', 'ipywidgets'):
            try:
                facts['kit'][name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                facts['kit'][name] = None
    except Exception:  # noqa: BLE001
        pass
    return facts


# ------------------------------------------------------------------ kernel

def prepare_kernel_environment(scratch):
    """A private kernelspec running this interpreter; writable Jupyter/IPython dirs."""
    spec_dir = scratch / 'jupyter' / 'kernels' / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / 'kernel.json').write_text(json.dumps({
        'argv': [sys.executable, '-m', 'ipykernel_launcher', '-f', '{connection_file}'],
        'display_name': 'Python 3 (GPU smoke)', 'language': 'python',
        'metadata': {'debugger': False}}, indent=1))
    notes = []
    old = os.environ.get('JUPYTER_PATH')
    os.environ['JUPYTER_PATH'] = str(scratch / 'jupyter') + (os.pathsep + old if old else '')
    os.environ['JUPYTER_RUNTIME_DIR'] = str(scratch / 'runtime')
    os.environ.setdefault('IPYTHONDIR', str(scratch / 'ipython'))
    os.environ.setdefault('PYDEVD_DISABLE_FILE_VALIDATION', '1')  # debugpy's frozen-modules warning
    home = Path.home()
    if 'MPLCONFIGDIR' not in os.environ and not os.access(home, os.W_OK):
        os.environ['MPLCONFIGDIR'] = str(scratch / 'matplotlib')
        notes.append('HOME not writable: MPLCONFIGDIR in the scratch folder')
    # ipykernel sets MPLBACKEND to the inline backend unless one is set already:
    # an inherited MPLBACKEND (Agg, say) would keep the figures out of the outputs.
    if os.environ.get('MPLBACKEND') and 'inline' not in os.environ['MPLBACKEND']:
        notes.append(f'inherited MPLBACKEND={os.environ.pop("MPLBACKEND")} dropped (inline backend)')
    return notes


def reap(pgid):
    """Kill what is still alive in a kernel's process group (workers, torchrun children).

    Returns the command lines of the processes it killed (zombies do not count).
    """
    if not pgid:
        return []
    alive = []
    for stat in Path('/proc').glob('[0-9]*/stat'):
        try:
            text = stat.read_text()
            fields = text[text.rindex(')') + 2:].split()
            if int(fields[2]) == pgid and fields[0] != 'Z':
                cmd = (stat.parent / 'cmdline').read_bytes().replace(b'\0', b' ').decode(errors='replace')
                alive.append(one_line(cmd, 120))
        except (OSError, ValueError, IndexError):
            continue
    if alive:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return alive


def kernel_log_tail(path, chars=1500):
    try:
        text = ANSI.sub('', Path(path).read_text(errors='replace'))
    except OSError:
        return ''
    lines = [line for line in text.splitlines()
             if line.strip() and 'Kernel is running over TCP without encryption' not in line]
    return '\n'.join(lines)[-chars:]


# ------------------------------------------------------------------ cells

def cell_seconds(cell, measured):
    timing = cell.get('metadata', {}).get('execution', {})
    start, end = timing.get('iopub.execute_input'), timing.get('shell.execute_reply')
    if start and end:
        try:
            parse = lambda s: datetime.datetime.fromisoformat(s.replace('Z', '+00:00'))  # noqa: E731
            return round((parse(end) - parse(start)).total_seconds(), 3)
        except ValueError:
            pass
    return None if measured is None else round(measured, 3)


def cell_record(cell, index, measured):
    rec = {'index': index, 'execution_count': cell.get('execution_count'),
           'source': first_line(cell.source), 'seconds': cell_seconds(cell, measured)}
    stderr = ''.join(o.get('text', '') for o in cell.get('outputs', [])
                     if o.get('output_type') == 'stream' and o.get('name') == 'stderr')
    if stderr.strip():
        rec['stderr'] = ANSI.sub('', stderr)[:STDERR_CHARS]
    for out in cell.get('outputs', []):
        if out.get('output_type') == 'error':
            lines = ANSI.sub('', '\n'.join(out.get('traceback', []))).splitlines()
            rec['error'] = {'ename': out.get('ename'), 'evalue': str(out.get('evalue'))[:2000],
                            'traceback': lines[-TRACEBACK_LINES:]}
            if 'raises-exception' in cell.get('metadata', {}).get('tags', []):
                rec['error']['expected'] = True
            break
    return rec


def error_entry(rec):
    return {'index': rec['index'], 'source': rec['source'], **rec['error']}


# ------------------------------------------------------------------ notebooks

class Runner:
    def __init__(self, args, out):
        self.args, self.out = args, out
        # the run's clock: from --started-at (the outer command's start) if given
        since = max(0.0, time.time() - args.started_at) if args.started_at else 0.0
        self.start = time.monotonic() - since
        self.summary = {'started_utc': now_utc(), 'args': dict(vars(args)), 'facts': {},
                        'notes': [], 'notebooks': {}}
        self.zip = None
        self.terminated = False

    def elapsed(self):
        return time.monotonic() - self.start

    def save(self):
        self.summary['elapsed_seconds'] = round(self.elapsed(), 1)
        tmp = self.out / 'summary.json.tmp'
        tmp.write_text(json.dumps(self.summary, indent=1, ensure_ascii=False, default=str))
        os.replace(tmp, self.out / 'summary.json')

    def keep_notebook(self, nb, name):
        import nbformat
        text = nbformat.writes(nb)
        if self.zip:
            with zipfile.ZipFile(self.out / 'executed.zip', 'a', zipfile.ZIP_DEFLATED) as z:
                z.writestr(f'{name}.ipynb', text)
        else:
            (self.out / f'{name}.ipynb').write_text(text, encoding='utf-8')

    def cell_timeout(self, cell):
        return cell_limit(self.elapsed(), self.args.cell_timeout, self.args.hard_stop)

    def run(self, name, original, path, workdir, log_path, startup_timeout):
        """Execute `path` (a scratch copy of `original`) with its kernel in `workdir`.

        The kernel process's own output (start-up messages, what a crashing
        kernel says last; cell output goes into the cells) goes to `log_path`;
        its tail, without the TCP-encryption notice, is kept as kernel_log.
        A cell that runs past its limit is interrupted by nbclient
        (interrupt_on_timeout), which hands back TIMEOUT_REPLY at once instead
        of waiting for the kernel; the KeyboardInterrupt's traceback still
        reaches the cell's outputs if the kernel answers within nbclient's
        iopub_timeout (INTERRUPT_WAIT s). on_executed then ends the notebook
        (CellTimedOut).
        """
        rec = {'path': shown(original), 'status': 'running', 'started_after_s': round(self.elapsed(), 1),
               'seconds': None, 'code_cells': None, 'cells': [], 'errors': []}
        self.summary['notebooks'][name] = rec
        self.save()
        t0 = time.monotonic()
        state = {'index': None, 't': None, 'pgid': None, 'limit': None}
        nb = client = None
        try:
            import nbformat
            from nbclient import NotebookClient
            from nbclient.exceptions import DeadKernelError
            nb = nbformat.read(path, as_version=4)
            rec['code_cells'] = sum(c.cell_type == 'code' and bool(c.source.strip()) for c in nb.cells)

            def on_execute(cell, cell_index):
                state['index'], state['t'] = cell_index, time.monotonic()
                state['limit'] = self.cell_timeout(cell)
                if state['pgid'] is None and client is not None and client.km is not None:
                    state['pgid'] = getattr(client.km.provisioner, 'pgid', None)
                rec['running_cell'] = cell_index
                self.save()

            def on_executed(cell, cell_index, execute_reply):
                content = (execute_reply or {}).get('content', {})
                if (content.get('ename'), content.get('evalue')) == (TIMEOUT_REPLY['ename'],
                                                                     TIMEOUT_REPLY['evalue']):
                    raise CellTimedOut(cell_index)
                cr = cell_record(cell, cell_index, time.monotonic() - state['t'])
                rec['cells'].append(cr)
                if 'error' in cr and not cr['error'].get('expected'):
                    rec['errors'].append(error_entry(cr))
                state['index'] = None
                rec.pop('running_cell', None)
                self.save()

            client = NotebookClient(
                nb, timeout=self.args.cell_timeout, timeout_func=self.cell_timeout,
                startup_timeout=startup_timeout, kernel_name=KERNEL_NAME,
                allow_errors=True, interrupt_on_timeout=True, error_on_timeout=TIMEOUT_REPLY,
                iopub_timeout=INTERRUPT_WAIT, record_timing=True,
                resources={'metadata': {'path': str(workdir)}},
                on_cell_execute=on_execute, on_cell_executed=on_executed)
            try:
                with open(log_path, 'wb') as log:  # the kernel process's own stdout/stderr
                    client.execute(stdout=log, stderr=log)
                rec['status'] = 'errors' if rec['errors'] else 'ok'
            except CellTimedOut:
                hard = (state['limit'] or 0) < self.args.cell_timeout
                rec['status'] = 'hard stop' if hard else 'timeout'
                self._cell_failed(nb, rec, state, 'CellTimeoutError',
                                  f'ran past {state.get("limit")} s '
                                  f'({"hard stop of the run" if hard else "cell timeout"}); '
                                  'interrupted, and the notebook ended there')
            except DeadKernelError as e:
                rec['status'] = 'kernel died'
                self._cell_failed(nb, rec, state, 'DeadKernelError', one_line(str(e), 300))
        except Exception as e:  # noqa: BLE001 - never raise on a notebook
            starting = state['index'] is None and not rec['cells']
            rec['status'] = ('kernel start timeout' if starting and "didn't respond" in str(e)
                             else 'runner error')
            rec['errors'].append({'index': state['index'], 'source': '(kernel start)' if starting else '',
                                  'ename': type(e).__name__,
                                  'evalue': one_line(str(e), 1000),
                                  'traceback': traceback.format_exc().splitlines()[-TRACEBACK_LINES:]})
        finally:
            # nbclient's own SIGINT/SIGTERM handler stopped the kernel (and left this mark)
            if client is not None and getattr(client, '_async_cleanup_kernel_future', None) is not None:
                rec['status'], self.terminated = 'terminated', True
            rec['seconds'] = round(time.monotonic() - t0, 1)
            rec.pop('running_cell', None)
            kernel_log = kernel_log_tail(log_path)
            if kernel_log:
                rec['kernel_log'] = kernel_log
            leftovers = reap(state['pgid'])
            if leftovers:
                rec['leftover_processes_killed'] = leftovers
            if nb is not None and rec['code_cells'] is not None:
                done = {c['index'] for c in rec['cells']}
                last = max(done) if done else -1
                rec['not_run'] = [i for i, c in enumerate(nb.cells)
                                  if i > last and c.cell_type == 'code' and c.source.strip()]
                try:
                    self.keep_notebook(nb, name)
                except Exception as e:  # noqa: BLE001
                    rec['notebook_write_error'] = f'{type(e).__name__}: {e}'
            self.save()

    def _cell_failed(self, nb, rec, state, ename, evalue):
        index = state['index']
        if index is None:  # before the first cell: kernel start-up
            rec['errors'].append({'index': None, 'source': '(kernel start)', 'ename': ename,
                                  'evalue': evalue, 'traceback': []})
            return
        # measured until the kernel was stopped; a timed-out cell ran for its limit
        measured = time.monotonic() - state['t'] if state['t'] else None
        if ename == 'CellTimeoutError' and state['limit']:
            measured = state['limit']
        cr = cell_record(nb.cells[index], index, measured)
        cr['seconds'] = None if measured is None else round(measured, 3)
        shown_error = cr.get('error', {})   # what the cell itself showed (the interrupt's traceback)
        cr['error'] = {'ename': ename, 'evalue': evalue, 'traceback': shown_error.get('traceback', [])}
        if ename == 'CellTimeoutError':
            cr['error']['evalue'] += (f' (traceback of its {shown_error["ename"]}: where it was)'
                                      if shown_error.get('traceback') else
                                      ' (the kernel did not answer the interrupt in time: no traceback)')
        rec['cells'].append(cr)
        rec['errors'].append(error_entry(cr))


def select(args):
    """[(name, path)] of the notebooks to run: NN-*.ipynb of --lang, or --notebook-path."""
    if args.notebook_path:
        return [(Path(p).stem, Path(p).resolve()) for p in args.notebook_path]
    folder = NOTEBOOKS / args.lang
    every = sorted(folder.glob('*.ipynb'))
    found = [p for p in every if re.match(r'\d\d-', p.name)]
    if args.notebooks:
        chosen = []
        for want in args.notebooks:
            match = [p for p in every if p.name.startswith(want)]
            if not match:
                raise SystemExit(f'no notebook {want!r} in {folder}')
            chosen += [p for p in match if p not in chosen]
        found = chosen
    return [(p.stem, p) for p in found]


def report(summary):
    facts = summary['facts']
    lines = ['', '=' * 72, 'GPU smoke run ' + summary['started_utc']]
    lines.append(f"python {facts.get('python')} | torch {facts.get('torch')} "
                 f"(CUDA {facts.get('torch_cuda')}) | "
                 f"{facts.get('device_count')} device(s): {facts.get('device_name')} | "
                 f"{facts.get('cpu_count')} CPUs")
    if facts.get('nvidia_smi'):
        lines.append('nvidia-smi: ' + one_line(facts['nvidia_smi'], 200))
    if facts.get('torch_error'):
        lines.append('torch: ' + one_line(facts['torch_error'], 300))
    if 'fashion_mnist' in facts:
        lines.append(f"Fashion-MNIST: {facts['fashion_mnist'] or 'not found'}")
    for note in summary['notes']:
        lines.append('note: ' + note)
    for name, rec in summary['notebooks'].items():
        if rec['status'] in ('skipped', 'pending'):
            lines.append(f'{name}: {rec["status"].upper()} ({rec.get("reason", "not reached")})')
            continue
        ran = len(rec['cells'])
        lines.append(f"{name}: {rec['status'].upper()} in {rec['seconds']} s, "
                     f"{ran}/{rec['code_cells'] if rec['code_cells'] is not None else '?'} code cells run, "
                     f"{len(rec['errors'])} error(s)"
                     + (f", not run: {rec['not_run']}" if rec.get('not_run') else ''))
        for err in rec['errors']:
            lines.append(f"  ERROR cell {err['index']}: {err['ename']}: {one_line(err['evalue'], 200)}")
            lines.append(f"        {err['source']}")
        slow = sorted((c for c in rec['cells'] if c.get('seconds')), key=lambda c: -c['seconds'])[:3]
        if slow:
            lines.append('  slowest: ' + ', '.join(f"cell {c['index']} {c['seconds']:.1f}s" for c in slow))
        if rec.get('kernel_log') and rec['status'] not in ('ok', 'errors'):
            lines.append('  kernel log: ' + one_line(rec['kernel_log'][-400:], 400))
        if rec.get('leftover_processes_killed'):
            lines.append(f"  killed leftover processes: {rec['leftover_processes_killed'][:3]}")
        for cell in rec['cells']:
            if cell.get('stderr'):
                lines.append(f"  stderr cell {cell['index']}: {one_line(cell['stderr'], 200)}")
    lines.append(f"total {summary.get('elapsed_seconds')} s")
    return '\n'.join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', type=Path, help='folder for summary.json and notebooks')
    parser.add_argument('--notebooks', nargs='*', help='number prefixes such as 00 05 07 (default: all)')
    parser.add_argument('--lang', default='en', choices=['en', 'zh'])
    parser.add_argument('--cell-timeout', type=int, default=300, help='seconds per cell')
    parser.add_argument('--budget', type=float, default=None,
                        help='skip notebooks that would start after this many seconds')
    parser.add_argument('--hard-stop', type=float, default=None,
                        help='no cell runs past this many seconds of the whole run')
    parser.add_argument('--started-at', type=float, default=None, metavar='UNIX_TIME',
                        help='count --budget and --hard-stop from this time (date +%%s), not from now')
    parser.add_argument('--startup-timeout', type=int, default=120, help='seconds for a kernel to start')
    parser.add_argument('--zip', action='store_true', help='executed notebooks into executed.zip')
    parser.add_argument('--make-kit', action='store_true',
                        help=f'download the wheels of {shown(KIT_FILE)} into {shown(KIT_DIR)}/ and stop')
    parser.add_argument('--notebook-path', action='append', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_kit:
        return make_kit()
    if args.out is None:
        parser.error('--out is required (or --make-kit)')
    args.out.mkdir(parents=True, exist_ok=True)

    runner = Runner(args, args.out)
    try:
        chosen = select(args)
    except SystemExit as e:
        runner.summary['notes'].append(str(e))
        runner.summary['finished_utc'] = now_utc()
        runner.save()
        print(f'[gpu_smoke] {e}', file=sys.stderr)
        return 2
    others = [p.name for p in args.out.iterdir() if p.is_file() and p.suffix != '.ipynb'
              and p.name not in ('summary.json', 'summary.json.tmp', 'executed.zip')]
    if not args.zip and len(chosen) + 1 + len(others) > MAX_FILES_BACK:
        args.zip = True
        runner.summary['notes'].append(f'{len(chosen)} notebooks (and {len(others)} other files in --out): '
                                       'executed notebooks go into executed.zip')
    runner.zip = args.zip
    if args.zip and (args.out / 'executed.zip').exists():
        (args.out / 'executed.zip').unlink()
    runner.summary['args'] = dict(vars(args))
    for name, path in chosen:  # 'pending' stays on those a killed run never reached
        runner.summary['notebooks'][name] = {'path': shown(path), 'status': 'pending',
                                             'cells': [], 'errors': []}
    runner.save()

    scratch = Path(tempfile.mkdtemp(prefix='gpu-smoke-'))
    signal.signal(signal.SIGTERM, on_sigterm)
    status = 0
    try:
        runner.summary['notes'] += prepare_kernel_environment(scratch)
        runner.summary['facts'] = machine_facts()
        notes, fatal = preflight(chosen, runner.summary['facts'],
                                 import_failures(RUNNER_MODULES + WIDGET_MODULES))
        runner.summary['notes'] += notes
        runner.save()
        if fatal:
            for name, _ in chosen:
                runner.summary['notebooks'][name].update(status='skipped', reason='stopped before the run: '
                                                         'see the notes')
            status = 2
            chosen = []
        if args.notebook_path:
            copies = []
            for name, path in chosen:
                work = scratch / 'single' / name
                work.mkdir(parents=True)
                shutil.copy2(path, work / path.name)
                copies.append((name, work / path.name, work))
        else:
            shutil.copytree(NOTEBOOKS, scratch / 'notebooks',
                            ignore=shutil.ignore_patterns('artifacts', '.ipynb_checkpoints'))
            work = scratch / 'notebooks' / args.lang
            copies = [(name, work / path.name, work) for name, path in chosen]
        for (name, copy, work), (_, original) in zip(copies, chosen):
            startup, reason = notebook_plan(runner.elapsed(), args.budget, args.hard_stop, args.startup_timeout)
            if runner.terminated or reason:
                runner.summary['notebooks'][name].update(
                    status='skipped', reason='the run was terminated' if runner.terminated else reason)
                runner.save()
                continue
            print(f'[gpu_smoke] {name} ...', flush=True)
            runner.run(name, original, copy, work, scratch / f'{name}.kernel.log', startup)
            signal.signal(signal.SIGTERM, on_sigterm)  # nbclient resets it while it runs
            rec = runner.summary['notebooks'][name]
            print(f"[gpu_smoke] {name}: {rec['status']} in {rec['seconds']} s, "
                  f"{len(rec['errors'])} error(s)", flush=True)
    except (Terminated, KeyboardInterrupt) as e:
        runner.terminated = True
        runner.summary['notes'].append(f'terminated ({type(e).__name__} {e})')
    except Exception as e:  # noqa: BLE001 - summary.json is always written
        runner.summary['notes'].append('runner failed: ' + ''.join(
            traceback.format_exception_only(type(e), e)).strip())
    finally:
        runner.summary['finished_utc'] = now_utc()
        runner.save()
        shutil.rmtree(scratch, ignore_errors=True)
    print(report(runner.summary), flush=True)
    return 143 if runner.terminated else status


if __name__ == '__main__':
    sys.exit(main())
