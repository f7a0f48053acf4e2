"""GPU reference figures: recorded by the GPU run, read back by every GPU cell, shown labelled in both languages.

No real GPU file exists yet, so the whole path is checked with a SYNTHETIC file,
written by the notebooks' own GpuReference.record() into a temporary folder (never
under data/reference/): record, load, show through each notebook's own show
function in English and Chinese, verdicts from the stored values, and every planted
mismatch (a unit, a missing figure, another torch, another format) named clearly.
"""
import ast
import json
import math

import nbpair
import pytest
import torch
from helpers import ROOT
from notebook_code import definitions, section_of

from comp_perf import reference

# Each GPU cell that keeps reference figures: the names its show function needs, in order, from its page.
SHOWN_BY = {
    '01': [('CUDA_GRAPH', 'show_cuda_graph')],
    '02': [('CUDA_EVENTS', 'show_events'), ('QUEUE_MEMORY', 'show_queue_memory')],
    '03': [('TWO_STREAMS', 'show_streams'), ('COPY_OVERLAP', 'show_copy_overlap'),
           ('BATCH_COPIES', 'show_batch_copies')],
    '04': [('GPU_RATES', 'show_gpu_rates')],
    '09': [('VARIANTS', 'PAYOFF', 'OVERALL', 'show_payoff')],
    '10': [('ATTENTION', 'plain_attention', 'VERSIONS', 'MEMORY_CASES', 'SPEED_CASES', 'show_attention'),
           ('DECODE', 'PREDICTION_CASES', 'show_prediction', 'show_batches', 'show_decode')],
    '11': [('median', 'KERNELS', 'show_kernels')],
}
# Figures that a cell stores as one number per measured point (lengths, batch sizes) or per round.
LIST_FIGURES = {'10 decode on the roofline': {'batch', 'ms per step', 'FLOP per byte', 'GFLOP/s'},
                '11 kernels': {'add kernel', 'add torch', 'softmax kernel', 'softmax torch', 'softmax chain',
                               'softmax bf16 kernel', 'softmax bf16 torch', 'matmul kernel', 'matmul torch',
                               'attention kernel', 'attention sdpa'}}
SYNTHETIC_GPU = 'SYNTHETIC GPU (test data, not a measurement)'


def page_references():
    """{section: [names assigned a common.GpuReference(...) at the top level of its code cells]}."""
    found = {}
    for src in nbpair.sources():
        for code in nbpair.python_code(src).values():
            for node in ast.parse(code).body:
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                        and getattr(node.value.func, 'attr', None) == 'GpuReference'):
                    found.setdefault(section_of(src), []).append(node.targets[0].id)
    return found


def load(section, names):
    """(the GpuReference, its show function) as the page defines them."""
    page = definitions(section, *names)
    ref = next(page[n] for n in names if isinstance(page[n], reference.GpuReference))
    return ref, page[names[-1]]


def every_cell():
    return [(section, names) for section, cells in SHOWN_BY.items() for names in cells]


def synthetic_values(ref, scale=1.0):
    """Plausible numbers for each figure (lists for the 's' figures of an interleaved timing)."""
    values = {}
    for i, (name, unit) in enumerate(ref.units.items()):
        if ref.experiment == '10 attention against length':
            values[name] = ([256.0, 512.0, 1024.0] if name == 'length' else
                            [scale * (10.0 + 3 * i) * (1 + 0.01 * r) for r in range(3)])
        elif name in LIST_FIGURES.get(ref.experiment, ()):
            values[name] = [scale * (10.0 + 3 * i) * (1 + r) for r in range(3)]
        elif ref.experiment == '09 payoff' and unit == 's':
            base = 0.050 if name == 'first draft' else 0.010
            values[name] = [base * (1 + 0.01 * r) for r in range(5)]
        elif unit == 'fraction':
            values[name] = 0.1 + 0.05 * i
        else:
            values[name] = scale * (10.0 + 3 * i)
    return values


@pytest.fixture
def synthetic_dir(tmp_path, monkeypatch):
    """A folder holding one synthetic reference file, written through record(), and read instead of data/."""
    folder = tmp_path / 'reference'
    folder.mkdir()
    out = folder / 'synthetic-gpu.json'
    monkeypatch.setenv(reference.OUT_VARIABLE, str(out))
    monkeypatch.setattr(reference, 'machine_header', lambda: {
        'device_name': SYNTHETIC_GPU, 'torch': torch.__version__, 'cuda': '0.0', 'date': '2000-01-01'})
    for section, names in every_cell():
        ref, _ = load(section, names)
        ref.record(synthetic_values(ref), settings={'size': 7})
    monkeypatch.delenv(reference.OUT_VARIABLE)
    data = json.loads(out.read_text(encoding='utf-8'))
    data['synthetic'] = True
    out.write_text(json.dumps(data), encoding='utf-8')
    monkeypatch.setenv(reference.DIR_VARIABLE, str(folder))
    return folder


def test_every_gpu_reference_of_the_pages_is_checked_here_and_five_notebooks_keep_one():
    declared = {section: sorted(names) for section, names in page_references().items()}
    covered = {section: sorted(n for names in cells for n in names if n in declared.get(section, []))
               for section, cells in SHOWN_BY.items()}
    assert declared == covered, 'add each new GpuReference of a page to SHOWN_BY'
    assert len(declared) >= 5


@pytest.mark.parametrize('lang', ['en', 'zh'])
@pytest.mark.parametrize('section,names', every_cell())
def test_each_cell_shows_the_synthetic_figures_labelled_in_its_language(section, names, lang, synthetic_dir,
                                                                       monkeypatch, capsys):
    monkeypatch.setenv('COURSE_LANG', lang)
    ref, show = load(section, names)
    shown = ref.show_stored(show)
    out = capsys.readouterr().out
    assert len(shown) == 1 and dict(shown[0]) == synthetic_values(ref)
    assert SYNTHETIC_GPU in out and '2000-01-01' in out and 'size=7' in out
    label, verdict = ('GPU reference figures, measured on', 'Verdict:') if lang == 'en' else ('GPU 参考数据', '结论')
    assert out.startswith(label), out
    assert verdict in out, f'{ref.experiment}: no verdict computed from the stored figures'
    if lang == 'zh':
        assert 'measured on' not in out and 'Verdict' not in out, out


def test_the_verdict_comes_from_the_stored_values(synthetic_dir, monkeypatch, capsys):
    """02's queue-memory verdict flips when the stored peaks do: it is computed, not written."""
    monkeypatch.setenv('COURSE_LANG', 'en')
    ref, show = load('02', ['QUEUE_MEMORY', 'show_queue_memory'])
    path = synthetic_dir / 'synthetic-gpu.json'
    data = json.loads(path.read_text(encoding='utf-8'))
    for kept, expected in ((1000.0, 'keeping references is what holds memory'), (12.0, 'no difference')):
        data['experiments']['02 queue memory']['figures']['kept']['value'] = kept
        path.write_text(json.dumps(data), encoding='utf-8')
        ref.show_stored(show)
        assert expected in capsys.readouterr().out


@pytest.mark.parametrize('eager,graph,case', [(103.3, 132.6, 'the graph was slower'),   # the H200 run
                                              (100.0, 100.0, 'no clear gain'), (100.0, 50.0, 'replaying one graph')])
def test_the_cuda_graph_verdict_names_a_slower_graph(eager, graph, case, capsys):
    """The reference run found torch.compile's CUDA graph slower than eager at batch 1: that is a case of its own."""
    _, show = load('01', ['CUDA_GRAPH', 'show_cuda_graph'])
    show(reference.Figures({'eager': eager, 'graph': graph}))
    assert case in capsys.readouterr().out


@pytest.mark.parametrize('lang', ['en', 'zh'])
def test_without_a_file_each_cell_says_none_is_recorded(tmp_path, monkeypatch, capsys, lang):
    monkeypatch.setenv(reference.DIR_VARIABLE, str(tmp_path))
    monkeypatch.setenv('COURSE_LANG', lang)
    for section, names in every_cell():
        ref, show = load(section, names)
        assert ref.show_stored(show) == []
    lines = capsys.readouterr().out.splitlines()
    expected = ('GPU reference: none recorded yet' if lang == 'en' else 'GPU 参考数据：尚未记录')
    assert len(lines) == len(every_cell()) and all(line.startswith(expected) for line in lines), lines


def planted(folder, change):
    """Apply change(data) to the synthetic file and return the file's path."""
    path = folder / 'synthetic-gpu.json'
    data = json.loads(path.read_text(encoding='utf-8'))
    change(data)
    path.write_text(json.dumps(data), encoding='utf-8')
    return path


def events_figures(data):
    return data['experiments']['02 CUDA events']['figures']


@pytest.mark.parametrize('lang', ['en', 'zh'])
@pytest.mark.parametrize('mistake,message_en,message_zh', [
    (lambda d: events_figures(d)['gpu'].update(unit='s'),
     'gives "gpu" of "02 CUDA events" in s; this cell reads ms', '以 s 为单位，而这个单元格读取的单位是 ms'),
    (lambda d: events_figures(d).pop('issued'),
     'has no figure "issued" for "02 CUDA events"', '中没有“02 CUDA events”的“issued”这一项'),
    (lambda d: d['experiments'].pop('02 CUDA events'),
     'has no figures for "02 CUDA events" (its run did not reach that cell)', '中没有“02 CUDA events”的数字'),
    (lambda d: events_figures(d)['gpu'].update(value=float('nan')),
     '"gpu" of "02 CUDA events" is not a finite number', '不是有限的数'),
    (lambda d: d.update(format=99), 'is in format 99; this course reads format 1', '的格式版本是 99'),
    (lambda d: d['machine'].pop('torch'), 'does not say which GPU, torch and date', '没有注明'),
])
def test_a_planted_mismatch_is_named_and_nothing_wrong_is_shown(synthetic_dir, monkeypatch, capsys, lang,
                                                                mistake, message_en, message_zh):
    monkeypatch.setenv('COURSE_LANG', lang)
    planted(synthetic_dir, mistake)
    ref, show = load('02', ['CUDA_EVENTS', 'show_events'])
    assert ref.show_stored(show) == []
    out = capsys.readouterr().out
    assert 'synthetic-gpu.json' in out and (message_en if lang == 'en' else message_zh) in out, out
    assert out.count('\n') == 1, f'only the reason is printed, no figure: {out}'


def test_a_file_that_is_not_json_is_named(synthetic_dir, capsys):
    (synthetic_dir / 'synthetic-gpu.json').write_text('{"format": 1,', encoding='utf-8')
    ref, show = load('01', ['CUDA_GRAPH', 'show_cuda_graph'])
    assert ref.show_stored(show) == []
    assert 'synthetic-gpu.json cannot be read as JSON' in capsys.readouterr().out


@pytest.mark.parametrize('lang', ['en', 'zh'])
def test_a_file_from_another_torch_is_shown_with_that_said(synthetic_dir, monkeypatch, capsys, lang):
    monkeypatch.setenv('COURSE_LANG', lang)
    planted(synthetic_dir, lambda d: d['machine'].update(torch='1.13.1+cu117'))
    ref, show = load('01', ['CUDA_GRAPH', 'show_cuda_graph'])
    assert len(ref.show_stored(show)) == 1
    out = capsys.readouterr().out
    note = ('recorded with torch 1.13.1+cu117; this machine runs torch ' if lang == 'en'
            else '记录时用的是 torch 1.13.1+cu117，本机运行的是 torch ')
    assert note + torch.__version__ in out, out
    planted(synthetic_dir, lambda d: d['machine'].update(torch=torch.__version__))
    ref.show_stored(show)
    assert '1.13' not in capsys.readouterr().out


def test_a_synthetic_file_under_data_reference_is_refused(synthetic_dir, monkeypatch, capsys):
    monkeypatch.setattr(reference, 'REFERENCE_DIR', synthetic_dir)
    monkeypatch.delenv(reference.DIR_VARIABLE)
    ref, show = load('01', ['CUDA_GRAPH', 'show_cuda_graph'])
    assert ref.show_stored(show) == []
    assert 'synthetic test data, not a measurement' in capsys.readouterr().out


def test_record_refuses_figures_it_does_not_declare_and_numbers_that_are_not(tmp_path, monkeypatch):
    ref = reference.GpuReference('test', {'a': 'ms', 'b': 's'})
    with pytest.raises(ValueError, match=r"records \['a', 'b'\], got \['a'\]"):
        ref.record({'a': 1.0})
    with pytest.raises(ValueError, match='finite number'):
        ref.record({'a': 1.0, 'b': math.inf})
    with pytest.raises(ValueError, match='finite number'):
        ref.record({'a': 1.0, 'b': []})
    out = tmp_path / 'reference.json'
    monkeypatch.setenv(reference.OUT_VARIABLE, str(out))
    header = {'device_name': 'GPU A', 'torch': '2.11.0', 'date': '2000-01-01'}
    monkeypatch.setattr(reference, 'machine_header', lambda: dict(header))
    ref.record({'a': 1, 'b': [2, 3]}, settings={'n': 4, 'dtype': torch.float32})
    ref.record({'a': 5, 'b': [6]})   # the cell run again: its figures are replaced
    data = json.loads(out.read_text(encoding='utf-8'))
    assert data['machine'] == header and data['synthetic'] is False
    assert data['experiments']['test'] == {'settings': {}, 'figures': {'a': {'value': 5.0, 'unit': 'ms'},
                                                                       'b': {'value': [6.0], 'unit': 's'}}}
    header['device_name'] = 'GPU B'
    with pytest.raises(ValueError, match='one file per GPU'):
        ref.record({'a': 1, 'b': 2})


def test_record_without_the_gpu_run_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv(reference.OUT_VARIABLE, raising=False)
    monkeypatch.chdir(tmp_path)
    figures = reference.GpuReference('test', {'a': 'ms'}).record({'a': 2})
    assert figures == {'a': 2.0} and list(tmp_path.iterdir()) == []


def test_committed_reference_files_fit_every_cell_they_hold_and_none_is_synthetic():
    refs = [load(section, names)[0] for section, names in every_cell()]
    for path in sorted(reference.REFERENCE_DIR.glob('*.json')):
        assert not json.loads(path.read_text(encoding='utf-8')).get('synthetic'), f'{path} is synthetic'
        assert reference.check_file(path, refs) == [], path


@pytest.mark.parametrize('lang', ['en', 'zh'])
def test_a_partial_file_is_kept_and_shown_and_each_missing_cell_says_so(synthetic_dir, tmp_path, monkeypatch,
                                                                        capsys, lang):
    """A run cut by the hard stop: what it recorded is committed and shown, the rest says it was not reached."""
    import gpu_smoke
    monkeypatch.setenv('COURSE_LANG', lang)
    refs = [load(section, names)[0] for section, names in every_cell()]
    path = planted(synthetic_dir, lambda d: [d['experiments'].pop(r.experiment) for r in refs[-3:]])
    assert reference.check_file(path, refs) == []
    assert reference.missing_experiments(path, refs) == [r.experiment for r in refs[-3:]]
    kept = tmp_path / 'kept'
    monkeypatch.setattr(reference, 'REFERENCE_DIR', kept)
    planted(synthetic_dir, lambda d: d.update(synthetic=False))
    assert gpu_smoke.install_reference(path) == 0 and len(list(kept.glob('*.json'))) == 1
    capsys.readouterr()
    for section, names in every_cell():
        ref, show = load(section, names)
        assert len(ref.show_stored(show)) == (ref.experiment not in [r.experiment for r in refs[-3:]])
    out = capsys.readouterr().out
    reason = 'its run did not reach that cell' if lang == 'en' else '那次运行没有执行到这个单元格'
    assert out.count(reason) == 3, out
    planted(synthetic_dir, lambda d: d['experiments'].clear())
    assert reference.check_file(path, refs) == ['synthetic-gpu.json holds none of the experiments the notebooks '
                                                'record']
    planted(synthetic_dir, lambda d: d['experiments'].update({'99 gone': {}}))
    assert 'synthetic-gpu.json holds "99 gone", which no notebook cell reads' in reference.check_file(path, refs)


def test_check_file_finds_a_planted_problem(synthetic_dir):
    refs = [load(section, names)[0] for section, names in every_cell()]
    path = synthetic_dir / 'synthetic-gpu.json'
    assert reference.check_file(path, refs) == []
    planted(synthetic_dir, lambda d: events_figures(d)['finished'].update(unit='µs'))
    assert reference.check_file(path, refs) == [
        'synthetic-gpu.json gives "finished" of "02 CUDA events" in µs; this cell reads ms']


def stored_outputs(lang, section):
    nb = nbpair_notebook(lang, section)
    return '\n'.join(str(out.get('text', '')) for cell in nb.cells if cell.cell_type == 'code'
                     for out in cell.get('outputs', []))


def nbpair_notebook(lang, section):
    import nbformat
    path = next((ROOT / 'notebooks' / lang).glob(f'{section}-*.ipynb'))
    return nbformat.read(path, as_version=4)


@pytest.mark.parametrize('lang', ['en', 'zh'])
@pytest.mark.parametrize('section', sorted(SHOWN_BY))
def test_stored_notebooks_quote_no_gpu_figure_until_a_file_is_committed(lang, section):
    text = stored_outputs(lang, section)
    none = 'GPU reference: none recorded yet' if lang == 'en' else 'GPU 参考数据：尚未记录'
    if not list(reference.REFERENCE_DIR.glob('*.json')):
        assert text.count(none) == len(SHOWN_BY[section]), f'{lang}/{section}: re-execute it'
        assert 'GPU reference figures, measured on' not in text and 'GPU 参考数据，' not in text


def test_gpu_slug():
    assert reference.gpu_slug('NVIDIA H200') == 'nvidia-h200'
    assert reference.gpu_slug('NVIDIA GeForce RTX 4090') == 'nvidia-geforce-rtx-4090'


def test_no_page_indexes_its_settings_like_a_dict():
    """common.settings returns a namespace: cfg['d'] raises, and only the GPU branch of 09 had it (found on the GPU)."""
    found = []
    for src in nbpair.sources():
        for code in nbpair.python_code(src).values():
            found += [f'{src.name}: line {node.lineno}' for node in ast.walk(ast.parse(code))
                      if isinstance(node, ast.Subscript) and getattr(node.value, 'id', None) == 'cfg']
    assert found == []
    from comp_perf.machine import settings
    assert not hasattr(settings(T0={'d': 1}), '__getitem__')
