"""Worker functions for the launcher tests (spawned processes import them from here)."""
import os
import time

import torch
import torch.distributed as dist


def rank_and_world(rank, world_size):
    return rank, world_size, dist.get_rank(), dist.get_world_size(), os.environ['RANK']


def environment_variable(rank, world_size, name):
    return os.environ.get(name)


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ZeroDivisionError('worker one divides by zero on purpose')
    dist.barrier()  # rank 0 waits here for a peer that never comes
    return rank


def die_hard(rank, world_size):
    if rank == 0:
        os._exit(7)
    time.sleep(600)


def report_pid_then_hang(rank, world_size, folder):
    with open(os.path.join(folder, f'{rank}.pid'), 'w') as f:
        f.write(str(os.getpid()))
    time.sleep(600)


def return_tensor(rank, world_size):
    import torch
    return torch.full((3,), float(rank))


def killed_while_peer_waits(rank, world_size):
    import signal

    import torch
    if rank == 0:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.recv(torch.empty(1), 0)  # fails when rank 0 dies: connection closed


def every_ring_check(rank, world_size, numel):
    """{algorithm: largest difference from dist.all_reduce} for every ring algorithm, in one process group."""
    from comp_perf.s07_ring import RING_ALGORITHMS, ring_check
    return {algorithm: ring_check(rank, world_size, numel, algorithm) for algorithm in RING_ALGORITHMS}


def check_a_broken_ring(rank, world_size, numel):
    import common
    from comp_perf.s07_ring import RING_ALGORITHMS

    def reduce_scatter_only(tensor):
        n, r = dist.get_world_size(), dist.get_rank()
        chunks = list(tensor.view(-1).tensor_split(n))
        for step in range(n - 1):
            incoming = chunks[(r - step - 1) % n].clone()
            request = dist.isend(chunks[(r - step) % n].clone(), (r + 1) % n)
            dist.recv(incoming, (r - 1) % n)
            request.wait()
            chunks[(r - step - 1) % n] += incoming
    RING_ALGORITHMS['broken'] = reduce_scatter_only
    return common.ring_check(rank, world_size, numel, 'broken')


def receive_from_a_sleeper(rank, world_size):
    import torch
    if rank == 0:
        time.sleep(600)
    dist.recv(torch.empty(1), 0)


def backend_and_device(rank, world_size):
    import common
    return dist.get_backend(), str(common.worker_device())


def beyond_data_parallelism_seeing_gpus(rank, world_size):
    """08's workers in a process that believes it has a GPU: each must stay on the CPU and gloo."""
    import torch

    import common
    # where fully_shard picks its default mesh (faking torch.cuda too would send Adam to CUDA code)
    torch._C._get_accelerator = lambda: torch.device('cuda')
    sharded = common.sharded_training(rank, world_size, dict(widths=[8, 8, 4], batch_size=8, steps=2, lr=0.1,
                                                             count_step=1, modes=('ddp', 'fsdp')))
    tp = common.tensor_parallel_check(rank, world_size, dict(d=8, hidden=16, batch_size=4))
    pipe = common.pipeline_run(rank, world_size, dict(hidden=8, layers=2, classes=4, batch_size=4, repeats=1,
                                                      schedules=[('GPipe', 2)]))
    return dict(devices={mode: r['device'] for mode, r in sharded.items()},
                same=sharded['ddp']['losses'] == sharded['fsdp']['losses'] or
                max(abs(a - b) for a, b in zip(sharded['ddp']['losses'], sharded['fsdp']['losses'])) < 1e-5,
                tp=tp['output'] / tp['scale'], pipe=pipe[0]['grad_diff'] / pipe[0]['grad_scale'])


def intra_op_threads(rank, world_size):
    return torch.get_num_threads()


def large_result(rank, world_size):
    """1 MB per rank: the queue's feeder thread is still writing it when the worker leaves."""
    return torch.full((250_000,), float(rank))


def bucketed_against_plain_average(rank, world_size, modules, folder, plans):
    """Section 06's BucketedAllReduce of each module against a plain average, in float64.

    For each plan (micro-batches per step, say (2, 1, 1)) a float64 ResNet-18 of width 8 from one
    seed is trained twice on this rank's batches, never reset between steps: once with the
    module's class and once plainly, its gradients accumulated over the micro-batches, then
    summed with one all_reduce and divided by the world size. Returns {module: [largest gap of
    each plan]}, each the largest over the plan's steps of the gradients' difference relative to
    the largest gradient. In float64 two correct versions differ by roundings of about 1e-16,
    too small to move a ReLU's input across zero, so they stay together step after step; in
    float32 they need not (comp_perf/s06_bucketed.py, _step).
    """
    import copy
    import importlib
    import sys

    from comp_perf.s06_ddp import resnet18
    sys.path.insert(0, folder)
    gaps = {}
    for module in modules:
        cls = importlib.import_module(module).BucketedAllReduce
        gaps[module] = [_plain_average_gap(cls, plan, rank, world_size, resnet18, copy) for plan in plans]
    return gaps


def _plain_average_gap(cls, plan, rank, world_size, resnet18, copy):
    torch.manual_seed(0)
    mine = resnet18(width=8).double()
    plain = copy.deepcopy(mine)
    cls(mine, bucket_mb=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    worst = 0.0
    for micro_batches in plan:
        for model in (mine, plain):
            model.zero_grad()
        for _ in range(micro_batches):
            X = torch.randn(16, 1, 28, 28, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 10, (16,), generator=gen)
            for model in (mine, plain):
                torch.nn.functional.cross_entropy(model(X), y).backward()
        for p in plain.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world_size
        pairs = list(zip(mine.parameters(), plain.parameters()))
        largest = max(float(b.grad.abs().max()) for _, b in pairs)
        worst = max(worst, max(float((a.grad - b.grad).abs().max()) for a, b in pairs) / largest)
        with torch.no_grad():
            for a, b in pairs:
                a -= 0.1 * a.grad
                b -= 0.1 * b.grad
    return worst


def bucketed_checks(rank, world_size, modules, folder):
    """Section 06's check worker for several modules in one process group: {module: its result}."""
    from comp_perf.s06_bucketed import bucketed_check
    return {module: bucketed_check(rank, world_size, module, folder) for module in modules}
