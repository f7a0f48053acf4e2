"""The Chinese catalog (comp_perf/text_zh.json): complete, nothing unused, each entry in its section's group."""
import ast
import json
import os
import re
import string

import nbpair
import pytest
from helpers import ROOT
from notebook_code import section_of

import common
from comp_perf import language

PACKAGE = ROOT / 'comp_perf'

CJK = re.compile(r'[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]')   # full-width punctuation counts: ', ' is '，'


def module_group(path):
    """A section module (sNN_…) serves section NN; every other module serves all sections."""
    return path.stem[1:3] if re.match(r's\d\d_', path.stem) else 'all'


def _trees():
    """(group, code tree) for every section's code cells and every module of the package."""
    for src in nbpair.sources():
        for code in nbpair.python_code(src).values():
            yield section_of(src), ast.parse(code)
    for path in sorted(PACKAGE.glob('*.py')):
        yield module_group(path), ast.parse(path.read_text(encoding='utf-8'))


def string_constants():
    """{text: groups whose code holds it as a string constant}."""
    found = {}
    for group, tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                found.setdefault(node.value, set()).add(group)
    return found


def translated_literals():
    """English literals passed where a reader sees them: tr(...), verdict's quantity and cases."""
    found = set()
    for _, tree in _trees():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, 'attr', getattr(node.func, 'id', None))
            texts = []
            if name == 'tr':
                texts = node.args[:1]
            elif name == 'verdict':
                cases = node.args[2] if len(node.args) > 2 else None
                texts = node.args[:1] + [case.elts[2] for case in getattr(cases, 'elts', [])
                                         if isinstance(case, ast.Tuple) and len(case.elts) == 3]
            found |= {t.value for t in texts if isinstance(t, ast.Constant) and isinstance(t.value, str)}
    return found


def expected_group(groups):
    """A text used by a shared module is in 'all'; otherwise in the first section that uses it."""
    if 'all' in groups:
        return 'all'
    sections = sorted(g for g in groups if g != 'guide')
    return sections[0] if sections else 'guide'


def test_the_catalog_refuses_a_key_twice_in_a_group_and_across_groups(tmp_path):
    twice = tmp_path / 'twice.json'
    twice.write_text('{"00": {"bag": "包", "bag": "袋"}}', encoding='utf-8')
    with pytest.raises(ValueError, match="twice in one group: \\['bag'\\]"):
        language.read_catalog(twice)
    across = tmp_path / 'across.json'
    across.write_text('{"00": {"bag": "包"}, "05": {"bag": "袋"}}', encoding='utf-8')
    with pytest.raises(ValueError, match="'bag' is in group '00' and in '05'"):
        language.read_catalog(across)


def test_every_text_the_code_passes_to_tr_or_verdict_has_a_translation():
    literals = translated_literals()
    assert len(literals) > 100
    missing = sorted(literals - set(language.zh_text()))
    assert not missing, f'add these to comp_perf/text_zh.json: {missing}'


def test_no_catalog_entry_is_unused():
    used = string_constants()
    unused = sorted(set(language.zh_text()) - set(used))
    assert not unused, f'no code uses these catalog entries: {unused}'


def test_each_entry_sits_in_the_group_of_its_first_user():
    used = string_constants()
    misplaced = [(key, group, expected_group(used[key]))
                 for group, entries in language.read_catalog().items() for key in entries
                 if key in used and expected_group(used[key]) != group]
    assert not misplaced, f'(key, group, belongs in): {misplaced}'


def test_groups_run_in_course_order():
    groups = list(language.read_catalog())
    assert groups[0] == 'all' and groups[1:] == sorted(groups[1:])


def test_english_keys_chinese_values_and_the_same_format_fields():
    def fields(text):
        return sorted(name for _, name, _, _ in string.Formatter().parse(text) if name is not None)

    for key, value in language.zh_text().items():
        assert not CJK.search(key), key
        assert CJK.search(value) or key == value, (key, value)
        assert fields(key) == fields(value), (key, value)


def test_tr_keeps_english_in_english_notebooks(monkeypatch):
    monkeypatch.setenv('COURSE_LANG', 'en')
    assert common.tr('step {t}', t=3) == 'step 3'
    assert common.tr('not in the table') == 'not in the table'


def test_tr_speaks_chinese_in_chinese_notebooks(monkeypatch):
    monkeypatch.setenv('COURSE_LANG', 'zh')
    assert common.tr('step {t}', t=3) == '第 3 步'
    assert common.tr('CPU only') == '仅 CPU'


def test_the_catalog_file_is_what_the_package_installs():
    toml = (ROOT / 'pyproject.toml').read_text()
    assert 'text_zh.json' in toml
    json.loads(language.CATALOG_FILE.read_text(encoding='utf-8'))


def test_chinese_figure_text_renders_without_missing_glyphs(monkeypatch):
    import warnings

    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    if language.cjk_font() is None:
        if os.environ.get('CI'):
            pytest.fail('no Chinese font: ./course setup installs fonts-wqy-microhei')
        pytest.skip('no Chinese font on this machine')
    monkeypatch.setenv('COURSE_LANG', 'zh')
    assert common.tr('step {t}', t=3) == '第 3 步'
    fig, ax = plt.subplots()
    ax.set(xlabel=common.tr('number of devices'), title=common.tr('memory pinned by the queue'))
    ax.plot([1, 2], [3, -4])
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # matplotlib warns "Glyph ... missing from font(s)"
        fig.canvas.draw()
    plt.close(fig)
    assert ax.get_xlabel() == '设备数'


def test_without_a_chinese_font_the_text_stays_chinese_and_the_reader_is_told_once(monkeypatch, capsys):
    monkeypatch.setenv('COURSE_LANG', 'zh')
    monkeypatch.setattr(language, '_CJK_STATE', {'font': None})   # as on a machine without one
    assert common.tr('step {t}', t=3) == '第 3 步'
    assert common.tr('CPU only') == '仅 CPU'
    out = capsys.readouterr().out
    assert out.count('fonts-wqy-microhei') == 1 and '方框' in out
