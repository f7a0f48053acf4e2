"""Section 07, what the synchronous and the asynchronous parameter servers share: the keys
of their run dicts, the point-to-point messages that name a lost peer (PSFault), the
faults an experiment plants, the checkpoints, and the test of the trained LeNet.
"""
import datetime
import os
import re
import signal
import time
from pathlib import Path

import torch
import torch.distributed as dist

from comp_perf.fashion_mnist import fashion_mnist_datasets
from comp_perf.processes import run_keys
from comp_perf.s05_data_parallel import accuracy, lenet

# The keys of each server's `run` dict: (required, optional).
PS_RUN_KEYS = {
    'ps_process': (('servers', 'steps', 'batch_size', 'lr'),
                   ('seed', 'subset', 'piece', 'test_subset', 'timeout', 'fault', 'checkpoint')),
    'ps_async_process': (('servers', 'steps', 'batch_size', 'lr'),
                         ('seed', 'subset', 'piece', 'test_subset', 'timeout', 'fault', 'staleness', 'slow')),
}
_FAULT_KEYS = (('role', 'index', 'step'), ('kind', 'stamp'))
_CHECKPOINT_KEYS = (('dir', 'every'), ('resume',))


class PSFault(ConnectionError):
    """A parameter-server process lost a peer: the message says which one."""


class _PSLink:
    """Turn a failed send/receive into a PSFault that names the process at the other end."""

    def __init__(self, what):
        self.what = what

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if isinstance(error, RuntimeError):
            reason = re.sub(r'^\[[^\]]*\]\s*', '', str(error).strip().splitlines()[0])
            reason = reason.split(' This is typically')[0][:160]
            raise PSFault(f'{self.what}: that process died or stopped answering ({reason})') from None
        return False


# Point-to-point messages, each item (tensor, peer, tag); `what` says what the process
# was doing, so that a lost peer raises a PSFault naming it. timeout=None waits as long
# as the process group allows (launch's op_timeout).

def ps_start_sends(items, what):
    """Start sending every item; returns the requests, for ps_wait."""
    with _PSLink(what):
        return [dist.isend(tensor, peer, tag=tag) for tensor, peer, tag in items]


def ps_wait(requests, what, timeout=None):
    """Wait for every request, at most `timeout` seconds each."""
    with _PSLink(what):
        for request in requests:
            if timeout is None:
                request.wait()
            else:
                request.wait(datetime.timedelta(seconds=timeout))


def ps_send(items, what, timeout=None):
    """Send every item and wait until each is sent."""
    ps_wait(ps_start_sends(items, what), what, timeout)


def ps_receive(items, what, timeout=None):
    """Receive into every item's tensor; a peer of None takes the first sender."""
    with _PSLink(what):
        requests = [dist.irecv(tensor, peer, tag=tag) for tensor, peer, tag in items]
    ps_wait(requests, what, timeout)


def inject_fault(run, role, index, step):
    """The fault a test or an experiment asked for (run['fault']): this process dies or goes silent here."""
    fault = run.get('fault')
    if fault and (fault['role'], fault['index'], fault['step']) == (role, index, step):
        if fault.get('stamp'):
            Path(fault['stamp']).write_text(repr(time.time()))
        if fault.get('kind', 'kill') == 'kill':
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # 'hang': alive but silent


def ps_servers(world_size, run, name):
    """The number of servers, after checking the backend, the roles and the fault and checkpoint dicts."""
    if run.get('fault') is not None:
        run_keys(run['fault'], *_FAULT_KEYS, who=f"{name}'s fault")
    if run.get('checkpoint') is not None:
        run_keys(run['checkpoint'], *_CHECKPOINT_KEYS, who=f"{name}'s checkpoint")
    if dist.get_backend() != 'gloo':
        raise ValueError(f"{name} runs on CPU processes; launch it with backend='gloo', "
                         f'not {dist.get_backend()!r}.')
    servers = run['servers']
    if not 1 <= servers < world_size:
        raise ValueError(f'need 1 <= servers < processes; got {servers} servers of {world_size}.')
    return servers


def _checkpoint_files(run, s):
    ckpt = run.get('checkpoint')
    return sorted(Path(ckpt['dir']).glob(f'server{s}-step*.pt'),
                  key=lambda f: int(f.stem.split('step')[1])) if ckpt else []


def resume_step(rank, servers, run):
    """The step to start from: the newest one that every server has saved (0: from scratch)."""
    ckpt = run.get('checkpoint') or {}
    latest = 0
    if ckpt.get('resume') and rank < servers:
        files = _checkpoint_files(run, rank)
        latest = int(files[-1].stem.split('step')[1]) if files else 0
    t = torch.tensor([latest if rank < servers else 2 ** 62], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)  # the workers' huge number never wins
    return int(t)


def save_checkpoint(run, s, step, store):
    """Server s saves its keys after `step` if run['checkpoint'] asks for it, keeping the last two."""
    ckpt = run.get('checkpoint')
    if not ckpt or step % ckpt['every']:
        return
    folder = Path(ckpt['dir'])
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f'server{s}.tmp'
    torch.save({k: store.pull(k) for k in store.keys()}, tmp)
    tmp.replace(folder / f'server{s}-step{step}.pt')  # atomic: never a half-written checkpoint
    for old in _checkpoint_files(run, s)[:-2]:
        old.unlink()


def ps_test(params, n):
    """Accuracy and loss of LeNet with `params` on the first n test images."""
    X, y = fashion_mnist_datasets(download=False)[1].tensors
    with torch.no_grad():
        logits = lenet(X[:n], params)
    return {'test_accuracy': accuracy(logits, y[:n]) / n,
            'test_loss': float(torch.nn.functional.cross_entropy(logits, y[:n]))}
