"""common.py is the course's map: each name in the group of the first section that uses it.

The map is computed here from the notebook sources, not kept by hand: a name moved,
added or no longer used makes one of these tests fail with what to change.
"""
import ast
import re
import sys
from pathlib import Path

import pytest
from notebook_code import section_of

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / 'comp_perf'
MAP = ROOT / 'common.py'
BEHIND = 'behind'            # the last group: what no notebook calls
LARGEST_MODULE = 500         # lines, of a module of the package or a tool


def section_sources():
    """{section: source text}: '00' … for the numbered sections, 'guide' for the instructor's guide."""
    out = {}
    for src in sorted((ROOT / 'notebooks' / 'src').glob('*.txt')):
        out[section_of(src)] = src.read_text(encoding='utf-8')
    return out


def common_names(text):
    return set(re.findall(r'\bcommon\.([A-Za-z_]\w*)', text))


def first_users():
    """{name: the first section (in course order) whose source uses common.name}."""
    first = {}
    for section, text in section_sources().items():   # '00' < … < '09' < 'guide'
        for name in sorted(common_names(text)):
            first.setdefault(name, section)
    return first


def definitions():
    """{public name: module} for every top-level def, class or assignment of the package."""
    found = {}
    for path in sorted(PACKAGE.glob('*.py')):
        for node in ast.parse(path.read_text(encoding='utf-8')).body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else \
                [t.id for t in getattr(node, 'targets', []) if isinstance(t, ast.Name)]
            for name in names:
                if not name.startswith('_'):
                    assert name not in found, f'{name} is defined in {found[name]} and in {path.stem}'
                    found[name] = path.stem
    return found


def read_map(text=None):
    """[(group, [(module, name), ...])] in the order of common.py; group is 'NN', 'guide' or 'behind'."""
    text = MAP.read_text(encoding='utf-8') if text is None else text
    tree = ast.parse(text)
    imports = {node.lineno: node for node in tree.body if isinstance(node, ast.ImportFrom)}
    groups, lines = [], text.splitlines()
    for lineno, line in enumerate(lines, 1):
        header = re.match(r'# (\d\d|guide) [A-Z]', line) or re.match(r'# (Behind) ', line)
        if header:
            groups.append((header.group(1).lower() if header.group(1) == 'Behind' else header.group(1), []))
        if lineno in imports:
            node = imports[lineno]
            assert groups, f'common.py:{lineno}: an import before the first group header'
            groups[-1][1].extend((node.module.split('.')[-1], alias.name) for alias in node.names)
    return groups


def test_the_map_defines_nothing_and_imports_only_from_the_package():
    tree = ast.parse(MAP.read_text(encoding='utf-8'))
    assert ast.get_docstring(tree), 'common.py starts with a docstring that says how to read it'
    for node in tree.body[1:]:
        assert isinstance(node, ast.ImportFrom) and node.module.startswith('comp_perf.') and node.level == 0, \
            f'common.py:{node.lineno}: the map holds only "from comp_perf.<module> import ..." lines'
        assert all(alias.asname is None for alias in node.names), f'common.py:{node.lineno}: no renaming'


def test_every_section_has_a_group_in_course_order():
    groups = [group for group, _ in read_map()]
    sections = [s for s in section_sources() if s != 'guide']
    assert [g for g in groups if g not in ('guide', BEHIND)] == sections, \
        f'one group per section, in course order: {sections}; the map has {groups}'
    assert groups[-1] == BEHIND, 'the last group holds what no notebook calls'


def test_every_public_name_of_the_package_is_in_the_map_once_from_where_it_is_defined():
    defined = definitions()
    listed = [(module, name) for _, entries in read_map() for module, name in entries]
    names = [name for _, name in listed]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []
    assert sorted(set(defined) - set(names)) == [], 'add these to common.py'
    wrong = [(name, module, defined.get(name)) for module, name in listed if defined.get(name) != module]
    assert not wrong, f'(name, imported from, defined in): {wrong}'


def test_each_name_sits_in_the_group_of_the_first_section_that_uses_it():
    first = first_users()
    misplaced = [(name, group, first.get(name, BEHIND)) for group, entries in read_map()
                 for _, name in entries if first.get(name, BEHIND) != group]
    assert not misplaced, f'(name, its group, the group of its first user): {misplaced}'


def test_a_section_module_serves_no_earlier_section():
    first = first_users()
    early = [(name, module, first[name]) for name, module in definitions().items()
             if re.match(r's\d\d_', module) and name in first and first[name] < module[1:3]]
    assert not early, f'(name, module, used first by): move these to a shared module: {early}'


def test_what_no_notebook_calls_is_still_used_by_the_package_the_set_up_or_a_tool():
    # Tests do not count: a helper only a test calls is dead code.
    package = {path.stem: path.read_text(encoding='utf-8') for path in PACKAGE.glob('*.py')}
    tools = '\n'.join(p.read_text(encoding='utf-8') for p in (ROOT / 'tools').glob('*.py'))
    tools += (ROOT / 'course').read_text(encoding='utf-8')
    defined = definitions()
    unused = []
    for group, entries in read_map():
        for module, name in entries:
            if group != BEHIND:
                continue
            uses = sum(len(re.findall(rf'\b{name}\b', text)) for text in package.values())
            if uses < 2 and f'common.{name}' not in tools:   # one is its own definition
                unused.append((name, defined[name]))
    assert not unused, f'nothing uses these: {unused}'


def _common_attributes(code):
    """The X of every common.X in Python code."""
    return {node.attr for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == 'common'}


def test_every_common_name_the_course_uses_exists():
    import common
    sys.path.insert(0, str(ROOT / 'tools'))
    import nbpair
    used = {p.relative_to(ROOT).as_posix(): _common_attributes(p.read_text(encoding='utf-8'))
            for pattern in ('tests/*.py', 'tools/*.py') for p in ROOT.glob(pattern)}
    for src in nbpair.sources():   # code cells, and prose and solutions: `common.X`
        used[src.name] = common_names(src.read_text(encoding='utf-8')) - {'py'}
    used['course'] = common_names((ROOT / 'course').read_text(encoding='utf-8')) - {'py'}
    missing = sorted((where, name) for where, names in used.items() for name in names
                     if not hasattr(common, name))
    assert not missing, f'(file, common.X that does not exist): {missing}'


def test_nothing_patches_or_assigns_common():
    # After the split a patch of common.X would not reach the module that uses X.
    pattern = re.compile(r'setattr\(common\b|^\s*common\.\w+(\.\w+)*\s*=(?!=)', re.M)
    offenders = [p.relative_to(ROOT).as_posix()
                 for pattern_glob in ('notebooks/src/*.txt', 'tests/*.py', 'tools/*.py')
                 for p in ROOT.glob(pattern_glob) if pattern.search(p.read_text(encoding='utf-8'))]
    assert not offenders, f'patch the defining module (comp_perf.<module>), not common: {offenders}'


# "Used in: 05", "Used by resnet18() (06)": claims about where a name is used, which drift.
HAND_KEPT_USES = re.compile(r'\bUsed (in|by)\b')


def test_modules_are_small_and_say_what_they_serve():
    for path in sorted(PACKAGE.glob('*.py')):
        text = path.read_text(encoding='utf-8')
        doc = ast.get_docstring(ast.parse(text)) or ''
        assert len(doc) > 40, f'{path.name}: a docstring that says what the module serves'
        assert len(text.splitlines()) <= LARGEST_MODULE, f'{path.name} has grown past {LARGEST_MODULE} lines'


def test_tools_are_small():
    for path in sorted((ROOT / 'tools').glob('*.py')):
        assert len(path.read_text(encoding='utf-8').splitlines()) <= LARGEST_MODULE, \
            f'tools/{path.name} has grown past {LARGEST_MODULE} lines: split it along its jobs'


def test_no_hand_kept_note_says_where_a_name_is_used():
    files = [*PACKAGE.glob('*.py'), *(ROOT / 'tools').glob('*.py'), ROOT / 'course']
    offenders = [f'{path.relative_to(ROOT)}:{n}' for path in files
                 for n, line in enumerate(path.read_text(encoding='utf-8').splitlines(), 1)
                 if HAND_KEPT_USES.search(line)]
    assert not offenders, f'the map and the tests say where a name is used, not hand-kept notes: {offenders}'


@pytest.mark.parametrize('planted, complaint', [
    ('from comp_perf.machine import settings\n', 'settings'),          # in the wrong group
    ('from comp_perf.s05_data_parallel import sgd\n', 'sgd'),           # twice
])
def test_the_map_checks_fail_on_a_planted_mistake(planted, complaint):
    # The 01 group gains a name that belongs to 00 (settings) or that 05 already lists (sgd).
    text = MAP.read_text(encoding='utf-8')
    header = next(line for line in text.splitlines() if line.startswith('# 01 '))
    broken = text.replace(header + '\n', header + '\n' + planted)
    groups = read_map(broken)
    first = first_users()
    names = [name for _, entries in groups for _, name in entries]
    misplaced = [name for group, entries in groups for _, name in entries
                 if first.get(name, BEHIND) != group]
    assert complaint in misplaced and names.count(complaint) == 2
