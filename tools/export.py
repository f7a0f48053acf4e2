"""Export the notebooks of one language as reveal.js slide decks and as HTML pages.

    ./course export en                  every English notebook into build/en/
    ./course export zh --only 07-parameter-servers --out /tmp/deck

The decks and pages show the outputs stored in the notebooks (one clean run on
the CI machine), so nothing is re-executed and a long cell costs nothing here.
Each deck follows the cells' slide metadata (see tools/nbpair.py) and lets a
slide scroll if it is still too tall. Written: <out>/<lang>/slides/NAME.slides.html,
<out>/<lang>/html/NAME.html, <out>/<lang>/index.html linking them all, and
<out>/<lang>/assets/ with everything they load: reveal.js 5 (bundled by the
PyPI package sphinx-revealjs), require.js, jQuery and MathJax 2 (bundled by
nbclassic). Nothing comes from the network, so <out>/<lang> can be copied to a
USB stick and opened in a lecture hall without internet. Sliders need a running
kernel: in the exported files they are left out (their cells also draw a
static figure).
"""
import argparse
import html
import importlib.util
import shutil
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / 'notebooks'
TITLES = {'en': 'Computational Performance: slides and pages',
          'zh': '计算性能：幻灯片与网页'}


TEMPLATES = Path(__file__).resolve().parent / 'templates'   # offline_reveal, offline_lab
# Where each asset comes from: (package, path inside it, name under assets/).
ASSETS = [('sphinx_revealjs', '_static/revealjs/dist', 'reveal.js/dist'),
          ('sphinx_revealjs', '_static/revealjs/plugin/notes', 'reveal.js/plugin/notes'),
          ('nbclassic', 'static/components/requirejs/require.js', 'require.js'),
          ('nbclassic', 'static/components/jquery/jquery.min.js', 'jquery.min.js'),
          ('nbclassic', 'static/components/MathJax', 'MathJax')]
MATHJAX_CONFIG = 'TeX-AMS-MML_HTMLorMML-full,Safe'     # the configuration nbclassic's MathJax ships


def copy_assets(folder):
    """Copy reveal.js, require.js, jQuery and MathJax from installed packages into folder/assets."""
    for package, inside, name in ASSETS:
        spec = importlib.util.find_spec(package)   # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit(f'{package} is not installed, so the decks could not work offline; '
                             f'run ./course setup (it installs requirements.txt).')
        source = Path(spec.submodule_search_locations[0]) / inside
        target = folder / 'assets' / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)


def exporters():
    from nbconvert import HTMLExporter, SlidesExporter
    from traitlets.config import Config
    config = Config()
    for exporter in ('HTMLExporter', 'SlidesExporter'):   # every script from ../assets/, none from the web
        config[exporter].require_js_url = '../assets/require.js'
        config[exporter].jquery_url = '../assets/jquery.min.js'
        config[exporter].mathjax_url = f'../assets/MathJax/MathJax.js?config={MATHJAX_CONFIG}'
        config[exporter].extra_template_basedirs = [str(TEMPLATES)]
    config.SlidesExporter.reveal_url_prefix = '../assets/reveal.js'
    config.SlidesExporter.reveal_theme = 'white'     # its fonts ship with reveal.js ('simple' loads Google's)
    config.SlidesExporter.reveal_scroll = True        # a tall slide scrolls instead of spilling
    config.SlidesExporter.reveal_number = 'c/t'       # slide numbers, for "go back to slide 12"
    config.SlidesExporter.reveal_transition = 'none'
    config.SlidesExporter.reveal_width = '1280'
    config.SlidesExporter.reveal_height = '800'
    config.SlidesExporter.exclude_input_prompt = True
    config.SlidesExporter.exclude_output_prompt = True
    return (HTMLExporter(config=config, template_name='offline_lab'),
            SlidesExporter(config=config, template_name='offline_reveal'))


def export(lang, out, only=None):
    """Write the decks and pages of `lang` under out/lang; return the list of files written."""
    if lang not in TITLES:
        raise SystemExit(f'language must be one of {sorted(TITLES)}, got {lang!r}.')
    names = sorted(p.stem for p in (NOTEBOOKS / lang).glob('*.ipynb'))
    if only:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise SystemExit(f'no notebook named {unknown} in notebooks/{lang}; choose from {names}.')
        names = [n for n in names if n in only]
    page, deck = exporters()
    folder = Path(out) / lang
    (folder / 'html').mkdir(parents=True, exist_ok=True)
    (folder / 'slides').mkdir(parents=True, exist_ok=True)
    copy_assets(folder)
    written, rows = [], []
    for name in names:
        nb = nbformat.read(NOTEBOOKS / lang / f'{name}.ipynb', as_version=4)
        for exporter, sub, suffix in ((page, 'html', '.html'), (deck, 'slides', '.slides.html')):
            body, _ = exporter.from_notebook_node(nb, resources={'metadata': {'name': name}})
            path = folder / sub / f'{name}{suffix}'
            path.write_text(body, encoding='utf-8')
            written.append(path)
        rows.append(f'<li>{html.escape(name)}: <a href="slides/{name}.slides.html">slides</a> · '
                    f'<a href="html/{name}.html">page</a></li>')
    index = folder / 'index.html'
    index.write_text(f'<!DOCTYPE html><meta charset="utf-8"><title>{TITLES[lang]}</title>'
                     f'<h1>{TITLES[lang]}</h1><ul>{"".join(rows)}</ul>\n', encoding='utf-8')
    return written + [index]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('lang', choices=sorted(TITLES))
    ap.add_argument('--out', default=str(ROOT / 'build'), help='folder to write into (default build/)')
    ap.add_argument('--only', nargs='+', metavar='NAME', help='only these notebooks (names without .ipynb)')
    args = ap.parse_args(argv)
    start = time.perf_counter()
    files = export(args.lang, args.out, args.only)
    print(f'wrote {len(files)} files and their assets to {Path(args.out) / args.lang} in '
          f'{time.perf_counter() - start:.1f} s; open {Path(args.out) / args.lang / "index.html"} '
          f'(works offline: the folder can be copied as it is)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
