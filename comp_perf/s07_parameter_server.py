"""Section 07, the synchronous parameter server: a key-value store with push and pull, its
keys sharded over the servers, and LeNet trained through servers and workers on real
processes (ps_process: ps_server and ps_worker). The asynchronous server is in
s07_async_ps.py; what both share (messages, faults, checkpoints) in s07_ps_messages.py.
"""
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from comp_perf.fashion_mnist import fashion_mnist_datasets
from comp_perf.processes import run_keys
from comp_perf.s05_data_parallel import LENET_SHAPES, batch_indices, lenet, lenet_params
from comp_perf.s07_ps_messages import (PS_RUN_KEYS, inject_fault, ps_receive, ps_send, ps_servers,
                                       ps_start_sends, ps_test, ps_wait, resume_step, save_checkpoint)


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
    run_keys(run, *PS_RUN_KEYS['ps_process'])
    servers = ps_servers(world_size, run, 'ps_process')
    plan = shard_keys(LENET_SHAPES, servers, run.get('piece'))
    workers = list(range(servers, world_size))
    worker_group = dist.new_group(workers)  # every rank must take part in creating it
    start = resume_step(rank, servers, run)
    if rank < servers:
        return ps_server(rank, run, plan, workers, start)
    return ps_worker(rank - servers, run, plan, workers, start, worker_group)


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
        ps_send([(values[p['key']], r, plan.index(p)) for p in mine for r in workers],
                f'server {s} (rank {s}) sending the parameters for step {step} to the workers', wait)

    send_to_workers(start, None)  # the first pull, as long as the workers take to load their data
    pushes, pushed_bytes, events, t0 = 0, 0, [], time.perf_counter()
    for step in range(start, run['steps']):
        inject_fault(run, 'server', s, step)  # a fault an experiment asked for: die or go silent
        for p in mine:
            grads = [torch.empty(p['stop'] - p['start']) for _ in workers]
            for w, (r, g) in enumerate(zip(workers, grads)):
                ps_receive([(g, r, plan.index(p))], f'server {s} (rank {s}) waiting for the push of key '
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
        ps_receive([(b, p['server'], i) for i, (p, b) in enumerate(zip(plan, bufs))],
                   f'worker {w} (rank {rank}) pulling the parameters for step {step} '
                   f'from the servers (ranks 0-{servers - 1})', patience)
        with torch.no_grad():
            for p, b in zip(plan, bufs):
                params[p['param']].view(-1)[p['start']:p['stop']] = b
                pulled_bytes[p['server']] += b.nbytes

    pull(start)
    losses, step_diff, t0 = [], None, time.perf_counter()
    for step in range(start, run['steps']):
        inject_fault(run, 'worker', w, step)  # a fault an experiment asked for: die or go silent
        mine = batch_indices(order, step, batch_size, w, len(workers))
        loss = torch.nn.functional.cross_entropy(lenet(X_all[mine], params), y_all[mine],
                                                 reduction='sum')
        loss.backward()
        losses.append(loss.item() / len(mine))
        what, pushed = f'worker {w} (rank {rank}) pushing the gradients of step {step}', time.perf_counter()
        pushing = ps_start_sends([(params[p['param']].grad.reshape(-1)[p['start']:p['stop']].clone(),
                                   p['server'], i) for i, p in enumerate(plan)], what)
        if step == start:  # the same step done with all-reduce, for comparison
            by_allreduce = _allreduce_step(params, lr, batch_size, worker_group)
        pull(step + 1)
        events.append((pushed, time.perf_counter()))
        ps_wait(pushing, what, timeout)
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
        out.update(ps_test(params, run['test_subset']))
    return out


def _allreduce_step(params, lr, batch_size, worker_group):
    # The SGD step the server will take, computed instead by all-reducing among the workers.
    with torch.no_grad():
        grads = [q.grad.clone() for q in params]
        for g in grads:
            dist.all_reduce(g, group=worker_group)
        return [q - lr * g / batch_size for q, g in zip(params, grads)]
