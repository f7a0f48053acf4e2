"""The README's export command: slides and HTML pages from the stored outputs, per language."""
import html
import subprocess
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize('lang,name', [('en', '00-start-here'), ('zh', '07-parameter-servers')])
def test_course_export_writes_slides_and_pages(tmp_path, lang, name):
    start = time.monotonic()
    run = subprocess.run([str(ROOT / 'course'), 'export', lang, '--only', name, '--out', str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - start
    assert run.returncode == 0, run.stdout + run.stderr
    print(f'\nexport of {lang}/{name}: {seconds:.1f} s')
    folder = tmp_path / lang
    deck = (folder / 'slides' / f'{name}.slides.html').read_text(encoding='utf-8')
    page = (folder / 'html' / f'{name}.html').read_text(encoding='utf-8')
    assert f'slides/{name}.slides.html' in (folder / 'index.html').read_text(encoding='utf-8')
    stored = nbformat.read(ROOT / 'notebooks' / lang / f'{name}.ipynb', as_version=4)
    kinds = [c.metadata['slideshow']['slide_type'] for c in stored.cells]
    # reveal.js: one <section> per slide, holding one <section> per sub-slide
    assert deck.count('<section') == kinds.count('slide') + kinds.count('slide') + kinds.count('subslide')
    # the stored outputs are what the deck and the page show: no re-execution
    texts = [o['text'].strip().splitlines()[0] for c in stored.cells if c.cell_type == 'code'
             for o in c.outputs if o.get('output_type') == 'stream' and o['text'].strip()]
    assert texts and html.escape(texts[-1], quote=False) in page and 'image/png;base64' in deck


def test_export_refuses_an_unknown_notebook(tmp_path):
    run = subprocess.run([str(ROOT / 'course'), 'export', 'en', '--only', 'no-such-notebook', '--out',
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and 'no notebook named' in run.stderr
