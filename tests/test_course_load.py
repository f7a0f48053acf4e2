"""The course's load: no long stretch of prose without something to run or see, and every
section within the lecture time the instructor's guide gives it (estimated from the stored
English notebook by comp_perf.course_load)."""
import re

import nbformat
import pytest
from helpers import ROOT

from comp_perf import course_load

SECTIONS = sorted((ROOT / 'notebooks' / 'en').glob('[0-9][0-9]-*.ipynb'))


def guide_minutes():
    """{'04': 60, …} from the Timing table of the instructor's guide (English)."""
    text = (ROOT / 'notebooks' / 'src' / 'instructors.txt').read_text(encoding='utf-8')
    return {m[1]: int(m[2]) for m in re.finditer(r'^\| (\d\d) [^|]+\| (\d+) min \|', text, re.M)}


@pytest.mark.parametrize('path', SECTIONS, ids=lambda p: p.stem[:2])
def test_no_long_prose_stretch(path):
    cells = nbformat.read(path, as_version=4).cells
    long = [(words, f'c{first:03d}–c{last:03d}') for words, first, last in course_load.stretches(cells)
            if words > course_load.MAX_STRETCH_WORDS]
    assert not long, (f'prose without a runnable cell or figure for more than {course_load.MAX_STRETCH_WORDS} '
                      f'words (fold reference material into <details>, or add a cell): {long}')


@pytest.mark.parametrize('path', SECTIONS, ids=lambda p: p.stem[:2])
def test_section_fits_its_guide_time(path):
    given = guide_minutes()
    assert path.stem[:2] in given, f'the guide gives no lecture time for {path.stem}'
    minutes = course_load.notebook_load(path)['minutes']
    assert minutes <= given[path.stem[:2]], \
        f'{path.stem}: about {minutes:.0f} min to read and run, the guide gives {given[path.stem[:2]]} min'


def test_folded_text_and_code_blocks_are_not_counted():
    text = ('one two three\n```\nnot these words\n```\n'
            '<details><summary>x</summary>\nhidden <details>deep</details> text\n</details>')
    assert course_load.prose_words(text) == 3
    assert course_load.prose_words('[a link](x.ipynb) and ![a picture](p.png)') == 3  # alt text is not read


def test_stretches_break_at_code_and_figures_and_stop_at_the_summary():
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    cells = [md('a ' * 200), md('b ' * 200), code('x = 1'), md('c ' * 100), md('![f](f.png)'), md('d ' * 50),
             md('## 5 Summary\n' + 'e ' * 500)]
    assert course_load.stretches(cells) == [(400, 0, 1), (100, 3, 3), (50, 5, 5)]


def test_load_estimate():
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    cell = code('a = 1\n\nb = 2\n')
    cell.metadata['execution'] = {'iopub.execute_input': '2026-12-01T10:00:00Z',
                                  'shell.execute_reply': '2026-12-01T10:00:30Z'}
    result = course_load.load([md('w ' * 300), cell])
    assert (result['words'], result['code_lines'], result['run_seconds']) == (300, 2, 30)
    assert result['minutes'] == pytest.approx(2 + 2 / 15 + 0.5)


WIDGET = 'application/vnd.jupyter.widget-view+json'


def widget_cells_without_figure(cells):
    """Indices of code cells that show a slider or calculator but store no static image beside it."""
    return [i for i, c in enumerate(cells) if c.cell_type == 'code'
            and any(WIDGET in out.get('data', {}) for out in c.get('outputs', []))
            and not course_load.has_figure(c)]


@pytest.mark.parametrize('path', SECTIONS + sorted((ROOT / 'notebooks' / 'zh').glob('[0-9][0-9]-*.ipynb')),
                         ids=lambda p: f'{p.parent.name}-{p.stem[:2]}')
def test_every_slider_cell_draws_a_static_figure(path):
    """Decks and HTML pages have no kernel: a slider's cell must also store a picture."""
    missing = widget_cells_without_figure(nbformat.read(path, as_version=4).cells)
    assert not missing, f'slider/calculator cells without a static figure: {missing}'


def test_slider_check_sees_a_widget_without_figure():
    cell = nbformat.v4.new_code_cell('interact(f)')
    cell.outputs = [nbformat.v4.new_output('display_data', data={WIDGET: {}, 'text/plain': 'w'})]
    assert widget_cells_without_figure([cell]) == [0]
    cell.outputs.append(nbformat.v4.new_output('display_data', data={'image/png': 'iVBOR'}))
    assert widget_cells_without_figure([cell]) == []


def printed_run_times(guide):
    """{notebook stem: seconds} as the stored guide's timing cell printed them ('10-attention-… 48 s  about …')."""
    cells = nbformat.read(guide, as_version=4).cells
    text = '\n'.join(out.get('text', '') for cell in cells if cell.cell_type == 'code' for out in cell.outputs)
    return {m[1]: int(m[2]) for m in re.finditer(r'^(\d\d-[\w-]+)\s+(\d+) (?:s|秒)\s', text, re.M)}


def stale_timings(folder, guide):
    """{stem: (printed seconds, stored seconds now)} where the guide's printed run time is not the stored one's."""
    found = {}
    for stem, seconds in printed_run_times(guide).items():
        cells = nbformat.read(folder / f'{stem}.ipynb', as_version=4).cells
        stored = round(sum(course_load.cell_seconds(c) for c in cells if c.cell_type == 'code'))
        if stored != seconds:
            found[stem] = (seconds, stored)
    return found


@pytest.mark.parametrize('lang', ['en', 'zh'])
def test_the_guides_stored_timings_are_those_of_the_stored_notebooks(lang):
    # the guide reads its run times from the notebooks beside it: re-execute it after any section it lists
    folder = ROOT / 'notebooks' / lang
    assert set(printed_run_times(folder / 'instructors.ipynb')) == {p.stem for p in folder.glob('[0-9][0-9]-*.ipynb')}
    stale = stale_timings(folder, folder / 'instructors.ipynb')
    assert not stale, (f'{lang}/instructors.ipynb prints run times of older runs (printed, stored now): {stale}; '
                       'build the guide again after the sections: tools/nbpair.py build notebooks/src/instructors.txt')


def test_a_stale_guide_timing_is_found(tmp_path):
    folder = ROOT / 'notebooks' / 'en'
    guide = nbformat.read(folder / 'instructors.ipynb', as_version=4)
    for cell in guide.cells:
        for out in cell.get('outputs', []):
            if 'text' in out:   # planted: 05's printed run time 7 s longer than its stored cells
                out['text'] = re.sub(r'^(05-multi-gpu-from-scratch\s+)(\d+)', lambda m: m[1] + str(int(m[2]) + 7),
                                     out['text'], flags=re.M)
    nbformat.write(guide, tmp_path / 'instructors.ipynb')
    assert '05-multi-gpu-from-scratch' in stale_timings(folder, tmp_path / 'instructors.ipynb')
