"""Section 10's built piece (comp_perf/s10_flash_attention.py): the forward and backward checks pass the
reference, fail planted mistakes at the part each one breaks, and say "not built yet" on the notebook's
skeleton; peak_allocated measures known allocations. Nothing here starts a process.
"""
import re
from pathlib import Path

import nbpair
import pytest
import torch
from helpers import ROOT, planted_file

import common
from comp_perf import s10_flash_attention as s10
from comp_perf import s10_flash_checks as checks

REFERENCE = Path(s10.__file__).read_text(encoding='utf-8')
FORWARD = 'comp_perf.s10_flash_attention'


def planted(tmp_path, name, *changes):
    """A file holding the reference module with each (old, new) of changes made (old must be there once)."""
    return str(planted_file(REFERENCE, tmp_path, name, *changes))


def run(check, source, capsys):
    """(passed, printed text) of a check on source."""
    passed = check(source)
    return passed, capsys.readouterr().out


def verdicts(out):
    """{'a': 'pass', 'b': 'FAIL', ...} from the printed part lines."""
    return dict((letter, verdict) for verdict, letter in re.findall(r'^(pass|FAIL) \((\w)\)', out, re.M))


def test_the_reference_passes_both_checks(capsys):
    passed, out = run(common.check_flash_attention, FORWARD, capsys)
    assert passed and verdicts(out) == dict.fromkeys('abcdefgh', 'pass'), out
    assert out.rstrip().endswith('FlashAttention forward: pass')
    passed, out = run(common.check_flash_backward, FORWARD, capsys)
    assert passed and verdicts(out) == dict.fromkeys('abcd', 'pass'), out
    assert out.rstrip().endswith('FlashAttention backward: pass')


@pytest.mark.parametrize('name, changes, fails', [
    # (i) the running normaliser and output are not rescaled when the max grows
    ('no_rescale', [('row_sum * correction + p.sum(-1, keepdim=True), acc * correction + p @ v_tile',
                     'row_sum + p.sum(-1, keepdim=True), acc + p @ v_tile')], 'a'),
    # (ii) exp of the raw scores: right at small scores, inf / inf = nan once they pass 88
    ('no_max', [('m_new = torch.maximum(m, s.amax(-1, keepdim=True))', 'm_new = torch.zeros_like(m)')], 'd'),
    # (iii) a key hidden from its own query (< instead of <=)
    ('strict_mask', [('key > query', 'key >= query')], 'b'),
    # (iii) tile-local positions: right only where query and key tiles start together
    ('local_mask', [('torch.arange(i, i + rows,', 'torch.arange(0, rows,'),
                    ('torch.arange(j, j + cols,', 'torch.arange(0, cols,')], 'b'),
    # (iv) the last, partial query block dropped
    ('no_last_block', [('for i in range(0, t_q, block_q):', 'for i in range(0, t_q - block_q + 1, block_q):')], 'c'),
    # (vi) as many keys read as there are queries: right while t_q = t_k, wrong (or an error) otherwise
    ('keys_as_many_as_queries', [('range(0, visible_keys(i, rows, t_k, causal)',
                                  'range(0, visible_keys(i, rows, t_q, causal)')], 'g'),
    # (vii) the output shaped like q: right while v's head size is q's
    ('out_like_q', [('out = q.new_empty(*q.shape[:-1], v.shape[-1])', 'out = torch.empty_like(q)')], 'g'),
    # (v) log l without m
    ('lse_without_max', [('(m + torch.log(row_sum)).squeeze(-1)', 'torch.log(row_sum).squeeze(-1)')], 'e'),
    # (viii) every key block read and masked: the right numbers at the cost of no mask at all
    ('no_skipping', [('return min(t_k, i + rows) if causal else t_k', 'return t_k')], 'h'),
])
def test_a_planted_mistake_fails_its_part(name, changes, fails, tmp_path, capsys):
    passed, out = run(common.check_flash_attention, planted(tmp_path, name, *changes), capsys)
    assert not passed and verdicts(out)[fails] == 'FAIL', out
    assert out.rstrip().endswith('FlashAttention forward: fail')


def test_no_max_passes_small_scores_and_gives_nan_at_large_ones(tmp_path, capsys):
    passed, out = run(common.check_flash_attention, planted(
        tmp_path, 'no_max', ('m_new = torch.maximum(m, s.amax(-1, keepdim=True))', 'm_new = torch.zeros_like(m)')),
        capsys)
    assert verdicts(out)['a'] == 'pass' and re.search(r'FAIL \(d\) .*error nan', out), out


def test_a_tile_local_mask_is_right_only_where_the_tiles_align(tmp_path):
    path = planted(tmp_path, 'local_mask', ('torch.arange(i, i + rows,', 'torch.arange(0, rows,'),
                   ('torch.arange(j, j + cols,', 'torch.arange(0, cols,'))
    flash = checks.load_solution(path, 'flash_attention')
    assert checks._forward_errors(flash, 128, 32, 32, True, 2)[0] < checks.TOL
    assert checks._forward_errors(flash, 128, 32, 16, True, 2)[0] > 100 * checks.TOL


def test_plain_attention_inside_passes_everything_but_memory(tmp_path, capsys):
    path = tmp_path / 'plain.py'
    path.write_text('from comp_perf.s10_flash_checks import plain_attention\n\n\n'
                    'def flash_attention(q, k, v, causal=False, block_q=32, block_k=32):\n'
                    '    return plain_attention(q, k, v, causal)\n')
    passed, out = run(common.check_flash_attention, str(path), capsys)
    assert not passed and verdicts(out) == dict(dict.fromkeys('abcdeg', 'pass'), f='FAIL', h='FAIL'), out
    mine, plain = map(float, re.search(r'\(f\) .*: ([\d.]+) MiB, plain attention ([\d.]+) MiB', out).groups())
    assert mine == plain


@pytest.mark.parametrize('name, old, new, fails', [
    ('no_d', 'ds = p * (do_tile @ v_tile.transpose(-2, -1) - big_d[..., i:i + block_q, :])',
     'ds = p * (do_tile @ v_tile.transpose(-2, -1))', 'a'),
    ('dk_unscaled', 'ds.transpose(-2, -1) @ q_tile * scale', 'ds.transpose(-2, -1) @ q_tile', 'a'),
    ('no_mask_in_recompute', 'exp(tile_scores(q_tile, k_tile, i, j, causal)',
     'exp(tile_scores(q_tile, k_tile, i, j, False)', 'b'),
    ('keys_as_many_as_queries', 'for j in range(0, t_k, block_k):', 'for j in range(0, t_q, block_k):', 'd'),
])
def test_a_planted_backward_mistake_fails_its_part(name, old, new, fails, tmp_path, capsys):
    passed, out = run(common.check_flash_backward, planted(tmp_path, name, (old, new)), capsys)
    assert not passed and verdicts(out)[fails] == 'FAIL', out
    assert out.rstrip().endswith('FlashAttention backward: fail')


def test_the_backward_check_names_the_wrong_gradient_alone(tmp_path, capsys):
    # dk without its 1/sqrt(d): dq and dv stay right, and the line says which one is not
    passed, out = run(common.check_flash_backward, planted(
        tmp_path, 'dk_unscaled', ('ds.transpose(-2, -1) @ q_tile * scale', 'ds.transpose(-2, -1) @ q_tile')), capsys)
    line = next(row for row in out.splitlines() if row.startswith('FAIL (a)'))
    assert line.endswith(': dk wrong') and re.search(r'dq \d\.\de-\d\d, dk \d\.\de\+?-?\d\d, dv', line), line


def test_the_skipping_is_counted_not_inferred_from_the_result(tmp_path, capsys):
    # reading and masking every key block: every result part passes, only the FLOPs show it
    passed, out = run(common.check_flash_attention, planted(
        tmp_path, 'no_skipping', ('return min(t_k, i + rows) if causal else t_k', 'return t_k')), capsys)
    assert verdicts(out) == dict(dict.fromkeys('abcdefg', 'pass'), h='FAIL'), out
    assert re.search(r'FAIL \(h\) .* computed 100% of the matrix products', out), out
    assert 'gap 1 (visible_keys) decides how many key blocks' in out


def test_an_error_names_the_function_and_line_of_the_students_file(tmp_path, capsys):
    path = planted(tmp_path, 'transposed_v', ('acc * correction + p @ v_tile', 'acc * correction + p @ v_tile.mT'))
    passed, out = run(common.check_flash_attention, path, capsys)
    assert not passed and out.startswith('fail: flash_attention raised RuntimeError'), out
    number = REFERENCE.splitlines().index(next(row for row in REFERENCE.splitlines() if 'p @ v_tile' in row)) + 1
    assert f'(in online_update, line {number} of transposed_v.py: return m_new' in out, out


def test_a_logsumexp_of_the_wrong_shape_gets_a_hint_naming_gap_4(tmp_path, capsys):
    # finish_rows keeps the last dimension: the skeleton's assignment into lse fails with an expand error
    path = planted(tmp_path, 'lse_kept_dim', ('(m + torch.log(row_sum)).squeeze(-1)', 'm + torch.log(row_sum)'))
    passed, out = run(common.check_flash_attention, path, capsys)
    assert not passed and out.startswith('fail: flash_attention raised RuntimeError'), out
    assert 'hint: gap 4 (finish_rows) returns a logsumexp of shape (2, 3, 4, 1)' in out and 'shape (2, 3, 4)' in out


def test_a_logsumexp_of_the_wrong_shape_from_any_version_fails_part_e_by_its_shape(tmp_path, capsys):
    path = tmp_path / 'lse_2d.py'
    path.write_text('from comp_perf.s10_flash_checks import plain_attention\n\n\n'
                    'def flash_attention(q, k, v, causal=False, block_q=32, block_k=32):\n'
                    '    out, lse = plain_attention(q, k, v, causal)\n'
                    '    return out, lse[..., None]\n')
    passed, out = run(common.check_flash_attention, str(path), capsys)
    assert verdicts(out)['e'] == 'FAIL' and 'needs one number per query row' in out, out


@pytest.mark.parametrize('t_q, t_k', [(5, 9), (9, 5), (7, 7)])
def test_the_causal_mask_is_aligned_as_sdpa_aligns_it(t_q, t_k):
    # top left: query i sees keys 0 .. i (torch.ones(t_q, t_k).tril()), whatever the lengths
    q, k, v = (torch.randn(2, t, 4 if name != 'v' else 3, dtype=torch.float64)
               for name, t in (('q', t_q), ('k', t_k), ('v', t_k)))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(checks.plain_attention(q, k, v, causal=True)[0], want, atol=1e-12)
    out = s10.flash_attention(q.float(), k.float(), v.float(), causal=True, block_q=2, block_k=3)[0]
    assert out.shape == (2, t_q, 3) and torch.allclose(out.double(), want, atol=1e-5)


@pytest.mark.parametrize('q, k, v, error, says', [
    (torch.ones(1, 4, 8, dtype=torch.long), torch.ones(1, 4, 8, dtype=torch.long),
     torch.ones(1, 4, 8, dtype=torch.long), TypeError, 'floating-point'),
    (torch.ones(1, 4, 8), torch.ones(2, 4, 8), torch.ones(2, 4, 8), ValueError, 'leading'),
    (torch.ones(1, 4, 8), torch.ones(1, 4, 6), torch.ones(1, 4, 8), ValueError, 'head size'),
    (torch.ones(1, 4, 8), torch.ones(1, 4, 8), torch.ones(1, 5, 8), ValueError, 'as many rows'),
    (torch.ones(1, 4, 8), torch.ones(1, 0, 8), torch.ones(1, 0, 8), ValueError, 'at least one'),
])
def test_inputs_that_cannot_be_attended_get_a_clear_error(q, k, v, error, says):
    for attend in (s10.flash_attention, checks.plain_attention):
        with pytest.raises(error, match=says):
            attend(q, k, v)
    with pytest.raises(error, match=says):
        s10.flash_attention_backward(q, k, v, q, q[..., 0], q)


@pytest.mark.parametrize('body, says', [
    ("    raise NotImplementedError('gap 2')\n", 'not built yet: gap 2 still raises NotImplementedError'),
    ('    return q\n', 'fail: flash_attention should return 2 tensors, it returned Tensor'),
    ('    return q @ k\n', 'fail: flash_attention raised RuntimeError'),
])
def test_a_gap_a_wrong_return_or_an_error_is_one_line(body, says, tmp_path, capsys):
    path = tmp_path / 'mine.py'
    path.write_text(f'def flash_attention(q, k, v, causal=False, block_q=32, block_k=32):\n{body}')
    passed, out = run(common.check_flash_attention, str(path), capsys)
    assert not passed and out.startswith(says) and len(out.strip().splitlines()) == 1, out
    passed, out = run(common.check_flash_attention, str(tmp_path / 'missing.py'), capsys)
    assert not passed and out.startswith('fail: there is no file')


def test_peak_allocated_measures_known_allocations():
    def two_of_three():   # three 1 MiB buffers, at most two alive; a view and an in-place op are no new memory
        a = torch.empty(2**20, dtype=torch.uint8)
        b = torch.empty(2**20, dtype=torch.uint8)
        del a
        c = torch.empty(2**20, dtype=torch.uint8)
        c.add_(1)
        return b[:10], c.view(-1)
    assert common.peak_allocated(lambda: torch.empty(1000, 1000)) == 4_000_000
    assert common.peak_allocated(two_of_three) == 2 * 2**20
    q = torch.randn(2, 256, 16)   # plain attention holds two t × t float32 tensors at once, flash far less
    assert common.peak_allocated(lambda: checks.plain_attention(q, q, q)) >= 2 * 2 * 256 * 256 * 4
    assert common.peak_allocated(lambda: common.flash_attention(q, q, q, block_q=32, block_k=32)) < 256 * 256 * 4


def notebook_cells(name):
    """The English text of section 10's `%%writefile artifacts/{name}` cell and of its hint cells, or skip."""
    for source in sorted((ROOT / 'notebooks' / 'src').glob('10-*.txt')):
        cells = nbpair.parse(source)
        code = [c['en'] for c in cells if c['type'] == 'code' and c['en'].startswith(f'%%writefile artifacts/{name}')]
        if code:
            return code[0].split('\n', 1)[1], '\n'.join(c['en'] for c in cells if c['type'] == 'md')
    pytest.skip(f"section 10's source has no %%writefile artifacts/{name} cell yet")


@pytest.mark.parametrize('name, check', [('my_flash_attention.py', common.check_flash_attention),
                                         ('my_flash_backward.py', common.check_flash_backward)])
def test_the_checks_say_not_built_yet_on_the_notebooks_skeletons(name, check, tmp_path, capsys):
    skeleton, _ = notebook_cells(name)
    path = tmp_path / name
    path.write_text(skeleton, encoding='utf-8')
    passed, out = run(check, str(path), capsys)
    assert not passed and out.startswith('not built yet: gap 1 still raises NotImplementedError'), out
    assert 'Traceback' not in out


def test_the_skeleton_filled_with_the_hints_passes(tmp_path, capsys):
    # each hint's code block, put in place of its gap's raise, passes the check
    skeleton, markdown = notebook_cells('my_flash_attention.py')
    for number, gap in re.findall(r'<summary>Hint for gap (\d+)</summary>.*?```python\n(.*?)```', markdown, re.S):
        line = f"    raise NotImplementedError('gap {number}')\n"
        assert line in skeleton, f'the skeleton has no {line!r}'
        skeleton = skeleton.replace(line, ''.join(f'    {row}\n' for row in gap.splitlines()))
    path = tmp_path / 'my_flash_attention.py'
    path.write_text(skeleton, encoding='utf-8')
    passed, out = run(common.check_flash_attention, str(path), capsys)
    assert passed, out


def test_on_a_gpu_peak_allocated_reads_the_allocators_peak_between_two_synchronisations(monkeypatch):
    """Faked CUDA: the GPU branch waits for queued work before resetting and before reading the peak."""
    from comp_perf import s10_flash_checks as checks
    calls, state = [], {'allocated': 100, 'peak': 100}
    fake = dict(synchronize=lambda d=None: calls.append('sync'),
                reset_peak_memory_stats=lambda d=None: (calls.append('reset'), state.update(peak=state['allocated'])),
                memory_allocated=lambda d=None: state['allocated'],
                max_memory_allocated=lambda d=None: (calls.append('read'), state['peak'])[1])
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)

    def work():
        calls.append('work')
        state.update(peak=state['allocated'] + 4096)
    assert checks.peak_allocated(work, device='cuda') == 4096
    assert calls == ['sync', 'reset', 'work', 'sync', 'read']
