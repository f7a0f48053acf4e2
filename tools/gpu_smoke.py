#!/usr/bin/env python3
"""GPU smoke run: executes notebooks on a GPU machine and records what failed.

Each selected notebook runs in a fresh kernel inside a scratch copy of the
notebooks/ folder (the kernel's working directory is the copy's <lang>/ folder,
so `artifacts/`, relative links and comp_perf.language.course_language() behave as in
JupyterLab, and the repo's notebooks are never overwritten). Errors do not stop
a notebook (allow_errors). A cell that runs past its time limit is interrupted
(a KeyboardInterrupt, so its traceback shows where it was), and that ends its
notebook (the kernel is stopped); the run goes on with the next one.

    python3 tools/gpu_smoke.py --out DIR [--notebooks 09 02 03] [--lang en [zh]]
        [--cell-timeout 300] [--budget SECONDS] [--hard-stop SECONDS]
        [--started-at UNIX_TIME] [--zip]
    python3 tools/gpu_smoke.py --make-kit     (the wheel kit: tools/gpu_kit.py)
    python3 tools/gpu_smoke.py --keep-reference DIR/reference.json [DIR2/reference.json]
                                              (into data/reference/<gpu>.json, merged)

Written under --out: summary.json (the machine's facts and, per notebook, every
code cell's seconds, error and stderr; rewritten after every cell, so a run
killed mid-way keeps what it had done) and each executed notebook, NAME.ipynb
(all in executed.zip with --zip, or when they and the files already in --out
would be more than 8). The GPU cells of the first --lang's notebooks record their
figures in DIR/reference.json (comp_perf/reference.py; the tool sets
COURSE_REFERENCE_OUT for the kernels and adds the driver at the end); a later
language's notebooks run in the time left, for their errors only. A compact
report is printed at the end.

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
selected notebook calls one of the course's Fashion-MNIST loaders and the
loader finds no data without downloading. A missing ipywidgets is only noted:
the cells with sliders then raise.

The kernels run this interpreter (a private kernelspec) and inherit this
process's environment (PYTHONPATH, COURSE_SETTINGS, ...). Only the standard
library is imported at module level; nbformat and nbclient when the notebooks
run, torch only in the child program tools/gpu_facts.py. This file is the
command and its report; tools/gpu_runner.py runs the notebooks,
tools/gpu_facts.py probes the machine, tools/gpu_kit.py builds the kit.

The borrowed-machine recipe is in MAINTAINING.md.
"""
import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from gpu_facts import RUNNER_MODULES, WIDGET_MODULES, import_failures, machine_facts, preflight
from gpu_kit import KIT_DIR, KIT_FILE, make_kit, shown
from gpu_runner import NOTEBOOKS, Runner, Terminated, now_utc, on_sigterm, one_line, prepare_kernel_environment

MAX_FILES_BACK = 8   # more files than this in --out, and the executed notebooks go into one zip
REFERENCE_FILE = 'reference.json'   # the GPU reference figures the notebooks record (comp_perf/reference.py)
ROOT = Path(__file__).resolve().parent.parent


def select(args):
    """[(name, path)] of the notebooks to run: NN-*.ipynb of each --lang in turn, or --notebook-path.

    The first language's notebooks keep their plain names (09-one-training-step); those of a
    later language get it as a suffix (09-one-training-step.zh), so that both can be in one run.
    """
    if args.notebook_path:
        return [(Path(p).stem, Path(p).resolve()) for p in args.notebook_path]
    chosen = []
    for i, lang in enumerate(args.lang):
        suffix = '' if i == 0 else f'.{lang}'
        chosen += [(p.stem + suffix, p) for p in notebooks_of(NOTEBOOKS / lang, args.notebooks)]
    return chosen


def notebooks_of(folder, wanted):
    """The NN-*.ipynb of `folder`, or those whose names start with each of `wanted`, in that order."""
    every = sorted(folder.glob('*.ipynb'))
    if not wanted:
        return [p for p in every if re.match(r'\d\d-', p.name)]
    chosen = []
    for want in wanted:
        match = [p for p in every if p.name.startswith(want)]
        if not match:
            raise SystemExit(f'no notebook {want!r} in {folder}')
        chosen += [p for p in match if p not in chosen]
    return chosen


def keep_reference(out, facts):
    """Complete the GPU run's reference file (the driver, from nvidia-smi) and list what it holds.

    The notebooks' GPU cells wrote it (comp_perf/reference.py, COURSE_REFERENCE_OUT);
    None when none did.
    """
    path = out / REFERENCE_FILE
    if not path.exists():
        return None
    sys.path.insert(0, str(ROOT))
    from comp_perf.reference import write_file
    data = json.loads(path.read_text(encoding='utf-8'))
    smi = (facts.get('nvidia_smi') or '').splitlines()
    if smi and smi[0].count(',') >= 2:
        data['machine']['driver'] = smi[0].split(',')[1].strip()
    data['machine']['device_count'] = facts.get('device_count')
    write_file(path, data)
    return sorted(data.get('experiments', {}))


def install_reference(*paths):
    """Check GPU runs' reference files and copy them, as one, to data/reference/<gpu>.json; an exit status.

    Several files are the runs of one session on one machine (a second, shorter run
    after a fix): they must name the same GPU and torch, and a later file's
    experiment replaces an earlier one's.
    """
    sys.path.insert(0, str(ROOT))
    from comp_perf.reference import REFERENCE_DIR, UnusableReference, gpu_slug, read_file, write_file
    merged = None
    for path in paths:
        try:
            data = read_file(path)
        except UnusableReference as e:
            print(f'[gpu_smoke] not kept: {e}', file=sys.stderr)
            return 2
        if data.get('synthetic'):
            print(f'[gpu_smoke] not kept: {path} is synthetic test data', file=sys.stderr)
            return 2
        if merged is None:
            merged = data
            continue
        same = ('device_name', 'torch')
        if any(data['machine'].get(k) != merged['machine'].get(k) for k in same):
            print(f'[gpu_smoke] not kept: {path} comes from another GPU or torch than {paths[0]}', file=sys.stderr)
            return 2
        merged['experiments'].update(data['experiments'])
    target = REFERENCE_DIR / f"{gpu_slug(merged['machine']['device_name'])}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    write_file(target, merged)
    print(f"[gpu_smoke] {len(merged['experiments'])} experiments of {merged['machine']['device_name']} kept in "
          f'{shown(target)}: run the tests (tests/test_reference.py checks it against every GPU cell), then '
          're-execute the notebooks that show it and commit both.')
    return 0


GLYPH_WARNING = re.compile(r'^.*UserWarning: Glyph \d+ .* missing from font.*\n(?:[ \t]+\S.*\n?)?', re.M)


def without_glyph_warnings(stderr):
    """(stderr without matplotlib's 'Glyph ... missing from font' warnings, how many there were).

    A machine without a Chinese font prints one per character of every Chinese figure; in the
    report they would crowd out its head, so they are counted instead (the figures still render,
    with boxes for those characters, and summary.json keeps the full text).
    """
    return GLYPH_WARNING.sub('', stderr), len(GLYPH_WARNING.findall(stderr))


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
    if 'reference' in summary:
        recorded = summary['reference']
        lines.append(f'reference: {len(recorded)} experiment(s) in {REFERENCE_FILE}: {", ".join(recorded)}'
                     if recorded else f'reference: no GPU cell recorded a figure ({REFERENCE_FILE} not written)')
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
        glyphs = 0
        for cell in rec['cells']:
            stderr, missing = without_glyph_warnings(cell.get('stderr') or '')
            glyphs += missing
            if stderr.strip():
                lines.append(f"  stderr cell {cell['index']}: {one_line(stderr, 200)}")
        if glyphs:
            lines.append(f'  {glyphs} warnings of glyphs missing from the font (no Chinese font here), not listed')
    lines.append(f"total {summary.get('elapsed_seconds')} s")
    return '\n'.join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--out', type=Path, help='folder for summary.json and notebooks')
    parser.add_argument('--notebooks', nargs='*', help='number prefixes such as 00 05 07 (default: all)')
    parser.add_argument('--lang', nargs='+', default=['en'], choices=['en', 'zh'],
                        help='languages in turn; only the first records GPU reference figures')
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
    parser.add_argument('--keep-reference', type=Path, nargs='+', metavar='FILE',
                        help="check GPU runs' reference.json files and keep them, as one, in "
                             'data/reference/<gpu>.json')
    parser.add_argument('--notebook-path', action='append', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.out is None and not (args.make_kit or args.keep_reference):
        parser.error('--out is required (or --make-kit, or --keep-reference FILE)')
    return args


def start_run(runner, chosen, scratch):
    """Set up the kernels, record the facts, check kit and data; False when the run cannot start."""
    runner.summary['notes'] += prepare_kernel_environment(scratch)
    runner.summary['facts'] = machine_facts()
    notes, fatal = preflight(chosen, runner.summary['facts'], import_failures(RUNNER_MODULES + WIDGET_MODULES))
    runner.summary['notes'] += notes
    if fatal:
        for name, _ in chosen:
            runner.summary['notebooks'][name].update(status='skipped', reason='stopped before the run: '
                                                     'see the notes')
    runner.save()
    return not fatal


def plan_outputs(runner, chosen):
    """Where the executed notebooks go (executed.zip past MAX_FILES_BACK files); every one 'pending'."""
    args = runner.args
    others = [p.name for p in args.out.iterdir() if p.is_file() and p.suffix != '.ipynb'
              and p.name not in ('summary.json', 'summary.json.tmp', 'executed.zip', REFERENCE_FILE)]
    if not args.zip and len(chosen) + 2 + len(others) > MAX_FILES_BACK:   # + summary.json, reference.json
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


def main(argv=None):
    args = parse_args(argv)
    if args.make_kit:
        return make_kit()
    if args.keep_reference:
        return install_reference(*args.keep_reference)
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ['COURSE_REFERENCE_OUT'] = str((args.out / REFERENCE_FILE).resolve())   # the kernels inherit it
    runner = Runner(args, args.out)
    try:
        chosen = select(args)
    except SystemExit as e:
        runner.summary['notes'].append(str(e))
        runner.summary['finished_utc'] = now_utc()
        runner.save()
        print(f'[gpu_smoke] {e}', file=sys.stderr)
        return 2
    plan_outputs(runner, chosen)
    scratch = Path(tempfile.mkdtemp(prefix='gpu-smoke-'))
    signal.signal(signal.SIGTERM, on_sigterm)
    status = 0
    try:
        if not start_run(runner, chosen, scratch):
            status, chosen = 2, []
        runner.run_all(chosen, scratch)
    except (Terminated, KeyboardInterrupt) as e:
        runner.terminated = True
        runner.summary['notes'].append(f'terminated ({type(e).__name__} {e})')
    except Exception as e:   # summary.json is always written, with what failed
        runner.summary['notes'].append('runner failed: ' + ''.join(
            traceback.format_exception_only(type(e), e)).strip())
    finally:
        try:
            runner.summary['reference'] = keep_reference(args.out, runner.summary['facts']) or []
        except (OSError, ValueError, KeyError) as e:
            runner.summary['notes'].append(f'{REFERENCE_FILE} could not be completed: {e}')
        runner.summary['finished_utc'] = now_utc()
        runner.save()
        shutil.rmtree(scratch, ignore_errors=True)
    print(report(runner.summary), flush=True)
    return 143 if runner.terminated else status


if __name__ == '__main__':
    sys.exit(main())
