"""The README's two commands as real users meet them: `./course lab` as root (containers,
cloud notebooks, lab VMs) and as a normal user, each started for real until the server answers."""
import os
import secrets
import shutil
import subprocess

import pytest
import requests
from helpers import ROOT, wait_for_lab

from comp_perf.processes import free_port, stop_process_tree

pytestmark = pytest.mark.procs   # each test starts ./course, and JupyterLab or the set-up behind it


def _open_course(tmp_path, prefix=()):
    """Run `./course lab` (behind `prefix`, e.g. a user namespace) until JupyterLab answers; return its log."""
    home = tmp_path / 'home'
    home.mkdir()
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ, HOME=str(home), JUPYTERLAB_WORKSPACES_DIR=str(home / 'workspaces'),
               JUPYTERLAB_SETTINGS_DIR=str(home / 'settings'), JUPYTER_RUNTIME_DIR=str(home / 'runtime'),
               MPLCONFIGDIR=str(home / 'matplotlib'))
    log_path = tmp_path / 'lab.log'
    with open(log_path, 'w') as log:
        lab = subprocess.Popen(
            [*prefix, str(ROOT / 'course'), 'lab', '--no-browser', f'--port={port}', '--ServerApp.ip=127.0.0.1',
             f'--IdentityProvider.token={token}'],
            cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_for_lab(lab, f'http://127.0.0.1:{port}', token, log_path, 180)
            # the server really serves the course: the notebooks folder is its root
            contents = requests.get(f'http://127.0.0.1:{port}/api/contents/en', params={'token': token},
                                    timeout=10).json()
            assert '00-start-here.ipynb' in {item['name'] for item in contents['content']}
        finally:
            stop_process_tree(lab)
    return log_path.read_text()


@pytest.mark.skipif(os.geteuid() != 0, reason='needs root (as in containers and on CI)')
def test_course_lab_opens_as_root(tmp_path):
    log = _open_course(tmp_path)
    assert 'passing --allow-root' in log


def test_course_lab_opens_as_a_normal_user(tmp_path):
    if os.geteuid() != 0:
        log = _open_course(tmp_path)                     # this user is a normal user
    else:
        # As root, become user 1000 in a user namespace: the course, JupyterLab and every
        # process below see a normal user, while files stay readable as before.
        prefix = ['unshare', '--user', '--map-user=1000', '--map-group=1000']
        probe = subprocess.run([*prefix, 'id', '-u'], capture_output=True, text=True)
        if probe.returncode or probe.stdout.strip() != '1000':
            pytest.skip(f'cannot become a normal user here (unshare: {probe.stderr.strip()[:200]})')
        log = _open_course(tmp_path, prefix)
    assert 'allow-root' not in log


def test_course_refuses_an_unusable_python(tmp_path):
    """PYTHON names an interpreter: a wrong one is an error, not a silent switch to another."""
    checkout = tmp_path / 'checkout'
    checkout.mkdir()
    shutil.copy2(ROOT / 'course', checkout / 'course')   # no .venv there: set-up must pick a Python
    run = subprocess.run([str(checkout / 'course'), 'setup'], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHON='python2.1-does-not-exist'))
    assert run.returncode != 0 and 'PYTHON=python2.1-does-not-exist: no such interpreter' in run.stderr
    assert not (checkout / '.venv').exists()
