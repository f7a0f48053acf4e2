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
