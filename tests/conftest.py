"""Shared fixtures (a fake GPU count at the torch.cuda boundary) and the test tiers.

Markers, set here so that no test has to remember them:
  notebooks  nbval's cells of the stored notebooks
  browser    tests that drive headless Chromium (tests/test_browser.py)
  export     the slide and page export (tests/test_export.py)
  procs      tests that start processes: worker groups, torchrun, subprocesses, servers
The quick tier, `./course test --quick`, deselects all four.
"""
import inspect
import os
import re

import pytest
import torch

MARKERS = {'notebooks': "nbval's cells of the stored notebooks",
           'browser': 'drives headless Chromium',
           'export': 'exports slides and pages',
           'procs': 'starts processes (worker groups, torchrun, subprocesses, servers)'}
# A test (or a fixture it uses) whose code says any of these starts processes.
STARTS_PROCESSES = re.compile(r'\b(launch|torchrun|subprocess|Popen|NotebookClient|mp\.)\b|_spawn|\bspawn\(')


def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line('markers', f'{name}: {meaning}')


def _starts_processes(item):
    functions = [getattr(item, 'function', None)]
    for name in getattr(item, 'fixturenames', ()):
        for definition in item._fixtureinfo.name2fixturedefs.get(name, ()):
            functions.append(definition.func)
    for function in filter(None, functions):
        try:
            if STARTS_PROCESSES.search(inspect.getsource(function)):
                return True
        except (OSError, TypeError):
            pass
    return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(getattr(item, 'path', item.fspath))
        if path.endswith('.ipynb'):
            item.add_marker('notebooks')
        elif path.endswith('test_browser.py'):
            item.add_marker('browser')
        elif path.endswith('test_export.py'):
            item.add_marker('export')
        if not path.endswith('.ipynb') and _starts_processes(item):
            item.add_marker('procs')


@pytest.fixture
def fake_gpus(monkeypatch):
    """Call fake_gpus(n) to make this process believe it sees n CUDA GPUs.

    The course decides everything about GPUs through torch.cuda.is_available()
    and torch.cuda.device_count(), so that is where the count is faked (not in
    common.num_gpus): a helper that asked torch.cuda directly would be caught too.
    Spawned worker processes see the real machine.
    """
    def fake(n):
        monkeypatch.setattr(torch.cuda, 'is_available', lambda: n > 0)
        monkeypatch.setattr(torch.cuda, 'device_count', lambda: n)
    return fake


@pytest.fixture
def fashion_mnist():
    """The installed Fashion-MNIST folder; missing data fails in CI (a set-up bug) and skips elsewhere."""
    import common
    try:
        return common.find_fashion_mnist(download=False)
    except FileNotFoundError:
        if os.environ.get('CI'):
            raise
        pytest.skip('Fashion-MNIST is not installed on this machine')
