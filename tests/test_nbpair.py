"""The comment overlay of tools/nbpair.py: one code cell, its Chinese comments beside the English."""
import ast
import re

import nbformat
import pytest

import nbpair

CJK = re.compile(r'[\u3000-\u303f\u3400-\u9fff\uff00-\uffef]')


def _source(tmp_path, code, kind='code'):
    src = tmp_path / '99-demo.txt'
    src.write_text(f'%% md\n# Demo\n%% zh\n# 演示\n%% {kind}\n{code}\n', encoding='utf-8')
    return src


def _code_cell(tmp_path, code, kind='code'):
    return nbpair.parse(_source(tmp_path, code, kind))[1]


def test_each_language_gets_its_own_comments_and_the_same_code(tmp_path):
    cell = _code_cell(tmp_path, "x = 1  # add one  #zh 加一\n"
                                "s = '# a string  #zh stays'   # not a comment above  #zh 上面不是注释")
    assert cell['en'] == "x = 1  # add one\ns = '# a string  #zh stays'   # not a comment above"
    assert cell['zh'] == "x = 1  # 加一\ns = '# a string  #zh stays'   # 上面不是注释"
    assert nbpair.strip_comments(cell['en']) == nbpair.strip_comments(cell['zh'])
    assert cell['untranslated'] == []


def test_a_docstring_is_code_so_a_translated_one_is_refused_and_an_english_one_reported(tmp_path):
    # a docstring is the same in both notebooks: what a function does is said in a comment under its def
    with pytest.raises(ValueError, match='write what it says as a comment') as err:
        _code_cell(tmp_path, 'def f(x):\n    """Return x as it came."""  #zh 原样返回 x。\n    return x')
    assert '99-demo.txt:7' in str(err.value)
    english = _code_cell(tmp_path, 'def f():\n    """No Chinese."""\n    pass')
    assert english['untranslated'] == [(7, '"""No Chinese."""')]
    cell = _code_cell(tmp_path, 'def f(x):\n    # Return x as it came.  #zh 原样返回 x。\n    return x')
    assert cell['zh'] == 'def f(x):\n    # 原样返回 x。\n    return x' and cell['untranslated'] == []
    assert nbpair.strip_comments('def f():\n    """a"""\n    pass') != nbpair.strip_comments('def f():\n    pass')
    assert nbpair.strip_comments('def f():\n    """a"""\n    pass', docstrings=False) == \
        nbpair.strip_comments('def f():\n    # a\n    pass', docstrings=False)   # what prose accepts


def english_docstrings(source):
    """(name, docstring) of each function or class in a code cell's source whose docstring has no Chinese."""
    code = '\n'.join('' if line.lstrip().startswith(nbpair.MAGIC) else line for line in source.splitlines())
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []   # a %%writefile of C, say: no Python docstrings
    return [(node.name, ast.get_docstring(node)) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and ast.get_docstring(node) and not CJK.search(ast.get_docstring(node))
            and nbpair.needs_chinese(ast.get_docstring(node))]


def test_an_english_docstring_is_found_however_it_is_written():
    # planted: one-line, several lines, a class's, behind a magic line; a Chinese one passes
    planted = ('%%time\ndef f():\n    """Return one."""\n    return 1\n'
               'class A:\n    \'\'\'A class,\n    on two lines.\'\'\'\n'
               'def g():\n    """返回二。"""\n    return 2\n')
    assert [name for name, _ in english_docstrings(planted)] == ['f', 'A']


@pytest.mark.parametrize('path', sorted((nbpair.NOTEBOOKS / 'zh').glob('*.ipynb')), ids=lambda p: p.stem)
def test_the_chinese_notebooks_docstrings_are_chinese(path):
    cells = nbformat.read(path, as_version=4).cells
    found = [f'cell {i}: {name}: {doc.splitlines()[0]}' for i, cell in enumerate(cells)
             if cell.cell_type == 'code' for name, doc in english_docstrings(cell.source)]
    assert not found, ('English docstrings in a Chinese notebook (give each one line and "  #zh 中文" after it, '
                       'or write it as comments):\n' + '\n'.join(found))


def test_c_source_written_by_a_cell_uses_slash_comments(tmp_path):
    code = '%%writefile demo.c\nint x = 1;  // one  //zh 一\nchar *s = "// no";  // two  //zh 二'
    cell = _code_cell(tmp_path, code)
    assert cell['en'].splitlines()[1:] == ['int x = 1;  // one', 'char *s = "// no";  // two']
    assert cell['zh'].splitlines()[1:] == ['int x = 1;  // 一', 'char *s = "// no";  // 二']


def test_a_comment_without_chinese_is_reported_with_its_line(tmp_path):
    # line 6 of the source: the md cell takes lines 1-4, "%% code" is line 5
    src = _source(tmp_path, 'x = 1  # add one\ny = 2  # noqa: F841\nz = 3  # (3,)\nw = 4  # four  #zh 四')
    assert nbpair.untranslated(src) == [f'{src}:6: # add one']   # pragmas and bare symbols need none
    assert nbpair.untranslated(_source(tmp_path, 'x = 1  # add one', kind='code-only')) == []


@pytest.mark.parametrize('code, complaint', [
    ('x = 1  #zh 加一', 'without the English comment'),                 # an overlay with no English
    ('#zh 只有中文', 'without the English comment'),
    ('x = 1  # add one  #zh', 'unknown or misplaced marker'),          # nothing after the marker
    ('x = 1  # add one  #zh  ', 'with no Chinese'),
    ('x = 1  # add one  #zh 加一  #zh 再加一', 'unknown or misplaced marker'),  # twice
    ('x = 1  # add one  #ZH 加一', 'unknown or misplaced marker'),     # a marker nbpair does not know
    ('x = 1  # add one  #zh:加一', 'unknown or misplaced marker'),
    ('x = (1,  # open  #zh 未闭合', 'does not tokenize'),
])
def test_a_malformed_overlay_is_an_error_at_its_file_and_line(tmp_path, code, complaint):
    with pytest.raises(ValueError, match=re.escape(complaint)) as err:
        _code_cell(tmp_path, code)
    assert '99-demo.txt:6' in str(err.value)


def test_a_code_only_cell_refuses_an_overlay(tmp_path):
    with pytest.raises(ValueError, match='code-only cell keeps its comments'):
        _code_cell(tmp_path, 'x = 1  # add one  #zh 加一', kind='code-only')


def test_every_prose_comment_of_the_course_has_chinese():
    missing = [line for src in nbpair.sources() for line in nbpair.untranslated(src)]
    assert not missing, 'add "  #zh 中文" after each (or open the cell with %% code-only):\n' + '\n'.join(missing)


@pytest.mark.parametrize('src', nbpair.sources(), ids=lambda p: p.stem)
def test_the_chinese_notebooks_comments_are_chinese(src):
    cells = nbpair.parse(src)
    built = nbformat.read(nbpair.target(src, 'zh'), as_version=4).cells
    for cell, nb_cell in zip(cells, built):
        if cell['type'] != 'code' or cell['code_only']:
            continue
        lines = nb_cell.source.splitlines()
        for i, col in nbpair.comment_columns(lines).items():
            comment = lines[i][col:]
            assert CJK.search(comment) or not nbpair.needs_chinese(comment), \
                f'{src.name}:{cell["line"] + i}: an English comment in the Chinese notebook: {comment}'


def test_prose_copies_new_comments_and_keeps_the_outputs(tmp_path, monkeypatch):
    monkeypatch.setattr(nbpair, 'NOTEBOOKS', tmp_path)
    src = _source(tmp_path, 'x = 1  # one  #zh 一')
    for lang in nbpair.LANGS:
        nb = nbpair.make_notebook(nbpair.parse(src), lang)
        nb.cells[1].outputs = [nbformat.v4.new_output('stream', text='stored\n')]
        nbpair.target(src, lang).parent.mkdir(exist_ok=True)
        nbformat.write(nb, nbpair.target(src, lang))
    src.write_text(src.read_text(encoding='utf-8').replace('# one  #zh 一', '# the one  #zh 那个一'),
                   encoding='utf-8')
    nbpair.update_prose(src)
    zh = nbformat.read(nbpair.target(src, 'zh'), as_version=4).cells[1]
    assert (zh.source, zh.outputs[0].text) == ('x = 1  # 那个一', 'stored\n')
    src.write_text(src.read_text(encoding='utf-8').replace('x = 1', 'x = 2'), encoding='utf-8')
    with pytest.raises(SystemExit, match='code or its tags changed'):
        nbpair.update_prose(src)   # a change of code needs a run


@pytest.mark.parametrize('src', nbpair.sources(), ids=lambda p: p.stem)
def test_code_in_the_chinese_prose_has_chinese_comments(src):
    # Solutions and examples in markdown are translated with their text: their comments too.
    for cell in nbpair.parse(src):
        if cell['type'] != 'md':
            continue
        for block in re.findall(r'```python\n(.*?)```', cell['zh'], flags=re.S):
            lines = block.splitlines()
            for i, col in nbpair.comment_columns(lines).items():
                comment = lines[i][col:]
                assert CJK.search(comment) or not nbpair.needs_chinese(comment), \
                    f'{src.name}, markdown cell at line {cell["line"]}: {comment}'


def test_c_code_is_compared_without_its_comments_but_not_without_its_code():
    c = '%%writefile demo.c\nint x = 1;  // one\n'
    assert nbpair.strip_comments(c) == nbpair.strip_comments('%%writefile demo.c\nint x = 1;  // 一\n')
    assert nbpair.strip_comments(c) != nbpair.strip_comments('%%writefile demo.c\nint x = 2;  // one\n')
    assert nbpair.strip_comments(c) != nbpair.strip_comments('%%writefile demo.c\nint x = 1;  "// one"\n')
