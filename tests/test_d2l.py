"""The book's d2l package: installed by the set-up, importable with the course's PyTorch, and
every course helper that shares a d2l name says how it differs (checked against d2l itself)."""
import contextlib
import importlib
import inspect
import io
import pkgutil
import sys

import matplotlib
import pytest
import torch

import common
import comp_perf
from comp_perf import s00_book_helpers as book


@pytest.fixture(scope='module')
def d2l():
    return book.d2l_torch()


def test_d2l_imports_with_the_course_torch(d2l):
    import importlib.metadata
    assert importlib.metadata.version('d2l') == book.D2L_VERSION
    assert d2l.torch is torch and torch.__version__.startswith('2.14')


@pytest.mark.procs
def test_importing_d2l_changes_no_matplotlib_setting():
    """d2l.torch imports matplotlib_inline; importing it must leave the backend and rcParams alone."""
    code = ('import matplotlib; b = matplotlib.get_backend(); r = dict(matplotlib.rcParams)\n'
            'from d2l import torch as d2l\n'
            'assert matplotlib.get_backend() == b, matplotlib.get_backend()\n'
            'assert {k for k in r if r[k] != matplotlib.rcParams[k]} == set()\n')
    import subprocess
    done = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert matplotlib.get_backend()  # this process is untouched either way


def course_helpers():
    """{name: function or class} of everything public the package defines, whether or not a page calls it."""
    found = {}
    for info in pkgutil.iter_modules(comp_perf.__path__):
        module = importlib.import_module(f'comp_perf.{info.name}')
        found.update({name: value for name, value in vars(module).items() if not name.startswith('_')
                      and callable(value) and getattr(value, '__module__', None) == module.__name__})
    return found


def test_no_silent_duplicates(d2l):
    """Every course helper with a d2l name says in its docstring how it differs from d2l's."""
    helpers = course_helpers()
    names = sorted(name for name in helpers if hasattr(d2l, name))
    assert set(names) == set(book.DIFFERENCES), \
        f'course helpers named like d2l\'s without a stated difference: {set(names) - set(book.DIFFERENCES)}'
    for name in names:
        doc = ' '.join((helpers[name].__doc__ or '').split())
        assert f'd2l: {book.DIFFERENCES[name]}.' in doc, \
            f'{helpers[name].__module__}.{name}: its docstring needs the line "d2l: {book.DIFFERENCES[name]}."'


def test_every_stated_difference_is_true_of_the_installed_d2l(d2l):
    confirmed = book.compare_with_d2l(d2l)
    assert all(confirmed.values()), [name for name, ok in confirmed.items() if not ok]


def test_a_stated_difference_that_is_no_longer_true_is_reported(d2l):
    class Benchmark:  # a d2l whose Benchmark synchronises: the course's claim would be false
        def __exit__(self, *args):
            torch.cuda.synchronize()
    planted = type('FakeD2L', (), {name: getattr(d2l, name) for name in book.DIFFERENCES})
    planted.Benchmark = Benchmark
    planted.get_dataloader_workers = d2l.get_dataloader_workers
    with contextlib.redirect_stdout(io.StringIO()) as out:
        confirmed = book.compare_with_d2l(planted)
    assert confirmed['Benchmark'] is False and confirmed['Timer'] is True
    assert "d2l's version differs" in out.getvalue()


@pytest.mark.parametrize('n', [0, 1, 4])
def test_device_helpers_with_faked_gpu_counts(d2l, fake_gpus, n):
    fake_gpus(n)
    gpus = [torch.device(f'cuda:{i}') for i in range(n)]
    assert d2l.try_all_gpus() == gpus                      # the book: empty without a GPU
    assert common.try_all_gpus() == (gpus or [torch.device('cpu')])
    assert d2l.try_gpu() == common.try_gpu() == (gpus[0] if n else torch.device('cpu'))
    assert d2l.try_gpu(n) == common.try_gpu(n) == torch.device('cpu')
    assert d2l.num_gpus() == common.num_gpus() == n
    assert d2l.gpu(n) == torch.device(f'cuda:{n}')         # the book hands out a device that is not there
    with pytest.raises(RuntimeError, match=f'cuda:{n} was requested'):
        common.gpu(n)


def test_sgd_and_accuracy_agree_with_d2l(d2l):
    torch.manual_seed(0)
    ours, theirs = torch.randn(5, 3, requires_grad=True), None
    theirs = ours.detach().clone().requires_grad_()
    for p in (ours, theirs):
        (p ** 2).sum().backward()
    common.sgd([ours], lr=0.1, batch_size=4)
    d2l.sgd([theirs], lr=0.1, batch_size=4)
    assert torch.equal(ours, theirs) and torch.equal(ours.grad, theirs.grad)
    logits, labels = torch.randn(50, 10), torch.randint(0, 10, (50,))
    assert common.accuracy(logits, labels) == d2l.accuracy(logits, labels)
    assert common.accuracy(labels, labels) == d2l.accuracy(labels, labels) == 50


def test_resnet18_shapes_agree_and_the_course_one_is_narrower(d2l):
    x = torch.randn(2, 1, 28, 28)
    theirs = d2l.resnet18(10, 1)
    assert theirs(x).shape == common.resnet18(10, width=8)(x).shape == (2, 10)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(common.resnet18(10, width=64)) > 10 * count(common.resnet18(10, width=8))
    assert 'width' not in inspect.signature(d2l.resnet18).parameters


def test_benchmark_side_by_side_runs_and_prints_nothing_of_d2l(capsys):
    theirs, ours = book.benchmark_side_by_side(torch.device('cpu'), size=128, repeats=3)
    assert theirs > 0 and ours > 0
    assert capsys.readouterr().out == ''   # d2l's English "Done: … sec" line was captured


def test_missing_d2l_gives_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, 'd2l', None)
    with pytest.raises(ImportError, match=r"d2l is not installed .*pip install --no-deps d2l==1.0.3"):
        book.d2l_torch()


def test_environment_check_reports_d2l(monkeypatch, capsys):
    common.environment_report()
    assert any(line.split()[:2] == ['d2l', book.D2L_VERSION] for line in capsys.readouterr().out.splitlines())
    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, 'version', missing)
    common.environment_report()
    assert any(line.startswith('d2l') and 'NOT INSTALLED' in line for line in capsys.readouterr().out.splitlines())


def test_the_set_up_installs_the_release_the_course_checks_without_its_pins():
    from helpers import ROOT
    pins = [line for line in (ROOT / 'requirements-d2l.txt').read_text().splitlines() if line and line[0] != '#']
    assert pins == [f'd2l=={book.D2L_VERSION}']
    course = (ROOT / 'course').read_text(encoding='utf-8')
    assert 'pip_install -q --no-deps -r requirements-d2l.txt' in course and 'd2l.torch' in course
    assert 'pip install --no-deps -r requirements-d2l.txt' in (ROOT / 'README.md').read_text(encoding='utf-8')


FAKE_PIP = """#!/bin/bash
echo "ERROR: pip's dependency resolver does not currently take into account all the packages that are installed."
echo "d2l 1.0.3 requires numpy==1.23.5, but you have numpy 2.4.6 which is incompatible."
[ -n "$OTHER" ] && echo "foo 1.0 requires bar==2, but you have bar 3 which is incompatible."
exit ${RC:-0}
"""


@pytest.mark.parametrize('other,rc', [(False, 0), (True, 0), (False, 1)])
@pytest.mark.procs
def test_set_up_replaces_only_the_expected_d2l_complaint(tmp_path, other, rc):
    """pip's ERROR about d2l's own pins becomes one line; any other conflict or failure is shown as is."""
    import re
    import subprocess
    from helpers import ROOT
    course = (ROOT / 'course').read_text(encoding='utf-8')
    functions = re.search(r'^say\(\).*?$', course, re.M)[0] + '\n' + \
        re.search(r'^pip_install\(\) \{.*?^\}', course, re.M | re.S)[0]
    fake = tmp_path / 'python'
    fake.write_text(FAKE_PIP)
    fake.chmod(0o755)
    script = f'set -euo pipefail\nPY={fake}\n{functions}\npip_install -q x\n'
    env = {'PATH': '/usr/bin:/bin', **({'OTHER': '1'} if other else {}), 'RC': str(rc)}
    done = subprocess.run(['bash', '-c', script], capture_output=True, text=True, timeout=30, env=env)
    assert done.returncode == rc
    shown = 'd2l 1.0.3 requires' in done.stdout
    assert shown == (other or rc != 0), done.stdout
    assert ('foo 1.0 requires' in done.stdout) == other
    assert ("pins are not installed: expected" in done.stdout) == (not other and rc == 0)


def test_side_by_side_picks_large_products_on_a_gpu_and_small_ones_on_a_cpu(fake_gpus):
    """On a GPU the products must take far longer than queueing them, or d2l's missing sync would not show."""
    fake_gpus(1)
    assert common.try_gpu() == torch.device('cuda:0')
    assert book.products_size(common.try_gpu()) == 4096
    assert book.products_size('cuda:1') == 4096 and book.products_size('cpu') == 1024
