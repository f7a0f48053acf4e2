"""Section 12, part 6: the table of the five dimensions, with numbers measured on this machine.

dimensions_measured() runs three of 08's workers one after another in one process group
(DDP against fully_shard, the Megatron-split MLP block, a pipeline at two micro-batch counts), so
that 12 can set their counted collectives and measured bubble beside the formulas without
starting three groups of processes.
"""
from comp_perf.processes import run_keys
from comp_perf.s08_beyond_data_parallel import pipeline_run, sharded_training, tensor_parallel_check

# Small enough for a second or two on a laptop; the formulas and the counts do not depend on size.
# The hidden widths and the layers divide by 2, 3 and 4 processes, so every rank holds an equal part.
DIMENSIONS_RUN = dict(
    sharded=dict(widths=[64, 120, 120, 10], batch_size=60, steps=5, lr=1e-3, count_step=3,
                 modes=('ddp', 'fsdp')),
    tensor=dict(d=64, hidden=240, batch_size=32),
    pipeline=dict(hidden=480, layers=12, classes=10, batch_size=480, repeats=3,
                  schedules=[('GPipe', 1), ('GPipe', 4)]),
)


def dimensions_measured(rank, world_size, run):
    """Worker for launch(): 08's data/FSDP, tensor and pipeline workers run in turn, in one group.

    `run` has sharded, tensor and pipeline: the run dicts of common.sharded_training,
    common.tensor_parallel_check and common.pipeline_run (each checks its own keys).
    Returns their results under the same three names.
    """
    run_keys(run, ('sharded', 'tensor', 'pipeline'), ())
    return dict(sharded=sharded_training(rank, world_size, run['sharded']),
                tensor=tensor_parallel_check(rank, world_size, run['tensor']),
                pipeline=pipeline_run(rank, world_size, run['pipeline']))
