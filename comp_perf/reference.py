"""GPU reference figures (every section with a GPU cell): recorded by one GPU run, shown on every machine.

A GPU cell declares what it measures, `EVENTS = GpuReference('02 CUDA events',
{'issued': 'ms', 'finished': 'ms', 'gpu': 'ms'})`, and writes its display as a
function of those figures, `show(figures)`, verdict included. On a GPU it
measures, calls `EVENTS.record(values, settings)` and shows what it measured;
on every machine `EVENTS.show_stored(show)` then shows the figures stored in
data/reference/ by the same `show`, labelled with the GPU, its torch and the
date, so that the verdict beside stored figures comes from the code that judges
a live run.

One file per kind of GPU, data/reference/<gpu>.json (tools/gpu_smoke.py writes
it; MAINTAINING.md says how it gets there):

    {"format": 1, "synthetic": false,
     "machine": {"device_name": "...", "torch": "...", "cuda": "...", "driver": "...", "date": "YYYY-MM-DD"},
     "experiments": {"02 CUDA events": {"settings": {...},
                                        "figures": {"issued": {"value": 1.2, "unit": "ms"}, ...}}}}

A value is a number or a list of numbers (the rounds of an interleaved timing).
record() writes only when COURSE_REFERENCE_OUT names a file (the GPU run sets
it); COURSE_REFERENCE_DIR replaces data/reference/ (the tests' synthetic file).
A file that does not fit what a cell expects (another unit, a missing figure,
another format) is named with the reason and skipped, never shown wrong; one
recorded with another torch than the reader's is shown with that said.
"""
import datetime
import json
import math
import os
import re
from pathlib import Path

from comp_perf.language import tr

FORMAT = 1
REFERENCE_DIR = Path(__file__).resolve().parent.parent / 'data' / 'reference'
OUT_VARIABLE = 'COURSE_REFERENCE_OUT'
DIR_VARIABLE = 'COURSE_REFERENCE_DIR'


def reference_dir():
    """Where stored reference files are read: COURSE_REFERENCE_DIR, else data/reference/."""
    return Path(os.environ[DIR_VARIABLE]) if os.environ.get(DIR_VARIABLE) else REFERENCE_DIR


def gpu_slug(device_name):
    """'NVIDIA H200' -> 'nvidia-h200': the reference file's name for that GPU."""
    return re.sub(r'[^a-z0-9]+', '-', device_name.lower()).strip('-') or 'gpu'


def minor_version(version):
    """'2.11.0+cu130' -> '2.11'."""
    return '.'.join(str(version).split('+')[0].split('.')[:2])


class Figures(dict):
    """{name: value} of one experiment as stored, with where it came from (.machine, .settings)."""

    def __init__(self, values, machine=None, settings=None):
        super().__init__(values)
        self.machine, self.settings = machine or {}, settings or {}


class UnusableReference(ValueError):
    """A reference file that cannot be used for an experiment; the message says why (tr() translates it)."""

    def __init__(self, template, **fields):
        super().__init__(template.format(**fields))
        self.template, self.fields = template, fields

    def translated(self):
        return tr(self.template, **self.fields)


def _check_value(experiment, name, value):
    numbers = value if isinstance(value, list) else [value]
    if not numbers or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                              for v in numbers):
        raise ValueError(f'{experiment!r}: figure {name!r} must be a finite number or a non-empty list of '
                         f'them, got {value!r}.')


def machine_header():
    """The facts of this GPU run that label its figures: GPU, torch, CUDA, Python, date (driver: see gpu_smoke)."""
    import platform

    import torch
    header = {'device_name': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU',
              'torch': torch.__version__, 'cuda': torch.version.cuda, 'python': platform.python_version(),
              'date': datetime.datetime.now(datetime.timezone.utc).date().isoformat()}
    if torch.cuda.is_available():
        header['capability'] = '.'.join(map(str, torch.cuda.get_device_capability(0)))
    return header


def read_file(path):
    """The parsed reference file; UnusableReference naming the file and what is wrong with its frame."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding='utf-8'))
    except (OSError, ValueError) as e:
        raise UnusableReference('{file} cannot be read as JSON ({error})', file=path.name, error=e) from None
    if not isinstance(data, dict) or data.get('format') != FORMAT:
        found = data.get('format') if isinstance(data, dict) else type(data).__name__
        raise UnusableReference('{file} is in format {found}; this course reads format {format}', file=path.name,
                                found=found, format=FORMAT)
    machine = data.get('machine')
    if not isinstance(machine, dict) or not all(machine.get(k) for k in ('device_name', 'torch', 'date')):
        raise UnusableReference('{file} does not say which GPU, torch and date its figures come from',
                                file=path.name)
    if not isinstance(data.get('experiments'), dict):
        raise UnusableReference('{file} holds no experiments', file=path.name)
    if data.get('synthetic') and path.resolve().parent == REFERENCE_DIR.resolve():
        raise UnusableReference('{file} is synthetic test data, not a measurement: it must not be in '
                                'data/reference/', file=path.name)
    return data


def write_file(path, data):
    """Write a reference file atomically: a run killed mid-write keeps the previous file whole.

    The one writer of the format: the GPU cells (record), and tools/gpu_smoke.py when it adds
    the driver and when it keeps a run's files in data/reference/.
    """
    path = Path(path)
    tmp = path.with_suffix(path.suffix + '.tmp')
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + '\n', encoding='utf-8')
    tmp.replace(path)


def stored_files():
    """The reference files to show: every *.json in reference_dir(), sorted."""
    folder = reference_dir()
    return sorted(folder.glob('*.json')) if folder.is_dir() else []


class GpuReference:
    """One GPU experiment of a notebook: its name, the figures it measures and their units."""

    def __init__(self, experiment, units):
        if not experiment or not units:
            raise ValueError('GpuReference needs a name and at least one figure with its unit.')
        self.experiment, self.units = experiment, dict(units)

    def record(self, values, settings=None):
        """Check `values` against the declared figures, write them where the GPU run asked, return Figures.

        Writes only when COURSE_REFERENCE_OUT names a file (the GPU run): the
        file gets this machine's header once and this experiment's figures
        (replaced if the cell runs again). A live run anywhere else just shows
        them; either way the Figures carry this machine's header (its GPU's name).
        """
        if set(values) != set(self.units):
            raise ValueError(f'{self.experiment!r} records {sorted(self.units)}, got {sorted(values)}.')
        for name, value in values.items():
            _check_value(self.experiment, name, value)
        clean = {name: [float(v) for v in value] if isinstance(value, list) else float(value)
                 for name, value in values.items()}
        settings = {key: value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
                    for key, value in (settings or {}).items()}
        out = os.environ.get(OUT_VARIABLE)
        header = machine_header()
        if out:
            self._write(Path(out), header, clean, settings)
        return Figures(clean, header, settings)

    def _write(self, path, header, values, settings):
        data = read_file(path) if path.exists() else {'format': FORMAT, 'synthetic': False, 'machine': header,
                                                      'experiments': {}}
        if data['machine'].get('device_name') != header['device_name']:
            raise ValueError(f"{path} holds figures of {data['machine'].get('device_name')}, "
                             f"not of {header['device_name']}: one file per GPU.")
        data['machine'] = {**header, **{k: v for k, v in data['machine'].items() if k not in header}}
        data['experiments'][self.experiment] = {
            'settings': settings,
            'figures': {name: {'value': value, 'unit': self.units[name]} for name, value in values.items()}}
        write_file(path, data)

    def figures_from(self, data, name='the file'):
        """This experiment's Figures from a parsed file; UnusableReference saying what does not fit."""
        entry = data['experiments'].get(self.experiment)
        if not isinstance(entry, dict) or not isinstance(entry.get('figures'), dict):
            raise UnusableReference('{file} has no figures for "{experiment}" (its run did not reach that cell)',
                                    file=name, experiment=self.experiment)
        values = {}
        for figure, unit in self.units.items():
            stored = entry['figures'].get(figure)
            if not isinstance(stored, dict) or 'value' not in stored:
                raise UnusableReference('{file} has no figure "{figure}" for "{experiment}" (recorded by another '
                                        'version of the course?)', file=name, figure=figure,
                                        experiment=self.experiment)
            if stored.get('unit') != unit:
                raise UnusableReference('{file} gives "{figure}" of "{experiment}" in {found}; this cell reads {unit}',
                                        file=name, figure=figure, experiment=self.experiment,
                                        found=stored.get('unit'), unit=unit)
            try:
                _check_value(self.experiment, figure, stored['value'])
            except ValueError:
                raise UnusableReference('{file}: "{figure}" of "{experiment}" is not a finite number or a list of '
                                        'them', file=name, figure=figure, experiment=self.experiment) from None
            values[figure] = stored['value']
        return Figures(values, data['machine'], entry.get('settings') or {})

    def show_stored(self, show, files=None):
        """Print each stored GPU's figures, labelled, through show(figures); say so when there are none.

        Returns the Figures shown (a list, one per usable file). A file that does
        not fit is named with the reason and skipped: never a crash, never a
        silent omission.
        """
        import torch
        files = stored_files() if files is None else [Path(f) for f in files]
        if not files:
            print(tr('GPU reference: none recorded yet (no file in data/reference/), so no GPU figure is quoted '
                     'here.'))
            return []
        shown = []
        for path in files:
            try:
                figures = self.figures_from(read_file(path), path.name)
            except UnusableReference as e:
                print(tr('GPU reference not shown: {why}.', why=e.translated()))
                continue
            machine = figures.machine
            settings = ', '.join(f'{k}={v}' for k, v in figures.settings.items()) or tr('none')
            print(tr('GPU reference figures, measured on {gpu} with torch {torch} (CUDA {cuda}) on {date}; '
                     'settings: {settings}', gpu=machine['device_name'], torch=machine['torch'],
                     cuda=machine.get('cuda') or '?', date=machine['date'], settings=settings))
            if minor_version(machine['torch']) != minor_version(torch.__version__):
                print(tr('(recorded with torch {then}; this machine runs torch {now}: kernels and defaults may '
                         'differ between versions)', then=machine['torch'], now=torch.__version__))
            show(figures)
            shown.append(figures)
        return shown


def check_file(path, references):
    """Problems of a reference file against the GpuReference objects the notebooks define ([] if none).

    A partial file, from a run that the hard stop cut before some cells, is usable:
    an experiment it lacks is no problem here (missing_experiments lists them, and
    each of those cells says its run did not reach it). A figure that does not fit
    its cell, an experiment no cell reads, or a file holding no experiment at all is.
    """
    try:
        data = read_file(path)
    except UnusableReference as e:
        return [str(e)]
    name, known = Path(path).name, {ref.experiment for ref in references}
    held = [ref for ref in references if ref.experiment in data['experiments']]
    problems = [] if held else [f'{name} holds none of the experiments the notebooks record']
    problems += [f'{name} holds "{experiment}", which no notebook cell reads'
                 for experiment in sorted(set(data['experiments']) - known)]
    for ref in held:
        try:
            ref.figures_from(data, name)
        except UnusableReference as e:
            problems.append(str(e))
    return problems


def missing_experiments(path, references):
    """The experiments of `references` that a (usable) reference file does not hold: its run never reached them."""
    data = read_file(path)
    return [ref.experiment for ref in references if ref.experiment not in data['experiments']]
