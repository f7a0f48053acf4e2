"""Section 11's Triton pieces (comp_perf/s11_triton.py, comp_perf/s11_flash_kernel.py): the check passes the
reference kernel in Triton's interpreter and fails each planted mistake at the part it breaks; the byte
counter agrees with a hand count; a gap still raising reads "not built yet" on the CPU and on a (faked) GPU
compiler; bfloat16 is refused in the interpreter; a machine without Triton gets stand-ins, not an error;
the kernel inside autograd gives SDPA's gradients. Nothing here starts a process.
"""
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import planted_file
from torch.nn import functional as F

pytest.importorskip('triton', reason='Triton has no wheel for this platform')

from comp_perf import s11_triton as s11  # noqa: E402

REFERENCE = Path(s11.REFERENCE).read_text(encoding='utf-8')


def planted(tmp_path, name, *changes):
    """A file holding the reference kernel with each (old, new) of changes made."""
    return planted_file(REFERENCE, tmp_path, name, *changes)


@pytest.fixture(autouse=True)
def one_head(monkeypatch):
    """The check on one head instead of two: every part still runs, in half the interpreter's time."""
    monkeypatch.setattr(s11, 'CHECK_BATCH', (1, 1))


def verdicts(out):
    return dict((letter, verdict) for verdict, letter in re.findall(r'^(pass|FAIL) \((\w)\)', out, re.M))


def test_the_reference_kernel_passes_every_part_in_the_interpreter(capsys):
    assert s11.check_triton_flash()
    out = capsys.readouterr().out
    assert verdicts(out) == dict.fromkeys('abcdeg', 'pass') and 'Triton FlashAttention: pass' in out


PLANTED = {
    # the old max's sums are not rescaled when a later tile raises the max
    'no_rescale': ([('row_sum = row_sum * correction + tl.sum(p, axis=1)', 'row_sum = row_sum + tl.sum(p, axis=1)'),
                    ('acc = acc * correction[:, None] + tl.dot', 'acc = acc + tl.dot')], 'a'),
    # the causal mask compares tile-local positions: right only where query and key tiles coincide
    'mask_in_tile_positions': ([('keep = keep & (cols[None, :] <= rows[:, None])',
                                 'keep = keep & (tl.arange(0, BLOCK_K)[None, :] <= tl.arange(0, BLOCK_Q)[:, None])')],
                               'b'),
    # the loop stops before a last, partial key block
    'last_partial_block_skipped': ([('for start in range(0, end, BLOCK_K):',
                                     'for start in range(0, end - BLOCK_K + 1, BLOCK_K):')], 'c'),
    # v's rows are d apart instead of d_v: right only while the two head sizes agree
    'wrong_stride_of_v': ([('v = tl.load(v_ptr + head * t_k * d_v + cols[:, None] * d_v',
                            'v = tl.load(v_ptr + head * t_k * d_v + cols[:, None] * d')], 'g'),
}


@pytest.mark.parametrize('name', PLANTED)
def test_each_planted_mistake_fails_its_part(name, tmp_path, capsys):
    changes, part = PLANTED[name]
    assert not s11.check_triton_flash(planted(tmp_path, name, *changes))
    got = verdicts(capsys.readouterr().out)
    assert got[part] == 'FAIL', got


def test_a_gap_still_raising_is_not_built_yet(tmp_path, capsys):
    first = "    m = tl.full((BLOCK_Q,), -float('inf'), tl.float32)"
    path = planted(tmp_path, 'gap', (first, "    raise NotImplementedError('gap 2')\n" + first))
    assert not s11.check_triton_flash(path)
    out = capsys.readouterr().out
    assert out.startswith('not built yet: gap 2 still raises NotImplementedError') and 'Traceback' not in out, out


def test_the_gpu_compilers_refusal_of_a_gap_reads_as_that_gap():
    class CompilationError(Exception):   # what triton.compiler raises for a raise statement, quoting its line
        pass
    quoted = CompilationError("at 12:4:\n    raise NotImplementedError('gap 3')\n    ^\n"
                              "unsupported AST node type: Raise")
    assert s11._gap_in(quoted) == 'gap 3'
    assert s11._gap_in(ValueError('shapes differ')) is None


def test_the_counter_counts_the_bytes_a_hand_count_gives(tmp_path):
    import triton
    import triton.language as tl

    source = tmp_path / 'kernels.py'
    source.write_text('''
import triton
import triton.language as tl

@triton.jit
def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=inside) + tl.load(y_ptr + offsets, mask=inside),
             mask=inside)
''', encoding='utf-8')
    add = s11.load_kernel_file(source, 'add')
    n = 1000   # not a multiple of the block: the masked-off lanes of the last block move nothing
    x, y, out = torch.randn(n), torch.randn(n), torch.empty(n)
    traffic = s11.traffic_of(add, (triton.cdiv(n, 256),), x, y, out, n, BLOCK=256)
    assert torch.equal(out, x + y)
    assert (traffic.loaded, traffic.stored, traffic.loads, traffic.stores) == (2 * 4 * n, 4 * n, 2 * 4, 4)
    half = s11.traffic_of(add, (triton.cdiv(n, 256),), x.half(), y.half(), out.half(), n, BLOCK=256)
    assert half.total == 3 * 2 * n
    assert tl is not None


def test_the_interpreter_refuses_bfloat16():
    q = torch.randn(1, 1, 32, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match='bfloat16'):
        s11._graded_on(s11.load_kernel_file(), 'cpu')(q, q, q)


def test_without_triton_the_page_gets_stand_ins_and_a_sentence(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, 'triton', None)     # import triton now raises ImportError
    monkeypatch.setitem(sys.modules, 'triton.language', None)
    kit = s11.load_triton('cpu')
    assert kit.mode == 'missing' and not kit.runs and 'cannot be imported' in capsys.readouterr().out
    triton, tl = kit.triton, kit.tl

    @triton.jit
    def kernel(x_ptr, BLOCK: tl.constexpr):   # a page's definition cell still runs
        pass
    kernel[(triton.cdiv(10, 4),)](None, BLOCK=4)


@pytest.mark.procs
def test_import_common_does_not_import_triton():
    code = 'import sys, common; print("triton" in sys.modules)'
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120,
                         cwd=Path(s11.__file__).parent.parent)
    assert out.stdout.strip() == 'False', out.stderr


def test_the_kernel_inside_autograd_gives_sdpas_output_and_gradients():
    attention = s11.kernel_attention(s11.load_kernel_file())
    torch.manual_seed(0)
    leaves = [torch.randn(1, 2, 45, 16, requires_grad=True) for _ in range(3)]
    twins = [x.detach().clone().requires_grad_() for x in leaves]
    out, want = attention(*leaves, is_causal=True), F.scaled_dot_product_attention(*twins, is_causal=True)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    assert (out - want).abs().max() < 1e-5
    for got, ref in zip(leaves, twins):
        assert (got.grad - ref.grad).abs().max() / ref.grad.abs().max() < 1e-4
    assert math.isfinite(out.sum().item())


def notebook_cells():
    """The English text of section 11's skeleton cell and of its markdown cells."""
    import nbpair
    from helpers import ROOT
    cells = nbpair.parse(next((ROOT / 'notebooks' / 'src').glob('11-*.txt')))
    code = [c['en'] for c in cells if c['type'] == 'code' and c['en'].startswith('%%writefile artifacts/my_triton')]
    return code[0].split('\n', 1)[1], '\n'.join(c['en'] for c in cells if c['type'] == 'md')


def test_the_notebooks_skeleton_is_not_built_yet(tmp_path, capsys):
    skeleton, _ = notebook_cells()
    path = tmp_path / 'my_triton_flash.py'
    path.write_text(skeleton, encoding='utf-8')
    assert not s11.check_triton_flash(path)
    out = capsys.readouterr().out
    assert out.startswith('not built yet: gap 1 still raises NotImplementedError') and 'Traceback' not in out, out


def test_the_skeleton_filled_with_the_hints_passes(tmp_path, capsys):
    skeleton, markdown = notebook_cells()
    hints = re.findall(r'<summary>Hint for gap (\d+)</summary>.*?```python\n(.*?)```', markdown, re.S)
    assert [n for n, _ in hints] == ['1', '2', '3']
    for number, code in hints:
        line = next(row for row in skeleton.splitlines() if row.strip() == f"raise NotImplementedError('gap {number}')")
        indent = line[:len(line) - len(line.lstrip())]
        skeleton = skeleton.replace(line + '\n', ''.join(f'{indent}{row}\n' for row in code.splitlines()))
    path = tmp_path / 'my_triton_flash.py'
    path.write_text(skeleton, encoding='utf-8')
    assert s11.check_triton_flash(path), capsys.readouterr().out


def test_the_reference_kernel_refuses_integer_inputs_like_10s():
    from comp_perf import s11_flash_kernel   # imports Triton: interpreted here (conftest), as on the page's CPU
    q = torch.ones(1, 1, 8, 16, dtype=torch.int64)
    with pytest.raises(TypeError, match='floating-point'):
        s11_flash_kernel.triton_flash_attention(q, q, q)


@pytest.mark.procs
@pytest.mark.notebooks
def test_the_notebook_runs_top_to_bottom_where_triton_cannot_be_imported(tmp_path, monkeypatch):
    """macOS and Windows have no Triton wheel: a `triton` package that fails to import comes first on the
    kernel's path, and every cell must still run, the launching ones saying that they skipped."""
    import nbformat
    import nbpair
    from helpers import ROOT
    from nbclient import NotebookClient
    fake = tmp_path / 'no_triton' / 'triton'
    fake.mkdir(parents=True)
    (fake / '__init__.py').write_text("raise ImportError('no Triton wheel for this platform (faked)')\n")
    monkeypatch.setenv('PYTHONPATH', str(fake.parent))
    monkeypatch.setenv('COURSE_SETTINGS', 'T0')
    work = tmp_path / 'run'
    work.mkdir()
    nb = nbformat.read(ROOT / 'notebooks' / 'en' / '11-writing-kernels.ipynb', as_version=4)
    NotebookClient(nb, timeout=300, kernel_name=nbpair.KERNELSPEC['name'],
                   resources={'metadata': {'path': str(work)}}).execute()
    printed = '\n'.join(o.get('text', '') for c in nb.cells if c.cell_type == 'code' for o in c.outputs)
    assert 'Triton cannot be imported here (ImportError: no Triton wheel for this platform (faked))' in printed
    assert printed.count('skipped: Triton is not installed here') >= 5
    assert not any(o.output_type == 'error' for c in nb.cells if c.cell_type == 'code' for o in c.outputs)


def test_on_a_gpu_the_kit_compiles_and_the_interpreter_is_left_off(monkeypatch, capsys):
    """Faked CUDA device: load_triton neither switches the interpreter on nor hides which GPU it compiles for."""
    monkeypatch.delenv(s11.INTERPRET)
    monkeypatch.setattr(torch.cuda, 'get_device_name', lambda device=None: 'NVIDIA H100 80GB HBM3 (faked)')
    kit = s11.load_triton('cuda')
    assert kit.mode == 'native' and kit.why == 'NVIDIA H100 80GB HBM3 (faked)'
    assert s11.INTERPRET not in os.environ
    assert 'compiled for NVIDIA H100 80GB HBM3 (faked)' in capsys.readouterr().out
    monkeypatch.setenv(s11.INTERPRET, '1')   # set by hand on a GPU machine: interpreted, and the line says so
    assert s11.load_triton('cuda').mode == 'interpreter' and 'interpreter' in capsys.readouterr().out


def test_eager_traffic_counts_each_operators_reads_and_writes_and_no_view():
    x = torch.randn(64, 100)
    assert s11.eager_traffic(lambda x: torch.softmax(x, -1), x).total == 2 * x.nbytes     # one fused operator
    assert s11.eager_traffic(lambda x: (x + 1) * 2, x).total == 4 * x.nbytes              # two, each reads and writes
    assert s11.eager_traffic(lambda x: x.view(100, 64).t(), x).total == 0                 # views move nothing
