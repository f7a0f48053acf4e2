"""What several test files share: the checkout's paths, the stored notebooks, the visible text of
their markdown, and the helpers of the tests that drive JupyterLab and Chromium.

Code that a section defines on its page is read by tools/notebook_code.py; the tests'
fixtures are in tests/conftest.py.
"""
import os
import re
import shutil
import time
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
EN, ZH = ROOT / 'notebooks' / 'en', ROOT / 'notebooks' / 'zh'
NAMES = sorted(p.name for p in EN.glob('*.ipynb'))   # the stored notebooks, the same in both languages
SHOTS = ROOT / 'artifacts' / 'browser'                # screenshots of what a browser test gave up on


def load(path):
    return nbformat.read(path, as_version=4)


def visible_text(markdown):
    """What a reader of a markdown cell sees as prose: no code (fenced or inline), math, HTML
    comments or tags, URLs or link targets, list markers, or the section number of a heading.

    (comp_perf.course_load.prose_words counts reading time by other rules: inline code and
    math are read there, folded <details> are not.)
    """
    text = re.sub(r'```.*?```', ' ', markdown, flags=re.S)
    text = re.sub(r'<!--.*?-->', ' ', text, flags=re.S)
    text = re.sub(r'`[^`]*`', ' ', text)
    text = re.sub(r'\$\$.*?\$\$', ' ', text, flags=re.S)
    text = re.sub(r'\$[^$\n]*\$', ' ', text)
    text = re.sub(r'\]\([^)]*\)', ']', text)
    text = re.sub(r'https?://\S+', ' ', text)
    text = re.sub(r'<[^>]+>', ' ', text)
    text = re.sub(r'^\s*#+\s+\d+(?:\.\d+)*\.?', ' ', text, flags=re.M)  # "## 3 s..." is a section
    return re.sub(r'^\s*(?:[*+-]|\d+[.)])\s+', ' ', text, flags=re.M)  # "1. " numbers a list


# --- JupyterLab and Chromium (tests/test_browser.py, test_course.py, test_export.py) ----------

def find_browser():
    """(chromium, chromedriver); skips without them, except in CI, where the set-up installs them."""
    chromium = next(filter(None, map(shutil.which, ('chromium', 'chromium-browser', 'google-chrome'))), None)
    driver = shutil.which('chromedriver') or next(
        (p for p in ('/usr/bin/chromedriver', '/usr/lib/chromium/chromedriver') if os.path.exists(p)), None)
    if not (chromium and driver):
        if os.environ.get('CI'):
            pytest.fail('Chromium or chromedriver is missing: ./course test installs them '
                        '(Debian packages chromium and chromium-driver).')
        pytest.skip('Chromium and chromedriver are not installed (sudo apt-get install chromium chromium-driver)')
    pytest.importorskip('selenium')
    return chromium, driver


def wait_for_lab(server, url, token, log, seconds):
    """Return once the JupyterLab `server` answers at url; fail with the end of its log if it dies or is late."""
    import requests   # here, not above: most tests that import this module ask no server anything
    deadline = time.monotonic() + seconds
    while True:
        try:
            if requests.get(f'{url}/api/status', params={'token': token}, timeout=2).ok:
                return
        except requests.ConnectionError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            pytest.fail('JupyterLab did not start:\n' + Path(log).read_text()[-3000:])
        time.sleep(0.5)


def wait_for(browser, condition, seconds, what):
    """The first true value of the script `condition` in the page; a screenshot and an error after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = browser.execute_script(condition)
        if result:
            return result
        time.sleep(0.5)
    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / f'failed-{int(time.time())}.png'
    browser.save_screenshot(str(shot))
    raise AssertionError(f'gave up after {seconds} s waiting for {what}; screenshot {shot}')


def planted_file(reference, tmp_path, name, *changes):
    """tmp_path/name.py holding the text `reference` with each (old, new) of changes made (old there once)."""
    for old, new in changes:
        assert reference.count(old) == 1, f'the reference should contain {old!r} once'
        reference = reference.replace(old, new)
    path = tmp_path / f'{name}.py'
    path.write_text(reference, encoding='utf-8')
    return path
