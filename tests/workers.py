"""Worker functions for the launcher tests (spawned processes import them from here)."""
import os
import time

import torch.distributed as dist


def rank_and_world(rank, world_size):
    return rank, world_size, dist.get_rank(), dist.get_world_size(), os.environ['RANK']


def fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ZeroDivisionError('worker one divides by zero on purpose')
    dist.barrier()  # rank 0 waits here for a peer that never comes
    return rank


def hang(rank, world_size, seconds=600):
    time.sleep(seconds)


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
