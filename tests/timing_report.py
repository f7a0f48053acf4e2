"""Print how long each notebook took under nbval, for instructors' timing tables."""
from collections import defaultdict


def pytest_terminal_summary(terminalreporter):
    seconds = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            path = getattr(report, 'nodeid', '').split('::')[0]
            if path.endswith('.ipynb'):
                seconds[path] += getattr(report, 'duration', 0.0)
    if seconds:
        terminalreporter.write_sep('-', 'seconds per notebook (nbval)')
        for path, total in sorted(seconds.items()):
            terminalreporter.write_line(f'{total:7.1f}  {path}')
