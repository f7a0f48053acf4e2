"""The glossary (notebooks/glossary.md): every term is used, and used consistently in both languages."""
import functools
import re

import pytest
from helpers import EN, NAMES, ROOT, ZH, load, visible_text

GLOSSARY = ROOT / 'notebooks' / 'glossary.md'


def terms():
    """(english forms, chinese forms, section) for every row of the glossary's table."""
    rows = []
    for line in GLOSSARY.read_text(encoding='utf-8').splitlines():
        cells = [c.strip() for c in line.strip().strip('|').split('|')]
        if len(cells) == 3 and re.fullmatch(r'\d\d', cells[2]):
            rows.append(([f.strip() for f in cells[0].split(' / ')],
                         [f.strip() for f in cells[1].split(' / ')], cells[2]))
    return rows


def english(forms):
    return re.compile(r'\b(' + '|'.join(re.escape(f) for f in forms) + r')(s|es)?\b', re.I)


@functools.cache
def markdown_pairs(name):
    """(English, Chinese) visible text of each markdown cell, read once per notebook (every term reads them)."""
    return tuple((visible_text(a.source), visible_text(b.source))
                 for a, b in zip(load(EN / name).cells, load(ZH / name).cells) if a.cell_type == 'markdown')


def test_glossary_has_terms():
    rows = terms()
    assert len(rows) >= 40
    assert len({tuple(r[0]) for r in rows}) == len(rows), 'a term is listed twice'


@pytest.mark.parametrize('name', NAMES)
def test_chinese_uses_the_glossary_term_where_english_uses_it(name):
    problems = []
    for forms_en, forms_zh, _ in terms():
        pattern = english(forms_en)
        for i, (en, zh) in enumerate(markdown_pairs(name)):
            found = pattern.search(en)
            if found and not any(z.lower() in zh.lower() for z in forms_zh):
                problems.append(f'markdown cell {i}: "{found.group(0)}" in English but none of '
                                f'{forms_zh} in Chinese')
    assert not problems, '\n'.join(problems)


def test_every_term_is_used_in_its_section_in_both_languages():
    for forms_en, forms_zh, section in terms():
        name = next(n for n in NAMES if n.startswith(section))
        en = ' '.join(e for e, _ in markdown_pairs(name))
        zh = ' '.join(z for _, z in markdown_pairs(name))
        assert english(forms_en).search(en), f'{forms_en[0]!r} is not used in en/{name}'
        assert any(z.lower() in zh.lower() for z in forms_zh), f'{forms_zh[0]!r} is not used in zh/{name}'
