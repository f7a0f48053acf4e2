"""Worker functions for the launcher tests (spawned processes import them from here)."""
import os
import time

import torch
import torch.distributed as dist


def rank_and_world(rank, world_size):
    return rank, world_size, dist.get_rank(), dist.get_world_size(), os.environ['RANK']


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
