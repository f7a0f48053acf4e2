"""Build the en/zh notebook pair of a section from its one bilingual source.

    python tools/nbpair.py build notebooks/src/01-compilers-and-interpreters.txt
    python tools/nbpair.py build --all          # every section
    python tools/nbpair.py check                # do the notebooks match their sources?
    python tools/nbpair.py code DIR             # every section's code cells as .py files
    python tools/nbpair.py lint                 # ruff over those cells, findings at the sources' lines

A source is a sequence of cells, each opened by a line that starts with '%% ':

    %% md                      a markdown cell; its English text follows
    %% zh                      ...then its Chinese text
    %% code [tag tag ...]      a code cell, shared by both languages
    %% code-only [tag ...]     a code cell whose comments are code, not prose: kept as written

A code cell is written once. Each comment in it carries its Chinese beside the
English, on the same line (in C source written by %%writefile: // and //zh):

    x = f(y)  # English words  #zh 中文

The English notebook shows "# English words", the Chinese one "# 中文". A docstring
is code, the same in both notebooks, so a function in a code cell says what it does
in a comment under its def line, which each language words its own way; a
docstring there is refused with the line. A prose comment without "#zh" is
reported by `untranslated` (and a test); comments for
tools (# noqa, # type: ...) need none. A malformed overlay ("#zh" with no English
before it or no Chinese after it, a second or unknown marker) is an error naming
the source's file and line, never a dropped comment.

Tags are cell tags, e.g. nbval-ignore-output for cells whose output depends on
the run (timings, hardware). `build` writes both notebooks and executes each
top to bottom in its own folder, so they carry the outputs of one clean run.

Every cell also gets slide metadata for presenting (`jupyter nbconvert --to
slides`, JupyterLab's RISE): a level-1 or level-2 heading starts a slide, a
level-3 heading a sub-slide, and a cell that would overflow the current slide
(estimated from its text and the stored outputs of the English notebook)
starts a sub-slide, so one idea sits on each slide (tools/slides.py). Both languages get the
same slide structure. `python tools/nbpair.py slides` redoes only this, and
`python tools/nbpair.py prose <src>` copies corrected markdown and code
comments into a built pair without re-running it (it refuses if any code changed).
"""
import argparse
import io
import re
import sys
import tokenize
from pathlib import Path

import nbformat

from slides import set_slides, slide_types  # noqa: F401 (slide_types: the tests read it here)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / 'notebooks'
LANGS = ('en', 'zh')


def parse(path):
    """List of cells: dicts with type, tags, en and zh text, the source line, and for code cells
    `untranslated`: [(source line, comment)] of prose comments that have no Chinese."""
    cells, current, lang = [], None, 'en'
    for lineno, line in enumerate(Path(path).read_text(encoding='utf-8').splitlines(), 1):
        if line.startswith('%% '):
            words = line[3:].split()
            if words[0] == 'zh':
                if current is None or lang == 'zh':
                    raise ValueError(f'{path}:{lineno}: "%% zh" must follow an English cell')
                if current['type'] == 'code':
                    raise ValueError(f'{path}:{lineno}: a code cell is written once, its Chinese comments '
                                     f'beside the English ("# words  #zh 中文"), not in a "%% zh" copy')
                lang = 'zh'
                current['zh'] = []
                continue
            if words[0] not in ('md', 'code', 'code-only'):
                raise ValueError(f'{path}:{lineno}: unknown cell kind {words[0]!r}')
            current, lang = {'type': 'md' if words[0] == 'md' else 'code', 'code_only': words[0] == 'code-only',
                             'tags': words[1:], 'en': [], 'zh': None, 'line': lineno + 1}, 'en'
            cells.append(current)
        elif current is None:
            if line.strip():
                raise ValueError(f'{path}:{lineno}: text before the first cell')
        else:
            current[lang].append(line)
    for i, cell in enumerate(cells):
        lines = cell['en']
        first = next((k for k, line in enumerate(lines) if line), len(lines))  # blank lines dropped
        cell['line'] += first
        if cell['type'] == 'md':
            if cell['zh'] is None:
                raise ValueError(f'{path}: markdown cell {i} has no Chinese text')
            for lang in LANGS:
                cell[lang] = '\n'.join(cell[lang]).strip('\n')
            continue
        lines = '\n'.join(lines).strip('\n').split('\n')
        texts, missing = render_code(lines, lambda k, start=cell['line']: f'{path}:{start + k}', cell['code_only'])
        cell.update(texts)
        cell['untranslated'] = [(cell['line'] + k, comment) for k, comment in missing]
    return cells


# ---------------------------------------------------------------------------------------------
# The comment overlay: a code cell exists once, and each of its comments carries its Chinese
# beside the English, on the same line:    x = f(y)  # English words  #zh 中文
# The English notebook drops "  #zh …"; the Chinese one shows "# 中文" in place of the English.
# In a %%writefile cell of C code the same holds for // comments:  // words  //zh 中文

OVERLAY = {'#': '#zh', '//': '//zh'}
# Comments for tools, not readers: they read the same in both languages.
PRAGMA = re.compile(r'^(#|//)\s*(noqa|type:|fmt:|pragma|pylint:|ruff:|isort:|nbval)')
# Anything shaped like a language marker that is not exactly "#zh " (a typo would be lost).
MARKER_LIKE = re.compile(r'(#|//)\s*(zh|cn|ZH|CN|zh-\w+)(?=[\s:：=,.]|$)')
MAGIC = ('%', '!')   # IPython lines: left as written
# A line that is only a string literal (a docstring), with its quotes: translated by "#zh" after it.
DOCSTRING_LINE = re.compile(r'^(\s*)([rRuU]?)("""|\'\'\')(.*)\3\s*$')


def _cell_language(lines):
    """'c' for a %%writefile of C source, 'python' otherwise."""
    first = lines[0].strip() if lines else ''
    if first.startswith('%%writefile') and first.rsplit('.', 1)[-1] in ('c', 'h', 'cc', 'cpp'):
        return 'c'
    return 'python'


def _c_comment_start(line):
    """Column of a // comment outside string and character literals, or None."""
    quote, k = None, 0
    while k < len(line):
        ch = line[k]
        if quote:
            if ch == '\\':
                k += 1
            elif ch == quote:
                quote = None
        elif ch in '"\'':
            quote = ch
        elif line.startswith('//', k):
            return k
        k += 1
    return None


def comment_columns(lines):
    """{line index: column where that line's comment starts} for a code cell's lines."""
    if _cell_language(lines) == 'c':
        found = {i: _c_comment_start(line) for i, line in enumerate(lines) if i}
        return {i: col for i, col in found.items() if col is not None}
    # IPython lines become blank, so that the rest tokenizes and every row keeps its number.
    python = ['' if line.lstrip().startswith(MAGIC) else line for line in lines]
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO('\n'.join(python) + '\n').readline))
    except (tokenize.TokenError, IndentationError, SyntaxError) as err:
        raise ValueError(f'the cell does not tokenize as Python ({err})') from None
    return {t.start[0] - 1: t.start[1] for t in tokens if t.type == tokenize.COMMENT}


def split_overlay(comment):
    """(English comment, Chinese text or None) of one comment; ValueError on a malformed overlay."""
    lead = '//' if comment.startswith('//') else '#'
    marker = OVERLAY[lead]
    if comment.startswith(marker) and comment[len(marker):len(marker) + 1] in (' ', ''):
        raise ValueError(f'"{marker}" without the English comment it translates: '
                         f'write "{lead} English  {marker} 中文"')
    at = comment.find(f' {marker} ')
    english, chinese = (comment, None) if at < 0 else (comment[:at].rstrip(), comment[at + len(marker) + 2:])
    stray = MARKER_LIKE.search(english, 1) or (chinese is not None and MARKER_LIKE.search(chinese))
    if stray or (at < 0 and comment.rstrip().endswith(f' {marker}')):
        raise ValueError(f'unknown or misplaced marker in {comment!r}: the overlay is '
                         f'"{lead} English  {marker} 中文", once per comment')
    if chinese is not None and not chinese.strip():
        raise ValueError(f'"{marker}" with no Chinese after it in {comment!r}')
    return english, None if chinese is None else chinese.strip()


def needs_chinese(comment):
    """Whether a comment is prose for a reader: words, and not a tool's pragma."""
    return bool(re.search(r'[A-Za-z]{2,}', comment)) and not PRAGMA.match(comment)


def render_code(lines, where, code_only=False):
    """({'en': source, 'zh': source}, [(line index, English comment) with no Chinese]).

    `where(i)` names line i of the source in errors.
    """
    out = {'en': list(lines), 'zh': list(lines)}
    missing = []
    try:
        columns = comment_columns(lines)
    except ValueError as err:
        raise ValueError(f'{where(0)}: {err}') from None
    for i, col in columns.items():
        code, comment = lines[i][:col], lines[i][col:]
        lead = '//' if comment.startswith('//') else '#'
        if DOCSTRING_LINE.match(code) and comment.startswith(f'{OVERLAY[lead]} ') and not code_only:
            raise ValueError(f'{where(i)}: a docstring is code, the same in both languages: write what it says as '
                             f'a comment, "# English  {OVERLAY[lead]} 中文"')
        try:
            english, chinese = split_overlay(comment)
        except ValueError as err:
            raise ValueError(f'{where(i)}: {err}') from None
        if chinese is not None and code_only:
            raise ValueError(f'{where(i)}: a code-only cell keeps its comments as written; drop the overlay')
        out['en'][i] = code + english
        out['zh'][i] = code + (english if chinese is None else f'{lead} {chinese}')
        if chinese is None and not code_only and needs_chinese(english):
            missing.append((i, english))
    missing += [(i, line.strip()) for i, line in enumerate(lines)
                if i not in columns and not code_only and _english_docstring(lines, i)]
    return {lang: '\n'.join(text) for lang, text in out.items()}, missing


def _english_docstring(lines, i):
    """Whether line i is a one-line docstring with words (the caller knows it has no comment): the Chinese
    notebook would show it in English, so `untranslated` asks for a comment instead."""
    found = DOCSTRING_LINE.match(lines[i])
    return bool(found) and needs_chinese(found.group(4)) and not re.search('[\u4e00-\u9fff]', found.group(4))


def untranslated(src):
    """['file:line: comment'] for every prose comment of a code cell that has no Chinese."""
    name = Path(src).relative_to(ROOT) if Path(src).is_relative_to(ROOT) else Path(src)
    return [f'{name}:{line}: {comment}' for cell in parse(src) if cell['type'] == 'code'
            for line, comment in cell['untranslated']]


def strip_comments(src, docstrings=True):
    """Code without comments and blank lines, as a comparable string (IPython lines as written); docstrings=False
    also drops strings alone on their line, so that a docstring turned into a comment compares equal."""
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    lines = src.splitlines()
    if _cell_language(lines) == 'c':
        code = (line[:_c_comment_start(line)] for line in lines)   # [:None]: a line without a comment
        return ' '.join(part.strip() for part in code if part.strip())
    python = '\n'.join(repr(line.strip()) if line.lstrip().startswith(MAGIC) else line for line in lines)
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(python).readline))
        dropped = set() if docstrings else {k for k, t in enumerate(toks)
                                             if t.type == tokenize.STRING and _alone(toks, k)}
        return ' '.join(t.string for k, t in enumerate(toks) if t.type not in skip and k not in dropped)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return src  # not Python: compare as written


def _alone(toks, k):
    """Whether token k, a string, is a statement of its own (a docstring, which each language words its way)."""
    layout = (tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT)
    before = next((t for t in reversed(toks[:k]) if t.type not in (tokenize.COMMENT, tokenize.NL)), None)
    after = next((t for t in toks[k + 1:] if t.type != tokenize.COMMENT), None)
    return (before is None or before.type in layout) and (after is None or after.type in (tokenize.NEWLINE,
                                                                                           tokenize.ENDMARKER))


# The course's kernel, registered by ./course inside .venv: a notebook that asks for it runs the
# course's Python in JupyterLab, VS Code or nbval alike.
KERNELSPEC = {'name': 'comp-perf', 'display_name': 'Python (计算性能 · Computational Performance)',
              'language': 'python'}


def make_notebook(cells, lang):
    """An unexecuted nbformat notebook for one language."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        'kernelspec': KERNELSPEC,
        'language_info': {'name': 'python'},
    }
    for i, cell in enumerate(cells):
        new = nbformat.v4.new_markdown_cell if cell['type'] == 'md' else nbformat.v4.new_code_cell
        c = new(cell[lang])
        c.id = f'c{i:03d}'
        if cell['tags']:
            c.metadata['tags'] = list(cell['tags'])
        nb.cells.append(c)
    return nb


def target(src, lang):
    return NOTEBOOKS / lang / (Path(src).stem + '.ipynb')


def build(src, execute=True, timeout=600):
    import time
    from nbclient import NotebookClient
    cells = parse(src)
    notebooks = []
    for lang in LANGS:
        nb = make_notebook(cells, lang)
        path = target(src, lang)
        path.parent.mkdir(parents=True, exist_ok=True)
        if execute:
            t = time.perf_counter()
            NotebookClient(nb, timeout=timeout, kernel_name=KERNELSPEC['name'],
                           resources={'metadata': {'path': str(path.parent)}}).execute()
            print(f'{path.relative_to(ROOT)}: executed in {time.perf_counter() - t:.1f} s')
        notebooks.append(nb)
    set_slides(notebooks)
    for lang, nb in zip(LANGS, notebooks):
        nbformat.write(nb, target(src, lang))


def update_prose(src):
    """Copy the markdown and the code comments of a source into its built pair without re-running.

    For corrections of the text only: markdown cells may be edited, split at a
    heading, added or removed, and comments in code cells changed, but the code
    cells (their order, their code without comments, and tags) must be those of
    the last run; each keeps its stored outputs. Anything else needs a new run (`build`).
    """
    cells = parse(src)
    paths = [target(src, lang) for lang in LANGS]
    notebooks = [nbformat.read(p, as_version=4) for p in paths]
    rebuilt = []
    for lang, nb in zip(LANGS, notebooks):
        want = make_notebook(cells, lang)
        old_code = [c for c in nb.cells if c.cell_type == 'code']
        new_code = [c for c in want.cells if c.cell_type == 'code']
        # a docstring may become a comment (what the course asks of code cells) without a new run
        if [(strip_comments(c.source, docstrings=False), c.metadata.get('tags', [])) for c in old_code] != \
           [(strip_comments(c.source, docstrings=False), c.metadata.get('tags', [])) for c in new_code]:
            raise SystemExit(f'{Path(src).name}: code or its tags changed; run `build` instead.')
        for old, new in zip(old_code, new_code):
            new.outputs, new.execution_count = old.outputs, old.execution_count
            new.metadata = {**old.metadata, 'tags': new.metadata.get('tags', [])}
            if not new.metadata['tags']:
                del new.metadata['tags']
        want.metadata = nb.metadata
        rebuilt.append(want)
    set_slides(rebuilt)
    for path, nb in zip(paths, rebuilt):
        nbformat.write(nb, path)


def resplit(src):
    """Recompute the slide metadata of a built pair from its stored outputs."""
    paths = [target(src, lang) for lang in LANGS]
    notebooks = [nbformat.read(p, as_version=4) for p in paths]
    set_slides(notebooks)
    for path, nb in zip(paths, notebooks):
        nbformat.write(nb, path)


def mismatches(src):
    """Differences between a source and its two notebooks (cell kinds, text, tags)."""
    problems = []
    cells = parse(src)
    for lang in LANGS:
        path = target(src, lang)
        if not path.exists():
            problems.append(f'{path.relative_to(ROOT)} is missing')
            continue
        nb = nbformat.read(path, as_version=4)
        want = make_notebook(cells, lang).cells
        if len(nb.cells) != len(want):
            problems.append(f'{path.relative_to(ROOT)}: {len(nb.cells)} cells, source has {len(want)}')
            continue
        for i, (have, w) in enumerate(zip(nb.cells, want)):
            if (have.cell_type, have.source, have.metadata.get('tags', [])) != \
               (w.cell_type, w.source, w.metadata.get('tags', [])):
                problems.append(f'{path.relative_to(ROOT)}: cell {i} differs from {Path(src).name}')
    return problems


def python_code(src, line_numbers=False):
    """A section's English code cells as Python files: {name: source}, for linters and tests.

    The notebook's cells go, in order, into NN-name.py, each headed by a '# %% cell N'
    line that says where it came from; a %%writefile cell of a .py script becomes a
    file of its own under that script's name. IPython lines (%magic, !command) are
    kept as comments, so that every line keeps its place. With line_numbers=True the
    values are (source, [line of the .txt source for each line, or None]).
    """
    stem = Path(src).stem
    files = {f'{stem}.py': []}
    for i, cell in enumerate(parse(src)):
        if cell['type'] != 'code':
            continue
        lines = list(enumerate(cell['en'].splitlines(), cell['line']))
        if lines and lines[0][1].startswith('%%writefile'):
            name = lines[0][1].split()[-1]
            if name.endswith('.py'):
                files[f'{stem}--{Path(name).name}'] = lines[1:]
            continue
        body = [(n, '# ' + line if line.lstrip().startswith(('%', '!')) else line) for n, line in lines]
        files[f'{stem}.py'] += [(None, f'# %% cell {i}'), *body, (None, '')]
    out = {name: '\n'.join(line for _, line in lines) + '\n' for name, lines in files.items()}
    if line_numbers:
        return {name: (out[name], [n for n, _ in lines]) for name, lines in files.items()}
    return out


def lint(ruff_args=()):
    """Run ruff over every section's code cells; print findings at their .txt lines; 0 if clean.

    Cells import where they need to (E402 is off), everything else follows pyproject.toml.
    """
    import json
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        where = {}
        for src in sources():
            for name, (code, lines) in python_code(src, line_numbers=True).items():
                (Path(folder) / name).write_text(code, encoding='utf-8')
                where[name] = (src, lines)
        done = subprocess.run([sys.executable, '-m', 'ruff', 'check', '--config', str(ROOT / 'pyproject.toml'),
                               '--extend-ignore', 'E402', '--output-format', 'json', *ruff_args, folder],
                              capture_output=True, text=True, timeout=120)
    if done.returncode not in (0, 1):
        print(done.stderr, file=sys.stderr)
        return done.returncode
    findings = json.loads(done.stdout or '[]')
    for f in findings:
        src, lines = where[Path(f['filename']).name]
        line = lines[f['location']['row'] - 1]
        print(f"{src.relative_to(ROOT)}:{line}:{f['location']['column']}: {f['code']} {f['message']}")
    return 1 if findings else 0


def write_code(folder):
    """Write every section's python_code() into folder; return the paths."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for src in sources():
        for name, code in python_code(src).items():
            (folder / name).write_text(code, encoding='utf-8')
            paths.append(folder / name)
    return paths


def sources():
    return sorted((NOTEBOOKS / 'src').glob('*.txt'))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = ap.add_subparsers(dest='cmd', required=True)
    b = sub.add_parser('build', help='write and execute the pair(s)')
    b.add_argument('src', nargs='*')
    b.add_argument('--all', action='store_true')
    b.add_argument('--no-execute', action='store_true')
    sub.add_parser('check', help='report notebooks that do not match their source, and untranslated comments')
    sub.add_parser('slides', help='recompute the slide metadata of every pair')
    code = sub.add_parser('code', help="write every section's code cells as .py files (for linters)")
    code.add_argument('folder')
    sub.add_parser('lint', help="ruff over every section's code cells, reported at the sources' lines")
    prose = sub.add_parser('prose', help='copy corrected markdown and code comments into built pairs, no re-run')
    prose.add_argument('src', nargs='+')
    args = ap.parse_args(argv)
    if args.cmd == 'build':
        for src in (sources() if args.all else args.src):
            build(src, execute=not args.no_execute)
        return 0
    if args.cmd == 'prose':
        for src in args.src:
            update_prose(src)
        return 0
    if args.cmd == 'lint':
        return lint()
    if args.cmd == 'code':
        print('\n'.join(str(path) for path in write_code(args.folder)))
        return 0
    if args.cmd == 'slides':
        for src in sources():
            resplit(src)
        return 0
    problems = [p for src in sources() for p in mismatches(src) + untranslated(src)]
    print('\n'.join(problems) or 'all notebooks match their sources')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
