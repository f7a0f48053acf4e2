"""`import common` works outside the repo, under torchrun, and the live plot in a notebook."""
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from helpers import ROOT
from nbclient import NotebookClient


@pytest.mark.procs
def test_common_is_installed_not_found_by_accident(tmp_path):
    out = subprocess.run([sys.executable, '-c', 'import common; print(common.__file__)'],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert Path(out.stdout.strip()) == ROOT / 'common.py'


@pytest.mark.procs
def test_common_under_torchrun(tmp_path):
    script = tmp_path / 'job.py'
    script.write_text(
        'import os\n'
        'import torch.distributed as dist\n'
        'import common\n'
        "dist.init_process_group('gloo')\n"
        'total = common.allreduce_check(dist.get_rank(), dist.get_world_size())\n'
        "os.write(1, f'sum {total}\\n'.encode())  # one write: lines of two ranks cannot interleave\n"
        'dist.destroy_process_group()\n')
    out = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone',
                          '--nproc_per_node=2', str(script)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count('sum 3.0') == 2


@pytest.mark.procs
def test_animator_leaves_its_final_frame_in_an_executed_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        'import common\n'
        "anim = common.Animator(xlabel='epoch', legend=['loss'])\n"
        'for epoch in range(4):\n'
        '    anim.add(epoch, [1 / (epoch + 1)])\n'
        "print('done')")]
    NotebookClient(nb, timeout=120, kernel_name='comp-perf',
                   resources={'metadata': {'path': str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    figures = [o for o in outputs if o.output_type == 'display_data']
    assert len(figures) == 1 and 'image/png' in figures[0].data  # updated in place, not 4 copies
    assert any(o.output_type == 'stream' and 'done' in o.text for o in outputs)


def test_the_notebooks_ask_for_the_course_kernel_and_it_runs_this_python():
    """One kernel: the name ./course registers is the name every notebook asks for."""
    from jupyter_client.kernelspec import KernelSpecManager
    course = (ROOT / 'course').read_text()
    assert 'KERNEL=comp-perf' in course and '--name "$KERNEL"' in course
    names = {nbformat.read(f, as_version=4).metadata.kernelspec.name
             for f in sorted((ROOT / 'notebooks').glob('*/*.ipynb'))}
    assert names == {'comp-perf'}
    spec = KernelSpecManager().get_kernel_spec('comp-perf')
    assert Path(spec.argv[0]).resolve() == Path(sys.executable).resolve(), \
        f'the comp-perf kernel runs {spec.argv[0]}, not this environment: run ./course setup'


def test_every_requirement_is_used_by_the_course():
    """requirements.txt lists only what the course (or a package it uses) needs: each package's
    import name appears in the course's own files, or it is one of the few used without an import."""
    import importlib.metadata
    without_import = {'jupyterlab-rise': 'a JupyterLab extension: View > Render as Reveal Slideshow'}
    own = '\n'.join(f.read_text(encoding='utf-8') for f in
                    [ROOT / 'common.py', ROOT / 'course', *ROOT.glob('tools/*.py'), *ROOT.glob('notebooks/src/*.txt')])
    modules = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            modules.setdefault(dist.lower().replace('_', '-'), []).append(module)
    import d2l
    # what the book's d2l.torch imports: d2l itself comes without dependencies (requirements-d2l.txt)
    book = (Path(d2l.__file__).parent / 'torch.py').read_text(encoding='utf-8')
    for line in (ROOT / 'requirements.txt').read_text().splitlines():
        name = re.split(r'[<>=\[ ]', line.strip(), maxsplit=1)[0].lower()
        if not name or name.startswith('#') or name in without_import:
            continue
        if name in ('pandas', 'scipy', 'requests'):
            assert re.search(rf'^(import|from) {name}\b', book, re.M), f"d2l.torch no longer imports {name}"
            continue
        names = modules.get(name, [name.replace('-', '_')])
        assert any(re.search(rf'\b{re.escape(m)}\b', own) for m in names), f'{name} ({names}) is never used'


def test_the_course_lab_opens_without_asking_about_jupyter_news():
    """./course puts its JupyterLab defaults into the environment (overrides.json), not the user's home."""
    import json
    overrides = Path(sys.prefix, 'share', 'jupyter', 'lab', 'settings', 'overrides.json')
    ours = json.loads((ROOT / 'tools' / 'lab_overrides.json').read_text(encoding='utf-8'))
    assert ours['@jupyterlab/apputils-extension:notification'] == {'fetchNews': 'false', 'checkForUpdates': False}
    assert overrides.exists(), f'{overrides} is missing: run ./course setup'
    assert json.loads(overrides.read_text(encoding='utf-8')) == ours
