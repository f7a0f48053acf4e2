"""The en/zh pairs: same program, real translations, outputs of one clean run."""
import re

import nbformat
import nbpair
import pytest
from helpers import EN, NAMES, ROOT, ZH, load, visible_text

CJK = re.compile(r'[\u3000-\u303f\u3400-\u9fff\uf900-\ufaff\uff00-\uffef]')
REQUIRED = ['00-start-here.ipynb', '01-compilers-and-interpreters.ipynb']


def test_every_section_has_both_languages():
    assert set(REQUIRED) <= set(NAMES)
    assert NAMES == sorted(p.name for p in ZH.glob('*.ipynb'))
    sources = sorted(p.stem + '.ipynb' for p in (ROOT / 'notebooks' / 'src').glob('*.txt'))
    assert sources == NAMES, 'every pair is built from notebooks/src/<name>.txt'


def test_notebooks_match_their_bilingual_source():
    problems = [p for src in nbpair.sources() for p in nbpair.mismatches(src)]
    assert not problems, 'rebuild with: python tools/nbpair.py build <src>\n' + '\n'.join(problems)


@pytest.mark.parametrize('name', NAMES)
def test_same_program_in_both_languages(name):
    en, zh = load(EN / name), load(ZH / name)
    assert [c.cell_type for c in en.cells] == [c.cell_type for c in zh.cells]
    for i, (a, b) in enumerate(zip(en.cells, zh.cells)):
        assert a.metadata.get('tags', []) == b.metadata.get('tags', []), f'cell {i}: tags differ'
        if a.cell_type == 'code':
            assert nbpair.strip_comments(a.source) == nbpair.strip_comments(b.source), \
                f'code cell {i} differs beyond comments'


@pytest.mark.parametrize('name', NAMES)
def test_english_notebook_has_no_cjk(name):
    for i, cell in enumerate(load(EN / name).cells):
        texts = [cell.source] + [str(o.get('text', '')) + str(o.get('data', {}).get('text/plain', ''))
                                 for o in cell.get('outputs', [])]
        found = CJK.findall(''.join(texts))
        assert not found, f'cell {i} contains CJK: {"".join(found[:10])}'


@pytest.mark.parametrize('name', NAMES)
def test_chinese_markdown_is_chinese_and_complete(name):
    en, zh = load(EN / name), load(ZH / name)
    for i, (a, b) in enumerate(zip(en.cells, zh.cells)):
        if a.cell_type != 'markdown':
            continue
        en_text, zh_text = visible_text(a.source), visible_text(b.source)
        if len(re.findall(r'[A-Za-z]{3,}', en_text)) >= 5:
            assert CJK.search(zh_text), f'markdown cell {i} of zh/{name} has no Chinese'
            # Chinese takes roughly a third of the characters of English; far less is a summary.
            assert len(zh_text) >= 0.2 * len(en_text), f'markdown cell {i} looks summarised'
        for pattern in (r'^#+ ', r'<details>', r'^\s*[*\d]+[.)]? ', r'^\|'):
            assert len(re.findall(pattern, a.source, re.M)) == len(re.findall(pattern, b.source, re.M)), \
                f'markdown cell {i}: structure ({pattern}) differs between en and zh'


@pytest.mark.parametrize('lang', ['en', 'zh'])
@pytest.mark.parametrize('name', NAMES)
def test_outputs_come_from_one_clean_run(name, lang):
    nb = load(ROOT / 'notebooks' / lang / name)
    code = [c for c in nb.cells if c.cell_type == 'code']
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), \
        're-execute the notebook top to bottom (python tools/nbpair.py build ...)'
    for c in code:
        assert not [o for o in c.outputs if o.output_type == 'error'], f'stored error in: {c.source[:60]}'
        stderr = [o.text for o in c.outputs if o.output_type == 'stream' and o.name == 'stderr']
        assert not stderr, f'stored warning or stderr output in: {c.source[:60]}\n{stderr[0][:300]}'


@pytest.mark.parametrize('lang,other', [('en', 'zh'), ('zh', 'en')])
@pytest.mark.parametrize('name', NAMES)
def test_navigation_line_top_and_bottom(name, lang, other):
    md = [c.source for c in load(ROOT / 'notebooks' / lang / name).cells if c.cell_type == 'markdown']
    for where, text in (('top', md[0].splitlines()[0]), ('bottom', md[-1].splitlines()[-1])):
        assert f'](../{other}/{name})' in text, f'{where} navigation line lacks the {other} link'
        for target in re.findall(r'\]\(([^)#]+\.ipynb)', text):
            assert (ROOT / 'notebooks' / lang / target).resolve().exists(), f'broken link {target}'


@pytest.mark.parametrize('name', NAMES)
def test_slide_metadata_is_complete_and_current(name):
    en, zh = load(EN / name), load(ZH / name)
    kinds = [c.metadata.get('slideshow', {}).get('slide_type') for c in en.cells]
    assert kinds == [c.metadata.get('slideshow', {}).get('slide_type') for c in zh.cells], \
        'en and zh must have the same slides'
    assert kinds[0] == 'slide' and set(kinds) <= {'slide', 'subslide', '-'}
    for cell, kind in zip(en.cells, kinds):
        if cell.cell_type == 'markdown' and cell.source.startswith('## '):
            assert kind == 'slide', f'a level-2 heading must start a slide: {cell.source[:40]}'
    assert kinds == nbpair.slide_types(en), 'stale slide metadata: python tools/nbpair.py slides'


def test_prose_update_keeps_outputs_and_refuses_code_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(nbpair, 'NOTEBOOKS', tmp_path)
    src = tmp_path / 'src' / '99-demo.txt'
    src.parent.mkdir()
    src.write_text('%% md\n# Demo\nold text\n%% zh\n# 演示\n旧的文字\n%% code\nprint(1)\n', encoding='utf-8')
    for lang in nbpair.LANGS:
        nb = nbpair.make_notebook(nbpair.parse(src), lang)
        nb.cells[1].outputs = [nbformat.v4.new_output('stream', name='stdout', text='1\n')]
        nbpair.target(src, lang).parent.mkdir(exist_ok=True)
        nbformat.write(nb, nbpair.target(src, lang))
    src.write_text(src.read_text(encoding='utf-8').replace('old text', 'new text'), encoding='utf-8')
    nbpair.update_prose(src)
    en = nbformat.read(nbpair.target(src, 'en'), as_version=4)
    assert 'new text' in en.cells[0].source and en.cells[1].outputs[0].text == '1\n'
    assert en.cells[0].metadata['slideshow']['slide_type'] == 'slide'
    src.write_text(src.read_text(encoding='utf-8').replace('旧的文字\n', '旧的文字\n%% md\n## Part\n%% zh\n## 部分\n'),
                   encoding='utf-8')
    nbpair.update_prose(src)  # a markdown cell split at a heading: the code keeps its outputs
    en = nbformat.read(nbpair.target(src, 'en'), as_version=4)
    assert [c.cell_type for c in en.cells] == ['markdown', 'markdown', 'code'] and en.cells[2].outputs[0].text == '1\n'
    assert en.cells[1].metadata['slideshow']['slide_type'] == 'slide'
    src.write_text(src.read_text(encoding='utf-8').replace('print(1)', 'print(2)'), encoding='utf-8')
    with pytest.raises(SystemExit, match='run `build` instead'):
        nbpair.update_prose(src)


@pytest.mark.parametrize('text,message', [
    ('hello\n%% md\n# x\n%% zh\n# y\n', 'text before the first cell'),
    ('%% zh\nx\n', '"%% zh" must follow an English cell'),
    ('%% md\n# x\n%% zh\n# y\n%% zh\n# z\n', '"%% zh" must follow an English cell'),
    ('%% table\nx\n', "unknown cell kind 'table'"),
    ('%% md\n# x\n', 'markdown cell 0 has no Chinese text'),
    ('%% code\nx = 1\n%% zh\nx = 2\n', 'a code cell is written once'),
])
def test_bilingual_source_errors_name_the_problem(tmp_path, text, message):
    src = tmp_path / '99-bad.txt'
    src.write_text(text, encoding='utf-8')
    with pytest.raises(ValueError, match=re.escape(message)):
        nbpair.parse(src)


def _python_blocks(markdown):
    return re.findall(r'```python\n(.*?)```', markdown, flags=re.S)


@pytest.mark.parametrize('name', NAMES)
def test_code_in_markdown_solutions_parses_and_names_real_helpers(name):
    # Worked solutions in <details> blocks are never executed: at least they must be
    # valid Python (IPython magics aside) and every common.X they use must exist.
    import ast

    import common
    for lang in ('en', 'zh'):
        for i, cell in enumerate(load(ROOT / 'notebooks' / lang / name).cells):
            if cell.cell_type != 'markdown':
                continue
            for block in _python_blocks(cell.source):
                code = '\n'.join(line for line in block.splitlines()
                                 if not line.lstrip().startswith(('%', '!')))
                try:
                    tree = ast.parse(code)
                except SyntaxError as error:
                    pytest.fail(f'{lang}/{name} cell {i}: a solution does not parse: {error}')
                used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
                        and isinstance(node.value, ast.Name) and node.value.id == 'common'}
                missing = sorted(u for u in used if not hasattr(common, u))
                assert not missing, f'{lang}/{name} cell {i}: common has no {missing}'


@pytest.mark.parametrize('lang', ['en', 'zh'])
@pytest.mark.parametrize('name', NAMES)
def test_shown_source_is_current(name, lang):
    """A cell that shows a helper's source (common.show_source) stores today's source of that helper."""
    import inspect

    import common
    for cell in load(ROOT / 'notebooks' / lang / name).cells:
        calls = re.findall(r'^common\.show_source\(common\.(\w+)\)$', cell.source, re.M) \
            if cell.cell_type == 'code' else []
        shown = [o.get('data', {}).get('text/markdown', '') for o in cell.get('outputs', [])]
        for helper, output in zip(calls, shown):
            assert inspect.getsource(getattr(common, helper)) in output, \
                f'{lang}/{name}: the stored source of common.{helper} is stale; rebuild the notebook'


HEADING = re.compile(r'^#{1,6} ')


def headings_inside_cells(text):
    """Headings of a markdown cell's text that are not its first line (outside code and <details>).

    The navigation line at the top of a notebook may stand above its title.
    """
    found, fence, details, seen = [], False, 0, []
    for line in text.split('\n'):
        if line.lstrip().startswith('```'):
            fence = not fence
        if not fence:
            details += line.count('<details') - line.count('</details>')
            if details == 0 and HEADING.match(line) and seen and not \
               (len(seen) == 1 and seen[0].startswith('[') and '](' in seen[0]):
                found.append(line)
        if line.strip():
            seen.append(line)
    return found


@pytest.mark.parametrize('src', nbpair.sources(), ids=lambda p: p.stem)
def test_every_heading_starts_a_cell(src):
    """So that every section, subsection and Summary starts its own slide."""
    inside = [(lang, h) for cell in nbpair.parse(src) if cell['type'] == 'md'
              for lang in nbpair.LANGS for h in headings_inside_cells(cell[lang])]
    assert not inside, f'headings in the middle of a cell (split the cell there): {inside[:5]}'


def test_heading_check_finds_a_heading_mid_cell():
    assert headings_inside_cells('Some text\n## Summary\nmore') == ['## Summary']
    assert headings_inside_cells('[← 02](x.ipynb) · [map](y.ipynb)\n\n# 03 Title\ntext') == []
    assert headings_inside_cells('## Title\n```\n# a comment\n```\n<details>\n### Hint\n</details>') == []
