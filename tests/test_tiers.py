"""The procs mark is enforced (tests/conftest.py): planted tests, run by a pytest inside this one
with a copy of the real conftest, show an unmarked test that starts a process failing, however it
starts it, and a procs mark on a test that starts none failing too. Each start is refused before
it happens; should the guard fail, the planted tests run only `true`."""
import multiprocessing.process
import os
import subprocess

from helpers import ROOT

PLANTED = '''
import multiprocessing
import subprocess

import pytest


@pytest.fixture(scope='module')
def server():
    return subprocess.Popen(['true'])


def test_runs_a_program():
    subprocess.run(['true'])


def test_hides_the_refusal():
    try:
        subprocess.run(['true'])
    except BaseException:
        pass


def test_starts_a_worker():
    multiprocessing.get_context('spawn').Process(target=print).start()


def test_runs_a_shell():
    import os
    os.system('true')


def test_uses_a_fixture_that_starts_a_server(server):
    pass


@pytest.mark.procs
def test_marked_but_starts_nothing():
    pass


def test_starts_nothing():
    assert sum([1, 2]) == 3
'''


def _process_starters():
    return (subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start, os.fork, os.system)


def test_unmarked_tests_that_start_processes_fail_and_so_does_a_needless_mark(pytester):
    pytester.makeconftest((ROOT / 'tests' / 'conftest.py').read_text(encoding='utf-8'))
    pytester.makepyfile(test_planted=PLANTED)
    before = _process_starters()
    result = pytester.runpytest_inprocess('-p', 'no:cacheprovider', '-rfE')
    assert _process_starters() == before, 'the inner run left a process starter wrapped'
    result.assert_outcomes(passed=1, failed=5, errors=1)
    why = {report.nodeid.split('::')[-1]: report.longreprtext for report in result.reprec.getfailures()}
    refused = 'this test starts processes: mark it procs (@pytest.mark.procs)'
    assert f"{refused}; it started ['true']" in why['test_runs_a_program']
    assert f"{refused}; during its call it started ['true']" in why['test_hides_the_refusal']
    assert f'{refused}; it started a multiprocessing process running builtins.print' in why['test_starts_a_worker']
    assert f"{refused}; it started os.system('true')" in why['test_runs_a_shell']
    assert f"{refused}; it started ['true']" in why['test_uses_a_fixture_that_starts_a_server']
    assert ('this test is marked procs but started no process, nor did a fixture it uses: drop the mark'
            in why['test_marked_but_starts_nothing'])


def test_the_timing_report_sums_seconds_per_file_and_per_tier():
    from types import SimpleNamespace

    import timing_report
    reports = [SimpleNamespace(nodeid='tests/test_a.py::x', duration=1.5, keywords={'procs': 1}),
               SimpleNamespace(nodeid='tests/test_a.py::y', duration=0.5, keywords={}),
               SimpleNamespace(nodeid='notebooks/en/02.ipynb::Cell 3', duration=2.0, keywords={'notebooks': 1}),
               SimpleNamespace(nodeid='', duration=9.0, keywords={})]   # a session-level report: no file
    by_file = timing_report.seconds_by(reports, lambda r: r.nodeid.split('::')[0])
    assert by_file == {'tests/test_a.py': 2.0, 'notebooks/en/02.ipynb': 2.0}
    assert timing_report.seconds_by(reports, timing_report.tier_of) == {'procs': 1.5, 'quick': 0.5, 'notebooks': 2.0}


def test_the_report_adds_up_each_workers_seconds():
    from types import SimpleNamespace

    import timing_report
    on = lambda worker: SimpleNamespace(gateway=SimpleNamespace(id=worker))   # noqa: E731
    reports = [SimpleNamespace(nodeid='tests/test_a.py::x', duration=1.5, node=on('gw0')),
               SimpleNamespace(nodeid='tests/test_b.py::y', duration=0.5, node=on('gw1')),
               SimpleNamespace(nodeid='tests/test_c.py::z', duration=2.0, node=on('gw0')),
               SimpleNamespace(nodeid='tests/test_d.py::w', duration=1.0)]   # run without workers
    assert timing_report.seconds_by(reports, timing_report.worker_of) == {'gw0': 3.5, 'gw1': 0.5, 'main': 1.0}


def test_each_xdist_worker_is_kept_to_a_core_of_its_own_with_one_torch_thread(monkeypatch):
    """Under `pytest -n 2` worker gwK takes the K-th usable core (wrapping round) and one torch
    thread, so two workers' kernels never share a core; outside xdist nothing is touched."""
    import conftest
    import torch
    pinned, threads = [], []
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {5, 0, 3}, raising=False)
    monkeypatch.setattr(os, 'sched_setaffinity', lambda pid, cores: pinned.append(set(cores)), raising=False)
    monkeypatch.setattr(torch, 'set_num_threads', threads.append)
    conftest.keep_worker_to_one_core(None)
    assert pinned == [] and threads == []
    for worker in ('gw0', 'gw1', 'gw2', 'gw3'):
        conftest.keep_worker_to_one_core(worker)
    assert pinned == [{0}, {3}, {5}, {0}]
    assert threads == [1, 1, 1, 1]


def test_the_test_command_keeps_each_file_on_one_worker():
    """nbval runs a notebook's cells in order in one kernel: `./course test` must hand out whole
    files (--dist loadfile), and may ask for workers only where conftest can pin them."""
    script = (ROOT / 'course').read_text(encoding='utf-8')
    workers = script[script.index('test_workers() {'):script.index('\n}\n', script.index('test_workers() {'))]
    assert '"-n 2 --dist loadfile"' in workers
    assert 'sched_setaffinity' in workers and '>= 2' in workers
    assert '$(test_workers) "$@"' in script   # before the user's arguments, so `-n 0` overrides
