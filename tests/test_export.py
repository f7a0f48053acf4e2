"""The README's export command: slides and HTML pages from the stored outputs, per language."""
import html
import subprocess
import time

import nbformat
import pytest
from helpers import ROOT, find_browser, wait_for


@pytest.fixture(scope='module')
def exported(tmp_path_factory):
    """export(lang, name) runs the README's export command once per notebook in this module; its folder."""
    folders = {}

    def export(lang, name):
        if (lang, name) not in folders:
            out = tmp_path_factory.mktemp('export')
            start = time.monotonic()
            run = subprocess.run([str(ROOT / 'course'), 'export', lang, '--only', name, '--out', str(out)],
                                 capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stdout + run.stderr
            print(f'\nexport of {lang}/{name}: {time.monotonic() - start:.1f} s')
            folders[lang, name] = out / lang
        return folders[lang, name]
    return export


@pytest.mark.parametrize('lang,name', [('en', '00-start-here'), ('zh', '07-parameter-servers')])
def test_course_export_writes_slides_and_pages(exported, lang, name):
    folder = exported(lang, name)
    deck = (folder / 'slides' / f'{name}.slides.html').read_text(encoding='utf-8')
    page = (folder / 'html' / f'{name}.html').read_text(encoding='utf-8')
    assert f'slides/{name}.slides.html' in (folder / 'index.html').read_text(encoding='utf-8')
    stored = nbformat.read(ROOT / 'notebooks' / lang / f'{name}.ipynb', as_version=4)
    kinds = [c.metadata['slideshow']['slide_type'] for c in stored.cells]
    # reveal.js: one <section> per slide, holding one <section> per sub-slide
    assert deck.count('<section') == kinds.count('slide') + kinds.count('slide') + kinds.count('subslide')
    # the stored outputs are what the deck and the page show: no re-execution
    texts = [o['text'].strip().splitlines()[0] for c in stored.cells if c.cell_type == 'code'
             for o in c.outputs if o.get('output_type') == 'stream' and o['text'].strip()]
    assert texts and html.escape(texts[-1], quote=False) in page and 'image/png;base64' in deck


def test_export_refuses_an_unknown_notebook(tmp_path):
    run = subprocess.run([str(ROOT / 'course'), 'export', 'en', '--only', 'no-such-notebook', '--out',
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and 'no notebook named' in run.stderr


def test_exported_deck_and_page_work_offline(exported):
    """A lecture hall without network: reveal.js starts, math renders, nothing is fetched from the web.

    Chromium resolves no host name and has no route but loopback, so any script or style sheet
    still pointing at a CDN fails to load. A screenshot of a slide with formulas is kept in
    artifacts/export/. The export is the one the test above checked (zh/07: formulas and Chinese).
    """
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    chromium, driver = find_browser()
    lang, name = 'zh', '07-parameter-servers'
    folder = exported(lang, name)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ('--headless=new', '--no-sandbox', '--disable-dev-shm-usage', '--window-size=1280,800',
                '--host-resolver-rules=MAP * ~NOTFOUND', '--proxy-server=http://127.0.0.1:9',
                '--proxy-bypass-list=<-loopback>', '--allow-file-access-from-files'):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(driver), options=options)
    try:
        browser.execute_cdp_cmd('Network.enable', {})
        browser.execute_cdp_cmd('Network.emulateNetworkConditions', {
            'offline': True, 'latency': 0, 'downloadThroughput': 0, 'uploadThroughput': 0})
        shots = ROOT / 'artifacts' / 'export'
        shots.mkdir(parents=True, exist_ok=True)
        for kind, path in (('deck', folder / 'slides' / f'{name}.slides.html'),
                           ('page', folder / 'html' / f'{name}.html')):
            browser.get(path.as_uri())
            if kind == 'deck':
                wait_for(browser, "return document.querySelector('.reveal.ready') !== null", 60,
                         'reveal.js to start (the .reveal element gets the class "ready")')
            wait_for(browser, "return [...document.querySelectorAll('.MathJax')].some(m => m.offsetWidth > 0"
                              " || m.closest('section'))", 60, 'MathJax to typeset the formulas')
            if kind == 'deck':   # show the first slide with a formula
                browser.execute_script(   # reveal.js came through require.js: navigate by the URL
                    "const s = document.querySelector('.reveal .slides .MathJax')"
                    ".closest('section'); const up = s.parentElement;"
                    "const [h, v] = up.matches('.slides') ? [[...up.children].indexOf(s), 0]"
                    " : [[...up.parentElement.children].indexOf(up), [...up.children].indexOf(s)];"
                    "location.hash = '#/' + h + '/' + v;")
                time.sleep(1)
            browser.save_screenshot(str(shots / f'{lang}-{name}-{kind}-offline.png'))
            fetched = browser.execute_script(
                "return performance.getEntriesByType('resource').map(e => e.name)")
            assert all(url.startswith('file:') for url in fetched), \
                [url for url in fetched if not url.startswith('file:')]
            missing = [e['message'] for e in browser.get_log('browser')
                       if 'Failed to load resource' in e['message'] and not e['message'].startswith('about:')]
            assert not missing, missing   # every asset the page asked for was there
    finally:
        browser.quit()

