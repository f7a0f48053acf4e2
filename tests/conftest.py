"""Shared fixtures (a fake GPU count at the torch.cuda boundary) and the test tiers.

Markers:
  notebooks  nbval's cells of the stored notebooks       set here, by file
  browser    tests that drive headless Chromium           set here, by file (tests/test_browser.py)
  export     the slide and page export                    set here, by file (tests/test_export.py)
  procs      tests that start processes: worker groups,   written on the test, @pytest.mark.procs
             torchrun, subprocesses, kernels, servers     (or a module's pytestmark)
The quick tier, `./course test --quick`, deselects all four.
  slow       a test that repeats what a faster one checks  written on the test, @pytest.mark.slow
             (the six-lecture cut executed, beside its     deselected unless `--slow` is given
             static check), kept for a maintainer

The procs mark is enforced, in every tier: while a test without any of these marks runs
(its fixtures' set-up and teardown included), starting a process fails it with "this test
starts processes: mark it procs". A test marked procs that passes without starting one, in
its body or in a fixture it uses, fails too: the mark would only keep it out of the quick
tier. So the quick tier is exactly the tests that start no process.
"""
import multiprocessing.process
import os
import subprocess
import sys
import threading

import pytest
import torch

if not torch.cuda.is_available():
    # Triton fixes interpreted or compiled for its own helpers when first imported, and any test may
    # import it first (torch.compile's checks do): on a machine without a GPU, interpreted, as 11 runs it.
    os.environ.setdefault('TRITON_INTERPRET', '1')

pytest_plugins = ('pytester',)   # tests/test_tiers.py runs planted tests through this conftest

MARKERS = {'notebooks': "nbval's cells of the stored notebooks",
           'browser': 'drives headless Chromium',
           'export': 'exports slides and pages',
           'procs': 'starts processes (worker groups, torchrun, subprocesses, kernels, servers)'}
# Tiers whose tests may start processes; only procs is held to its mark, since the other three
# are set by file and their tests all start a kernel, a browser or the export.
MAY_START = ('notebooks', 'browser', 'export', 'procs')


def pytest_addoption(parser):
    parser.addoption('--slow', action='store_true',
                     help='also run the tests marked slow (each repeats, slower, what another test checks)')


def pytest_configure(config):
    for name, meaning in {**MARKERS, 'slow': 'repeats a faster check; runs only with --slow'}.items():
        config.addinivalue_line('markers', f'{name}: {meaning}')
    keep_worker_to_one_core(os.environ.get('PYTEST_XDIST_WORKER'))


def keep_worker_to_one_core(worker):
    """Under `pytest -n N` (./course test on 2 or more cores), worker gwK runs on one core of its own.

    The kernels, workers and torchruns it starts inherit that core, and torch in each of them
    starts one thread. Unpinned, two workers' torch threads (2 each, and 2-3 processes per group)
    fight over both cores: the four longest notebooks took 566 s that way against 340 s one after
    another, and 234 s pinned (AMD EPYC, 2 cores). Outside xdist (`worker` None) nothing changes.
    """
    if not worker or not hasattr(os, 'sched_setaffinity'):
        return
    cores = sorted(os.sched_getaffinity(0))
    core = cores[int(worker.removeprefix('gw')) % len(cores)]
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)   # torch counted its threads at import, before the pin


def pytest_collection_modifyitems(config, items):
    if not config.getoption('--slow'):
        # Deselected rather than skipped: CI's budget (20 minutes) leaves them out on purpose.
        slow = [item for item in items if item.get_closest_marker('slow')]
        if slow:
            config.hook.pytest_deselected(items=slow)
            items[:] = [item for item in items if not item.get_closest_marker('slow')]
    for item in items:
        path = str(getattr(item, 'path', item.fspath))
        if path.endswith('.ipynb'):
            item.add_marker('notebooks')
        elif path.endswith('test_browser.py'):
            item.add_marker('browser')
        elif path.endswith('test_export.py'):
            item.add_marker('export')


# Programs a library runs for itself, once per process, whatever the test: not what the procs
# tier is about, and a mark for them would depend on the machine and on which test came first.
# Each passes only when that library's module is the one running it.
LIBRARY_HELPERS = {
    'fc-list': ('matplotlib.font_manager', 'lists the system fonts (comp_perf.language.cjk_font, '
                                           'on a machine whose font cache has no Chinese font)'),
    'uname': ('platform', 'platform.processor() asks `uname -p` (comp_perf.s04_hardware.cpu_facts)'),
}


def _argv(args, kwargs):
    return kwargs.get('args', args[1] if len(args) > 1 else '')


def _library_helper(args, kwargs):
    argv = _argv(args, kwargs)
    first = argv if isinstance(argv, (str, bytes, os.PathLike)) else next(iter(argv), '')
    program = os.path.basename(os.fsdecode(first).split(' ')[0])
    if program not in LIBRARY_HELPERS:
        return False
    module, frame = LIBRARY_HELPERS[program][0], sys._getframe(1)
    while frame is not None and frame.f_globals.get('__name__') != module:
        frame = frame.f_back
    return frame is not None


def _process(args, kwargs):
    target = getattr(args[0], '_target', None)
    name = f'{getattr(target, "__module__", "")}.{getattr(target, "__qualname__", "")}'.strip('.')
    return f'a multiprocessing process running {name or target}'


def _os_call(name):
    return lambda args, kwargs: f'os.{name}({repr(args[0])[:200] if args else ""})'


class ProcessGuard:
    """Every way a test starts a process, wrapped for the duration of one test.

    subprocess.Popen.__init__ covers subprocess.run/check_output, os.popen and asyncio's
    subprocesses; BaseProcess.start covers multiprocessing, torch.multiprocessing's spawn,
    DataLoader workers and process pools; KernelManager.start_kernel names a Jupyter kernel
    (it would reach Popen too, under a less telling name); the os functions are the ways
    around both. In refuse mode a start fails the test; in count mode it is only counted.
    """

    def __init__(self):
        self.starts = 0                  # every start counted since the session began
        self.refused = []                # what the running phase of an unmarked test tried to start
        self.starting_fixtures = set()   # FixtureDefs whose set-up started a process
        self._saved = []

    @staticmethod
    def _targets():
        """(owner, attribute, what it starts, which calls pass untouched) for each way to start one."""
        yield subprocess.Popen, '__init__', lambda args, kwargs: repr(_argv(args, kwargs))[:200], _library_helper
        yield multiprocessing.process.BaseProcess, 'start', _process, None
        manager = sys.modules.get('jupyter_client.manager')   # wrapped once something imported it
        if manager is not None:
            for cls in (manager.KernelManager, manager.AsyncKernelManager):
                yield cls, 'start_kernel', lambda args, kwargs: 'a Jupyter kernel', None
        for name in ('fork', 'forkpty', 'posix_spawn', 'posix_spawnp', 'system'):
            if hasattr(os, name):
                yield os, name, _os_call(name), None

    def install(self, refuse):
        for owner, name, describe, passes in self._targets():
            original = getattr(owner, name)
            own = not isinstance(owner, type) or name in owner.__dict__   # else inherited: delete to restore
            self._saved.append((owner, name, original, own))
            setattr(owner, name, self._wrap(original, describe, passes, refuse))

    def uninstall(self):
        while self._saved:
            owner, name, original, own = self._saved.pop()
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    def _wrap(self, original, describe, passes, refuse):
        def wrapper(*args, **kwargs):
            if passes and passes(args, kwargs):
                return original(*args, **kwargs)
            if refuse:
                what = describe(args, kwargs)
                thread = threading.current_thread()
                self.refused.append(what if thread is threading.main_thread() else f'{what} (thread {thread.name})')
                pytest.fail(f'this test starts processes: mark it procs (@pytest.mark.procs); it started {what}')
            self.starts += 1
            return original(*args, **kwargs)
        wrapper.__wrapped__ = original
        return wrapper


GUARD = ProcessGuard()
_STARTS_BEFORE = pytest.StashKey[int]()


def _marks(item):
    return {name for name in MAY_START if item.get_closest_marker(name)}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    # Installed around set-up, call and teardown together, so that a module-scoped fixture set
    # up for this test is covered too; the finally restores every wrapped function after it.
    # Unmarked tests refuse; procs tests count, for the check that the mark is needed; the
    # notebooks, browser and export tiers run untouched.
    marks = _marks(item)
    if not marks or marks == {'procs'}:
        GUARD.install(refuse=not marks)
    item.stash[_STARTS_BEFORE] = GUARD.starts
    try:
        return (yield)
    finally:
        GUARD.uninstall()


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = GUARD.starts
    result = yield
    if GUARD.starts > before:
        GUARD.starting_fixtures.add(fixturedef)
    return result


def _phase(when):
    # The refusal raised where the process was started; the check after the phase catches code
    # that swallowed it (an `except BaseException`, a thread that died of it, a kernel manager
    # that reported it and went on).
    GUARD.refused = []
    result = yield
    if GUARD.refused:
        pytest.fail(f'this test starts processes: mark it procs (@pytest.mark.procs); during its {when} '
                    f'it started {", ".join(GUARD.refused)}', pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _phase('set-up'))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield from _phase('call')
    if _marks(item) == {'procs'} and GUARD.starts == item.stash[_STARTS_BEFORE] and not any(
            definition in GUARD.starting_fixtures
            for name in item.fixturenames for definition in item._fixtureinfo.name2fixturedefs.get(name, ())):
        pytest.fail('this test is marked procs but started no process, nor did a fixture it uses: '
                    'drop the mark, so that the quick tier runs it', pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _phase('teardown'))


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
def one_torch_thread():
    """PyTorch on one thread while a test runs: on a busy 2-core machine, two threads that wait for each
    other at every operation make a step of hundreds of small operations up to 10× slower, at random."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
