"""common.py is the students' map: each name in the group of the first section page that calls it.

The map is computed here from the section pages, not kept by hand: a name moved, added
or no longer called makes one of these tests fail with what to change. What no page
calls is not in the map: its users (other modules, tools, tests, the set-up, the
instructor's guide) import it from its module, and a test here checks that one does.
"""
import ast
import re
import nbpair
import pytest
from helpers import ROOT
from notebook_code import section_of

PACKAGE = ROOT / 'comp_perf'
MAP = ROOT / 'common.py'
# A group's header, one short line of one shape: '# 04 Hardware — cache steps, compiled C, GPU datasheets'.
HEADER = re.compile(r'# (\d\d) (\S.*?) — \S')
HEADER_LENGTH = 100          # characters: a line of contents, not a paragraph
LARGEST_MODULE = 500         # lines, of a module of the package or a tool


def section_sources():
    """{section: source text} of the section pages, '00' … '09' (the instructor's guide is not one)."""
    return {section_of(src): src.read_text(encoding='utf-8')
            for src in sorted((ROOT / 'notebooks' / 'src').glob('[0-9][0-9]-*.txt'))}


def section_titles():
    """{section: title} from 00's course map: '| 04 | [Hardware](04-hardware.ipynb) | …'."""
    titles = {}
    rows = re.findall(r'^\| (\d\d) \| (?:\*\*(.+?)\*\*|\[(.+?)\])', section_sources()['00'], re.M)
    for number, bold, link in rows:
        titles.setdefault(number, bold or link)   # the English table comes before the Chinese one
    return titles


def common_names(text):
    # common.py is the file, not a name in it
    return set(re.findall(r'\bcommon\.(?!py\b)([A-Za-z]\w*)', text))


def first_users():
    """{name: the first section (in course order) whose page calls common.name}."""
    first = {}
    for section, text in section_sources().items():   # '00' < … < '09'
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
    """[(section, [(module, name), ...])] in the order of common.py, one group per header line."""
    text = MAP.read_text(encoding='utf-8') if text is None else text
    imports = {node.lineno: node for node in ast.parse(text).body if isinstance(node, ast.ImportFrom)}
    groups = []
    for lineno, line in enumerate(text.splitlines(), 1):
        header = HEADER.match(line)
        if header:
            groups.append((header.group(1), []))
        if lineno in imports:
            node = imports[lineno]
            assert groups, f'common.py:{lineno}: an import before the first group header'
            groups[-1][1].extend((node.module.split('.')[-1], alias.name) for alias in node.names)
    return groups


def misplaced(groups, first):
    """(name, its group, the section of its first caller) for each name not in the group the pages give it.

    None on the left: a page calls it, the map lacks it; None on the right: the map lists it, no page calls it.
    """
    listed = [(name, group) for group, entries in groups for _, name in entries]
    wrong = [(name, group, first.get(name)) for name, group in listed if first.get(name) != group]
    names = {name for name, _ in listed}
    return wrong + [(name, None, section) for name, section in first.items() if name not in names]


def doubled(names):
    """The names that occur more than once."""
    return sorted({name for name in names if names.count(name) > 1})


def set_up_programs():
    """The Python that the set-up script `course` runs: its -c '…' programs and <<'PY' here-documents."""
    text = (ROOT / 'course').read_text(encoding='utf-8')
    return re.findall(r"-c '([^']*)'", text) + re.findall(r"<<'PY'\n(.*?)\nPY\n", text, re.S)


def code_trees():
    """[(module, tree)] for all the Python that may use the package; module names a package file, else None.

    The package, tools/, tests/, the set-up's programs and every notebook's code cells (the guide's included).
    """
    trees = [(path.stem if path.parent == PACKAGE else None, ast.parse(path.read_text(encoding='utf-8')))
             for folder in (PACKAGE, ROOT / 'tools', ROOT / 'tests') for path in sorted(folder.glob('*.py'))]
    trees += [(None, ast.parse(code)) for code in set_up_programs()]
    trees += [(None, ast.parse(code)) for src in nbpair.sources() for code in nbpair.python_code(src).values()]
    return trees


def references(tree, module=None):
    """{(module, name)} of the package that a tree refers to.

    Counted: an import (from comp_perf.M import name), an attribute of an imported module (M.name,
    comp_perf.M.name) and, in the defining module itself, a read of the name. A docstring or comment
    that mentions a name is not a use, nor is a same-named variable elsewhere.
    """
    modules, found = {}, set()   # modules: {local name: package module it stands for}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == 'comp_perf':
            modules.update({alias.asname or alias.name: alias.name for alias in node.names})
        elif isinstance(node, ast.ImportFrom) and (node.module or '').startswith('comp_perf.'):
            found |= {(node.module.split('.')[1], alias.name) for alias in node.names}
        elif isinstance(node, ast.Import):
            modules.update({alias.asname: alias.name.split('.')[1] for alias in node.names
                            if alias.asname and alias.name.startswith('comp_perf.')})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if isinstance(owner, ast.Name) and owner.id in modules:
                found.add((modules[owner.id], node.attr))
            elif isinstance(owner, ast.Attribute) and isinstance(owner.value, ast.Name) \
                    and owner.value.id == 'comp_perf':
                found.add((owner.attr, node.attr))
        elif module and isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            found.add((module, node.id))
    return found


def unused(defined, listed, trees):
    """(name, module) of each public name that the map does not list and no code refers to."""
    used = set().union(*(references(tree, module) for module, tree in trees))
    return sorted((name, module) for name, module in defined.items()
                  if name not in listed and (module, name) not in used)


def test_the_map_defines_nothing_and_imports_only_from_the_package():
    tree = ast.parse(MAP.read_text(encoding='utf-8'))
    assert ast.get_docstring(tree), 'common.py starts with a docstring that says how to read it'
    for node in tree.body[1:]:
        assert isinstance(node, ast.ImportFrom) and node.module.startswith('comp_perf.') and node.level == 0, \
            f'common.py:{node.lineno}: the map holds only "from comp_perf.<module> import ..." lines'
        assert all(alias.asname is None for alias in node.names), f'common.py:{node.lineno}: no renaming'


def test_every_section_has_a_group_in_course_order_under_a_one_line_header():
    comments = [line for line in MAP.read_text(encoding='utf-8').splitlines() if line.startswith('#')]
    odd = [line for line in comments if not HEADER.match(line) or len(line) > HEADER_LENGTH]
    assert not odd, f'a group has one header line (at most {HEADER_LENGTH} characters), ' \
        f'"# NN Title — what it brings", and no other comment: {odd}'
    titles = section_titles()
    headers = [HEADER.match(line).group(1, 2) for line in comments]
    expected = [(section, titles.get(section)) for section in section_sources()]
    assert headers == expected, f'one group per section, in course order, titled as in 00\'s course map: {expected}'


def test_every_name_in_the_map_is_listed_once_from_where_it_is_defined():
    defined = definitions()
    listed = [(module, name) for _, entries in read_map() for module, name in entries]
    assert doubled([name for _, name in listed]) == []
    wrong = [(name, module, defined.get(name)) for module, name in listed if defined.get(name) != module]
    assert not wrong, f'(name, imported from, defined in): {wrong}'


def test_each_name_sits_in_the_group_of_the_first_section_page_that_calls_it():
    wrong = misplaced(read_map(), first_users())
    assert not wrong, f'(name, its group, the section of its first caller; None where there is none): {wrong}'


def test_a_section_module_serves_no_earlier_section():
    first = first_users()
    early = [(name, module, first[name]) for name, module in definitions().items()
             if re.match(r's\d\d_', module) and name in first and first[name] < module[1:3]]
    assert not early, f'(name, module, used first by): move these to a shared module: {early}'


def test_a_section_page_reaches_the_course_only_through_common():
    # The map is the students' namespace: a page that imported a module would bypass it.
    offenders = []
    for src in nbpair.sources():
        if section_of(src) == 'guide':
            continue
        for name, code in nbpair.python_code(src).items():
            for node in ast.walk(ast.parse(code)):
                modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ''] if isinstance(node, ast.ImportFrom) else []
                offenders += [(name, module) for module in modules if module.split('.')[0] == 'comp_perf']
    assert not offenders, f'(code of, import): call these through common instead: {offenders}'


def test_every_public_name_is_called_by_a_page_or_used_by_other_code():
    # "Other code": the package, tools, tests, the set-up, the guide; what none of them refers to is dead.
    # Tests count: a hook such as fashion_mnist.clear_cache exists for them.
    listed = {name for _, entries in read_map() for _, name in entries}
    dead = unused(definitions(), listed, code_trees())
    assert not dead, f'(name, module): nothing uses these; remove them: {dead}'


def _common_attributes(code):
    """The X of every common.X in Python code."""
    return {node.attr for node in ast.walk(ast.parse(code)) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name) and node.value.id == 'common'}


def test_every_common_name_the_course_uses_exists():
    import common
    used = {p.relative_to(ROOT).as_posix(): _common_attributes(p.read_text(encoding='utf-8'))
            for pattern in ('tests/*.py', 'tools/*.py') for p in ROOT.glob(pattern)}
    for src in nbpair.sources():   # code cells, and prose and solutions: `common.X`
        used[src.name] = common_names(src.read_text(encoding='utf-8'))
    used['course'] = common_names((ROOT / 'course').read_text(encoding='utf-8'))
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


@pytest.mark.parametrize('planted, removed, wrong, twice', [
    # 01 gains a name that belongs to 00, one that 05 already lists, one that no page calls;
    # or the map loses a name that 03's page calls.
    ('from comp_perf.machine import settings\n', '', [('settings', '01', '00')], ['settings']),
    ('from comp_perf.s05_data_parallel import sgd\n', '', [('sgd', '01', '05')], ['sgd']),
    ('from comp_perf.fashion_mnist import clear_cache\n', '', [('clear_cache', '01', None)], []),
    ('', 'from comp_perf.pictures import plot_dependency_graph\n', [('plot_dependency_graph', None, '03')], []),
])
def test_the_map_checks_fail_on_a_planted_mistake(planted, removed, wrong, twice):
    text = MAP.read_text(encoding='utf-8')
    header = next(line for line in text.splitlines() if line.startswith('# 01 '))
    broken = text.replace(header + '\n', header + '\n' + planted)
    if removed:
        assert removed in broken
        broken = broken.replace(removed, '')
    groups = read_map(broken)
    assert misplaced(groups, first_users()) == wrong
    assert doubled([name for _, entries in groups for _, name in entries]) == twice


def test_the_unused_check_fails_on_a_planted_helper():
    # A module 'planted' defines planted_helper, and only a docstring names it: a text match counted
    # that as a use. A same-named variable elsewhere is no use either; a call or an import is.
    defined = {**definitions(), 'planted_helper': 'planted'}
    listed = {name for _, entries in read_map() for _, name in entries}
    trees = code_trees()
    module = 'def planted_helper():\n    return 1\n\n\ndef caller():\n    """Like planted_helper()."""\n'
    elsewhere = 'planted_helper = 2\nprint(planted_helper)\n'
    planted = trees + [('planted', ast.parse(module)), (None, ast.parse(elsewhere))]
    assert unused(defined, listed, planted) == [('planted_helper', 'planted')]
    called = module.replace('"""Like planted_helper()."""', 'return planted_helper()')
    assert unused(defined, listed, trees + [('planted', ast.parse(called))]) == []
    imported = 'from comp_perf.planted import planted_helper\nplanted_helper()\n'
    assert unused(defined, listed, planted + [(None, ast.parse(imported))]) == []
    attribute = 'from comp_perf import planted as p\np.planted_helper()\n'
    assert unused(defined, listed, planted + [(None, ast.parse(attribute))]) == []


MAINTAINING = ROOT / 'MAINTAINING.md'
TREE_ITEM = re.compile(r'^[│ ]*[├└]── (\S+)')


def layout_trees(text):
    """[{folder: {name, ...}}] of each ```text layout block of MAINTAINING.md (one per language)."""
    trees = []
    for block in re.findall(r'^### (?:Layout|目录结构)\n+```text\n(.*?)^```', text, re.M | re.S):
        tree, folder = {}, None
        for line in block.splitlines():
            item = TREE_ITEM.match(line)
            if item and folder:
                tree[folder].add(item.group(1).rstrip('/'))
            elif not line.startswith((' ', '│')):
                name = line.split()[0] if line.split() else ''
                folder = name.rstrip('/') if name.endswith('/') else None
                if folder:
                    tree[folder] = set()
        trees.append(tree)
    return trees


def files_in(folder):
    """What a layout tree should list of a folder: its files and folders, but tests' test_*.py as one line."""
    names = {p.name for p in (ROOT / folder).iterdir()
             if not p.name.startswith(('.', '__')) and p.suffix not in ('.pyc',)}
    if folder == 'tests':
        names = {n for n in names if not n.startswith('test_')} | {'test_*.py'}
    return names


LAID_OUT = ('comp_perf', 'tools', 'tests')


def layout_problems(text, actual):
    """What each language's layout tree in MAINTAINING.md lists wrongly, against {folder: names}."""
    trees = layout_trees(text)
    problems = [] if len(trees) == 2 else [f'{len(trees)} layout blocks, expected one per language']
    for tree in trees:
        for folder in LAID_OUT:
            shown = tree.get(folder, set())
            problems += [f'{folder}/{n} is in the tree, not on disk' for n in sorted(shown - actual[folder])]
            problems += [f'{folder}/{n} is on disk, not in the tree' for n in sorted(actual[folder] - shown)]
    return problems


def test_maintainings_layout_shows_every_module_and_tool_in_both_languages():
    actual = {folder: files_in(folder) for folder in LAID_OUT}
    assert not layout_problems(MAINTAINING.read_text(encoding='utf-8'), actual)


def test_the_layout_check_fails_on_a_planted_missing_module():
    actual = {folder: files_in(folder) for folder in LAID_OUT}
    text = MAINTAINING.read_text(encoding='utf-8')
    planted = dict(actual, comp_perf=actual['comp_perf'] | {'s11_triton_kernels.py'})
    assert layout_problems(text, planted) == ['comp_perf/s11_triton_kernels.py is on disk, not in the tree'] * 2
    removed = text.replace('├── s07_ring.py', '├── s07_rings.py', 1)
    assert layout_problems(removed, actual) == ['comp_perf/s07_rings.py is in the tree, not on disk',
                                                'comp_perf/s07_ring.py is on disk, not in the tree']
