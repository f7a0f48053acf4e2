"""Prose beside a verdict must hold whichever case the verdict prints.

A measuring cell prints its conclusion with ``common.verdict``: "Verdict: … → <case>"
("结论：…→ <case>"). The reader's run, and the other language's stored run, may land
in another case, so the text next to it may explain the cases and point at the
verdict, but must not state one outcome as what happens *here*.

``asserted_outcomes(text, lang)`` finds the sentences of a markdown cell that do
that: a sentence that refers to this run or this machine ("here", "on this machine",
"这里", "本机" …), states an outcome ("faster", "slower", "helps", "更快", "拖慢" …),
and carries no hedge ("if", "can", "whether", "the verdict", "如果", "可能", "是否",
"结论" …). The test applies it to the markdown cells on either side of every cell
whose stored output holds a verdict, in both languages, and reports each such
sentence with the case that the stored verdict printed, saying when the sentence
contradicts it (an outcome of the opposite direction).
"""
import re

import pytest
from helpers import NAMES, ROOT, load

LANGS = ['en', 'zh']
VERDICT = {'en': 'Verdict: ', 'zh': '结论：'}

# Words that tie a sentence to this run or this machine.
DEICTIC = {
    'en': re.compile(r"\b(here|on this machine|on this CPU|on this laptop|in this run|this run's|measured|"
                     r"the stored (?:output|run)s?|on the CI machine)\b", re.I),
    'zh': re.compile(r'这里|本机|这台机器|这台 CPU|这次运行|保存的输出|CI 机器上|CI 测试机上|测得|实测'),
}
# Outcome words with their direction: +1 better, -1 worse, 2 no difference (a case too).
OUTCOMES = {
    'en': [(re.compile(r'\b(faster|speeds? up|helps?|helped|wins?|won|beats?|pays off|pays|gains?|gained)\b',
                       re.I), +1),
           (re.compile(r'\b(slower|slows? down|hurts?|loses?|lost|mostly wait|costs? (?:more|time))\b', re.I),
            -1),
           (re.compile(r'\b(about as fast|as fast as|no faster|no difference|about the same|the same bubble)\b',
                       re.I), 2)],
    'zh': [(re.compile(r'更快|加速了|有帮助|有收益|胜过|胜出|占了上风'), +1),
           (re.compile(r'更慢|变慢|拖慢|吃亏|不如|互相等待|彼此等待|得不偿失'), -1),
           (re.compile(r'差不多|大致相同|一样快|没有差别|气泡的大小不变|气泡相同'), 2)],
}
# Words that make a sentence conditional, or hand the outcome to the verdict.
HEDGES = {
    'en': re.compile(r"\b(if|whether|can|cannot|could|may|might|either|or|verdict|verdicts|depends?|when|"
                     r"unless|which|whichever|would|until|once|only where)\b", re.I),
    'zh': re.compile(r'如果|若|是否|可能|也许|结论|取决于|哪一|哪个|还是|或者|或|要么|能否|会不会|一旦|只要|只有|时，'),
}
SENTENCE_END = {'en': re.compile(r'(?<=[.!?;:])\s+|\n\s*\n'), 'zh': re.compile(r'(?<=[。！？；：])|\n\s*\n')}


def sentences(text, lang):
    text = re.sub(r'`[^`]*`', ' ', text)                    # code is not prose
    text = re.sub(r'\$[^$]*\$', ' ', text)                  # nor is a formula
    return [s.strip() for s in SENTENCE_END[lang].split(text) if s.strip()]


def outcome(sentence, lang):
    """+1, -1 or 2 when the sentence states a better, a worse or the same outcome, else 0."""
    for pattern, direction in OUTCOMES[lang]:
        if pattern.search(sentence):
            return direction
    return 0


def asserted_outcomes(text, lang):
    """(sentence, direction) for every sentence that states one outcome for this run, unhedged."""
    found = []
    for sentence in sentences(text, lang):
        direction = outcome(sentence, lang)
        if direction and DEICTIC[lang].search(sentence) and not HEDGES[lang].search(sentence):
            found.append((sentence, direction))
    return found


def verdict_lines(cell):
    lines = []
    for output in cell.get('outputs', []):
        text = output.get('text', '')
        lines += [line for line in (''.join(text) if isinstance(text, list) else text).splitlines()]
    return lines


def neighbours(cells, i):
    """The markdown cells between code cell i and the code cells before and after it."""
    found = []
    for step in (-1, 1):
        j = i + step
        while 0 <= j < len(cells) and cells[j].cell_type == 'markdown':
            found.append(j)
            j += step
    return found


def findings(nb, lang):
    """One message per unhedged outcome beside a verdict."""
    cells = nb.cells
    messages = []
    for i, cell in enumerate(cells):
        if cell.cell_type != 'code':
            continue
        verdicts = [line for line in verdict_lines(cell) if line.startswith(VERDICT[lang])]
        if not verdicts:
            continue
        case_directions = {outcome(line.split('→')[-1], lang) for line in verdicts} - {0}
        for j in neighbours(cells, i):
            for sentence, direction in asserted_outcomes(cells[j].source, lang):
                clash = direction != 2 and -direction in case_directions
                cases = ' | '.join(line.split('→')[-1].strip() for line in verdicts)
                messages.append(f'cell {j} {"contradicts" if clash else "asserts one case beside"} the verdict '
                                f'of cell {i} ({cases}): {sentence!r}')
    return messages


@pytest.mark.parametrize('lang', LANGS)
@pytest.mark.parametrize('name', NAMES)
def test_prose_beside_a_verdict_holds_for_every_case(lang, name):
    messages = findings(load(ROOT / 'notebooks' / lang / name), lang)
    assert not messages, '\n'.join(messages)


# --- The checker itself, on planted sentences ------------------------------------------------

PLANTED = {  # an unhedged outcome for this machine, in each direction
    'en': {+1: 'Here two threads are faster than one core.', -1: 'Here two threads are slower than one core.'},
    'zh': {+1: '这里两个线程比一个核心更快。', -1: '这里两个线程比一个核心更慢。'},
}


def test_the_checker_finds_unhedged_outcomes_and_accepts_hedged_ones():
    for lang, planted in PLANTED.items():
        assert asserted_outcomes(planted[-1], lang) == [(planted[-1], -1)]
    hedged = ['Here two threads can be slower than one core; the verdict says which case your run shows.',
              'If the operators are small, two threads are slower than one core here.',
              'Two threads are slower than one core when the operators are small.']   # no "here": a mechanism
    assert not any(asserted_outcomes(text, 'en') for text in hedged)
    assert not asserted_outcomes('这里两个线程可能比一个核心更慢，结论一行说明你的运行属于哪种情况。', 'zh')
    assert not asserted_outcomes('算子很小时，两个线程比一个核心更慢。', 'zh')


@pytest.mark.parametrize('lang', LANGS)
def test_a_contradiction_planted_beside_a_stored_verdict_fails(lang):
    """Plant, next to a real stored verdict of 03, the outcome opposite to the case it printed."""
    nb = load(ROOT / 'notebooks' / lang / '03-automatic-parallelism.ipynb')
    assert not findings(nb, lang)
    for i, cell in enumerate(nb.cells):
        cases = [outcome(line.split('→')[-1], lang) for line in verdict_lines(cell)
                 if cell.cell_type == 'code' and line.startswith(VERDICT[lang])]
        directions = [d for d in cases if d in (+1, -1)]
        if directions and neighbours(nb.cells, i):
            break
    else:
        pytest.fail('03 should have a verdict that prints a better or a worse case')
    target = nb.cells[neighbours(nb.cells, i)[0]]
    target.source += '\n\n' + PLANTED[lang][-directions[0]]
    messages = findings(nb, lang)   # the cell may sit beside two verdicts: one message for each
    assert messages and all(PLANTED[lang][-directions[0]] in m for m in messages), messages
    assert any('contradicts' in m for m in messages), messages
