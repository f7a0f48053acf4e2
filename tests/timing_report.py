"""Print where a run's time went: seconds per notebook (nbval, for instructors' timing tables),
per test file, per pytest worker and per tier (quick, procs, export, browser, notebooks), set-up
and teardown included."""
from collections import defaultdict

TIERS = ('notebooks', 'browser', 'export', 'procs')   # the first of these marks an item has is its tier


def tier_of(report):
    """The tier of a test report, from the marks tests/conftest.py gives each item; 'quick' if none."""
    keywords = getattr(report, 'keywords', {}) or {}
    return next((tier for tier in TIERS if tier in keywords), 'quick')


def worker_of(report):
    """The xdist worker (gw0, gw1, ...) that ran a report's test; 'main' in a run without workers."""
    gateway = getattr(getattr(report, 'node', None), 'gateway', None)
    return getattr(gateway, 'id', 'main')


def seconds_by(reports, key):
    """{key(report): summed duration} over reports that belong to a test file."""
    seconds = defaultdict(float)
    for report in reports:
        if getattr(report, 'nodeid', ''):
            seconds[key(report)] += getattr(report, 'duration', 0.0) or 0.0
    return seconds


def pytest_terminal_summary(terminalreporter):
    reports = [r for group in terminalreporter.stats.values() for r in group if hasattr(r, 'duration')]
    path = lambda r: r.nodeid.split('::')[0]   # noqa: E731
    notebooks = {p: s for p, s in seconds_by(reports, path).items() if p.endswith('.ipynb')}
    if notebooks:
        terminalreporter.write_sep('-', 'seconds per notebook (nbval)')
        for name, total in sorted(notebooks.items()):
            terminalreporter.write_line(f'{total:7.1f}  {name}')
    files = seconds_by(reports, path)
    if files:
        terminalreporter.write_sep('-', 'seconds per test file, longest first')
        for name, total in sorted(files.items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f'{total:7.1f}  {name}')
        workers = seconds_by(reports, worker_of)
        if len(workers) > 1:   # under xdist: how evenly the files were shared out
            terminalreporter.write_sep('-', 'seconds per pytest worker')
            for worker, total in sorted(workers.items()):
                terminalreporter.write_line(f'{total:7.1f}  {worker}')
        terminalreporter.write_sep('-', 'seconds per tier')
        for tier, total in sorted(seconds_by(reports, tier_of).items(), key=lambda item: -item[1]):
            terminalreporter.write_line(f'{total:7.1f}  {tier}')
