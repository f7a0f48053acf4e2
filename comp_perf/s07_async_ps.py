"""Section 07, asynchronous SGD with bounded staleness on the sharded parameter server
(ps_async_process), and ps_in_turn, which runs several synchronous and asynchronous
experiments one after another in one process group.
"""
import time

import torch
import torch.distributed as dist

from comp_perf.fashion_mnist import fashion_mnist_datasets
from comp_perf.processes import run_keys
from comp_perf.s05_data_parallel import LENET_SHAPES, batch_indices, lenet, lenet_params
from comp_perf.s07_parameter_server import ps_process, shard_keys
from comp_perf.s07_ps_messages import (PS_RUN_KEYS, inject_fault, ps_receive, ps_send, ps_servers,
                                       ps_start_sends, ps_test, ps_wait)


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
    run_keys(run, *PS_RUN_KEYS['ps_async_process'])
    servers = ps_servers(world_size, run, 'ps_async_process')
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
        ps_send([(message, servers + w, 0)], f'server {s} (rank {s}) answering worker {w} (rank {servers + w})',
                run.get('timeout'))

    for w in range(workers):          # the first pull
        answer(w)
    push, t0 = torch.empty(len(weights) + 1), time.perf_counter()
    while sum(clock) < budget:
        inject_fault(run, 'server', s, sum(clock) // workers)
        busy = ', '.join(f'worker {v} (rank {servers + v})' for v in range(workers)
                         if v not in held | done)
        what = (f'server {s} (rank {s}) waiting for a push from {busy} '
                f'(pushes so far, per worker: {clock})')
        # From any worker, whichever pushes first. (Gloo cannot poll one receive
        # per worker: is_completed() stays False until wait() is called.)
        ps_receive([(push, None, 0)], what, run.get('timeout'))
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
    # The data, its order and the parameters as in ps_worker, which 07's page shows whole.
    X_all, y_all = fashion_mnist_datasets(subset=run.get('subset'), download=False)[0].tensors
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(seed))
    params = [torch.zeros(shape, requires_grad=True) for shape in LENET_SHAPES]
    sizes = [[p['stop'] - p['start'] for p in shard] for shard in shards]
    pause = (run.get('slow') or {}).get(w, 0)
    patience = run.get('timeout') and 2 * run['timeout']  # a held pull waits for a slow peer

    def pull():
        bufs = [torch.empty(sum(n) + workers + 2) for n in sizes]
        ps_receive([(b, k, 0) for k, b in enumerate(bufs)],
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
        inject_fault(run, 'worker', w, step)
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
        pushing = ps_start_sends([(m, k, 0) for k, m in enumerate(messages)], what)
        got = pull()
        ps_wait(pushing, what, run.get('timeout'))
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
        out.update(ps_test(params, run['test_subset']))
    return out


def ps_in_turn(rank, world_size, runs):
    """Worker for launch(): several parameter-server runs in one process group, one after another.

    Each run dict goes to ps_async_process if it has a 'staleness' entry, else to
    ps_process; a barrier lines up the starts, so start-up is paid once and the
    runs do not overlap. Every run's keys are checked before the first one starts.
    Returns this rank's results, one per run.
    """
    chosen = [_server_for(run) for run in runs]
    out = []
    for server, run in zip(chosen, runs):
        dist.barrier()
        out.append(server(rank, world_size, run))
    return out


def _server_for(run):
    """ps_async_process for a run with a 'staleness' key, else ps_process, once the run's keys fit it."""
    # The choice hangs on one key: a misspelt 'staleness' would turn an asynchronous
    # experiment into a synchronous one, so the message says which server was chosen and why.
    server = ps_async_process if 'staleness' in run else ps_process
    which = 'with' if server is ps_async_process else 'without'
    run_keys(run, *PS_RUN_KEYS[server.__name__],
             who=f"ps_in_turn: a run {which} a 'staleness' key goes to {server.__name__}")
    return server
