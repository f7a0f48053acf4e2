"""The instructor's guide's lecture plan, as data, and its checks against the stored notebooks.

Eleven 90-minute lectures cover sections 00–11; a six-lecture cut merges nine of them
and drops named sections (all of sections 10 and 11, which students may read on their own). A
lecture is a list of parts, each (notebook stem, first `##` heading, last `##` heading),
the headings written without their number, so that a
section inserted or renumbered elsewhere moves no part. A part runs from its first
heading's cell (from the notebook's first cell when that heading is the first section)
to the cell before the `##` heading that follows its last one. Its minutes are
course_load's estimate over those cells of the stored English notebook, which counts
their stored run time.

These minutes are a student's: reading and running the cells at the reader's pace. A
lecture presents material more slowly than a student reads it, so the rule each lecture
must meet is stated in presenting time: the parts presented live, at PRESENTING times their
reading minutes, fit in MATERIAL_MINUTES, which leaves QUIZ_MINUTES for the five-question
quiz and DISCUSSION_MINUTES for questions and discussion out of LECTURE_MINUTES. PRESENTING
is a planning assumption, not a measurement: an instructor who presents faster or slower
changes it. What does not fit is read before class (a lecture's `before_class` parts, at
most BEFORE_CLASS_MINUTES of reading) and discussed in it. plan_problems() returns what
breaks the plan (tests/test_lecture_plan.py runs it, and plants a bug for each check).
"""
import re
from collections import namedtuple
from pathlib import Path

import nbformat

from comp_perf import course_load

LECTURE_MINUTES = 90
QUIZ_MINUTES = 10
DISCUSSION_MINUTES = 5
MATERIAL_MINUTES = LECTURE_MINUTES - QUIZ_MINUTES - DISCUSSION_MINUTES   # 75
PRESENTING = 1.25   # presenting a part takes a quarter longer than reading it: 60 min of reading per lecture
BEFORE_CLASS_MINUTES = 30   # reading assigned before a lecture, beside (not inside) its homework

Part = namedtuple('Part', 'stem first last')
# homework: ((section, exercise number or BUILD), ...); merges: the lectures of the ten a cut lecture joins;
# before_class: parts the students read before the lecture, which it discusses but does not present
Lecture = namedtuple('Lecture', 'number parts homework merges before_class', defaults=((), ()))

_CLOSING = {'Summary', 'Exercises', '小结', '练习'}
BUILD = 'build'   # a section's "Build it" part, the piece its check grades, as homework
# a build's minutes for a student, its check passing included (08's build is its exercise 5, timed there)
BUILD_MINUTES = {'06': 45, '09': 45, '10': 45, '11': 45, '12': 45}
# every lecture's homework, by the exercises' own estimates and BUILD_MINUTES: balanced, none a week's work
HOMEWORK_MINUTES = (45, 90)

LECTURES = [
    Lecture(1, [Part('00-start-here', 'How to run the course', 'Course map'),
                Part('01-compilers-and-interpreters', 'Imperative programming', 'Summary')],
            homework=(('00', 2), ('01', 1), ('01', 3))),
    Lecture(2, [Part('02-asynchronous-computation', 'Asynchrony through the back end', 'Summary')],
            homework=(('02', 1), ('02', 2), ('02', 3))),
    Lecture(3, [Part('03-automatic-parallelism', 'Parallel computation on GPUs', 'Summary'),
                Part('04-hardware', 'The computer', 'Memory')],
            homework=(('03', 1), ('03', 2), ('03', 3))),
    Lecture(4, [Part('04-hardware', 'Caches, and how to find them', 'Summary')],
            homework=(('04', 2), ('04', 4), ('04', 6), ('04', 7))),
    Lecture(5, [Part('05-multi-gpu-from-scratch', 'Splitting the problem', 'Summary'),
                Part('06-multi-gpu-concise', 'A ResNet-18 for 28×28 images', '`nn.DataParallel`')],
            homework=(('05', 2), ('05', 3), ('05', 4))),
    Lecture(6, [Part('06-multi-gpu-concise', '`DistributedDataParallel` under `torchrun`', 'Summary')],
            homework=(('06', BUILD), ('06', 2), ('06', 6))),
    Lecture(7, [Part('07-parameter-servers', 'Where should the gradients be added up?', 'Summary')],
            homework=(('07', 1), ('07', 4))),
    Lecture(8, [Part('08-beyond-data-parallelism', 'Memory is the constraint',
                     'Pipeline parallelism: splitting the layers into stages')],
            homework=(('08', 1), ('08', 2), ('08', 5))),
    Lecture(9, [Part('09-one-training-step', 'The model and its cost', 'Summary')],
            homework=(('09', BUILD), ('09', 1), ('09', 3)),
            before_class=[Part('08-beyond-data-parallelism', 'Choosing', 'Summary')]),
    Lecture(10, [Part('10-attention-and-generation', 'Attention against sequence length', 'Summary')],
            homework=(('10', BUILD), ('10', 1), ('10', 2)),
            before_class=[Part('10-attention-and-generation', 'A language model you can count',
                               'A language model you can count')]),
    Lecture(11, [Part('11-writing-kernels', 'The programming model', 'Summary')],
            homework=(('11', BUILD), ('11', 1))),
    Lecture(12, [Part('12-long-context-and-experts', 'Why long context needs more than one device', 'Summary')],
            homework=(('12', BUILD), ('12', 1), ('12', 2))),
]

# The six-lecture cut: lectures 1–9 of the twelve merged, these sections dropped (shown from the
# stored outputs or left for reading). Lectures 10 to 12 are dropped whole: six lectures cannot hold
# twelve topics, and sections 10 to 12 stand on their own after 09, so they are left for reading,
# their builds optional.
CUT_DROPS = [
    ('02-asynchronous-computation', 'What the profiler sees'),
    ('03-automatic-parallelism', 'Parallel computation on GPUs'),
    ('03-automatic-parallelism', 'The dependency graph of a training step'),
    ('04-hardware', 'Storage'),
    ('04-hardware', 'Networks and buses'),
    ('04-hardware', 'A systolic array, cycle by cycle'),
    ('05-multi-gpu-from-scratch', 'Results'),
    ('06-multi-gpu-concise', '`nn.DataParallel`'),
    ('07-parameter-servers', 'Training on many machines'),
    ('07-parameter-servers', 'The key–value store'),
    ('07-parameter-servers', 'A parameter server over real processes'),
    ('07-parameter-servers', 'When a process dies'),
    ('09-one-training-step', 'Memory, not only time'),
    ('09-one-training-step', 'The toolkit on the fast step'),
    ('10-attention-and-generation', 'A language model you can count'),
    ('10-attention-and-generation', 'Attention against sequence length'),
    ('10-attention-and-generation', "Build it: FlashAttention's forward pass"),
    ('10-attention-and-generation', 'Generation'),
    ('10-attention-and-generation', 'Smaller weights'),
    ('11-writing-kernels', 'The programming model'),
    ('11-writing-kernels', 'Fusion, counted'),
    ('11-writing-kernels', 'Tiles and the roofline'),
    ('11-writing-kernels', "Build it: FlashAttention-2's forward pass in Triton"),
    ('11-writing-kernels', 'What `torch.compile` writes'),
    ('11-writing-kernels', 'On a GPU'),
    ('12-long-context-and-experts', 'Why long context needs more than one device'),
    ('12-long-context-and-experts', 'Build it: ring attention'),
    ('12-long-context-and-experts', 'Balancing the causal ring'),
    ('12-long-context-and-experts', 'A mixture of experts on one process'),
    ('12-long-context-and-experts', 'Expert parallelism'),
    ('12-long-context-and-experts', 'Where the dimensions meet'),
]

SIX_LECTURES = [
    Lecture(1, LECTURES[0].parts, LECTURES[0].homework, merges=(1,)),
    Lecture(2, [Part('02-asynchronous-computation', 'Asynchrony through the back end', 'Barriers and blockers'),
                Part('02-asynchronous-computation', 'Summary', 'Summary')],
            homework=(('02', 2), ('02', 3), ('03', 1)), merges=(2, 3),
            before_class=[Part('03-automatic-parallelism', 'Overlapping computation and communication',
                               'On the CPU: the nearest equivalents')]),
    Lecture(3, [Part('04-hardware', 'The computer', 'Memory'),
                Part('04-hardware', 'Caches, and how to find them', 'Caches, and how to find them'),
                Part('04-hardware', 'CPUs', 'GPUs and other accelerators'),
                Part('04-hardware', 'The latency ladder', 'Summary')],
            homework=(('04', 2), ('04', 4), ('04', 7)), merges=(3, 4)),
    Lecture(4, [Part('05-multi-gpu-from-scratch', 'Training', 'Real parallelism on a CPU: one process per replica'),
                Part('05-multi-gpu-from-scratch', 'Summary', 'Summary'),
                Part('06-multi-gpu-concise', 'A ResNet-18 for 28×28 images', 'A ResNet-18 for 28×28 images'),
                Part('06-multi-gpu-concise', '`DistributedDataParallel` under `torchrun`', 'Summary')],
            homework=(('05', 4), ('06', BUILD), ('06', 6)), merges=(5, 6),
            before_class=[Part('05-multi-gpu-from-scratch', 'Splitting the problem', 'Data parallelism')]),
    Lecture(5, [Part('07-parameter-servers', 'A ring all-reduce for real', 'A ring all-reduce for real'),
                Part('07-parameter-servers', 'Summary', 'Summary'),
                Part('08-beyond-data-parallelism', 'Memory is the constraint',
                     'Tensor parallelism: splitting one layer')],
            homework=(('07', 4), ('08', 1), ('08', 5)), merges=(7, 8),
            before_class=[Part('07-parameter-servers', 'Where should the gradients be added up?',
                               'Ring synchronisation')]),
    Lecture(6, [Part('08-beyond-data-parallelism', 'Choosing', 'Summary'),
                Part('09-one-training-step', 'The model and its cost', 'The payoff, measured fairly'),
                Part('09-one-training-step', 'Build it: a faster step of your own', 'Summary')],
            homework=(('08', 3), ('09', BUILD), ('09', 1)), merges=(8, 9),
            before_class=[Part('08-beyond-data-parallelism', 'Pipeline parallelism: splitting the layers into stages',
                               'Pipeline parallelism: splitting the layers into stages')]),
]


def stored_notebooks(folder):
    """{stem: cells} of the stored numbered notebooks in a folder (notebooks/en or notebooks/zh)."""
    return {p.stem: nbformat.read(p, as_version=4).cells for p in sorted(Path(folder).glob('[0-9][0-9]-*.ipynb'))}


def headings(cells):
    """[(cell index, heading without its number)] of the `##` headings, each the first line of its cell."""
    found = []
    for i, cell in enumerate(cells):
        first = cell.source.lstrip().split('\n', 1)[0] if cell.cell_type == 'markdown' else ''
        match = re.match(r'## (?:\d+ )?(.+?)\s*$', first)
        if match:
            found.append((i, match.group(1)))
    return found


def taught_sections(cells):
    """The `##` sections a lecture must cover: those before the Summary (or the Exercises)."""
    found = []
    for i, name in headings(cells):
        if name in _CLOSING:
            break
        found.append((i, name))
    return found


def resolve(cells, part):
    """(first cell, last cell) of a part in a notebook's cells; KeyError names a heading that is not there."""
    heads = headings(cells)
    names = [name for _, name in heads]
    for name in (part.first, part.last):
        if name not in names:
            raise KeyError(f'{part.stem} has no section "{name}"')
    a, b = names.index(part.first), names.index(part.last)
    if b < a:
        raise KeyError(f'{part.stem}: "{part.last}" comes before "{part.first}"')
    start = 0 if a == 0 else heads[a][0]
    end = heads[b + 1][0] - 1 if b + 1 < len(heads) else len(cells) - 1
    return start, end


def lecture_load(notebooks, lecture, before_class=False):
    """course_load.load() over the cells a lecture presents (before_class=True: those read before it), with
    'ranges': [(stem, first cell, last cell)] and 'presenting', its minutes at PRESENTING times the reading's."""
    cells, ranges = [], []
    for part in (lecture.before_class if before_class else lecture.parts):
        start, end = resolve(notebooks[part.stem], part)
        ranges.append((part.stem, start, end))
        cells += notebooks[part.stem][start:end + 1]
    result = course_load.load(cells)
    result['ranges'], result['presenting'] = ranges, result['minutes'] * PRESENTING
    return result


def has_build(cells):
    """Whether a notebook has a `##` or `###` "Build it" (动手实现) part, whose piece a check grades."""
    for cell in cells:
        first = cell.source.lstrip().split('\n', 1)[0] if cell.cell_type == 'markdown' else ''
        if re.match(r'#{2,3} (?:\d+ )?(Build it|动手实现)', first):
            return True
    return False


def exercise_minutes(cells):
    """{exercise number: minutes} from the '*(★★ · 20 min)*' of each exercise in the Exercises cell."""
    for cell in cells:
        first = cell.source.lstrip().split('\n', 1)[0] if cell.cell_type == 'markdown' else ''
        if re.match(r'## (?:\d+ )?Exercises\s*$', first):
            body = cell.source.split('<details>')[0]
            return {int(n): int(m) for n, m in re.findall(r'^(\d+)\. .*?\(★+ · (\d+) min\)', body, re.M)}
    return {}


def homework_minutes(english, lecture):
    """A lecture's homework in minutes: its exercises' own estimates, and BUILD_MINUTES for a build."""
    by_section = {stem[:2]: stem for stem in english}
    total = 0
    for section, number in lecture.homework:
        if number == BUILD:
            total += BUILD_MINUTES.get(section, 0)
        elif section in by_section:
            total += exercise_minutes(english[by_section[section]]).get(number, 0)
    return total


def exercise_numbers(cells):
    """Numbers of the exercises in a notebook's Exercises cell (the items before the first solution)."""
    for cell in cells:
        first = cell.source.lstrip().split('\n', 1)[0] if cell.cell_type == 'markdown' else ''
        if re.match(r'## (?:\d+ )?(Exercises|练习)\s*$', first):
            return [int(n) for n in re.findall(r'^(\d+)\. ', cell.source.split('<details>')[0], re.M)]
    return []


def plan_problems(english, chinese, lectures, drops=()):
    """What breaks a plan, as sentences (empty when it holds).

    Every taught section of every notebook in exactly one lecture (or, for a cut, listed in
    `drops`; a part read before class counts as its lecture's); every heading a part names present
    in both languages at the same cell; every lecture's presenting time within MATERIAL_MINUTES and
    its reading before class within BEFORE_CLASS_MINUTES; every homework exercise present in both,
    and each lecture's homework within HOMEWORK_MINUTES.
    """
    problems, seen = [], {}
    by_section = {stem[:2]: stem for stem in english}
    for lecture in lectures:
        for part in (*lecture.parts, *lecture.before_class):
            if part.stem not in english or part.stem not in chinese:
                problems.append(f'lecture {lecture.number}: no stored notebook {part.stem}')
                continue
            try:
                start, end = resolve(english[part.stem], part)
            except KeyError as missing:
                problems.append(f'lecture {lecture.number}: {missing.args[0]}')
                continue
            zh = dict(headings(chinese[part.stem]))
            for name in (part.first, part.last):
                i = dict((n, i) for i, n in headings(english[part.stem]))[name]
                if i not in zh:
                    problems.append(f'lecture {lecture.number}: "{name}" of {part.stem} (c{i:03d}) '
                                    'has no `##` heading at the same cell in Chinese')
            for i, name in taught_sections(english[part.stem]):
                if start <= i <= end:
                    seen.setdefault((part.stem, name), []).append(lecture.number)
        if all(part.stem in english for part in (*lecture.parts, *lecture.before_class)):
            try:
                presenting = lecture_load(english, lecture)['presenting']
                reading = lecture_load(english, lecture, before_class=True)['minutes']
            except KeyError:
                presenting = reading = 0
            if presenting > MATERIAL_MINUTES:
                problems.append(f'lecture {lecture.number}: about {presenting:.0f} min to present, more than the '
                                f'{MATERIAL_MINUTES} min a {LECTURE_MINUTES}-minute lecture leaves beside its '
                                f'quiz ({QUIZ_MINUTES} min) and discussion ({DISCUSSION_MINUTES} min)')
            if reading > BEFORE_CLASS_MINUTES:
                problems.append(f'lecture {lecture.number}: about {reading:.0f} min of reading before class, more '
                                f'than {BEFORE_CLASS_MINUTES} min')
        low, high = HOMEWORK_MINUTES
        homework = homework_minutes(english, lecture)
        if not low <= homework <= high:
            problems.append(f'lecture {lecture.number}: about {homework} min of homework, outside the '
                            f'{low}–{high} min each lecture gets')
        for section, number in lecture.homework:
            stem = by_section.get(section)
            if number == BUILD:
                if stem is None or not has_build(english[stem]) or not has_build(chinese.get(stem, [])):
                    problems.append(f'lecture {lecture.number}: homework {section} build does not exist')
            elif stem is None or number not in exercise_numbers(english[stem]) \
                    or number not in exercise_numbers(chinese.get(stem, [])):
                problems.append(f'lecture {lecture.number}: homework {section} ex. {number} does not exist')
    for stem, name in drops:
        seen.setdefault((stem, name), []).append('dropped')
    for stem, cells in english.items():
        for _, name in taught_sections(cells):
            where = seen.get((stem, name), [])
            if len(where) != 1:
                problems.append(f'{stem} "{name}" is in {len(where)} lectures {where}, not in exactly one')
    return problems
