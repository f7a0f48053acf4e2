"""The reader's language: which one a notebook speaks, its Chinese catalog, and fonts for figures.

Code cells are the same in both languages and contain English only. Every
sentence, label or verdict a cell or a helper shows goes through tr(english):
in a Chinese notebook tr looks the English up in text_zh.json, a catalog
grouped by the section that first uses each entry.
"""
import json
import os
import sys
import unicodedata
from pathlib import Path

CATALOG_FILE = Path(__file__).with_name('text_zh.json')


def course_language():
    """'zh' in a kernel started in notebooks/zh (or with COURSE_LANG=zh), else 'en'.

    nbval and JupyterLab start a notebook's kernel in the notebook's folder.
    """
    lang = os.environ.get('COURSE_LANG')
    if lang in ('en', 'zh'):
        return lang
    cwd = Path.cwd()
    return 'zh' if cwd.name == 'zh' and cwd.parent.name == 'notebooks' else 'en'


def _refuse_duplicates(pairs):
    # json.load would silently keep the last of two equal keys, losing a translation.
    keys = [key for key, _ in pairs]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f'{CATALOG_FILE.name} has these keys twice in one group: {twice}')
    return dict(pairs)


def read_catalog(path=CATALOG_FILE):
    """The catalog's groups, {'all': {english: chinese}, '00': {...}, ...}; a key twice is an error."""
    groups = json.loads(Path(path).read_text(encoding='utf-8'), object_pairs_hook=_refuse_duplicates)
    seen = {}
    for group, entries in groups.items():
        for key in entries:
            if key in seen:
                raise ValueError(f'{Path(path).name}: {key!r} is in group {seen[key]!r} and in {group!r}')
            seen[key] = group
    return groups


_CATALOG = {}


def zh_text():
    """Every English key and its Chinese, from all groups of the catalog (read once)."""
    if not _CATALOG:
        for entries in read_catalog().values():
            _CATALOG.update(entries)
    return _CATALOG


def tr(english, **fields):
    """The text in the notebook's language: tr('time (ms)'), tr('step {t}', t=3).

    In an English notebook it is the English itself; in a Chinese one, its
    entry in the catalog (the English when there is none: a test finds such
    gaps). Fields are filled in after the lookup. The one entry point for text
    that a reader sees: printed sentences, verdicts, widget labels and figures
    (a Chinese notebook's figures use a font with Chinese glyphs).
    """
    out = english
    if course_language() == 'zh':
        out = zh_text().get(english, english)
        _use_cjk_font()
    return out.format(**fields) if fields else out


def name_list(names):
    """Names (operators, APIs, files) listed as each language lists them: 'a, b' in English, 'a、b' in Chinese,
    where a comma joins phrases and the enumeration comma joins names."""
    return ('、' if course_language() == 'zh' else ', ').join(str(name) for name in names)


def display_width(text):
    """Columns `text` takes in a fixed-width font: a Chinese character takes two."""
    return sum(2 if unicodedata.east_asian_width(c) in 'WF' else 1 for c in str(text))


def pad(text, width=0, right=False):
    """`text` padded to `width` display columns (right=True: spaces on the left), so that Chinese tables line up."""
    text = str(text)
    fill = ' ' * max(0, width - display_width(text))
    return fill + text if right else text + fill


# Fonts that cover Chinese, best first: Linux packages, then Windows and macOS.
CJK_FONTS = ('Noto Sans CJK SC', 'Noto Sans SC', 'Source Han Sans SC', 'WenQuanYi Micro Hei',
             'WenQuanYi Zen Hei', 'Noto Sans CJK JP', 'Microsoft YaHei', 'SimHei', 'PingFang SC',
             'Hiragino Sans GB', 'Heiti SC', 'Arial Unicode MS')
_CJK_STATE = {}


def cjk_font():
    """Name of an installed font with Chinese glyphs, registered with matplotlib; None if none.

    Looks through matplotlib's font list first, then through the system's
    font files (a font installed after matplotlib built its cache).
    """
    if 'font' not in _CJK_STATE:
        from matplotlib import font_manager
        names = {f.name for f in font_manager.fontManager.ttflist}
        found = next((n for n in CJK_FONTS if n in names), None)
        if found is None:
            hints = ('cjk', 'wqy', 'sourcehan', 'msyh', 'simhei', 'pingfang', 'hiragino')
            for path in font_manager.findSystemFonts():
                if any(h in Path(path).name.lower().replace('-', '') for h in hints):
                    try:
                        font_manager.fontManager.addfont(path)
                    except (OSError, RuntimeError):
                        continue
            names = {f.name for f in font_manager.fontManager.ttflist}
            found = next((n for n in CJK_FONTS if n in names), None)
        _CJK_STATE['font'] = found
    return _CJK_STATE['font']


def _use_cjk_font():
    # Chinese glyphs come from the CJK font; Latin ones stay in the default font.
    import matplotlib
    if _CJK_STATE.get('active'):
        return _CJK_STATE['font']
    font = cjk_font()
    if font:
        # matplotlib falls back along font.family: glyphs the first family lacks come from the next
        families = [f for f in matplotlib.rcParams['font.family'] if f != font]
        matplotlib.rcParams['font.family'] = families + [font]
        _CJK_STATE['active'] = True
    elif not _CJK_STATE.get('warned'):
        _CJK_STATE['warned'] = True
        print('没有找到中文字体，图中的中文会显示为方框。安装方法：sudo apt-get install '
              'fonts-wqy-microhei（Debian/Ubuntu），然后重启内核。')
    return font


def in_notebook():
    # True inside a Jupyter kernel (not in a plain script, a test or a worker process).
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and 'IPKernelApp' in shell.config


# Import-time adjustment (one of two; the other, in machine.py, silences cpp_extension):
# a Chinese notebook's figures need the Chinese font before the first figure is
# made. matplotlib fixes a text's font family when the axes are created, so
# turning it on at the first tr() would be too late for labels set afterwards.
if course_language() == 'zh' and 'IPython' in sys.modules and in_notebook():
    _use_cjk_font()
