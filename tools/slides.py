"""Slide metadata for presenting a built notebook pair (nbconvert --to slides, RISE).

A level-1 or level-2 heading starts a slide, a level-3 heading a sub-slide, and a
cell that would overflow the current slide (estimated from its text and the
stored outputs of the English notebook) starts a sub-slide, so one idea sits on
each slide. Both languages get the same structure. tools/nbpair.py calls it.
"""
import base64
import re
import struct

SLIDE_LINES = 24      # lines of text that fit on one slide at the export's size
CHARS_PER_LINE = 100  # characters per line of prose on a slide


def _png_height(data):
    raw = base64.b64decode(data[:64])
    return struct.unpack('>I', raw[20:24])[0] if raw[:8] == b'\x89PNG\r\n\x1a\n' else 300


def _text_lines(text, width=CHARS_PER_LINE):
    return sum(max(1, -(-len(line) // width)) for line in text.splitlines())


def cell_lines(cell):
    """Estimated height of a cell on a slide, in lines of text."""
    if cell.cell_type == 'markdown':
        text = re.sub(r'<details>.*?</details>', '<details>', cell.source, flags=re.S)  # folded
        return _text_lines(text) + text.count('\n\n') // 2
    lines = len(cell.source.splitlines())
    for out in cell.get('outputs', []):
        if out.output_type == 'stream':
            lines += _text_lines(out.text)
        elif out.output_type == 'error':
            lines += len(out.traceback)
        else:
            data = out.get('data', {})
            if 'image/png' in data:
                lines += _png_height(data['image/png']) // 20
            elif 'application/vnd.jupyter.widget-view+json' in data:
                lines += 8
            elif 'text/markdown' in data:
                lines += _text_lines(data['text/markdown'])
            else:
                lines += _text_lines(data.get('text/plain', ''))
    return lines


def slide_types(nb):
    """One slide type per cell: 'slide', 'subslide' or '-' (continue the current one)."""
    types, used = [], 0
    for i, cell in enumerate(nb.cells):
        height = cell_lines(cell)
        first = cell.source.lstrip().split('\n', 1)[0] if cell.cell_type == 'markdown' else ''
        if i == 0 or first.startswith(('# ', '## ')):
            kind = 'slide'
        elif first.startswith('### ') or (used and used + height > SLIDE_LINES):
            kind = 'subslide'
        else:
            kind = '-'
        used = height if kind != '-' else used + height
        types.append(kind)
    return types


def set_slides(notebooks):
    """Give every language the slide structure computed from the first (English) notebook."""
    types = slide_types(notebooks[0])
    for nb in notebooks:
        for cell, kind in zip(nb.cells, types):
            cell.metadata['slideshow'] = {'slide_type': kind}
