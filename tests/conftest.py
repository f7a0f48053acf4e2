"""Print how long each notebook took under nbval, for instructors' timing tables."""
from collections import defaultdict

_durations = defaultdict(float)


def pytest_runtest_logreport(report):
    path = report.nodeid.split('::')[0]
    if path.endswith('.ipynb'):
        _durations[path] += report.duration


def pytest_terminal_summary(terminalreporter):
    if _durations:
        terminalreporter.write_sep('-', 'seconds per notebook')
        for path, seconds in sorted(_durations.items()):
            terminalreporter.write_line(f'{seconds:7.1f}  {path}')
