"""Prose must not contradict the stored outputs.

The course's rule: the text never copies a number that a particular run measured;
a cell prints the measured verdict (``common.verdict``), and the text says what to
look for. Numbers from textbooks, datasheets, the seed notes or a stored reference
run are allowed when the text names their source; the GPU reference files under
data/reference/ count as stored outputs.

``find_unbacked_numbers(nb)`` looks for *measured quantities* in the markdown cells
of a notebook (a number with a unit of time, bandwidth, throughput, ratio or
percentage) and reports every one that neither appears in the notebook's stored
outputs nor carries a source label. Known cases are listed in
``tests/prose_baseline.json``, a ratchet: a new case fails the test, and so does a
listed case that has disappeared, so the list only ever shrinks. Rewrite it with

    python tests/test_prose.py --write-baseline

and review the diff before committing it.

How to write a number the checker accepts, in order of preference:

* print it from a cell, and let the text describe what to look for;
* copy it from the stored output (the same digits, or rounded, keeping at least two
  significant digits: 1.4174 sec may become "1.4 s", but not "1 s");
* label its source in the same paragraph, list item or table, e.g.
  "(source: H100 datasheet)" or "（来源：教材）";
* if it is an input or a budget rather than a result ("a 3 s timeout",
  "at most 60 s per notebook"), put ``<!-- given -->`` in the same block.
"""
import json
import re
import sys
from collections import Counter, namedtuple
from decimal import ROUND_HALF_UP, Decimal

import nbformat
import pytest

from helpers import NAMES, ROOT, load, visible_text

BASELINE = ROOT / 'tests' / 'prose_baseline.json'
LANGS = ['en', 'zh']

# --- The convention, for the notebooks' authors -------------------------------------------
#
# A markdown block (a paragraph, one list item, or a table together with the line right
# before it) that contains one of these labels may quote numbers that no cell printed.
# Matching is case-insensitive and looks at the visible text (not at code, URLs or HTML).
SOURCE_LABELS = [
    # English
    'source:', '(source', 'datasheet', 'the notes', 'seed notes', 'd2l',
    'Dive into Deep Learning', 'textbook', 'paper', 'reference run', '[ref]',
    # Chinese: source, datasheet, notes, textbook, paper, reference run
    '来源', '数据手册', '笔记', '原书', '教材', '论文', '参考运行',
]
# Words that contain a label without being one; they are removed before the search.
# 笔记本 is "notebook" (or "laptop"), not "the notes" (笔记).
NOT_SOURCE_LABELS = ['笔记本']
# An invisible marker for a block whose numbers are inputs or budgets, not results.
GIVEN_MARKER = '<!-- given -->'

# Units that make a number a measured quantity, grouped into families: a number in the
# prose and one in an output are compared only within the same family. Sizes (MB, GB,
# KiB, ...) are deliberately absent: they are usually inputs, not results.
UNIT_FAMILIES = {
    'ns': ['ns', '纳秒'],
    'µs': ['µs', 'μs', 'us', '微秒'],  # micro sign and Greek mu both occur
    'ms': ['ms', '毫秒'],
    's': ['seconds', 'second', 'secs', 'sec', 's', '秒'],
    'TB/s': ['TB/s'], 'GB/s': ['GB/s'], 'MB/s': ['MB/s'],
    'TiB/s': ['TiB/s'], 'GiB/s': ['GiB/s'], 'MiB/s': ['MiB/s'],
    'TFLOP/s': ['TFLOP/s', 'TFLOPS'], 'GFLOP/s': ['GFLOP/s', 'GFLOPS'],
    'img/s': ['images/s', 'img/s'],
    '×': ['×', 'x', 'times', '倍'],  # × and x only when glued to the number: "1.4x", not "x = 3"
    '%': ['%'],
}
GLUED_ONLY = ['×', 'x']
FAMILY = {unit: family for family, units in UNIT_FAMILIES.items() for unit in units}

# --- Finding quantities --------------------------------------------------------------------

# 1.4   20   1,414   10 000 (thousands grouped by commas or spaces)
NUMBER = r'\d{1,3}(?:[,\u00a0\u202f ]\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?'
# A number starts a quantity only if it is not the tail of a word or of another number:
# not "H100", "sm_90", "v2.1", "x86-64", "1/2", nor the "000" of "10 000". A sign is
# allowed and ignored: an output's "-17%" backs the prose's "a 17% drop".
START = r'(?<![A-Za-z0-9_.,/])(?<![A-Za-z0-9]-)(?<!\d[ \u00a0\u202f])'
# Range separators: 1.02–1.78×, 3—5 s, 10 to 20 %, between 1.0 and 1.8 times, 1.0-1.8x,
# 3~5 s, 3 到 5 秒
RANGE = r'\s*(?:–|—|-|~|to|and|至|到)\s*'


def _unit_pattern():
    """Longest spelling first, so that "ms" is not read as "m" + "s"."""
    def alternatives(units):
        return '|'.join(re.escape(u) for u in sorted(units, key=len, reverse=True))
    glued = alternatives(GLUED_ONLY)
    spaced = alternatives([u for u in FAMILY if u not in GLUED_ONLY])
    # A unit must end the word: "20 s" and "20s." but not "2 steps", "8 servers", or the
    # formula "2s/b" (s a size).
    return rf'(?:(?P<glued>{glued})|[ \u00a0\u202f]?(?P<unit>{spaced}))(?![A-Za-z0-9_/])'


QUANTITY = re.compile(
    rf'{START}(?P<first>{NUMBER})(?:{RANGE}(?P<second>{NUMBER}))?{_unit_pattern()}')

Quantity = namedtuple('Quantity', 'text family numbers')
Finding = namedtuple('Finding', 'cell text reason')


def quantities(text):
    """Every measured quantity in `text`, with its unit family and its numbers as written
    (one number, or both ends of a range)."""
    found = []
    for m in QUANTITY.finditer(text):
        unit = m.group('glued') or m.group('unit')
        numbers = [n for n in (m.group('first'), m.group('second')) if n]
        found.append(Quantity(' '.join(m.group(0).split()), FAMILY[unit], numbers))
    return found


# --- Reading markdown ----------------------------------------------------------------------

Block = namedtuple('Block', 'text label_text')


def markdown_blocks(source):
    """Split a markdown cell into the blocks a source label applies to.

    A block is a paragraph (lines between blank lines), one list item (with its
    continuation lines), a heading, or a table. A table's label may also stand in the
    line right before it, as a caption. Fenced code blocks are dropped first.
    """
    lines = re.sub(r'```.*?```', '\n\n', source, flags=re.S).splitlines()
    blocks, current, previous = [], [], ''
    for line in lines + ['']:
        is_table = line.lstrip().startswith('|')
        in_table = bool(current) and current[0].lstrip().startswith('|')
        starts_new = (not line.strip() or line.lstrip().startswith('#')
                      or re.match(r'\s*(?:[*+-]|\d+[.)])\s', line) or is_table != in_table)
        if starts_new and current:
            text = '\n'.join(current)
            blocks.append(Block(text, previous + '\n' + text if in_table else text))
            previous = current[-1]
            current = []
        if line.strip():
            current.append(line)
    return blocks


def has_source_label(block):
    """True if the block names a source for its numbers, or is marked as given."""
    if GIVEN_MARKER in block.label_text:
        return True
    visible = visible_text(block.label_text).lower()
    for word in NOT_SOURCE_LABELS:
        visible = visible.replace(word, ' ')
    return any(label.lower() in visible for label in SOURCE_LABELS)


# --- Reading outputs -----------------------------------------------------------------------

def output_text(nb):
    """All stored output text of the notebook's code cells (stream, plain, markdown, HTML)."""
    parts = []
    for cell in nb.cells:
        for out in cell.get('outputs', []) if cell.cell_type == 'code' else []:
            parts.append(str(out.get('text', '')))
            data = out.get('data', {})
            parts += [str(data.get('text/plain', '')), str(data.get('text/markdown', ''))]
            parts.append(re.sub(r'<[^>]+>', ' ', str(data.get('text/html', ''))))
    return '\n'.join(parts)


# In outputs a number may stand up to three characters (spaces, tabs, ":", "=") before its unit.
OUTPUT_QUANTITY = re.compile(
    rf'{START}(?P<first>{NUMBER})(?:{RANGE}(?P<second>{NUMBER}))?[ \t:=]{{0,2}}{_unit_pattern()}')


def reference_values(folder=None):
    """{unit family: [numbers]} of the committed GPU reference files (data/reference/*.json): a source.

    A GPU run's stored figures may be quoted in the prose like a printed output;
    those in a unit the prose checker knows (ms, GB/s, TFLOP/s, ...) back it.
    """
    values = {}
    for path in sorted((folder or ROOT / 'data' / 'reference').glob('*.json')):
        data = json.loads(path.read_text(encoding='utf-8'))
        for experiment in data.get('experiments', {}).values():
            for figure in experiment.get('figures', {}).values():
                family = FAMILY.get(figure.get('unit'))
                numbers = figure['value'] if isinstance(figure.get('value'), list) else [figure.get('value')]
                if family:
                    values.setdefault(family, []).extend(repr(float(n)) for n in numbers)
    return values


def output_values(nb, reference_folder=None):
    """{unit family: [numbers as printed]} for every quantity in the stored outputs and the GPU reference files."""
    values = reference_values(reference_folder)
    for m in OUTPUT_QUANTITY.finditer(output_text(nb)):
        unit = m.group('glued') or m.group('unit')
        for number in (m.group('first'), m.group('second')):
            if number:
                values.setdefault(FAMILY[unit], []).append(number)
    return values


# --- Comparing numbers ---------------------------------------------------------------------

def _decimal(number):
    return Decimal(re.sub(r'[,\u00a0\u202f ]', '', number))


def significant_digits(number):
    """Digits written, without leading zeros: "1.4" 2, "0.64" 2, "10" 2, "2" 1, "2.0" 2."""
    digits = re.sub(r'\D', '', number).lstrip('0')
    return max(len(digits), 1)


def backs(printed, written):
    """True if the number `printed` by a cell backs the number `written` in the prose.

    The rule: round the printed number (half up) to as many significant digits as the
    prose writes, but to at least two; the result must equal the prose number. And the
    printed number must show at least as many significant digits as the prose number.

      printed 1.4123 backs 1.4      printed 2.0 backs 2      printed 19.6 backs 20
      printed 9.62 does not back 10  (to two significant digits it is 9.6)
      printed 1.6  does not back 2   (a one-digit "2" still has to be right to two digits)
      printed 20   does not back 20.0 (the output shows fewer digits than the prose)
    """
    if significant_digits(printed) < significant_digits(written):
        return False
    value, target = _decimal(printed), _decimal(written)
    if value == 0:
        return target == 0
    digits = max(significant_digits(written), 2)
    step = Decimal(1).scaleb(value.adjusted() - digits + 1)  # the place of the last digit kept
    return value.quantize(step, rounding=ROUND_HALF_UP) == target


def is_parity(number, family):
    """A ratio of exactly 1 ("above 1× means faster") is a definition, not a measurement."""
    return family == '×' and _decimal(number) == 1


def find_unbacked_numbers(nb, reference_folder=None):
    """The measured quantities in the markdown of `nb` that no stored output (or GPU reference
    file) backs and no source label (or given-marker) covers; every end of a range must be backed."""
    printed = output_values(nb, reference_folder)
    findings = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != 'markdown':
            continue
        for block in markdown_blocks(cell.source):
            if has_source_label(block):
                continue
            for q in quantities(visible_text(block.text)):
                missing = [n for n in q.numbers if not is_parity(n, q.family)
                           and not any(backs(p, n) for p in printed.get(q.family, []))]
                if missing:
                    reason = f'{" and ".join(missing)} ({q.family}) is not in any stored output'
                    findings.append(Finding(index, q.text, reason))
    return findings


# --- The baseline --------------------------------------------------------------------------

def notebooks():
    return [(lang, name) for lang in LANGS for name in NAMES]


def notebook(lang, name):
    return load(ROOT / 'notebooks' / lang / name)


def current_findings():
    """{"en/01-....ipynb": [matched texts]} for every notebook, as the baseline stores it."""
    return {f'{lang}/{name}': sorted(f.text for f in find_unbacked_numbers(notebook(lang, name)))
            for lang, name in notebooks()}


def write_baseline():
    text = json.dumps(current_findings(), ensure_ascii=False, indent=1, sort_keys=True)
    BASELINE.write_text(text + '\n', encoding='utf-8')


# --- Tests ---------------------------------------------------------------------------------

@pytest.mark.parametrize('lang,name', notebooks())
def test_prose_numbers_are_backed_or_in_the_baseline(lang, name):
    baseline = json.loads(BASELINE.read_text(encoding='utf-8')).get(f'{lang}/{name}', [])
    findings = find_unbacked_numbers(notebook(lang, name))
    new = Counter(f.text for f in findings) - Counter(baseline)
    fixed = Counter(baseline) - Counter(f.text for f in findings)
    problems = []
    for f in findings:
        if new[f.text]:
            new[f.text] -= 1
            problems.append(f'{lang}/{name}, cell {f.cell}: "{f.text}": {f.reason}; '
                            'print the number from a cell (common.verdict) or label its source')
    for text in sorted(fixed.elements()):
        problems.append(f'{lang}/{name}: "{text}" is fixed — remove it from tests/prose_baseline.json')
    assert not problems, '\n'.join(problems)


@pytest.mark.parametrize('lang,name', notebooks())
def test_outputs_come_from_a_run_without_overrides(lang, name):
    """The committed notebooks are executed with the tier's own settings: a settings line
    shows "[override: ...]" only when COURSE_SETTINGS was set."""
    for line in output_text(notebook(lang, name)).splitlines():
        assert '[override:' not in line, f're-execute {lang}/{name} without COURSE_SETTINGS: {line}'


def demo_notebook(markdown, output):
    """A notebook with one markdown cell and one code cell whose stored output is `output`."""
    stdout = nbformat.v4.new_output('stream', name='stdout', text=output)
    code = nbformat.v4.new_code_cell('...', outputs=[stdout])
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(markdown), code])


def unbacked(markdown, output=''):
    return [f.text for f in find_unbacked_numbers(demo_notebook(markdown, output))]


def test_the_checker_finds_contradictions():
    findings = find_unbacked_numbers(demo_notebook(
        'Compiling takes about 20 s, and the fused kernel is 10× faster; 编译大约需要 20 秒。',
        'compile: 1.4 s\nfused/eager: 9.62x\n'))
    assert [f.text for f in findings] == ['20 s', '10×', '20 秒']
    assert all(f.cell == 0 for f in findings)


def test_a_gpu_reference_file_backs_the_prose(tmp_path):
    """A figure stored under data/reference/ may be quoted: the file is a source, in its own unit."""
    figures = {'bf16': {'value': 771.234, 'unit': 'TFLOP/s'}, 'fp32': {'value': [48.9, 49.6], 'unit': 's'}}
    (tmp_path / 'some-gpu.json').write_text(json.dumps({'format': 1, 'machine': {},
                                                        'experiments': {'x': {'figures': figures}}}))
    nb = demo_notebook('The reference GPU ran bf16 at 771 TFLOP/s in 49.6 s, and 4.2 ms per step.', 'nothing')
    assert [f.text for f in find_unbacked_numbers(nb, tmp_path)] == ['4.2 ms']
    assert sorted(f.text for f in find_unbacked_numbers(nb, tmp_path / 'none')) == ['4.2 ms', '49.6 s',
                                                                                   '771 TFLOP/s']


def test_the_checker_accepts_backed_labelled_and_given_numbers():
    assert unbacked('Compiling takes about 1.4 s.', 'compile: 1.4123 sec\n') == []
    assert unbacked('编译大约需要 1.4 秒。', 'compile: 1.4123 sec\n') == []
    assert unbacked('Fusion is 2× faster.', 'fused/eager: 2.0x\n') == []
    # a range needs both ends in the outputs
    assert unbacked('Speed-ups of 1.02–1.78×.', 'a: 1.02x\nb: 1.78x\n') == []
    assert unbacked('Speed-ups of 1.02–1.78×.', 'a: 1.02x\n') == ['1.02–1.78×']
    assert unbacked('From 10 to 20 %.', 'a: 10.1 %\n') == ['10 to 20 %']
    # a source label covers its own block only
    assert unbacked('The notes report 6 ms (source: the notes).\n\nWe measured 6 ms.') == ['6 ms']
    assert unbacked('| GPU | bandwidth |\n|---|---|\n| H100 | 3350 GB/s |') == ['3350 GB/s']
    assert unbacked('Datasheet figures:\n\n| GPU | bandwidth |\n|---|---|\n| H100 | 3350 GB/s |') == []
    # the given-marker likewise
    assert unbacked(f'{GIVEN_MARKER}Each worker has a 3 s timeout.\n\nIt finished in 3 s.') == ['3 s']
    assert unbacked(f'* a 3 s timeout {GIVEN_MARKER}\n* it took 3 s') == ['3 s']


def test_the_checker_ignores_numbers_that_are_not_measurements():
    assert unbacked('Take 2 steps on 8 servers; x = 3, a 4×4 array, 64 MB, an H100, 2 × 3.') == []
    assert unbacked('## 3 sections\n\n### 3.5 s-curves\n\n1. s is the size\n2. x is the input') == []
    assert unbacked('Run `print(f"{t:.1f} s")`, see [the log](logs/20s.txt) or https://x.org/20s.') == []
    assert unbacked('The bandwidth term stays below 2s/b.') == []  # s is a size here
    assert unbacked('The 笔记本 stores 20 秒.') == ['20 秒']  # 笔记本 (notebook) is no source label
    assert unbacked('Above 1× is faster; 比值趋近 1 倍. It was 1.5× here.') == ['1.5×']  # parity is a definition


def test_the_rule_for_the_same_value():
    assert backs('1.4123', '1.4') and backs('1.4174', '1.4') and backs('0.64', '0.64')
    assert backs('2.0', '2') and backs('9.96', '10') and backs('1,414.2', '1,414')
    assert backs('19.6', '20') and backs('2', '2')
    assert not backs('9.62', '10')  # 9.62 to two significant digits is 9.6
    assert not backs('1.6', '2')  # ... and 1.6 is 1.6
    assert not backs('20', '20.0')  # the output shows fewer digits than the prose
    assert not backs('1.45', '1.4')  # rounded half up: 1.5
    assert unbacked('a 17% drop', 'L2: 115.5 GB/s -> 96.1 GB/s: -17%\n') == []  # the sign is ignored


if __name__ == '__main__':
    if sys.argv[1:] != ['--write-baseline']:
        sys.exit('usage: python tests/test_prose.py --write-baseline')
    write_baseline()
    print(f'wrote {BASELINE.relative_to(ROOT)}')
