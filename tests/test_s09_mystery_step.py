"""Section 09's exercise 8 (comp_perf/s09_mystery_step.py): every mix of mistakes is found by what the step
runs, a seed's draft and its fix are graded as they should be for several seeds, partial fixes are counted
without the unfixed mistakes named, wrong fixes fail, and the draft is never written over a student's work.
Everything runs in this process: the quick tier.
"""
import itertools
import re

import pytest

import common
from comp_perf import s09_mystery_step as mystery

SEEDS = [0, 1, 2, 3, 4, 'student-017']
# Words that would name a mistake; the check's printout must contain none of them.
TELLING = re.compile(r'float64|double|anomaly|per.sample|\bitem\b|forward|numpy|loop|mistake \w+:', re.I)


pytestmark = pytest.mark.usefixtures('one_torch_thread')   # tests/conftest.py


def written(tmp_path, name, mistakes):
    path = tmp_path / f'{name}.py'
    path.write_text(mystery.draft_source(mistakes), encoding='utf-8')
    return str(path)


def test_every_mix_of_mistakes_is_found_from_what_the_step_runs():
    for k in range(len(mystery.MISTAKES) + 1):
        for mix in itertools.combinations(mystery.MISTAKES, k):
            assert mystery.mistakes_made(mystery._step_of(mystery.draft_source(mix))) == set(mix), mix


def test_seeds_draw_their_mistakes_the_same_way_each_time_and_differ_between_students():
    assert [mystery.mistakes_of(seed) for seed in SEEDS] == [mystery.mistakes_of(seed) for seed in SEEDS]
    assert all(len(mystery.mistakes_of(seed)) == mystery.PER_SEED for seed in SEEDS)
    assert len({mystery.mistakes_of(seed) for seed in range(12)}) >= 4
    with pytest.raises(TypeError, match='int or a str'):
        mystery.mistakes_of(1.5)
    with pytest.raises(ValueError, match='no such mistake'):
        mystery.draft_source(('typo',))


@pytest.mark.parametrize('seed', SEEDS)
def test_a_seeds_draft_fails_and_its_fix_passes_and_neither_names_a_mistake(seed, tmp_path, capsys):
    planted = mystery.mistakes_of(seed)
    assert not common.check_mystery_step(written(tmp_path, 'draft', planted), seed=seed, rounds=3)
    out = capsys.readouterr().out
    assert 'your step no longer makes 0 of them' in out and 'pass same step' in out
    assert out.rstrip().endswith('mystery step: 0 of 3 fixed; the profiler shows where the rest is')
    assert not TELLING.search(out), out
    assert common.check_mystery_step(written(tmp_path, 'fixed', ()), seed=seed, rounds=3)
    out = capsys.readouterr().out
    assert 'no longer makes 3 of them' in out and out.rstrip().endswith('mystery step: all fixed')


@pytest.mark.parametrize('seed', SEEDS[:3])
def test_each_mistake_fixed_alone_counts_one(seed, tmp_path, capsys):
    planted = mystery.mistakes_of(seed)
    for gone in planted:
        left = tuple(name for name in planted if name != gone)
        assert not common.check_mystery_step(written(tmp_path, f'without_{gone}', left), seed=seed, rounds=3)
        out = capsys.readouterr().out
        assert 'no longer makes 1 of them' in out and 'mystery step: 1 of 3 fixed' in out
        assert not TELLING.search(out), out


@pytest.mark.parametrize('old, new', [('    optimizer.zero_grad()\n', ''),
                                      ('F.cross_entropy(logits, y)', 'F.cross_entropy(logits, y, reduction="sum")')])
def test_a_fast_fix_that_trains_differently_fails_the_same_step(old, new, tmp_path, capsys):
    path = tmp_path / 'wrong.py'
    path.write_text(mystery.draft_source(()).replace(old, new), encoding='utf-8')
    assert not common.check_mystery_step(str(path), seed=0, rounds=3)
    out = capsys.readouterr().out
    assert 'FAIL same step' in out and 'no longer makes 3 of them' in out


def test_the_draft_is_written_once_and_never_over_a_students_file(tmp_path, capsys):
    path = tmp_path / 'my_mystery_step.py'
    common.write_mystery_step(7, path)
    assert path.read_text(encoding='utf-8') == mystery.draft_source(mystery.mistakes_of(7))
    path.write_text('# my work\n', encoding='utf-8')
    common.write_mystery_step(7, path)
    assert path.read_text(encoding='utf-8') == '# my work\n' and 'is there already' in capsys.readouterr().out


@pytest.mark.parametrize('text, says', [(None, 'fail: there is no file'),
                                        ('def mystery_step(model, optimizer, batch)\n', 'could not be loaded'),
                                        ('def mystery_step(model, optimizer, batch):\n    return 1 / 0\n',
                                         'raised an error: ZeroDivisionError')])
def test_a_file_that_cannot_be_graded_gets_one_line(text, says, tmp_path, capsys):
    path = tmp_path / 'broken.py'
    if text is not None:
        path.write_text(text, encoding='utf-8')
    assert not common.check_mystery_step(str(path), seed=0, rounds=3)
    out = capsys.readouterr().out
    assert says in out and 'Traceback' not in out and len(out.strip().splitlines()) == 1, out
