"""Checks on this test process's children: that a launcher leaves nothing behind."""
import time

import psutil


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children():
    """This process's descendants, except multiprocessing's resource tracker and fork server.

    Both live on by design: the fork server that launch() forks its workers from is started
    once and ends with this process."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            line = ' '.join(child.cmdline())
            if 'resource_tracker' not in line and 'multiprocessing.forkserver' not in line:
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_until(condition, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()
