"""The guide's lecture plan, checked against the stored notebooks and their timings.

The rule: a 90-minute lecture holds at most 75 minutes of material in presenting time
(course_load's reading estimate from the stored English notebook, run time included, times
lecture_plan.PRESENTING), leaving 10 for its five-question quiz and 5 for discussion; what
does not fit is read before class, at most 30 minutes a lecture. Every `##` section of 00–10 before its
Summary is in exactly one of the twelve lectures; in the six-lecture cut, in exactly one
lecture or in the cut's list of dropped sections. Every heading a part names exists in
both languages at the same cell, and every homework exercise exists. Each check is shown
failing on a planted bug.
"""
import re

import nbpair
import pytest
from helpers import ROOT

from comp_perf import lecture_plan as lp

GUIDE = ROOT / 'notebooks' / 'src' / 'instructors.txt'


@pytest.fixture(scope='module')
def stored_en():
    """{notebook stem: cells} of the stored English notebooks, as the plan reads them."""
    return lp.stored_notebooks(ROOT / 'notebooks' / 'en')


@pytest.fixture(scope='module')
def stored_zh():
    """The same, of the stored Chinese notebooks."""
    return lp.stored_notebooks(ROOT / 'notebooks' / 'zh')


# The rule's numbers are decisions, and the guide's hand-written prose states them in both languages:
# each phrase below must be there, with the number that lecture_plan's constant holds. (The
# constants alone cannot be tested against themselves: MATERIAL_MINUTES is their difference.)
RULE_IN_THE_GUIDE = {
    'en': [(r'twelve lectures of (\d+) minutes', 'LECTURE_MINUTES'),
           (r'at most (\d+) minutes of material', 'MATERIAL_MINUTES'),
           (r'leaves (\d+) minutes for the five-question quiz', 'QUIZ_MINUTES'),
           (r'and (\d+) for questions and discussion', 'DISCUSSION_MINUTES'),
           (r'well under the (\d+)', 'MATERIAL_MINUTES'),
           (r'every lecture within (\d+) minutes', 'MATERIAL_MINUTES'),
           (r'at most (\d+) minutes of reading before class', 'BEFORE_CLASS_MINUTES')],
    'zh': [(r'每次 (\d+) 分钟', 'LECTURE_MINUTES'),
           (r'内容最多 (\d+) 分钟', 'MATERIAL_MINUTES'),
           (r'留出 (\d+) 分钟做五道题的小测', 'QUIZ_MINUTES'),
           (r'(\d+) 分钟用于提问和讨论', 'DISCUSSION_MINUTES'),
           (r'远低于 (\d+) 分钟', 'MATERIAL_MINUTES'),
           (r'都不超过 (\d+) 分钟', 'MATERIAL_MINUTES'),
           (r'课前阅读最多 (\d+) 分钟', 'BEFORE_CLASS_MINUTES')],
}
RULE = ('LECTURE_MINUTES', 'QUIZ_MINUTES', 'DISCUSSION_MINUTES', 'MATERIAL_MINUTES', 'BEFORE_CLASS_MINUTES')


def rule_disagreements(text, lang, minutes):
    """Where the guide's text in `lang` states another rule than `minutes` ({constant: value}), or no
    longer states a part of it."""
    problems = []
    for pattern, name in RULE_IN_THE_GUIDE[lang]:
        found = re.findall(pattern, text)
        if not found:
            problems.append(f'{lang}: the guide no longer says "{pattern}"')
        problems += [f'{lang}: the guide says {n} where {name} is {minutes[name]} ("{pattern}")'
                     for n in found if int(n) != minutes[name]]
    return problems


def test_the_guide_states_the_rule_the_plan_checks():
    minutes = {name: getattr(lp, name) for name in RULE}
    problems = [p for lang in ('en', 'zh') for p in rule_disagreements(guide_text(lang), lang, minutes)]
    assert not problems, '\n'.join(problems)


def test_a_rule_the_guide_does_not_state_is_found():
    minutes = {name: getattr(lp, name) for name in RULE}
    longer_quiz = dict(minutes, QUIZ_MINUTES=15, MATERIAL_MINUTES=70)   # the constants changed, not the guide
    found = rule_disagreements(guide_text('zh'), 'zh', longer_quiz)
    assert any('says 10 where QUIZ_MINUTES is 15' in p for p in found), found
    assert sum('where MATERIAL_MINUTES is 70' in p for p in found) == 4, found   # every place that says 75
    text = guide_text('en').replace('and 5 for questions and discussion', 'and some time for questions')
    [found] = rule_disagreements(text, 'en', minutes)
    assert found.startswith('en: the guide no longer says') and 'for questions and discussion' in found


def test_twelve_lectures_cover_every_section_once_and_fit(stored_en, stored_zh):
    assert [lecture.number for lecture in lp.LECTURES] == list(range(1, 13))
    assert lp.plan_problems(stored_en, stored_zh, lp.LECTURES) == []


def test_the_six_lecture_cut_covers_or_drops_every_section_once_and_fits(stored_en, stored_zh):
    assert [lecture.number for lecture in lp.SIX_LECTURES] == list(range(1, 7))
    merged = sorted({n for lecture in lp.SIX_LECTURES for n in lecture.merges})
    assert merged == list(range(1, 10)), 'the cut says which of the twelve lectures each of its lectures merges'
    # lectures 10 and 11 are merged into none: the cut drops every section of 10 and 11 (left for reading)
    for lecture in lp.LECTURES[9:]:
        stem = lecture.parts[0].stem
        assert {name for _, name in lp.taught_sections(stored_en[stem])} == {n for s, n in lp.CUT_DROPS if s == stem}
    assert lp.plan_problems(stored_en, stored_zh, lp.SIX_LECTURES, lp.CUT_DROPS) == []


def test_parts_resolve_to_the_cells_of_their_sections(stored_en):
    cells = stored_en['02-asynchronous-computation']
    heads = lp.headings(cells)
    start, end = lp.resolve(cells, lp.Part('02-asynchronous-computation', heads[0][1], heads[1][1]))
    assert (start, end) == (0, heads[2][0] - 1)        # the first section takes the title cells with it
    start, end = lp.resolve(cells, lp.Part('02-asynchronous-computation', heads[1][1], heads[-1][1]))
    assert (start, end) == (heads[1][0], len(cells) - 1)


# --- each check fails on a planted bug ---------------------------------------------------------

def _replace(lectures, number, **changes):
    return [lecture._replace(**changes) if lecture.number == number else lecture for lecture in lectures]


def test_a_missing_section_is_found(stored_en, stored_zh):
    # Lecture 2 stops after "A back end you can watch": two sections of 02 are in no lecture.
    broken = _replace(lp.LECTURES, 2, parts=[lp.Part('02-asynchronous-computation',
                                                       'Asynchrony through the back end',
                                                       'A back end you can watch')])
    found = lp.plan_problems(stored_en, stored_zh, broken)
    assert any('"Barriers and blockers" is in 0 lectures' in p for p in found), found
    assert any('"What the profiler sees" is in 0 lectures' in p for p in found), found


def test_a_section_in_two_lectures_is_found(stored_en, stored_zh):
    broken = _replace(lp.LECTURES, 9, parts=lp.LECTURES[8].parts + [lp.Part('07-parameter-servers',
                                                                               'When a process dies', 'Summary')])
    found = lp.plan_problems(stored_en, stored_zh, broken)
    assert any('"When a process dies" is in 2 lectures [7, 9]' in p for p in found), found


def test_a_heading_that_does_not_exist_is_found(stored_en, stored_zh):
    broken = _replace(lp.LECTURES, 4, parts=[lp.Part('04-hardware', 'Caches, and how to find them', 'Summery')])
    found = lp.plan_problems(stored_en, stored_zh, broken)
    assert 'lecture 4: 04-hardware has no section "Summery"' in found, found


def test_a_heading_missing_in_chinese_is_found(stored_en, stored_zh):
    # The Chinese notebook's heading cell of "Memory" becomes a plain paragraph.
    chinese = dict(stored_zh)
    cells = [cell.copy() for cell in chinese['04-hardware']]
    i = dict((name, i) for i, name in lp.headings(stored_en['04-hardware']))['Memory']
    cells[i]['source'] = cells[i]['source'].replace('## ', '', 1)
    chinese['04-hardware'] = cells
    found = lp.plan_problems(stored_en, chinese, lp.LECTURES)
    assert any('"Memory" of 04-hardware' in p and 'in Chinese' in p for p in found), found


def test_an_overfull_lecture_is_found(stored_en, stored_zh):
    # Lectures 3 and 4 in one: 03 and all of 04 do not fit in 75 minutes.
    broken = _replace(lp.LECTURES, 3, parts=lp.LECTURES[2].parts + lp.LECTURES[3].parts)
    broken = [lecture for lecture in broken if lecture.number != 4]
    found = lp.plan_problems(stored_en, stored_zh, broken)
    assert any(p.startswith('lecture 3: about') and 'more than the 75 min' in p for p in found), found


def test_presenting_is_what_the_rule_holds_and_reading_before_class_is_capped(stored_en, stored_zh):
    # lecture 10 presents its parts 2-5 live and leaves part 1 for reading before class; presenting
    # part 1 too (its reading minutes fit 75) takes more than 75 min at PRESENTING times the reading
    whole = _replace(lp.LECTURES, 10, parts=[lp.Part('10-attention-and-generation', 'A language model you can count',
                                                     'Summary')], before_class=[])
    load = lp.lecture_load(stored_en, whole[9])
    assert load['minutes'] <= lp.MATERIAL_MINUTES < load['presenting']
    found = lp.plan_problems(stored_en, stored_zh, whole)
    assert any(p.startswith('lecture 10: about') and 'min to present' in p for p in found), found
    # everything of 10 read before class: nothing is presented, but the reading is over its cap
    homework = _replace(lp.LECTURES, 10, parts=[], before_class=whole[9].parts)
    found = lp.plan_problems(stored_en, stored_zh, homework)
    assert any('min of reading before class, more than 30 min' in p for p in found), found


def test_a_part_read_before_class_and_presented_too_is_found(stored_en, stored_zh):
    twice = _replace(lp.LECTURES, 8, before_class=[lp.Part('08-beyond-data-parallelism', 'Choosing', 'Choosing')])
    found = lp.plan_problems(stored_en, stored_zh, twice)
    assert found == ['08-beyond-data-parallelism "Choosing" is in 2 lectures [8, 9], not in exactly one'], found


def test_an_overfull_cut_lecture_is_found(stored_en, stored_zh):
    # The cut's third lecture given all of 04 and all of 07, without their drops: it no longer fits.
    parts = [lp.Part('04-hardware', 'The computer', 'Summary'),
             lp.Part('07-parameter-servers', 'Where should the gradients be added up?', 'Summary')]
    broken = _replace(lp.SIX_LECTURES, 3, parts=parts)
    drops = [d for d in lp.CUT_DROPS if d[0] not in ('04-hardware', '07-parameter-servers')]
    found = lp.plan_problems(stored_en, stored_zh, broken, drops)
    assert any(p.startswith('lecture 3: about') for p in found), found


def test_homework_that_does_not_exist_is_found(stored_en, stored_zh):
    broken = _replace(lp.LECTURES, 9, homework=(('09', lp.BUILD), ('09', 1), ('09', 17)))
    assert lp.plan_problems(stored_en, stored_zh, broken) == ['lecture 9: homework 09 ex. 17 does not exist']
    broken = _replace(lp.LECTURES, 8, homework=(('08', 1), ('08', 5), ('07', lp.BUILD)))   # 07 has no build
    assert lp.plan_problems(stored_en, stored_zh, broken) == ['lecture 8: homework 07 build does not exist']


def test_homework_outside_its_band_is_found(stored_en, stored_zh):
    heavy = _replace(lp.LECTURES, 7, homework=(('07', 1), ('07', 3), ('07', 4)))   # 60 + 45 + 15 min
    assert lp.plan_problems(stored_en, stored_zh, heavy) == [
        'lecture 7: about 120 min of homework, outside the 45–90 min each lecture gets']
    light = _replace(lp.LECTURES, 2, homework=(('02', 1),))
    assert lp.plan_problems(stored_en, stored_zh, light) == [
        'lecture 2: about 10 min of homework, outside the 45–90 min each lecture gets']


def test_every_build_and_its_exercise_is_homework_in_both_plans(stored_en):
    builds = {stem[:2] for stem, cells in stored_en.items() if lp.has_build(cells)}
    assert builds == {'06', '08', '09', '10', '11', '12'}   # 06's and 08's builds are `###` parts of a section
    graded = {('06', lp.BUILD), ('08', 5), ('09', lp.BUILD), ('10', lp.BUILD), ('11', lp.BUILD), ('12', lp.BUILD)}
    assert graded <= {item for lecture in lp.LECTURES for item in lecture.homework}
    # The cut drops sections 10 and 11 whole, so their builds are not graded there: a student would first read
    # about 33 min of 10's parts 1–3 (not counted in the homework band) and then build for 45, beside
    # 09's build in the same week, well beyond the 90 min a lecture's homework may take. The guide
    # offers it as reading with an optional build. Every build of a section the cut teaches is homework.
    taught = {stem[:2] for stem, cells in stored_en.items()
              if {n for _, n in lp.taught_sections(cells)} - {n for s, n in lp.CUT_DROPS if s == stem}}
    assert not {'10', '11', '12'} & taught
    dropped = {('10', lp.BUILD), ('11', lp.BUILD), ('12', lp.BUILD)}
    assert {item for item in graded if item[0] in taught} == graded - dropped
    assert graded - dropped <= {item for lecture in lp.SIX_LECTURES for item in lecture.homework}
    for plan in (lp.LECTURES, lp.SIX_LECTURES):   # 06's exercise 6 tests the built piece's bucket sizes
        assert ('06', 6) in {item for lecture in plan for item in lecture.homework}
    assert lp.exercise_minutes(stored_en['08-beyond-data-parallelism'])[5] == 45


def names_bound(code):
    """Names a code cell binds at its top level (assignments, defs, imports, for targets, with ... as)."""
    import ast
    bound = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split('.')[0] for a in node.names}
    return bound


def names_read(code):
    """Names a code cell reads, and the top-level modules it imports (a dropped cell may have written one)."""
    import ast
    read = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.add(node.id)
        elif isinstance(node, ast.Import):
            read |= {a.name.split('.')[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            read.add(node.module.split('.')[0])
    return read


def python_of(cell):
    """A code cell's Python: line magics and shell lines dropped, a cell magic's body kept (%%time …),
    and nothing of a %%writefile cell, whose body is a file's text."""
    lines = cell.source.splitlines()
    if lines and lines[0].startswith('%%'):
        if lines[0].startswith('%%writefile'):
            return ''
        lines = lines[1:]
    return '\n'.join(line for line in lines if not line.lstrip().startswith(('%', '!')))


def files_written(cell):
    """What a %%writefile cell gives later cells: 'file:' and its path, and the module it can be imported as."""
    first = cell.source.split('\n', 1)[0].split()
    if not first or first[0] != '%%writefile':
        return set()
    path = first[-1]
    stem = path.rsplit('/', 1)[-1]
    return {f'file:{path}'} | ({stem[:-3]} if stem.endswith('.py') else set())


def files_named(cell, provided):
    """The written files of `provided` whose path the cell's text names."""
    return {f for f in provided if f.startswith('file:') and f[len('file:'):] in cell.source}


def dropped_cells(stem, cells, drops):
    """Indices of the cells a cut drops from one notebook: each dropped heading up to the next heading
    (the set-up cells above a first section stay)."""
    dropped = set()
    heads = lp.headings(cells)
    for name in [n for s, n in drops if s == stem]:
        k = [n for _, n in heads].index(name)
        end = heads[k + 1][0] if k + 1 < len(heads) else len(cells)
        dropped |= set(range(heads[k][0], end))
    return dropped


def cut_problems(english, drops):
    """Names and written files a kept cell of the six-lecture cut needs that only a dropped cell before it
    provides.

    This is the cut's Run All, read instead of executed: it finds the NameError, the import of a module a
    dropped %%writefile cell wrote, the file not found. State a dropped cell changes without binding a name
    (an attribute set, a random draw) it cannot see; `./course test --slow` runs the cut for real
    (test_the_six_lecture_cut_executes_top_to_bottom)."""
    problems = []
    for stem, cells in english.items():
        dropped = dropped_cells(stem, cells, drops)
        only_dropped, kept_bound = set(), set()
        for i, cell in enumerate(cells):
            if cell.cell_type != 'code':
                continue
            code = python_of(cell)
            provides = names_bound(code) | files_written(cell)
            if i in dropped:
                only_dropped |= provides - kept_bound
                continue
            needs = names_read(code) | files_named(cell, only_dropped)
            missing = (needs & only_dropped) - kept_bound
            problems += [f'{stem} c{i:03d} reads {name}, bound only in a dropped part' for name in sorted(missing)]
            kept_bound |= provides
    return problems


def test_the_six_lecture_cut_runs_top_to_bottom_without_its_dropped_parts(stored_en):
    # the kept cells, in order, must not need a name that only a dropped part defines (09 once lost ck_s so)
    assert cut_problems(stored_en, lp.CUT_DROPS) == []


def test_a_cut_that_drops_what_a_kept_cell_needs_is_found(stored_en):
    drops = list(lp.CUT_DROPS) + [('09-one-training-step', 'The first draft')]
    found = cut_problems(stored_en, drops)
    assert any(p.startswith('09-one-training-step') and 'make_step' in p for p in found), found


def test_a_cut_that_drops_a_file_or_a_timed_definition_a_kept_cell_needs_is_found():
    import nbformat
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    cells = [md('# 99 Demo'), md('## Writes'), code('%%writefile artifacts/probe.c\nint main() {}'),
             code('%%writefile my_worker.py\ndef work(): pass'), code('%%time\ntimed = 1'),
             md('## Uses'), code("probe = common.compile_c('artifacts/probe.c')"),
             code('import my_worker\nmy_worker.work()'), code('%%time\nprint(timed)'), md('## Summary')]
    found = cut_problems({'99-demo': cells}, [('99-demo', 'Writes')])
    assert found == ['99-demo c006 reads file:artifacts/probe.c, bound only in a dropped part',
                     '99-demo c007 reads my_worker, bound only in a dropped part',
                     '99-demo c008 reads timed, bound only in a dropped part'], found
    assert cut_problems({'99-demo': cells}, []) == []


def cut_notebook(stem, cells, drops):
    """The English notebook as the cut teaches it: its kept cells, in order, outputs cleared."""
    import copy

    import nbformat
    nb = nbformat.v4.new_notebook()
    nb.metadata = {'kernelspec': nbpair.KERNELSPEC, 'language_info': {'name': 'python'}}
    dropped = dropped_cells(stem, cells, drops)
    for i, cell in enumerate(cells):
        if i not in dropped:
            kept = copy.deepcopy(cell)
            if kept.cell_type == 'code':
                kept.outputs, kept.execution_count = [], None
            nb.cells.append(kept)
    return nb


def sections_cut_before_kept_code(english, drops):
    """Notebooks where a kept code cell follows a dropped part: only there can a cut break a later cell.
    (A drop with nothing kept after it leaves a prefix of the notebook, which nbval already runs.)"""
    found = []
    for stem, cells in english.items():
        dropped = dropped_cells(stem, cells, drops)
        if dropped and any(c.cell_type == 'code' and i > min(dropped) and i not in dropped
                           for i, c in enumerate(cells)):
            found.append(stem)
    return sorted(found)


CUT_EXECUTED = ['03-automatic-parallelism', '04-hardware', '06-multi-gpu-concise', '09-one-training-step',
                '10-attention-and-generation']


def test_the_cut_is_executed_wherever_it_drops_a_part_before_kept_code(stored_en):
    # a new drop before kept code must be added to CUT_EXECUTED, so that the test below runs it
    assert sections_cut_before_kept_code(stored_en, lp.CUT_DROPS) == CUT_EXECUTED


@pytest.mark.slow
@pytest.mark.procs
@pytest.mark.notebooks
@pytest.mark.parametrize('stem', CUT_EXECUTED)
def test_the_six_lecture_cut_executes_top_to_bottom(stem, stored_en):
    """Run All of the cut: the kept cells of the notebook, in order, in the course's kernel."""
    from nbclient import NotebookClient
    nb = cut_notebook(stem, stored_en[stem], lp.CUT_DROPS)
    NotebookClient(nb, timeout=600, kernel_name=nbpair.KERNELSPEC['name'],
                   resources={'metadata': {'path': str(ROOT / 'notebooks' / 'en')}}).execute()
    assert len(nb.cells) < len(stored_en[stem])   # something was dropped, and the rest ran


# --- the guide's prose agrees with the plan ----------------------------------------------------

def homework_text(lecture, lang):
    """'00 ex. 2 · 09 build, ex. 1, 3' (en) or '00 练习 2 · 09 动手实现、练习 1、3' (zh), in the plan's order."""
    sections = {}
    for section, number in lecture.homework:
        sections.setdefault(section, []).append(number)
    word, comma, build = ('ex.', ', ', 'build') if lang == 'en' else ('练习', '、', '动手实现')
    texts = []
    for s, items in sections.items():
        numbers = comma.join(str(n) for n in items if n != lp.BUILD)
        parts = ([build] if lp.BUILD in items else []) + ([f'{word} {numbers}'] if numbers else [])
        texts.append(f'{s} {comma.join(parts)}')
    return ' · '.join(texts)


def guide_cells():
    return [c for c in nbpair.parse(GUIDE) if c['type'] == 'md']


def guide_text(lang):
    return '\n'.join(c[lang] for c in guide_cells())


def lecture_text(number):
    """{'en': …, 'zh': …}: the guide's cells from "### Lecture n" up to the next heading."""
    cells = guide_cells()
    first = next((i for i, c in enumerate(cells) if c['en'].startswith(f'### Lecture {number} ')), None)
    if first is None:
        return None
    end = next((i for i in range(first + 1, len(cells)) if cells[i]['en'].startswith('#')), len(cells))
    return {lang: '\n\n'.join(c[lang] for c in cells[first:end]) for lang in ('en', 'zh')}


@pytest.mark.parametrize('lecture', lp.LECTURES, ids=lambda lec: f'lecture-{lec.number}')
def test_the_guide_gives_each_lecture_its_homework_and_a_five_question_quiz(lecture):
    cell = lecture_text(lecture.number)
    assert cell, f'the guide has no "### Lecture {lecture.number} …" cell'
    assert cell['zh'].startswith(f'### 第 {lecture.number} 讲'), cell['zh'][:40]
    assert f'**Homework:** {homework_text(lecture, "en")}\n' in cell['en'] + '\n'
    assert f'**作业：** {homework_text(lecture, "zh")}\n' in cell['zh'] + '\n'
    for lang, answers in (('en', 'Answers'), ('zh', '答案')):
        quiz, _, rest = cell[lang].partition(f'<details><summary>{answers}</summary>')
        assert rest, f'{lang}: lecture {lecture.number} has no <details> with the answers'
        questions = re.findall(r'^(\d)\. ', quiz.split('**Quiz' if lang == 'en' else '**小测')[-1], re.M)
        given = re.findall(r'^(\d)\. ', rest.split('</details>')[0], re.M)
        assert questions == given == list('12345'), (lang, questions, given)


def test_the_guide_names_the_six_lecture_cuts_homework():
    text, zh = guide_text('en'), guide_text('zh')
    for lecture in lp.SIX_LECTURES:
        assert homework_text(lecture, 'en') in text, homework_text(lecture, 'en')
        assert homework_text(lecture, 'zh') in zh, homework_text(lecture, 'zh')
