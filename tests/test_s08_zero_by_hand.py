"""Section 08's built pieces (comp_perf/s08_zero_by_hand.py, comp_perf/s08_fsdp_timeline.py): the ZeRO-1
check passes the reference, fails planted bugs and says "not built yet" on the notebook's skeleton; the
FSDP timeline records each layer's all-gathers and reduce-scatters in the order FSDP runs them.
Every test here starts worker processes (check_zero1 and fsdp_timeline run under common.launch): the
procs tier.
"""
import inspect
import re

import nbpair
import pytest
from helpers import ROOT

import common
from comp_perf import s08_zero_by_hand

pytestmark = pytest.mark.procs

REFERENCE = inspect.getsource(s08_zero_by_hand.Zero1)
HEADER = 'import torch\nimport torch.distributed as dist\n\n\n'


def planted(tmp_path, name, old, new):
    """A file holding the reference Zero1 with `old` replaced by `new` (which must be there)."""
    assert old in REFERENCE, f'the reference no longer contains {old!r}'
    path = tmp_path / f'{name}.py'
    path.write_text(HEADER + REFERENCE.replace(old, new))
    return path


def skeleton():
    """The notebook's %%writefile artifacts/my_zero1.py cell, without its first line."""
    cells = [c['en'] for c in nbpair.parse(ROOT / 'notebooks' / 'src' / '08-beyond-data-parallelism.txt')
             if c['type'] == 'code' and c['en'].startswith('%%writefile artifacts/my_zero1.py')]
    assert len(cells) == 1, '08 has one %%writefile artifacts/my_zero1.py cell'
    return cells[0].split('\n', 1)[1]


def test_the_reference_zero1_passes_its_check(capsys):
    assert common.check_zero1('comp_perf.s08_zero_by_hand')
    out = capsys.readouterr().out
    assert out.count('pass (a)') == 2 and 'pass (b)' in out and out.rstrip().endswith('ZeRO-1 by hand: pass')


def test_the_zero1_check_fails_when_the_gradients_are_not_averaged(tmp_path, capsys):
    # Adam hardly notices a gradient scaled by N; SGD with momentum does
    bug = planted(tmp_path, 'summed', 'grad_shard /= self.world', 'pass')
    assert not common.check_zero1(str(bug))
    out = capsys.readouterr().out
    assert 'FAIL (a) SGD' in out and 'pass (b)' in out and out.rstrip().endswith('fail')


def test_the_zero1_check_fails_when_every_rank_keeps_the_whole_optimiser_state(tmp_path, capsys):
    # every rank steps an optimiser over all parameters: right parameters, full-size state
    bug = planted(tmp_path, 'full_state', 'self.optimizer = optimizer_class([self.shard], **defaults)',
                  'self.whole = flat.clone().requires_grad_()\n'
                  '        self.optimizer = optimizer_class([self.whole], **defaults)')
    bug.write_text(bug.read_text().replace(
        '        self.shard.grad = grad_shard\n        self.optimizer.step()',
        '        whole = torch.empty(self.world * self.shard_numel)\n'
        '        dist.all_gather_single(whole, grad_shard)\n'
        '        self.whole.grad = whole\n'
        '        self.optimizer.step()\n'
        '        self.shard.copy_(self.whole.detach()[self.rank * self.shard_numel:][:self.shard_numel])'))
    assert not common.check_zero1(str(bug))
    out = capsys.readouterr().out
    assert out.count('pass (a)') == 2 and 'FAIL (b)' in out
    ratios = [float(r) for r in re.search(r'state per rank: ([\d., ]+) of', out).group(1).split(', ')]
    assert all(r > 0.9 for r in ratios)


def test_the_zero1_check_says_not_built_yet_on_the_notebooks_skeleton(tmp_path, capsys):
    # the skeleton raises NotImplementedError in its first gap, in both worker processes
    path = tmp_path / 'my_zero1.py'
    path.write_text(skeleton())
    assert not common.check_zero1(str(path))
    out = capsys.readouterr().out
    assert out.startswith('not built yet: gap 1 still raises NotImplementedError') and 'Traceback' not in out


def test_the_zero1_check_reports_a_worker_error_without_hanging(tmp_path, capsys):
    # a rank that skips the all-gather leaves the other one waiting: op_timeout ends it
    bug = planted(tmp_path, 'one_rank', 'dist.all_gather_single(whole, self.shard.detach())',
                  'dist.all_gather_single(whole, self.shard.detach()) if self.rank == 0 else None')
    assert not common.check_zero1(str(bug))
    assert capsys.readouterr().out.startswith('fail: your Zero1 raised an error')


def test_the_fsdp_timeline_records_each_layers_gathers_and_reduce_scatters():
    widths = [32, 64, 48, 10]
    results = common.launch(common.fsdp_timeline, 2, dict(widths=widths, batch_size=32, steps=2))
    for r in results:
        spans = {(kind, i): [(s, e) for k, j, s, e in r['spans'] if (k, j) == (kind, i)]
                 for kind in ('F', 'B', 'all-gather', 'reduce-scatter') for i in range(len(widths) - 1)}
        for i in range(len(widths) - 2):                 # every unit but the root
            (f_start, f_end), = spans['F', i]
            (b_start, b_end), = spans['B', i]
            first, second = sorted(spans['all-gather', i])
            (rs_start, _), = spans['reduce-scatter', i]
            assert first[1] <= f_start and f_end <= second[0] and second[1] <= b_end and b_end <= rs_start
        assert len(spans['all-gather', len(widths) - 2]) == 1       # the root keeps its weights for backward
        held = [b for _, b in r['samples']]
        assert min(held) == sum(r['shard']) and max(held) > sum(r['shard'])


@pytest.mark.parametrize('bad', [dict(widths=[30, 63, 10])])
def test_the_fsdp_timeline_places_the_collectives_of_a_padded_layer(bad):
    # 63 rows do not split in two: FSDP pads every tensor to 64 rows, and layer_of still finds the layer
    results = common.launch(common.fsdp_timeline, 2, dict(bad, batch_size=8, steps=1))
    assert all(i is not None for r in results for _, i, _, _ in r['spans'])


def test_the_skeleton_filled_with_solution_5_passes(tmp_path, capsys):
    # exercise 5's solution, put in place of the skeleton's raises, passes the check
    source = (ROOT / 'notebooks' / 'src' / '08-beyond-data-parallelism.txt').read_text(encoding='utf-8')
    solution = re.search(r'<details><summary>Solution 5</summary>(.*?)</details>', source, re.S).group(1)
    gaps = re.findall(r'```python\n(.*?)```', solution, re.S)
    code = skeleton()
    for number, gap in enumerate(gaps, 1):
        line = f"        raise NotImplementedError('gap {number}')\n"
        assert line in code, f'the skeleton has no {line!r}'
        code = code.replace(line, ''.join(f'        {row}\n' for row in gap.splitlines()))
    path = tmp_path / 'my_zero1.py'
    path.write_text(code)
    assert common.check_zero1(str(path)), capsys.readouterr().out
