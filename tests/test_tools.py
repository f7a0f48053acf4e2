"""The maintainers' tools: their code paths run here on the CPU."""
import importlib.util
import os
import re
import signal

import pytest
import torch
from helpers import ROOT

import common


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / 'tools' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_precision(fashion_mnist):
    return _tool('gpu_precision')


def test_gpu_precision_runs_section_05s_step_on_the_cpu(gpu_precision, fake_gpus, capsys):
    fake_gpus(0)
    gaps = gpu_precision.main(examples=64)
    assert list(gaps) == [('cpu', 'full fp32')]
    assert gaps['cpu', 'full fp32'] < common.step_tolerance(torch.float32, 'cpu')
    assert 'k=2 vs k=1' in capsys.readouterr().out


def test_gpu_precision_sees_a_data_parallel_step_that_loses_an_example(gpu_precision, fake_gpus,
                                                                       monkeypatch):
    fake_gpus(0)
    split_batch = gpu_precision.SECTION_05['split_batch']

    def drop_last(X, y, devices):  # the planted bug: with k > 1 the last shard loses an example
        Xs, ys = split_batch(X, y, devices)
        if len(devices) == 1:
            return Xs, ys
        return Xs[:-1] + [Xs[-1][:-1]], ys[:-1] + [ys[-1][:-1]]

    monkeypatch.setitem(gpu_precision.SECTION_05['train_batch'].__globals__, 'split_batch', drop_last)
    gaps = gpu_precision.main(examples=64)
    assert gaps['cpu', 'full fp32'] > common.step_tolerance(torch.float32, 'cpu')


# ---- tools/gpu_smoke.py and the files it runs on (gpu_runner, gpu_facts, gpu_kit): the decisions
# it makes before and between notebooks

@pytest.fixture(scope='module')
def gpu_smoke():
    return _tool('gpu_smoke')


@pytest.fixture(scope='module')
def gpu_runner():
    return _tool('gpu_runner')


@pytest.fixture(scope='module')
def gpu_facts():
    return _tool('gpu_facts')


@pytest.fixture(scope='module')
def gpu_kit():
    return _tool('gpu_kit')


def test_gpu_smoke_cuts_cell_limits_to_the_hard_stop(gpu_runner):
    assert gpu_runner.cell_limit(100, 90) == 90                     # no hard stop: the cell timeout
    assert gpu_runner.cell_limit(100, 90, hard_stop=540) == 90
    assert gpu_runner.cell_limit(500, 90, hard_stop=540) == 40      # what is left
    assert gpu_runner.cell_limit(539.5, 90, hard_stop=540) == 1     # never 0: nbclient reads 0 as no limit
    assert gpu_runner.cell_limit(600, 90, hard_stop=540) == 1


def test_gpu_smoke_starts_a_notebook_only_with_time_left(gpu_runner):
    plan = gpu_runner.notebook_plan
    assert plan(0, startup_timeout=120) == (120, None)
    assert plan(100, hard_stop=540, startup_timeout=120) == (120, None)
    assert plan(480, hard_stop=540, startup_timeout=120) == (60, None)   # start-up capped by what is left
    assert plan(505, hard_stop=540, startup_timeout=120) == (35, None)
    startup, reason = plan(515, hard_stop=540, startup_timeout=120)      # 25 s left: under 30
    assert startup is None and 'hard stop' in reason
    startup, reason = plan(420, budget=420, hard_stop=540)
    assert startup is None and 'budget' in reason
    assert plan(419, budget=420)[0] == 120


def test_gpu_smoke_counts_from_the_outer_commands_start(gpu_runner, tmp_path):
    import argparse
    import time
    args = argparse.Namespace(started_at=time.time() - 100)
    assert 99 < gpu_runner.Runner(args, tmp_path).elapsed() < 110
    assert gpu_runner.Runner(argparse.Namespace(started_at=None), tmp_path).elapsed() < 5


def test_gpu_smoke_kit_is_pinned_once_and_closed(gpu_kit):
    from importlib import metadata

    from packaging.requirements import Requirement
    lines = [line.split('#')[0].strip() for line in gpu_kit.KIT_FILE.read_text().splitlines()]
    lines = [line for line in lines if line]
    kit = gpu_kit.read_kit()
    assert len(kit) == len(lines) and all('==' in line for line in lines)   # every name once, pinned
    assert {'nbclient', 'nbformat', 'ipykernel', 'jupyter-client', 'ipywidgets', 'd2l'} <= set(kit)
    known = set(kit) | {gpu_kit.canonical(n) for n in gpu_kit.KIT_ASSUMED + gpu_kit.KIT_LEFT_OUT}
    python312 = {'python_version': '3.12', 'python_full_version': '3.12.3', 'sys_platform': 'linux',
                 'platform_system': 'Linux', 'platform_machine': 'x86_64', 'os_name': 'posix',
                 'implementation_name': 'cpython', 'platform_python_implementation': 'CPython',
                 'extra': ''}
    unlisted, checked = {}, 0
    for name, version in kit.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != version:   # this environment holds another release: its needs may differ
            continue
        if name in gpu_kit.KIT_PINS_NOT_FOLLOWED:   # installed without its own pins, on purpose
            checked += 1
            continue
        checked += 1
        for text in dist.requires or []:
            req = Requirement(text)
            if (not req.marker or req.marker.evaluate(python312)) and gpu_kit.canonical(req.name) not in known:
                unlisted.setdefault(name, []).append(str(req))
    assert checked >= len(kit) // 2, 'too few kit packages installed here at the pinned version to check'
    assert unlisted == {}


def test_gpu_smoke_kit_command_asks_for_cp312_wheels_only(gpu_kit, tmp_path):
    cmd = gpu_kit.kit_command(tmp_path / 'kit', tmp_path / 'kit.txt', python='python3')
    assert cmd[:4] == ['python3', '-m', 'pip', 'download']
    pairs = dict(zip(cmd, cmd[1:]))
    assert pairs['--python-version'] == '3.12' and pairs['--abi'] == 'cp312'
    assert pairs['--dest'] == str(tmp_path / 'kit') and pairs['--requirement'] == str(tmp_path / 'kit.txt')
    assert {'--no-deps', '--only-binary=:all:'} <= set(cmd)
    assert 'manylinux2014_x86_64' in cmd and 'manylinux_2_28_x86_64' in cmd


def test_gpu_smoke_make_kit_keeps_one_wheel_per_pin(gpu_kit, tmp_path, monkeypatch, capsys):
    import subprocess
    from types import SimpleNamespace

    kit = tmp_path / 'kit.txt'
    kit.write_text('nbclient==0.11.0\nnest-asyncio2==1.7.4  # a comment\n')
    dest = tmp_path / 'whl'
    dest.mkdir()
    (dest / 'nbclient-0.10.0-py3-none-any.whl').write_bytes(b'old')   # an earlier kit's

    def fake_pip(cmd):
        (dest / 'nbclient-0.11.0-py3-none-any.whl').write_bytes(b'new')
        (dest / 'nest_asyncio2-1.7.4-py3-none-any.whl').write_bytes(b'new')
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(gpu_kit, 'subprocess', SimpleNamespace(run=fake_pip))
    assert gpu_kit.make_kit(dest, kit) == 0
    assert sorted(p.name for p in dest.iterdir()) == ['nbclient-0.11.0-py3-none-any.whl',
                                                      'nest_asyncio2-1.7.4-py3-none-any.whl']
    (dest / 'nest_asyncio2-1.7.4-py3-none-any.whl').unlink()
    monkeypatch.setattr(gpu_kit, 'subprocess', SimpleNamespace(run=lambda cmd: subprocess.CompletedProcess(cmd, 1)))
    assert gpu_kit.make_kit(dest, kit) == 1
    assert "missing: ['nest-asyncio2']" in capsys.readouterr().out


def the_documented_gpu_commands():
    """The one command of MAINTAINING.md's borrowed-machine recipe, each language's copy as one line."""
    text = (ROOT / 'MAINTAINING.md').read_text(encoding='utf-8')
    return [block.replace('\\\n', ' ') for block in re.findall(r'```bash\n(S=\$\(date \+%s\);.*?)```', text, re.S)]


# Code that decides or measures something on a GPU: a cell with any of these is a GPU cell.
GPU_CELL = re.compile(r"try_gpu|try_all_gpus|num_gpus\(|replica_devices|torch\.cuda|GpuReference|== 'cuda'")


def sections_with_gpu_cells():
    import nbpair
    found = set()
    for src in nbpair.sources():
        if src.stem[:2].isdigit() and any(GPU_CELL.search(code) for code in nbpair.python_code(src).values()):
            found.add(src.stem[:2])
    return found


def test_gpu_smoke_command_runs_09_first_keeps_its_logs_and_reaches_every_gpu_cell(gpu_smoke):
    from test_reference import page_references
    english, chinese = the_documented_gpu_commands()
    assert english == chinese, 'the two copies of the GPU command in MAINTAINING.md differ'
    notebooks = re.search(r'--notebooks ((?:\d\d )+)', english).group(1).split()
    assert notebooks[0] == '09' and len(set(notebooks)) == len(notebooks)
    assert set(notebooks) == sections_with_gpu_cells(), 'the command must run exactly the sections with GPU cells'
    recording = [n for n in notebooks if n in page_references()]
    assert notebooks[:len(recording)] == recording, 'the sections that record GPU figures run first'
    assert '--lang en zh' in english and '| tee $OUT/gpu-tests.log' in english and '--zip' in english
    files_back = {'summary.json', 'executed.zip', 'gpu-tests.xml', 'gpu-tests.log', gpu_smoke.REFERENCE_FILE}
    assert len(files_back) <= gpu_smoke.MAX_FILES_BACK


def test_a_section_with_a_gpu_cell_is_found():
    assert {'01', '02', '03', '04', '05', '09', '10'} <= sections_with_gpu_cells()
    assert not {'07'} & sections_with_gpu_cells()
    assert GPU_CELL.search("if device.type == 'cuda':") and not GPU_CELL.search('x = torch.zeros(3)')


def test_gpu_smoke_report_counts_missing_glyph_warnings_instead_of_listing_them(gpu_smoke):
    glyph = ("/x/pylabtools.py:170: UserWarning: Glyph 20013 (\\N{CJK UNIFIED IDEOGRAPH-4E2D}) missing from "
             "font(s) DejaVu Sans.\n  fig.canvas.print_figure(bytes_io, **kw)\n")
    assert gpu_smoke.without_glyph_warnings(glyph * 3) == ('', 3)
    assert gpu_smoke.without_glyph_warnings(glyph + 'RuntimeWarning: real\n') == ('RuntimeWarning: real\n', 1)
    summary = {'started_utc': 'now', 'facts': {}, 'notes': [], 'elapsed_seconds': 1, 'notebooks': {'10.zh': {
        'status': 'ok', 'seconds': 1, 'code_cells': 2, 'errors': [], 'cells': [
            {'index': 3, 'seconds': 1.0, 'stderr': glyph * 40}, {'index': 5, 'seconds': 1.0, 'stderr': 'odd\n'}]}}}
    text = gpu_smoke.report(summary)
    assert 'stderr cell 3' not in text and 'stderr cell 5: odd' in text and '  40 warnings of glyphs' in text


def test_gpu_smoke_runs_a_second_language_after_the_first_and_only_the_first_records(gpu_smoke, gpu_runner,
                                                                                    tmp_path, monkeypatch):
    import argparse
    args = gpu_smoke.parse_args(['--out', str(tmp_path), '--notebooks', '09', '02', '--lang', 'en', 'zh'])
    chosen = gpu_smoke.select(args)
    assert [name for name, _ in chosen] == ['09-one-training-step', '02-asynchronous-computation',
                                            '09-one-training-step.zh', '02-asynchronous-computation.zh']
    assert [path.parent.name for _, path in chosen] == ['en', 'en', 'zh', 'zh']
    monkeypatch.setenv('COURSE_REFERENCE_OUT', str(tmp_path / 'reference.json'))
    runner = gpu_runner.Runner(argparse.Namespace(started_at=None, lang=['en', 'zh']), tmp_path)
    runner.record_reference_in(tmp_path / 'notebooks' / 'en')
    assert os.environ['COURSE_REFERENCE_OUT'] == str(tmp_path / 'reference.json')
    runner.record_reference_in(tmp_path / 'notebooks' / 'zh')
    assert 'COURSE_REFERENCE_OUT' not in os.environ
    runner.record_reference_in(tmp_path / 'notebooks' / 'en')   # the path is remembered, not lost
    assert os.environ['COURSE_REFERENCE_OUT'] == str(tmp_path / 'reference.json')


def test_gpu_smoke_completes_and_keeps_the_reference_file(gpu_smoke, tmp_path, monkeypatch, capsys):
    import json

    from comp_perf import reference
    assert gpu_smoke.keep_reference(tmp_path, {}) is None          # no GPU cell recorded: nothing to keep
    data = {'format': 1, 'synthetic': False, 'experiments': {'02 CUDA events': {'settings': {}, 'figures': {}}},
            'machine': {'device_name': 'NVIDIA H200', 'torch': '2.11.0+cu130', 'date': '2026-12-02'}}
    (tmp_path / 'reference.json').write_text(json.dumps(data))
    facts = {'nvidia_smi': 'NVIDIA H200, 580.159.04, 143771 MiB', 'device_count': 1}
    assert gpu_smoke.keep_reference(tmp_path, facts) == ['02 CUDA events']
    kept = json.loads((tmp_path / 'reference.json').read_text())
    assert kept['machine']['driver'] == '580.159.04' and kept['machine']['device_count'] == 1
    monkeypatch.setattr(reference, 'REFERENCE_DIR', tmp_path / 'data' / 'reference')
    assert gpu_smoke.install_reference(tmp_path / 'reference.json') == 0
    assert json.loads((tmp_path / 'data' / 'reference' / 'nvidia-h200.json').read_text()) == kept
    kept['synthetic'] = True
    (tmp_path / 'synthetic.json').write_text(json.dumps(kept))
    assert gpu_smoke.install_reference(tmp_path / 'synthetic.json') == 2
    (tmp_path / 'broken.json').write_text('{')
    assert gpu_smoke.install_reference(tmp_path / 'broken.json') == 2
    assert 'cannot be read as JSON' in capsys.readouterr().err
    second = dict(kept, synthetic=False, experiments={'09 payoff': {'settings': {}, 'figures': {}}})
    (tmp_path / 'second.json').write_text(json.dumps(second))
    assert gpu_smoke.install_reference(tmp_path / 'reference.json', tmp_path / 'second.json') == 0
    merged = json.loads((tmp_path / 'data' / 'reference' / 'nvidia-h200.json').read_text())
    assert sorted(merged['experiments']) == ['02 CUDA events', '09 payoff'] and merged['machine'] == kept['machine']
    second['machine'] = dict(kept['machine'], torch='2.12.0')
    (tmp_path / 'second.json').write_text(json.dumps(second))
    assert gpu_smoke.install_reference(tmp_path / 'reference.json', tmp_path / 'second.json') == 2
    assert 'another GPU or torch' in capsys.readouterr().err


def test_gpu_smoke_knows_which_notebooks_read_fashion_mnist(gpu_facts):
    reading = {p.name[:2] for p in sorted((ROOT / 'notebooks' / 'en').glob('0*.ipynb')) if gpu_facts.reads_data(p)}
    assert reading == {'00', '05', '06', '07', '09'}


def test_gpu_smoke_stops_before_the_run_without_kit_or_data(gpu_facts):
    en = ROOT / 'notebooks' / 'en'
    chosen = [('02', en / '02-asynchronous-computation.ipynb'), ('05', en / '05-multi-gpu-from-scratch.ipynb')]
    data = {'fashion_mnist': '/somewhere/fashion-mnist'}
    assert gpu_facts.preflight(chosen, data, {}) == ([], False)
    notes, fatal = gpu_facts.preflight(chosen, data, {'nbclient': 'ModuleNotFoundError: nbclient'})
    assert fatal and '--make-kit' in notes[0]
    notes, fatal = gpu_facts.preflight(chosen, data, {'ipywidgets': 'ModuleNotFoundError: ipywidgets'})
    assert not fatal and 'ipywidgets' in notes[0]                  # only its cells fail
    notes, fatal = gpu_facts.preflight(chosen, {'fashion_mnist': None}, {})
    assert fatal and '05' in notes[0] and 'data/fashion-mnist' in notes[0]
    assert gpu_facts.preflight(chosen[:1], {'fashion_mnist': None}, {}) == ([], False)   # 02 needs no data


@pytest.mark.procs
def test_gpu_facts_child_program_reports_imports_and_torch(gpu_facts):
    # both run tools/gpu_facts.py in a subprocess, as the smoke run does before any notebook
    assert gpu_facts.import_failures(['json', 'no_such_module_here']) == \
        {'no_such_module_here': "ModuleNotFoundError: No module named 'no_such_module_here'"}
    facts = gpu_facts.machine_facts()
    assert facts['torch'] == torch.__version__ and 'torch_error' not in facts
    assert facts['cuda_available'] == torch.cuda.is_available() and 'nbclient' in facts['kit']


@pytest.mark.procs
def test_gpu_smoke_interrupts_a_cell_past_its_limit_and_keeps_its_traceback(gpu_smoke, tmp_path, capsys,
                                                                           monkeypatch):
    import json
    # The run points Jupyter and IPython at its scratch folder through os.environ (it is a
    # command of its own); undo that here, or later kernels of this pytest look in a deleted folder.
    for name in ('JUPYTER_PATH', 'JUPYTER_RUNTIME_DIR', 'IPYTHONDIR', 'PYDEVD_DISABLE_FILE_VALIDATION',
                 'MPLCONFIGDIR', 'MPLBACKEND', 'COURSE_REFERENCE_OUT'):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.setenv(name, '')   # recorded as unset, so that undoing it removes it again
            monkeypatch.delenv(name)
    nbformat = pytest.importorskip('nbformat')
    pytest.importorskip('nbclient')
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        'print("first")', 'import time\ndef stuck():\n    while True:\n        time.sleep(0.05)\nstuck()',
        'print("never")')])
    path = tmp_path / 'stuck.ipynb'
    nbformat.write(nb, path)
    out = tmp_path / 'out'
    on_sigterm = signal.getsignal(signal.SIGTERM)   # the run installs its own handler
    try:
        assert gpu_smoke.main(['--out', str(out), '--notebook-path', str(path), '--cell-timeout', '3']) == 0
    finally:
        signal.signal(signal.SIGTERM, on_sigterm)
    rec = json.loads((out / 'summary.json').read_text())['notebooks']['stuck']
    assert rec['status'] == 'timeout' and rec['not_run'] == [2]      # the timeout ended the notebook
    [error] = rec['errors']
    assert error['index'] == 1 and error['ename'] == 'CellTimeoutError'
    assert any('time.sleep(0.05)' in line for line in error['traceback'])   # where it was
