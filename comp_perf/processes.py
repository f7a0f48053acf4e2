"""Worker processes (infrastructure: you need not read it to follow the course).

launch() starts `nprocs` processes in a torch.distributed process group on this
machine, runs a worker function in each and returns their results in rank
order. It uses gloo unless the caller asks for NCCL, and then a worker puts every
tensor it communicates on worker_device(), cuda:<its rank>. A worker that raises
is reported with its traceback, one that dies or hangs by name, and no process
outlives the call. torchrun() runs a script under the real torchrun, as one or
several "machines" on this host.
"""
import datetime
import os
import pickle
import queue
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from comp_perf.language import course_language, tr
from comp_perf.machine import num_gpus, usable_cores

# Infrastructure: you need not read this part to follow the course. What to
# know: launch() runs a function in several processes joined by
# torch.distributed, over gloo unless you ask for NCCL; a worker that wants
# GPUs asks for them and then puts every tensor it sends on cuda:<its rank>.


def launch(fn, world_size, *args, backend='gloo', timeout=120, threads=None, op_timeout=None,
           names=None):
    """Run fn(rank, world_size, *args) in `world_size` processes joined by torch.distributed.

    The backend is what you ask for: gloo (CPU tensors) unless backend='nccl',
    which needs one GPU per process; each NCCL worker's current device is then
    cuda:<rank>, and it must put every tensor it communicates there. launch
    never picks NCCL by itself, however many GPUs the machine has.

    fn must live in an importable module (a .py file), not in a notebook. Returns the list of
    return values by rank. A worker's exception is re-raised here with its traceback; a worker
    that dies without a word is named; a hang raises TimeoutError after `timeout` seconds. No
    worker or port outlives the call (on Linux their fork server lives on, unused). `threads` is
    each worker's PyTorch thread count (default: the cores shared out). `op_timeout` (seconds)
    bounds every single send, receive or collective inside the workers (torch's default is 30
    minutes); `names` labels the ranks in error messages, e.g. 'worker 1'. Workers are daemons,
    so they cannot start DataLoader worker processes of their own (num_workers = 0 inside fn).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f'world_size must be a whole number >= 1, got {world_size!r}.')
    if getattr(fn, '__module__', None) == '__main__':
        raise ValueError(
            f'{fn.__name__} is defined in the notebook (module __main__); worker '
            'processes cannot import it. Write it to a .py file (%%writefile my_worker.py), '
            'import it from there, and launch that function.')
    if backend not in ('gloo', 'nccl'):
        raise ValueError(f"backend must be 'gloo' (CPU tensors) or 'nccl' (one GPU per process), "
                         f'got {backend!r}.')
    if backend == 'nccl' and num_gpus() < world_size:
        raise ValueError(f'backend nccl needs one GPU per process: {world_size} processes, '
                         f'{num_gpus()} GPU(s). Use backend="gloo" or fewer processes.')
    if names is not None and len(names) != world_size:
        raise ValueError(f'names has {len(names)} entries for {world_size} processes.')
    threads = threads or max(1, usable_cores() // world_size)
    group = (fn, world_size, args, backend, threads, op_timeout)
    try:
        return _run_group(group, timeout, names)
    except ConnectionFailed as failure:   # nothing of fn ran yet: one more try is safe
        print(tr('launch: the worker processes could not connect to each other ({why}); '
                 'starting them once more', why=failure.why), file=sys.stderr)
        return _run_group(group, timeout, names)


# Nothing here may ask CUDA anything (a child forked after that cannot use CUDA; a test checks). DTensor,
# FSDP and pipelining cost each worker 2-3 s to import: imported here once, they cost a launch nothing.
FORK_SERVER_PRELOAD = ('torch', 'torch.distributed', 'torch.distributed.tensor', 'torch.distributed.fsdp',
                       'torch.distributed.pipelining')


def _context():
    """Linux: workers forked from a server that imported torch once (spawned, each imports it: ~2 s)."""
    if not sys.platform.startswith('linux'):
        return mp.get_context('spawn')
    mp.get_context('forkserver').set_forkserver_preload(list(FORK_SERVER_PRELOAD))
    return mp.get_context('forkserver')


def _run_group(group, timeout, names):
    """Start the group's processes with a store of their own, collect their results, leave no process."""
    fn, world_size, args, backend, threads, op_timeout = group
    ctx = _context()
    results = ctx.Queue()
    # The store lives here, on a port the OS picks, so parallel notebooks never collide.
    store = dist.TCPStore('127.0.0.1', 0, world_size + 1, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(rank, world_size, store.port, backend, threads, fn, args,
                                  results, os.getpid(), op_timeout, dict(os.environ)))
            p.start()
            procs.append(p)
        return _collect(procs, results, timeout, names)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        del store


def worker_device():
    """The device a launch() worker computes and communicates on: cuda:<rank> under NCCL, else the CPU.

    Call it inside a worker, after launch() has joined the process group.
    """
    return torch.device(f'cuda:{dist.get_rank()}') if dist.get_backend() == 'nccl' else torch.device('cpu')


def run_keys(run, required, optional=(), who=None):
    """Check a worker's settings dict `run`: every key of `required`, no key outside `optional`.

    Raises ValueError naming the missing or unknown keys and the keys allowed;
    `who` names the worker in it (default: the function that calls run_keys).
    """
    # Pages and exercises write these dicts by hand: unchecked, a misspelt key
    # ('timout') would be ignored and silently change the experiment.
    who = who or sys._getframe(1).f_code.co_name
    if not isinstance(run, dict):
        raise TypeError(f'{who} takes its settings as a dict, got {type(run).__name__}.')
    missing = [key for key in required if key not in run]
    unknown = [key for key in run if key not in required and key not in optional]
    if missing or unknown:
        wrong = '; '.join(([f'unknown key(s) {unknown} (check the spelling)'] if unknown else [])
                          + ([f'missing key(s) {missing}'] if missing else []))
        raise ValueError(f'{who}: {wrong}. It takes {", ".join(required) or "no required keys"}'
                         + (f' and optionally {", ".join(optional)}' if optional else '') + '.')


def allreduce_check(rank, world_size):
    """Worker for launch(): all-reduce each rank's number; every rank returns the sum.

    Rank r contributes r + 1, so every rank returns world_size·(world_size+1)/2.
    Works over gloo and, with launch(..., backend='nccl'), on GPUs.
    """
    t = torch.tensor([float(rank + 1)], device=worker_device())
    dist.all_reduce(t)
    return t.item()


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its rank and traceback."""


class ConnectionFailed(WorkerError):
    """The processes could not connect to each other while joining the group; fn had not started."""

    def __init__(self, message, why):
        super().__init__(message)
        self.why = why


# What gloo (and torch's store) say when a connection between the processes fails while they join:
# a peer that gave up or went away mid-handshake, or an address that something else answered.
CONNECTION_ERRORS = ('connectFullMesh', 'Connection closed by peer', 'Connection reset by peer',
                     'Connection refused', 'Broken pipe')


def connection_failure(text):
    """The first of CONNECTION_ERRORS in a traceback or log, or None."""
    return next((e for e in CONNECTION_ERRORS if e in text), None)


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it first)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def torchrun(script, *args, nproc_per_node=1, nnodes=1, timeout=300, show=False):
    """Run `script` with torchrun as `nnodes` launchers on this host; return each launcher's output.

    One node uses --standalone (torchrun picks a free port). Several nodes meet through c10d
    rendezvous on 127.0.0.1, as separate machines would. A failing script raises RuntimeError
    with the end of its output; past `timeout` seconds everything is killed and TimeoutError
    raised. No launcher or worker outlives the call: all launchers are watched
    at once, so a node that fails early is reported at once. show=True prints each
    node's command line first, as you would type it on that machine. With several
    nodes on a machine that has a GPU for every process, node i sees only its own
    GPUs (CUDA_VISIBLE_DEVICES, shown in its command line), as on separate machines:
    otherwise every node's LOCAL_RANK 0 would pick cuda:0, which NCCL refuses.
    The script sees COURSE_LANG, so that its common.tr() speaks the notebook's language.
    """
    visible = node_gpus(nnodes, nproc_per_node)
    commands = _torchrun_commands(script, args, nproc_per_node, nnodes)
    if show:
        for node, command in enumerate(commands):
            prefix = f'CUDA_VISIBLE_DEVICES={visible[node]} ' if visible[node] is not None else ''
            print(tr('node {node}: {command}', node=node, command=prefix + shlex.join(['torchrun'] + command[3:])))
    try:
        return _run_launchers(script, commands, visible, timeout)
    except ConnectionFailed as failure:   # the workers never formed their group: the script's work had not started
        print(tr('torchrun: the worker processes could not connect to each other ({why}); '
                 'starting them once more', why=failure.why), file=sys.stderr)
        # a fresh rendezvous port and id: the old port may be what something else answered
        return _run_launchers(script, _torchrun_commands(script, args, nproc_per_node, nnodes), visible, timeout)


# What torchrun's output shows when its processes failed to meet, before the script's own work:
# gloo's connections while joining, or the rendezvous store (a multi-node run's free_port() can be
# taken by another program between the moment it is picked and the moment torchrun binds it).
JOIN_ERRORS = ('connectFullMesh', 'RendezvousConnectionError', 'The connection to the C10d store has failed')


def _torchrun_commands(script, args, nproc_per_node, nnodes):
    """The command line of each launcher: --standalone for one node, else a c10d rendezvous on a free port."""
    base = [sys.executable, '-m', 'torch.distributed.run', f'--nproc-per-node={nproc_per_node}']
    if nnodes == 1:
        return [base + ['--standalone', str(script), *map(str, args)]]
    rendezvous = [f'--nnodes={nnodes}', '--rdzv-backend=c10d', f'--rdzv-id={uuid.uuid4().hex[:8]}',
                  f'--rdzv-endpoint=127.0.0.1:{free_port()}']
    return [base + rendezvous + [str(script), *map(str, args)]] * nnodes


def _run_launchers(script, commands, visible, timeout):
    """Run the launchers at once and return their outputs; raise on failure (ConnectionFailed if they never met)."""
    logs = [tempfile.TemporaryFile(mode='w+') for _ in commands]
    # the script prints in the notebook's language: a Chinese notebook's language comes from its folder,
    # which a script started elsewhere would not see
    env = {**os.environ, 'COURSE_LANG': course_language()}
    procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                              env=env if gpus is None else {**env, 'CUDA_VISIBLE_DEVICES': gpus},
                              start_new_session=hasattr(os, 'killpg'))
             for cmd, log, gpus in zip(commands, logs, visible)]
    def output(node):
        logs[node].seek(0)
        return logs[node].read()

    try:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            failed = [node for node, p in enumerate(procs) if p.returncode]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        for node, p in enumerate(procs):
            if p.returncode:
                message = (f'torchrun {script} (node {node}) exited with code {p.returncode}:\n'
                           + '\n'.join(output(node).splitlines()[-60:]))
                why = next((e for e in JOIN_ERRORS if e in output(node)), None)
                raise ConnectionFailed(message, why) if why else RuntimeError(message)
        if any(p.returncode is None for p in procs):
            raise TimeoutError(f'torchrun {script} did not finish within {timeout} s; stopped it.')
        return [output(node) for node in range(len(procs))]
    finally:
        for p in procs:
            if p.poll() is None:
                stop_process_tree(p)
        for log in logs:
            log.close()


def node_gpus(nnodes, nproc_per_node):
    """CUDA_VISIBLE_DEVICES for each of `nnodes` launchers on this host, or None to leave it alone.

    Only when there are several nodes and a GPU for every process: node i then gets
    GPUs i·nproc_per_node … (i+1)·nproc_per_node − 1.
    """
    if nnodes == 1 or num_gpus() < nnodes * nproc_per_node:
        return [None] * nnodes
    # indices count the GPUs this process sees: map them through a CUDA_VISIBLE_DEVICES already set
    seen = os.environ.get('CUDA_VISIBLE_DEVICES', '').split(',')
    name = (lambda k: seen[k].strip()) if len(seen) >= num_gpus() and seen[0].strip() else str
    return [','.join(name(node * nproc_per_node + j) for j in range(nproc_per_node)) for node in range(nnodes)]


def stop_process_tree(popen, grace=5):
    """Stop a subprocess.Popen and every process below it: terminate, then kill after `grace` s.

    torchrun starts its workers in sessions of their own, so stopping a process
    group is not enough.
    """
    try:
        root = psutil.Process(popen.pid)
        tree = [root] + root.children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for proc in tree:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(tree, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
    popen.wait()


# How launch() works: its workers, error reports and clean-up.


class _RemoteTraceback(Exception):
    def __str__(self):
        return self.args[0]


def _watch_parent(parent_pid):
    # Exit if the launching process disappears (kernel killed): no orphans. A forked worker's
    # parent is the fork server, which ends with the launcher: either parent changing means it went.
    parent = os.getppid()

    def watch():
        while os.getppid() == parent and psutil.pid_exists(parent_pid):
            time.sleep(0.5)
        os._exit(3)
    threading.Thread(target=watch, daemon=True).start()


def _worker_main(rank, world_size, port, backend, threads, fn, args, results, parent_pid,
                 op_timeout, environ):
    """Entry point of a worker process started by launch()."""
    _watch_parent(parent_pid)
    os.environ.clear()   # a forked worker holds its fork server's environment: take the launcher's
    os.environ.update(environ)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    joined = False
    try:
        if backend == 'nccl':
            torch.cuda.set_device(rank)
        store = dist.TCPStore('127.0.0.1', port, world_size + 1, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                **_group_options(backend, rank, op_timeout))
        joined = True
        outcome = (rank, 'ok', fn(rank, world_size, *args))
    except BaseException as e:
        tb = traceback.format_exc()
        try:
            pickle.dumps(e)
            exc = e
        except Exception:
            exc = None
        # 'join-error': the group never formed here, so fn did not run on this rank
        outcome = (rank, 'error' if joined else 'join-error', (exc, tb, time.time()))
    # Report before leaving the group: leaving makes peers fail, and their
    # secondary errors must not arrive ahead of this one. Plain pickle copies
    # tensors by value (torch's queue would share them through this process,
    # which is about to exit).
    try:
        message = pickle.dumps(outcome)
    except Exception:
        message = pickle.dumps((rank, 'error', (None, f'result of rank {rank} cannot be pickled:\n'
                                                   f'{traceback.format_exc()}', time.time())))
    results.put(message)
    if joined:
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    _leave(results)


def leave_process_group():
    """destroy_process_group(), then end this process at once (for a torchrun script's last line).

    In this torch, gloo's teardown at the interpreter's exit now and then aborts a
    process whose work is finished ('terminate called without an active exception',
    exit -6); torchrun then reports the whole run failed. Ending with os._exit(0)
    after the group is destroyed skips that teardown. Output is flushed first.
    """
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _leave(results):
    """End the worker at once, once its result is on its way to the launcher.

    The worker's work is done and reported. In this torch, gloo's teardown at the
    interpreter's exit now and then aborts the process ('terminate called without an
    active exception', exit -6) after everything has finished: seen in 2 of 84 runs
    of the built pieces' workers, and in PyTorch's own DDP too. os._exit skips that
    teardown; the queue is flushed first, since os._exit would drop what its feeder
    thread has not yet written.
    """
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _group_options(backend, rank, op_timeout):
    """init_process_group's options: the operation timeout, and on NCCL the GPU of this rank.

    device_id binds the group to cuda:<rank>, so that NCCL need not guess the device at
    its first collective (it warns when it has to, e.g. at a barrier).
    """
    options = {} if op_timeout is None else {'timeout': datetime.timedelta(seconds=op_timeout)}
    if backend == 'nccl':
        options['device_id'] = torch.device('cuda', rank)
    return options


def _label(rank, names):
    return f'rank {rank} ({names[rank]})' if names else f'rank {rank}'


def _exit_text(code):
    if code is not None and code < 0:
        try:
            return f'code {code} ({signal.Signals(-code).name})'
        except ValueError:
            pass
    return f'code {code}'


def _raise_first_error(rank, payload, results, procs, names, grace=1.0):
    # Peers of a failed worker fail too (connection closed): wait a moment for
    # their reports and raise the root cause.
    # A process that died without reporting (killed, crashed) is the root
    # cause of everything its peers report, so it is named first.
    errors = [(payload[2], rank, payload)]
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            r, status, p = pickle.loads(results.get(timeout=max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            break
        if status in ('error', 'join-error'):
            errors.append((p[2], r, p))
    # A closed connection is a consequence (the peer died, timed out or gave up first):
    # prefer any other error, then the earliest.
    secondary = ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe')
    _, rank, (exc, tb, _) = min(errors, key=lambda e: (any(s in e[2][1] for s in secondary), e[0]))
    remote = _RemoteTraceback(f'\n--- worker {_label(rank, names)} ---\n{tb}')
    reported = {e[1] for e in errors}
    silent = [r for r, p in enumerate(procs) if r not in reported and p.exitcode not in (None, 0)]
    if silent:
        r = silent[0]
        last = tb.strip().splitlines()[-1] if tb.strip() else repr(exc)
        raise WorkerError(f'{_label(r, names)} exited with {_exit_text(procs[r].exitcode)} without '
                          f'reporting a result (killed or crashed); {_label(rank, names)} noticed '
                          f'first: {last}') from remote
    if exc is None:
        raise WorkerError(f'worker {_label(rank, names)} failed:\n{tb}')
    raise exc from remote


def _collect(procs, results, timeout, names=None):
    deadline = time.monotonic() + timeout
    done = {}
    while len(done) < len(procs):
        try:
            rank, status, payload = pickle.loads(results.get(timeout=0.2))
        except queue.Empty:
            dead = [r for r, p in enumerate(procs)
                    if r not in done and p.exitcode is not None]
            if dead:
                time.sleep(0.5)  # a message sent just before exit may still be in flight
                if results.empty():
                    r = dead[0]
                    raise WorkerError(f'worker {_label(r, names)} exited with '
                                      f'{_exit_text(procs[r].exitcode)} without reporting a '
                                      'result (killed or crashed).')
                continue
            if time.monotonic() > deadline:
                waiting = sorted(set(range(len(procs))) - set(done))
                raise TimeoutError(f'worker rank(s) {waiting} did not finish within '
                                   f'{timeout} s; all workers were stopped.')
            continue
        if status == 'join-error' and connection_failure(payload[1]):
            raise ConnectionFailed(f'worker {_label(rank, names)} could not connect to its peers:\n{payload[1]}',
                                   connection_failure(payload[1]))
        if status in ('error', 'join-error'):
            _raise_first_error(rank, payload, results, procs, names)
        done[rank] = payload
    return [done[r] for r in range(len(procs))]
