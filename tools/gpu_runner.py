"""The GPU smoke run's runner (tools/gpu_smoke.py): executes notebooks one after another,
each in a fresh kernel on a scratch copy, under the cell, budget and hard-stop limits,
and records every cell in summary.json as it goes.

Standard library only at module level: nbformat and nbclient are imported when a
notebook runs (the GPU machine gets them from the wheel kit).
"""
import datetime
import json
import os
import re
import shutil
import signal
import sys
import time
import traceback
import zipfile
from pathlib import Path

from gpu_kit import ROOT, shown

NOTEBOOKS = ROOT / 'notebooks'
KERNEL_NAME = 'gpu-smoke-python3'
ANSI = re.compile(r'\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07')
TRACEBACK_LINES = 15
STDERR_CHARS = 500
MIN_NOTEBOOK_SECONDS = 30   # no notebook starts with less than this left before --hard-stop
INTERRUPT_WAIT = 10   # s for an interrupted kernel to send its traceback (nbclient's iopub_timeout)
# what nbclient hands back, instead of waiting for the kernel's reply, once it has
# interrupted a cell that ran past its limit (error_on_timeout)
TIMEOUT_REPLY = {'ename': 'CellTimeoutError', 'evalue': 'gpu_smoke: cell time limit', 'traceback': []}


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
    """A cell's seconds from nbclient's timestamps in its metadata, else `measured`."""
    # comp_perf/course_load.py's cell_seconds reads the same timestamps; this copy keeps
    # the runner free of the course's package (standard library only, see the docstring).
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
    """One smoke run: its clock, its summary.json and the notebooks it executes."""

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

    def run_all(self, chosen, scratch):
        """Run the chosen notebooks in order, each from its scratch copy, while the time limits allow."""
        for name, original, copy, work in scratch_copies(chosen, scratch, self.args):
            startup, reason = notebook_plan(self.elapsed(), self.args.budget, self.args.hard_stop,
                                            self.args.startup_timeout)
            if self.terminated or reason:
                self.summary['notebooks'][name].update(
                    status='skipped', reason='the run was terminated' if self.terminated else reason)
                self.save()
                continue
            print(f'[gpu_smoke] {name} ...', flush=True)
            self.record_reference_in(work)
            self.run(name, original, copy, work, scratch / f'{name}.kernel.log', startup)
            signal.signal(signal.SIGTERM, on_sigterm)  # nbclient resets it while it runs
            rec = self.summary['notebooks'][name]
            print(f"[gpu_smoke] {name}: {rec['status']} in {rec['seconds']} s, "
                  f"{len(rec['errors'])} error(s)", flush=True)

    def record_reference_in(self, workdir):
        """Let the kernel record GPU reference figures only in the first language's notebooks.

        The figures do not depend on the language; a second language's run would only
        replace them with a later measurement.
        """
        langs = getattr(self.args, 'lang', None) or ['en']
        reference = self.summary.setdefault('reference_out', os.environ.get('COURSE_REFERENCE_OUT'))
        if reference and workdir.name == langs[0]:
            os.environ['COURSE_REFERENCE_OUT'] = reference
        else:
            os.environ.pop('COURSE_REFERENCE_OUT', None)

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
        except Exception as e:   # never raise on a notebook: record it, go on with the next
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
                except Exception as e:   # a notebook that cannot be kept is noted; the summary still is
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


def scratch_copies(chosen, scratch, args):
    """[(name, original, copy, working directory)] of the chosen notebooks, copied into `scratch`.

    The course's notebooks run in a copy of notebooks/, from its <lang>/ folder;
    a --notebook-path notebook alone in a folder of its own.
    """
    if args.notebook_path:
        out = []
        for name, path in chosen:
            work = scratch / 'single' / name
            work.mkdir(parents=True)
            shutil.copy2(path, work / path.name)
            out.append((name, path, work / path.name, work))
        return out
    shutil.copytree(NOTEBOOKS, scratch / 'notebooks', ignore=shutil.ignore_patterns('artifacts', '.ipynb_checkpoints'))
    copies = []
    for name, path in chosen:
        work = scratch / 'notebooks' / path.parent.name   # en/ or zh/: the kernel's language
        copies.append((name, path, work / path.name, work))
    return copies
