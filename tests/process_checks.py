"""Checks on this test process's children: that a launcher leaves nothing behind."""
import time

import psutil


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def children():
    """This process's descendants, except multiprocessing's resource tracker (it lives on by design)."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if 'resource_tracker' not in ' '.join(child.cmdline()):
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
