"""`import common` works outside the repo, under torchrun, and the live plot in a notebook."""
import subprocess
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent


def test_common_is_installed_not_found_by_accident(tmp_path):
    out = subprocess.run([sys.executable, '-c', 'import common; print(common.__file__)'],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, check=True)
    assert Path(out.stdout.strip()) == ROOT / 'common.py'


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


def test_animator_leaves_its_final_frame_in_an_executed_notebook(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        'import common\n'
        "anim = common.Animator(xlabel='epoch', legend=['loss'])\n"
        'for epoch in range(4):\n'
        '    anim.add(epoch, [1 / (epoch + 1)])\n'
        "print('done')")]
    NotebookClient(nb, timeout=120, kernel_name='python3',
                   resources={'metadata': {'path': str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    figures = [o for o in outputs if o.output_type == 'display_data']
    assert len(figures) == 1 and 'image/png' in figures[0].data  # updated in place, not 4 copies
    assert any(o.output_type == 'stream' and 'done' in o.text for o in outputs)
