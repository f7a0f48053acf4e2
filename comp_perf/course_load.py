"""How long a section takes to teach, estimated from its stored English notebook.

The instructor's guide prints these figures and tests hold the notebooks to them.
The estimate is the one the December student review used: prose at 150 words a
minute, code at 15 non-empty lines a minute, plus the stored run time. Material
folded into <details> (solutions, reference tables) and code blocks inside
markdown are not counted as prose: a reader opens them when needed. A section's
Summary and Exercises are left out of the longest stretch (they are read apart)
but counted in its minutes.
"""
import datetime
import re
from pathlib import Path

import nbformat

WORDS_PER_MINUTE = 150
CODE_LINES_PER_MINUTE = 15
MAX_STRETCH_WORDS = 350     # prose a student reads before something runs or a figure appears
_CLOSING = re.compile(r'^#{1,3} (?:\d+ )?(Summary|Exercises|小结|练习)\b', re.M)


def without_folded(markdown):
    """Markdown without code blocks and <details> … </details> blocks."""
    text = re.sub(r'```.*?```', ' ', markdown, flags=re.S)
    previous = None
    while previous != text:  # innermost first, so that nested blocks go too
        previous, text = text, re.sub(r'<details>(?:(?!<details>).)*?</details>', ' ', text, flags=re.S)
    return text


def prose_words(markdown):
    """Words a reader reads in a markdown cell (English text)."""
    text = re.sub(r'<[^>]+>|!\[[^\]]*\]\([^)]*\)|\]\([^)]*\)', ' ', without_folded(markdown))
    return len(re.findall(r"[A-Za-z0-9][\w'’.,%-]*", text))


def has_figure(cell):
    """Whether a cell shows a picture: an image in markdown, or a stored image output."""
    if cell.cell_type == 'markdown':
        return bool(re.search(r'!\[[^\]]*\]\(|<img ', cell.source))
    return any('image/png' in out.get('data', {}) or 'image/svg+xml' in out.get('data', {})
               for out in cell.get('outputs', []))


def cell_seconds(cell):
    """Seconds a stored code cell took, from the timestamps nbclient records."""
    stamps = cell.metadata.get('execution', {})
    start, end = stamps.get('iopub.execute_input'), stamps.get('shell.execute_reply')
    if not (start and end):
        return 0.0
    parse = lambda s: datetime.datetime.fromisoformat(s.replace('Z', '+00:00'))  # noqa: E731
    return (parse(end) - parse(start)).total_seconds()


def stretches(cells):
    """(words, first cell, last cell) of each run of markdown with no code cell or figure in it."""
    found, words, first = [], 0, None
    end = next((i for i, c in enumerate(cells) if c.cell_type == 'markdown' and _CLOSING.search(c.source)),
               len(cells))
    for i, cell in enumerate(cells[:end]):
        if cell.cell_type == 'code' or has_figure(cell):
            if words:
                found.append((words, first, i - 1))
            words, first = 0, None
            continue
        first = i if first is None else first
        words += prose_words(cell.source)
    if words:
        found.append((words, first, end - 1))
    return found


def load(cells):
    """Prose words, code lines, stored seconds and estimated minutes of a list of cells."""
    words = sum(prose_words(c.source) for c in cells if c.cell_type == 'markdown')
    code = sum(1 for c in cells if c.cell_type == 'code' for line in c.source.splitlines() if line.strip())
    seconds = sum(cell_seconds(c) for c in cells if c.cell_type == 'code')
    minutes = words / WORDS_PER_MINUTE + code / CODE_LINES_PER_MINUTE + seconds / 60
    return {'words': words, 'code_lines': code, 'run_seconds': seconds, 'minutes': minutes}


def notebook_load(path):
    """load() of a stored notebook, plus its longest prose stretch."""
    cells = nbformat.read(Path(path), as_version=4).cells
    result = load(cells)
    result['longest_stretch'] = max(stretches(cells), default=(0, None, None))
    return result
