"""The course's map: what each section of 计算性能 · Computational Performance uses, in course order.

Every section's notebook, and each torchrun script it writes, does ``import common``
and nothing else of the course's. This file defines nothing: each group below
imports what one section's page calls for the first time, from the module of the
package ``comp_perf/`` that defines it, so ``common.launch`` is
``comp_perf/processes.py``'s ``launch`` and ``common.launch??`` opens that file.
"First" means first on a page, not in the package, and a name no page calls is
not here: the modules, tools, tests, set-up and instructor's guide that use it
import it from its module. The modules are small and named for what they serve:
``language``, ``machine``, ``measure``, ``pictures``, ``processes`` and
``fashion_mnist`` serve every section; ``sNN_…`` serves section NN. A section's
own lesson is written on its page; a module holds only what a later section, a
widget or a new process must import. tests/test_map.py keeps this file true.
"""
# 00 Start here — language, devices, settings, timing, verdicts, processes, data, the book's d2l
from comp_perf.language import tr
from comp_perf.machine import num_gpus, try_gpu, gpu, try_all_gpus, environment_report, settings
from comp_perf.measure import Benchmark, measure, verdict
from comp_perf.processes import launch, allreduce_check
from comp_perf.fashion_mnist import FASHION_LABELS, load_data_fashion_mnist
from comp_perf.s00_book_helpers import d2l_torch, compare_with_d2l, benchmark_side_by_side

# 01 Compilers and interpreters — quiet profiler output, aligned tables, GPU reference figures
from comp_perf.measure import quiet_native_stderr
from comp_perf.language import pad
from comp_perf.reference import GpuReference

# 02 Asynchronous computation — device waits, usable cores, timelines, display width
from comp_perf.machine import usable_cores
from comp_perf.language import display_width
from comp_perf.measure import synchronize
from comp_perf.pictures import plot_timeline

# 03 Automatic parallelism — a task graph drawn by resource
from comp_perf.pictures import plot_dependency_graph

# 04 Hardware — cache steps, compiled C, GPU datasheets, roofline, systolic array
from comp_perf.s04_hardware import cache_knees, compile_c, GPU_DATASHEETS, gpu_datasheet
from comp_perf.s04_hardware import cpu_facts, describe_cpu, plot_by_size, report_cache_sweep, plot_strides
from comp_perf.s04_hardware import plot_roofline, gpu_rate_table, plot_ladder, plot_busy_cells
from comp_perf.s04_hardware import plot_utilisation

# 05 Multi-GPU training from scratch — LeNet, training helpers, the data-parallel worker
from comp_perf.measure import Timer
from comp_perf.pictures import show_source, plot_device_rows
from comp_perf.fashion_mnist import fashion_mnist_datasets
from comp_perf.s05_data_parallel import (full_fp32, step_difference, step_tolerance, accuracy,
                                         evaluate_accuracy, Animator, sgd, lenet_params, lenet,
                                         batch_indices, replica_devices, dp_worker)

# 06 Concise multi-GPU training — ResNet-18, torchrun, DDP hooks and timeline, bucketed all-reduce
from comp_perf.processes import torchrun, leave_process_group
from comp_perf.s06_ddp import (resnet18, overlapped_hook, after_backward_hook, ddp_timeline,
                               plot_ddp_timeline)
from comp_perf.s06_bucketed import make_buckets, BucketedAllReduce, check_bucketed_allreduce, show_solution

# 07 Parameter servers — sync costs, ring all-reduce, key-value store, a sharded server
from comp_perf.processes import WorkerError
from comp_perf.fashion_mnist import find_fashion_mnist
from comp_perf.s05_data_parallel import LENET_SHAPES
from comp_perf.s07_ring import (SYNC_STRATEGIES, SYNC_LABELS, sync_time, ring_allreduce, ring_check,
                                ring_allreduce_both_ways, comm_benchmark, sync_calculator, ring_trace)
from comp_perf.s07_pictures import ring_steps, plot_ring_steps, plot_push_pull, plot_async_runs
from comp_perf.s07_parameter_server import KVStore, shard_keys, ps_process, ps_server, ps_worker
from comp_perf.s07_ps_messages import PSFault, resume_step, save_checkpoint
from comp_perf.s07_async_ps import ps_async_process, ps_in_turn

# 08 Beyond data parallelism — memory, ZeRO and FSDP, tensor and pipeline parallelism, a 2-D mesh
from comp_perf.processes import worker_device
from comp_perf.s08_memory import (PRECISIONS, ZERO_SHARDS, MEMORY_PARTS, zero_memory, training_memory,
                                  saved_activation_bytes, memory_calculator, memory_figure, parameter_count)
from comp_perf.s08_beyond_data_parallel import (ring_bytes, mlp, teacher_batches, sharded_training,
                                                tensor_parallel_check, bubble_fraction, pipeline_run,
                                                measured_bubble)
from comp_perf.s08_zero_by_hand import Zero1, check_zero1
from comp_perf.s08_fsdp_timeline import fsdp_timeline, plot_fsdp_timeline
from comp_perf.s08_combining import draw_mesh_2d, mesh_2d_training, plan_estimate, plot_plan_memory

# 09 Make one training step fast — profiler readings, interleaved timing, peaks, the build
from comp_perf.measure import interleaved, paired_ratio, noise_verdict
from comp_perf.language import name_list
from comp_perf.s09_training_step import (PHASES, wait_for_device, trace_spans, phase_shares, top_operator,
                                         self_time_share, calls_per_step, input_types, step_peak_bytes,
                                         debug_mode_cost, self_time_per_call,
                                         matmul_peak, datasheet_peak, print_rows, plot_payoff)
from comp_perf.s09_faster_step import (slow_step, show_slow_step, check_faster_step,
                                       show_fast_step_solution)
from comp_perf.s09_mystery_step import write_mystery_step, check_mystery_step

# 10 Attention and generation — the model, FlashAttention's tiles, graded
from comp_perf.s10_model import Block, GPT
from comp_perf.s10_flash_checks import check_flash_attention, check_flash_backward, peak_allocated
from comp_perf.s10_flash_attention import flash_attention, flash_attention_backward, show_flash_solution

# 11 Writing a kernel — Triton here, bytes counted, the kernel build and its check
from comp_perf.s11_triton import (load_triton, skipped, traffic_of, eager_traffic, check_triton_flash,
                                  load_kernel_file, kernel_attention)

# 12 Long context and experts — ring attention, its check, experts over all-to-all, five splits
from comp_perf.s12_ring import (pad_block, visible_part, check_ring_attention, show_ring_solution,
                                ring_run, ring_bytes_per_rank, imbalance)
from comp_perf.s12_experts import (MixtureOfExperts, tokens_per_expert, check_expert_parallel,
                                   expert_parallel_check, EXPERT_CHECK_RUN)
from comp_perf.s12_dimensions import dimensions_measured, DIMENSIONS_RUN
