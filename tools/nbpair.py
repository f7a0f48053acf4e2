"""Build the en/zh notebook pair of a section from its one bilingual source.

    python tools/nbpair.py build notebooks/src/01-compilers-and-interpreters.txt
    python tools/nbpair.py build --all          # every section
    python tools/nbpair.py check                # do the notebooks match their sources?

A source is a sequence of cells, each opened by a line that starts with '%% ':

    %% md                      a markdown cell; its English text follows
    %% zh                      ...then its Chinese text
    %% code [tag tag ...]      a code cell, shared by both languages
    %% zh                      (optional) the same code with Chinese comments

Tags are cell tags, e.g. nbval-ignore-output for cells whose output depends on
the run (timings, hardware). `build` writes both notebooks and executes each
top to bottom in its own folder, so they carry the outputs of one clean run.
"""
import argparse
import io
import sys
import tokenize
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / 'notebooks'
LANGS = ('en', 'zh')


def parse(path):
    """List of cells: dicts with type, tags, en and zh text."""
    cells, current, lang = [], None, 'en'
    for lineno, line in enumerate(Path(path).read_text(encoding='utf-8').splitlines(), 1):
        if line.startswith('%% '):
            words = line[3:].split()
            if words[0] == 'zh':
                if current is None or lang == 'zh':
                    raise ValueError(f'{path}:{lineno}: "%% zh" must follow an English cell')
                lang = 'zh'
                current['zh'] = []
                continue
            if words[0] not in ('md', 'code'):
                raise ValueError(f'{path}:{lineno}: unknown cell kind {words[0]!r}')
            current, lang = {'type': words[0], 'tags': words[1:], 'en': [], 'zh': None}, 'en'
            cells.append(current)
        elif current is None:
            if line.strip():
                raise ValueError(f'{path}:{lineno}: text before the first cell')
        else:
            current[lang].append(line)
    for i, cell in enumerate(cells):
        for lang in LANGS:
            if cell[lang] is not None:
                cell[lang] = '\n'.join(cell[lang]).strip('\n')
        if cell['type'] == 'md' and cell['zh'] is None:
            raise ValueError(f'{path}: markdown cell {i} has no Chinese text')
        if cell['type'] == 'code':
            if cell['zh'] is None:
                cell['zh'] = cell['en']
            elif strip_comments(cell['zh']) != strip_comments(cell['en']):
                raise ValueError(f'{path}: code cell {i} differs between en and zh beyond comments')
    return cells


def strip_comments(src):
    """Code without comments and blank lines, as a comparable string."""
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)
    try:
        toks = tokenize.generate_tokens(io.StringIO(src).readline)
        return ' '.join(t.string for t in toks if t.type not in skip)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return src  # IPython syntax (%magic, !cmd): compare as written


def make_notebook(cells, lang):
    """An unexecuted nbformat notebook for one language."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        'kernelspec': {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'},
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
    for lang in LANGS:
        nb = make_notebook(cells, lang)
        path = target(src, lang)
        path.parent.mkdir(parents=True, exist_ok=True)
        if execute:
            t = time.perf_counter()
            NotebookClient(nb, timeout=timeout, kernel_name='python3',
                           resources={'metadata': {'path': str(path.parent)}}).execute()
            print(f'{path.relative_to(ROOT)}: executed in {time.perf_counter() - t:.1f} s')
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


def sources():
    return sorted((NOTEBOOKS / 'src').glob('*.txt'))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    sub = ap.add_subparsers(dest='cmd', required=True)
    b = sub.add_parser('build', help='write and execute the pair(s)')
    b.add_argument('src', nargs='*')
    b.add_argument('--all', action='store_true')
    b.add_argument('--no-execute', action='store_true')
    sub.add_parser('check', help='report notebooks that do not match their source')
    args = ap.parse_args(argv)
    if args.cmd == 'build':
        for src in (sources() if args.all else args.src):
            build(src, execute=not args.no_execute)
        return 0
    problems = [p for src in sources() for p in mismatches(src)]
    print('\n'.join(problems) or 'all notebooks match their sources')
    return 1 if problems else 0


if __name__ == '__main__':
    sys.exit(main())
