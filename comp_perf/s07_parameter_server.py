"""Section 07, parameter servers: a key-value store with push and pull, and a sharded
parameter server on real processes, synchronous (ps_process: ps_server and ps_worker)
and asynchronous with bounded staleness (ps_async_process), with the faults,
timeouts and checkpoints the section's experiments use.
"""
import datetime
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from comp_perf.fashion_mnist import fashion_mnist_datasets
from comp_perf.s05_data_parallel import (
    LENET_SHAPES,
    accuracy,
    batch_indices,
    lenet,
    lenet_params,
)


class KVStore:
    """A key-value store with update semantics, in one process.

    push(key, values) sums the values (the gradients of several devices or
    workers) and, if an updater is set, hands the sum to it together with the
    stored value, which it changes in place (the optimiser step); without one
    the sum replaces the stored value. pull(key) returns a copy.
    """

    def __init__(self, updater=None):
        self.updater, self._data = updater, {}

    def init(self, key, value):
        if key in self._data:
            raise KeyError(f'key {key!r} is already initialised.')
        self._data[key] = value.detach().clone()

    def _stored(self, key):
        if key not in self._data:
            raise KeyError(f'key {key!r} was never initialised; call init({key!r}, value) first.')
        return self._data[key]

    def push(self, key, values):
        stored = self._stored(key)
        values = list(values) if isinstance(values, (list, tuple)) else [values]
        for v in values:
            if v.shape != stored.shape:
                raise ValueError(f'key {key!r} holds shape {tuple(stored.shape)}; a value of '
                                 f'shape {tuple(v.shape)} was pushed.')
        total = values[0].detach().to(stored.device, copy=True)
        for v in values[1:]:
            total += v.detach().to(stored.device)
        if self.updater is None:
            stored.copy_(total)
        else:
            self.updater(key, total, stored)

    def pull(self, key):
        return self._stored(key).clone()

    def keys(self):
        return list(self._data)


def shard_keys(shapes, servers, piece=None):
    """Assign parameter tensors, or pieces of them, to `servers` so the elements balance.

    With piece=None each tensor is one key; with piece=k tensors are cut into
    ranges of at most k elements first. Keys go largest first to the least
    loaded server. Returns a list of dicts: key, param, start, stop, server.
    """
    if servers < 1 or (piece is not None and piece < 1):
        raise ValueError('need servers >= 1 and piece >= 1 (or None).')
    pieces = []
    for i, shape in enumerate(shapes):
        numel = int(np.prod(shape))
        step = piece or numel
        for j, start in enumerate(range(0, numel, step)):
            pieces.append({'key': f'{i}.{j}', 'param': i, 'start': start,
                           'stop': min(start + step, numel)})
    load = [0] * servers
    for p in sorted(pieces, key=lambda p: p['start'] - p['stop']):
        p['server'] = load.index(min(load))
        load[p['server']] += p['stop'] - p['start']
    return pieces


class PSFault(ConnectionError):
    """A parameter-server process lost a peer: the message says which one."""


class _ps_link:
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

def _start_sends(items, what):
    with _ps_link(what):
        return [dist.isend(tensor, peer, tag=tag) for tensor, peer, tag in items]


def _wait(requests, what, timeout=None):
    with _ps_link(what):
        for request in requests:
            if timeout is None:
                request.wait()
            else:
                request.wait(datetime.timedelta(seconds=timeout))


def _send(items, what, timeout=None):
    _wait(_start_sends(items, what), what, timeout)


def _receive(items, what, timeout=None):
    with _ps_link(what):
        requests = [dist.irecv(tensor, peer, tag=tag) for tensor, peer, tag in items]
    _wait(requests, what, timeout)


def _ps_fault(run, role, index, step):
    # The fault a test or an experiment asked for: this process dies or goes silent here.
    fault = run.get('fault')
    if fault and (fault['role'], fault['index'], fault['step']) == (role, index, step):
        if fault.get('stamp'):
            Path(fault['stamp']).write_text(repr(time.time()))
        if fault.get('kind', 'kill') == 'kill':
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # 'hang': alive but silent


def ps_process(rank, world_size, run):
    """Worker for launch(): LeNet trained through a sharded parameter server.

    Ranks 0 … servers-1 are servers (ps_server), the rest workers (ps_worker).
    `run` holds servers, steps, batch_size (global), lr, and optionally seed,
    subset, piece (see shard_keys), test_subset, timeout (seconds a server
    waits for a push; workers wait twice as long for a pull, so that the
    server, which knows who is missing, reports a silent worker first), fault
    (role, index, step, kind 'kill' or 'hang', stamp file) and checkpoint
    (dir, every, resume). It runs on CPU processes: launch it over gloo (the default).
    """
    servers = _ps_check(world_size, run, 'ps_process')
    plan = shard_keys(LENET_SHAPES, servers, run.get('piece'))
    workers = list(range(servers, world_size))
    worker_group = dist.new_group(workers)  # every rank must take part in creating it
    start = resume_step(rank, servers, run)
    if rank < servers:
        return ps_server(rank, run, plan, workers, start)
    return ps_worker(rank - servers, run, plan, workers, start, worker_group)


def _ps_check(world_size, run, name):
    """The number of servers, after checking the backend and the roles."""
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


def ps_server(s, run, plan, workers, start):
    """Server s: holds its keys in a KVStore, sums each key's pushes and applies the SGD step."""
    lr, batch_size, timeout = run['lr'], run['batch_size'], run.get('timeout')
    mine = [p for p in plan if p['server'] == s]

    def sgd_update(key, grad_sum, weight):  # the optimiser runs on the server
        weight -= lr * grad_sum / batch_size

    store = KVStore(updater=sgd_update)
    init = lenet_params(run.get('seed', 0))
    saved = torch.load(Path(run['checkpoint']['dir']) / f'server{s}-step{start}.pt') if start else {}
    for p in mine:
        store.init(p['key'], saved[p['key']] if start else
                   init[p['param']].reshape(-1)[p['start']:p['stop']])

    def send_to_workers(step, wait=timeout):
        values = {p['key']: store.pull(p['key']) for p in mine}  # alive until sent
        _send([(values[p['key']], r, plan.index(p)) for p in mine for r in workers],
              f'server {s} (rank {s}) sending the parameters for step {step} to the workers', wait)

    send_to_workers(start, None)  # the first pull, as long as the workers take to load their data
    pushes, pushed_bytes, events, t0 = 0, 0, [], time.perf_counter()
    for step in range(start, run['steps']):
        _ps_fault(run, 'server', s, step)  # a fault an experiment asked for: die or go silent
        for p in mine:
            grads = [torch.empty(p['stop'] - p['start']) for _ in workers]
            for w, (r, g) in enumerate(zip(workers, grads)):
                _receive([(g, r, plan.index(p))], f'server {s} (rank {s}) waiting for the push of key '
                         f'{p["key"]} from worker {w} (rank {r}) at step {step}', timeout)
            store.push(p['key'], grads)
            pushes, pushed_bytes = pushes + len(grads), pushed_bytes + sum(g.nbytes for g in grads)
        all_in = time.perf_counter()
        send_to_workers(step + 1)
        events.append((all_in, time.perf_counter()))   # for the picture: every push in, the pull sent
        save_checkpoint(run, s, step + 1, store)
    return {'role': 'server', 'index': s, 'keys': [p['key'] for p in mine],
            'elements': sum(p['stop'] - p['start'] for p in mine), 'pushes': pushes,
            'pushed_bytes': pushed_bytes, 'events': events, 'seconds': time.perf_counter() - t0}


def ps_worker(w, run, plan, workers, start, worker_group):
    """Worker w: computes the gradient of its slice of each minibatch, pushes it, pulls the new weights."""
    rank, servers, timeout = workers[w], run['servers'], run.get('timeout')
    batch_size, lr, seed = run['batch_size'], run['lr'], run.get('seed', 0)
    X_all, y_all = fashion_mnist_datasets(subset=run.get('subset'), download=False)[0].tensors
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(seed))
    params = [torch.zeros(shape, requires_grad=True) for shape in LENET_SHAPES]
    patience = timeout and 2 * timeout  # a pull may wait for a slow peer
    pulled_bytes, events = [0] * servers, []  # per server; (pushed, pulled) times per step

    def pull(step):
        bufs = [torch.empty(p['stop'] - p['start']) for p in plan]
        _receive([(b, p['server'], i) for i, (p, b) in enumerate(zip(plan, bufs))],
                 f'worker {w} (rank {rank}) pulling the parameters for step {step} '
                 f'from the servers (ranks 0-{servers - 1})', patience)
        with torch.no_grad():
            for p, b in zip(plan, bufs):
                params[p['param']].view(-1)[p['start']:p['stop']] = b
                pulled_bytes[p['server']] += b.nbytes

    pull(start)
    losses, step_diff, t0 = [], None, time.perf_counter()
    for step in range(start, run['steps']):
        _ps_fault(run, 'worker', w, step)  # a fault an experiment asked for: die or go silent
        mine = batch_indices(order, step, batch_size, w, len(workers))
        loss = torch.nn.functional.cross_entropy(lenet(X_all[mine], params), y_all[mine],
                                                 reduction='sum')
        loss.backward()
        losses.append(loss.item() / len(mine))
        what, pushed = f'worker {w} (rank {rank}) pushing the gradients of step {step}', time.perf_counter()
        pushing = _start_sends([(params[p['param']].grad.reshape(-1)[p['start']:p['stop']].clone(),
                                 p['server'], i) for i, p in enumerate(plan)], what)
        if step == start:  # the same step done with all-reduce, for comparison
            by_allreduce = _allreduce_step(params, lr, batch_size, worker_group)
        pull(step + 1)
        events.append((pushed, time.perf_counter()))
        _wait(pushing, what, timeout)
        if step == start:
            step_diff = max(float((q.detach() - a).abs().max()) for q, a in zip(params, by_allreduce))
        for q in params:
            q.grad = None
    seconds = time.perf_counter() - t0
    out = {'role': 'worker', 'index': w, 'losses': losses, 'allreduce_diff': step_diff,
           'images_per_s': (run['steps'] - start) * batch_size / seconds, 'started': t0, 'events': events,
           'pulled_bytes': pulled_bytes,
           'params': [q.detach().clone() for q in params] if w == 0 else None}
    if w == 0 and run.get('test_subset'):
        out.update(_ps_test(params, run['test_subset']))
    return out


def _allreduce_step(params, lr, batch_size, worker_group):
    # The SGD step the server will take, computed instead by all-reducing among the workers.
    with torch.no_grad():
        grads = [q.grad.clone() for q in params]
        for g in grads:
            dist.all_reduce(g, group=worker_group)
        return [q - lr * g / batch_size for q, g in zip(params, grads)]


def _ps_test(params, n):
    """Accuracy and loss of LeNet with `params` on the first n test images."""
    X, y = fashion_mnist_datasets(download=False)[1].tensors
    with torch.no_grad():
        logits = lenet(X[:n], params)
    return {'test_accuracy': accuracy(logits, y[:n]) / n,
            'test_loss': float(torch.nn.functional.cross_entropy(logits, y[:n]))}

def ps_async_process(rank, world_size, run):
    """Worker for launch(): LeNet trained by asynchronous SGD with bounded staleness.

    Same roles and `run` as ps_process (servers, steps, batch_size (global),
    lr, seed, subset, piece, test_subset, timeout, fault; no checkpoint), but
    no process waits for all the others. A worker computes the gradient of its
    slice of a minibatch on the parameters it last pulled, pushes it and pulls
    again; a server applies each push the moment it arrives, as that worker's
    share of a synchronous step (w -= lr·g/batch_size), and answers with its
    shard. run['staleness'] = s bounds how far the workers drift apart (stale
    synchronous parallel): a server holds back its answer to a worker that
    has pushed more than s steps beyond the slowest one. s=0 is synchronous
    SGD (the updates of ps_process, added one push at a time); s=None never
    waits. The servers apply steps × workers updates in every mode, handed
    out by server 0 first come, first served, so a fast worker does more of
    them. run['slow'] = {worker: seconds, or a list of seconds cycled over
    the steps} makes that worker sleep in every step: a straggler.
    Workers report per step: loss, staleness (how many steps this worker was
    ahead of the slowest worker whose updates its parameters held; at most s)
    and delay (how many updates of other workers the server applied between
    this worker's pull and its push). Launch it over gloo.
    """
    servers = _ps_check(world_size, run, 'ps_async_process')
    s = run.get('staleness')
    if s is not None and (isinstance(s, bool) or not isinstance(s, int) or s < 0):
        raise ValueError(f'staleness must be a whole number >= 0, or None; got {s!r}.')
    plan = shard_keys(LENET_SHAPES, servers, run.get('piece'))
    shards = [[p for p in plan if p['server'] == k] for k in range(servers)]
    if rank < servers:
        return _ps_async_server(rank, run, shards[rank], world_size - servers)
    return _ps_async_worker(rank - servers, run, shards)


# A push to a server is [its slice of the gradient, worker index]; the answer is
# [its slice of the weights, pushes applied per worker, delay of that push, go].


def _ps_async_server(s, run, mine, workers):
    servers, lr, batch_size = run['servers'], run['lr'], run['batch_size']
    bound = run.get('staleness')
    budget = run['steps'] * workers   # updates in all, however the workers share them
    init = lenet_params(run.get('seed', 0))
    weights = torch.cat([init[p['param']].reshape(-1)[p['start']:p['stop']] for p in mine])
    clock = [0] * workers             # pushes applied, per worker
    pulled_at = [0] * workers         # updates applied when each worker last pulled
    delay = [0] * workers             # updates of others between a worker's pull and its push
    held = set()                      # workers whose answer is held back
    tickets, done = 0, set()          # server 0: steps handed out, workers told to stop

    def answer(w):
        nonlocal tickets
        go = s == 0 and tickets < budget  # server 0 says whether w computes another step
        tickets += go
        if s == 0 and not go:
            done.add(w)
        pulled_at[w] = sum(clock)
        message = torch.cat([weights, torch.tensor(clock + [delay[w], go], dtype=torch.float)])
        _send([(message, servers + w, 0)], f'server {s} (rank {s}) answering worker {w} (rank {servers + w})',
              run.get('timeout'))

    for w in range(workers):          # the first pull
        answer(w)
    push, t0 = torch.empty(len(weights) + 1), time.perf_counter()
    while sum(clock) < budget:
        _ps_fault(run, 'server', s, sum(clock) // workers)
        busy = ', '.join(f'worker {v} (rank {servers + v})' for v in range(workers)
                         if v not in held | done)
        what = (f'server {s} (rank {s}) waiting for a push from {busy} '
                f'(pushes so far, per worker: {clock})')
        # From any worker, whichever pushes first. (Gloo cannot poll one receive
        # per worker: is_completed() stays False until wait() is called.)
        _receive([(push, None, 0)], what, run.get('timeout'))
        w = int(push[-1])
        delay[w] = sum(clock) - pulled_at[w]
        weights -= lr * push[:-1] / batch_size   # applied at once: no barrier
        clock[w] += 1
        held.add(w)
        # Answer every held worker that is at most `bound` steps ahead of the
        # slowest, and everyone once the last update is in.
        for v in sorted(held):
            if bound is None or clock[v] - min(clock) <= bound or sum(clock) == budget:
                held.remove(v)
                answer(v)
    seconds = time.perf_counter() - t0
    for w in range(workers):          # the final pull: every update applied
        answer(w)
    return {'role': 'server', 'index': s, 'pushes': sum(clock), 'pushes_per_worker': clock,
            'seconds': seconds}


def _ps_async_worker(w, run, shards):
    servers = len(shards)
    rank, batch_size, seed = servers + w, run['batch_size'], run.get('seed', 0)
    workers = dist.get_world_size() - servers
    X_all, y_all = fashion_mnist_datasets(subset=run.get('subset'), download=False)[0].tensors
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(seed))
    params = [torch.zeros(shape, requires_grad=True) for shape in LENET_SHAPES]
    sizes = [[p['stop'] - p['start'] for p in shard] for shard in shards]
    pause = (run.get('slow') or {}).get(w, 0)
    patience = run.get('timeout') and 2 * run['timeout']  # a held pull waits for a slow peer

    def pull():
        bufs = [torch.empty(sum(n) + workers + 2) for n in sizes]
        _receive([(b, k, 0) for k, b in enumerate(bufs)],
                 f'worker {w} (rank {rank}) pulling from the servers (ranks 0-{servers - 1})', patience)
        with torch.no_grad():
            for shard, n, b in zip(shards, sizes, bufs):
                for p, value in zip(shard, b[:sum(n)].split(n)):
                    params[p['param']].view(-1)[p['start']:p['stop']] = value
        clocks = [b[-workers - 2:-2].long() for b in bufs]
        return {'staleness': max(int(c[w] - c.min()) for c in clocks),
                'updates': int(clocks[0].sum()),          # in the parameters just pulled
                'delay': max(int(b[-2]) for b in bufs),   # of the push just applied
                'go': bool(bufs[0][-1])}

    got = pull()
    losses, staleness, updates, delays, times = [], [], [], [], []
    step, images, t0 = 0, 0, time.perf_counter()
    while got['go']:
        _ps_fault(run, 'worker', w, step)
        staleness.append(got['staleness'])
        updates.append(got['updates'])
        time.sleep(pause[step % len(pause)] if isinstance(pause, (list, tuple)) else pause)
        mine = batch_indices(order, step, batch_size, w, workers)
        loss = torch.nn.functional.cross_entropy(lenet(X_all[mine], params), y_all[mine],
                                                 reduction='sum')
        loss.backward()
        losses.append(loss.item() / len(mine))
        images += len(mine)
        messages = [torch.cat([params[p['param']].grad.reshape(-1)[p['start']:p['stop']]
                               for p in shard] + [torch.tensor([float(w)])])
                    for shard in shards]  # alive until sent
        what = f'worker {w} (rank {rank}) pushing the gradient of its step {step}'
        pushing = _start_sends([(m, k, 0) for k, m in enumerate(messages)], what)
        got = pull()
        _wait(pushing, what, run.get('timeout'))
        delays.append(got['delay'])
        times.append(time.perf_counter() - t0)
        for q in params:
            q.grad = None
        step += 1
    seconds = time.perf_counter() - t0
    pull()  # the final parameters, once every update is applied
    out = {'role': 'worker', 'index': w, 'steps': step, 'losses': losses,
           'staleness': staleness, 'updates': updates, 'delay': delays, 'times': times,
           'max_staleness': max(staleness, default=0),
           'mean_staleness': sum(staleness) / max(1, step),
           'max_delay': max(delays, default=0), 'mean_delay': sum(delays) / max(1, step),
           'images_per_s': images / seconds, 'seconds': seconds,
           'params': [q.detach().clone() for q in params] if w == 0 else None}
    if w == 0 and run.get('test_subset'):
        out.update(_ps_test(params, run['test_subset']))
    return out


def ps_in_turn(rank, world_size, runs):
    """Worker for launch(): several parameter-server runs in one process group, one after another.

    Each run dict goes to ps_async_process if it has a 'staleness' entry, else to
    ps_process; a barrier lines up the starts, so start-up is paid once and the
    runs do not overlap. Returns this rank's results, one per run.
    """
    out = []
    for run in runs:
        dist.barrier()
        out.append((ps_async_process if 'staleness' in run else ps_process)(rank, world_size, run))
    return out
