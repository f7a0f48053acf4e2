"""Exercises a student can choose and check: each is labelled with its difficulty (★ to ★★★)
and time, the same in both languages, and each solution has a check that says what a
correct result looks like (and, where numbers depend on the machine, which relation holds).

    1. **Title.** *(★★ · 20 min)* Text …            1. **标题。** *（★★ · 20 分钟）* 正文……
    <details><summary>Solution 1</summary> … **Check:** …   <details><summary>答案 1</summary> … **检查：** …
"""
import re

import nbpair
import pytest
from helpers import ROOT

SOURCES = sorted((ROOT / 'notebooks' / 'src').glob('[0-9][0-9]-*.txt'))
LABEL = {'en': re.compile(r'^(\d+)\. \*\*.+?\*\* \*\((★{1,3}) · (\d+) min\)\*', re.M),
         'zh': re.compile(r'^(\d+)\. \*\*.+?\*\* \*（(★{1,3}) · (\d+) 分钟）\*', re.M)}
SOLUTION = {'en': re.compile(r'<details><summary>Solution (\d+)</summary>(.*?)</details>', re.S),
            'zh': re.compile(r'<details><summary>答案 (\d+)</summary>(.*?)</details>', re.S)}
CHECK = {'en': '**Check:**', 'zh': '**检查：**'}
ITEM = re.compile(r'^(\d+)\. ', re.M)


def exercises(text, lang):
    """(numbered items, their labels, solutions as {number: body}) of an Exercises cell's text."""
    items = [int(n) for n in ITEM.findall(text.split('<details>')[0])]
    labels = [(int(n), stars, int(minutes)) for n, stars, minutes in LABEL[lang].findall(text)]
    solutions = {int(n): body for n, body in SOLUTION[lang].findall(text)}
    return items, labels, solutions


def problems(text, lang):
    items, labels, solutions = exercises(text, lang)
    found = []
    if [n for n, _, _ in labels] != items:
        found.append(f'{lang}: exercises {items} but labels (★ · minutes) on {[n for n, _, _ in labels]}')
    if sorted(solutions) != items:
        found.append(f'{lang}: exercises {items} but solutions {sorted(solutions)}')
    found += [f'{lang}: solution {n} has no {CHECK[lang]} line' for n, body in solutions.items()
              if CHECK[lang] not in body]
    return found


def exercise_cells(src):
    return [c for c in nbpair.parse(src) if c['type'] == 'md'
            and re.match(r'#{1,3} (\d+ )?(Exercises|练习)', c['en'].lstrip())]


@pytest.mark.parametrize('src', SOURCES, ids=lambda p: p.stem[:2])
def test_exercises_are_labelled_and_checkable(src):
    cells = exercise_cells(src)
    assert cells, f'{src.name} has no Exercises cell'
    found = []
    for cell in cells:
        found += problems(cell['en'], 'en') + problems(cell['zh'], 'zh')
        en, zh = ([lab[1:] for lab in LABEL[lang].findall(cell[lang])] for lang in ('en', 'zh'))
        assert en and en == zh, f'{src.name}: difficulty and minutes must agree between the languages'
    assert not found, found


def test_the_check_finds_an_unlabelled_exercise_and_a_solution_without_its_check():
    good = ('1. **One.** *(★ · 10 min)* Do it.\n2. **Two.** *(★★★ · 40 min)* Do more.\n\n'
            '<details><summary>Solution 1</summary>\nx\n\n**Check:** 4.\n</details>\n'
            '<details><summary>Solution 2</summary>\ny\n\n**Check:** a ratio above 1.\n</details>')
    assert problems(good, 'en') == []
    assert problems(good.replace(' *(★★★ · 40 min)*', ''), 'en') == \
        ['en: exercises [1, 2] but labels (★ · minutes) on [1]']
    assert problems(good.replace('**Check:** 4.', '4.'), 'en') == ['en: solution 1 has no **Check:** line']
    zh = '1. **一。** *（★★ · 15 分钟）* 做。\n\n<details><summary>答案 1</summary>\n**检查：** 2。\n</details>'
    assert problems(zh, 'zh') == []
