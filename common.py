"""Shared helpers for the course 计算性能 · Computational Performance.

Every notebook does ``import common``. The set-up installs this file into the
course's environment, so the import works in JupyterLab, under nbval, and in
the processes that ``torch.multiprocessing`` or ``torchrun`` start.

The file reads in the course's order. Each public helper's docstring ends
with the sections that use it ("Used in: ..."). The map:

  language               all     say, tr, cjk_font: text and figures in the notebook's language
  devices and tiers      00      num_gpus, try_gpu, gpu, try_all_gpus, detect_tier,
                                 environment_report
  settings by hardware   01-08   settings: one visible place per notebook, overridable
  worker processes       00, 05-08
                                 launch (gloo unless the caller asks for NCCL), worker_device,
                                 WorkerError, allreduce_check, free_port, torchrun,
                                 stop_process_tree
                                 (infrastructure: you need not read it to follow the course)
  measuring              01-05   synchronize, Timer, Benchmark, measure, verdict,
                                 text, full_fp32, step_difference, step_tolerance,
                                 quiet_native_stderr
  pictures               02, 03, 07, 08   plot_timeline, show_source
  data                   00, 05-07    find_fashion_mnist, fashion_mnist_datasets,
                                      load_data_fashion_mnist, FASHION_LABELS, clear_cache
  training               05, 06  accuracy, evaluate_accuracy, Animator, sgd
  data parallelism       05      lenet_params, lenet, batch_indices, replica_devices, dp_worker
                                 (05 defines get_params, allreduce, split_batch and train_batch
                                 on its page; dp_worker is its multi-process entry point)
  concise multi-GPU      06      resnet18
  parameter servers      07      sync_time, ps_time, hierarchical_time, sync_calculator,
                                 ring_allreduce, ring_check, comm_benchmark, fit_alpha_beta,
                                 ring_model, KVStore, shard_keys, ps_process
  beyond data parallelism 08     zero_memory, training_memory, saved_activation_bytes,
                                 memory_calculator, sharded_training, count_collectives,
                                 ring_bytes, tensor_parallel_check, pipeline_run,
                                 bubble_fraction, measured_bubble
"""
import ast
import contextlib
import copy
import datetime
import gzip
import inspect
import math
import os
import pickle
import platform
import queue
import re
import shutil
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

ROOT = Path(__file__).resolve().parent
if not torch.cuda.is_available():
    # Import-time adjustment (one of two; the other is the Chinese font below):
    # a CUDA build of PyTorch on a machine without CUDA logs a timestamped
    # "No CUDA runtime is found" at its first compilation; it is irrelevant here.
    import logging
    logging.getLogger('torch.utils.cpp_extension').setLevel(logging.ERROR)


# ---------------------------------------------------------------- language


def course_language():
    """'zh' in a kernel started in notebooks/zh (or with COURSE_LANG=zh), else 'en'.

    nbval and JupyterLab start a notebook's kernel in the notebook's folder.
    Used by say() and tr().
    """
    lang = os.environ.get('COURSE_LANG')
    if lang in ('en', 'zh'):
        return lang
    cwd = Path.cwd()
    return 'zh' if cwd.name == 'zh' and cwd.parent.name == 'notebooks' else 'en'


def say(en, zh):
    """Pick the English or the Chinese text by course_language(). Used in: every section."""
    return zh if course_language() == 'zh' else en


# English text in figures (tr) and verdict lines (verdict) -> Chinese. Keys are exactly
# what the notebooks pass, so code cells stay the same, and free of Chinese, in both languages.
FIGURE_TEXT = {
    # 00: Fashion-MNIST classes
    't-shirt': 'T恤', 'trouser': '裤子', 'pullover': '套衫', 'dress': '连衣裙', 'coat': '外套',
    'sandal': '凉鞋', 'shirt': '衬衫', 'sneaker': '运动鞋', 'bag': '包', 'ankle boot': '短靴',
    # 00: the verdict example
    'time of sum(list) over torch.sum': 'sum(list) 与 torch.sum 的耗时之比',
    'no real difference: something else dominates here': '没有实质差别：这里由别的因素主导',
    'sum(list) handles one Python object per number: overhead-bound':
        'sum(list) 每个数都要处理一个 Python 对象：受开销限制',
    'first call over the median of the next 20': '第一次调用与随后 20 次调用的耗时中位数之比',
    'no visible one-off cost: it was paid earlier in this process':
        '看不出一次性代价：它已在本进程早些时候付过了',
    'the first call paid a one-off cost: warm up before timing': '第一次调用付出了一次性代价：计时之前要先预热',
    # 01
    'compile time, empty cache over filled cache': '空缓存与已填充缓存的编译时间之比',
    'the cache made little difference here': '缓存在这里作用不大',
    'the cache saved most of the work: a machine pays for the first compile once':
        '缓存省下了大部分工作：一台机器只需为第一次编译付一次代价',
    'compile speed-up at the smallest batch': '最小批量下 compile 的加速比',
    'compile is slower: it adds per-call work and there is no arithmetic to save':
        'compile 更慢：它给每次调用增加了工作，而这里没有可省的算术',
    'no clear difference': '没有明显差别',
    'compile is faster even here': '即使在这里 compile 也更快',
    'script speed-up at the smallest batch': '最小批量下 script 的加速比',
    'TorchScript is slower': 'TorchScript 更慢',
    'TorchScript makes no real difference': 'TorchScript 没有实质差别',
    'TorchScript helps a little: its interpreter is leaner than Python':
        'TorchScript 略有帮助：它的解释器比 Python 精简',
    'compile speed-up at the largest batch': '最大批量下 compile 的加速比',
    'compile is still slower at the largest batch': '在最大批量下 compile 仍然更慢',
    'within 10% of eager: the matrix products dominate': '与 eager 相差不到 10%：矩阵乘法占主导',
    'compile is faster at the largest batch': '在最大批量下 compile 更快',
    'fused chain, in copies of the tensor': '融合后的运算链，折合成张量拷贝的次数',
    'about one copy: memory-bound, near the best this memory allows':
        '约等于一次拷贝：受内存带宽限制，已接近这块内存所能达到的最好成绩',
    'more than one copy: something besides memory traffic costs time here':
        '超过一次拷贝：除了内存读写，这里还有别的因素在耗时',
    'batch size': '批量大小', 'µs per sample': '每个样本耗时（µs）',
    'overhead-bound': '开销受限', 'compute-bound': '计算受限',
    'peak memory, eager over fused': 'eager 与融合版的峰值内存之比',
    'no real saving here': '这里没有实质节省',
    'the eager chain materialises intermediates that the fused kernel never stores':
        'eager 运算链把中间结果都存成了张量，而融合后的内核从不存储它们',
    'CUDA-graph speed-up at batch 1': '批量为 1 时 CUDA Graph 的加速比',
    'no clear gain: the launches were not the cost here': '没有明显收益：这里的代价不在内核启动上',
    'replaying one graph beats launching kernel by kernel': '重放一整张图胜过逐个启动内核',
    'No GPU here: CUDA graphs record GPU kernels, so there is nothing to replay on a CPU.':
        '这里没有 GPU：CUDA Graph 录制的是 GPU 内核，在 CPU 上没有可以重放的东西。',
    '512-256-128-2 MLP, inference': '512-256-128-2 多层感知机，推理',
    # 02
    'GPU kernel time over front-end time': 'GPU 内核时间与前端时间之比',
    'the GPU waits most of the time: the front end sets the pace': 'GPU 大部分时间在等待：由前端决定节奏',
    'the GPU is busy: its kernels set the pace': 'GPU 很忙：由它的内核决定节奏',
    'share of CPU time in matrix products': '矩阵乘法占 CPU 时间的比例',
    'most of the time goes to work around the products: element-wise operators and overhead':
        '大部分时间花在矩阵乘法之外的工作上：逐元素算子和开销',
    'the matrix products take most of the time: arithmetic sets the pace': '矩阵乘法占了大部分时间：由算术决定节奏',
    'the products and the work around them take comparable time: both matter': '矩阵乘法与其余工作耗时相当：两者都不可忽视',
    'No GPU here: CUDA events are timestamps that a GPU records.': '这里没有 GPU：CUDA 事件是由 GPU 记录的时间戳。',
    'No GPU here: CPU operators never wait for a device, so there is nothing to catch.':
        '这里没有 GPU：CPU 算子从不等待设备，也就没有隐藏的同步可找。',
    'No GPU here: CPU operators check their inputs before they return, so errors are raised where they happen.':
        '这里没有 GPU：CPU 算子在返回之前就会检查输入，所以错误会在出错的那一行当场抛出。',
    'time until returned over time until finished': '返回所需时间与完成所需时间之比',
    'the loop returned long before the work was done: asynchronous':
        '循环在工作完成之前很久就返回了：异步执行',
    'returning took as long as finishing: the operators ran synchronously':
        '返回与完成用时相当：算子是同步执行的',
    'NumPy time over PyTorch time, both float32': 'NumPy 与 PyTorch 的耗时之比（都用 float32）',
    'NumPy is faster here': '这里 NumPy 更快',
    'about the same: both hand the product to a BLAS library': '大致相同：二者都把矩阵乘法交给 BLAS 库',
    'PyTorch is faster here': '这里 PyTorch 更快',
    'peak memory, results kept over nothing kept': '保留结果与不保留结果的显存峰值之比',
    'keeping references is what holds memory; queued kernels alone do not':
        '占住显存的是保留下来的引用，而不是排队的内核本身',
    'no difference: something else holds the memory here': '没有差别：这里占住显存的是别的东西',
    'No GPU here: PyTorch runs CPU operators synchronously, so nothing waits in a queue. '
    'The simulated back end above shows what running ahead holds.':
        '这里没有 GPU：PyTorch 在 CPU 上同步执行算子，没有任何东西在队列中等待。'
        '上面的模拟后端展示了前端跑在前面时会占住哪些内存。',
    'wait for every result: n(t1 + t2 + t3)': '逐个等待结果：n(t1 + t2 + t3)',
    'submit without waiting: about n·max(t1, t2)': '提交后不等待：约 n·max(t1, t2)',
    'never wait': '从不等待', 'sync once per minibatch': '每个小批量同步一次',
    'time (ms)': '时间（ms）', 'time ({unit})': '时间（{unit}）',
    'MB held by queued work': '排队任务占用的内存（MB）',
    'memory pinned by the queue': '队列占住的内存',
    # timeline lanes (02, 03)
    'front end': '前端', 'back end': '后端', 'front end waits': '前端等待',
    'one after the other': '依次执行', 'thread {i}': '线程 {i}',
    'bus 1': '总线 1', 'bus 2': '总线 2',
    'read the result every k steps (0: never)': '每 k 步读取一次结果（0：从不）',
    # 03
    'One GPU: two CUDA streams stand in for two devices.': '只有一块 GPU：用两个 CUDA 流代替两个设备。',
    'two devices: sum of the times alone over both together': '两个设备各自单独运行的时间之和与同时运行的时间之比',
    'the devices mostly took turns': '两个设备大多是轮流工作',
    'the two devices computed at the same time': '两个设备同时在计算',
    'two streams: twice the time of one over both together': '一个流耗时的两倍与两个流同时运行的耗时之比',
    'the streams mostly took turns: each product fills the GPU': '两个流大多是轮流执行：每次乘法都能占满 GPU',
    'the streams overlapped: the products left part of the GPU idle': '两个流重叠执行了：乘法没有占满 GPU',
    'No GPU here: there is no second device to run on. Part 3 measures the CPU equivalent '
    '(independent products in threads of ours).':
        '这里没有 GPU：也就没有第二个设备可用。本节第 3 部分测量 CPU 上的对应实验（在我们自己的线程中运行的独立乘法）。',
    'No GPU here: there is no device-to-host copy to overlap. The CPU equivalent in part 3 '
    'overlaps matrix products with large memory copies in two threads.':
        '这里没有 GPU：没有从设备到主机的复制可以重叠。本节第 3 部分的 CPU 对应实验在两个线程中让矩阵乘法与大块内存复制重叠。',
    'one stream over a copy stream': '只用一个流与另设复制流的耗时之比',
    'no gain from the copy stream here': '复制流在这里没有带来收益',
    'only the copy stream overlaps: one stream runs copies and products in turn':
        '只有用了复制流才能重叠：在单个流中，复制与乘法只能轮流执行',
    'front-end time, pageable over pinned': '从可分页内存与从锁页内存复制时的前端耗时之比',
    'no clear difference here': '这里没有明显差别',
    'from pinned memory the front end returns at once and can go on': '从锁页内存复制时，前端立即返回，可以继续工作',
    'No GPU here: there is no host-to-device copy to issue.': '这里没有 GPU：也就无从发出从主机到设备的复制。',
    'GPU, small products: one batched call over the loop': 'GPU 上做小矩阵乘法时，一次批量调用相对循环的加速比',
    'batching changes little here': '批量化在这里作用不大',
    'batching wins: one launch instead of thousands': '批量化胜出：一次启动代替了几千次',
    'GPU, small products: graph replay over the loop': 'GPU 上做小矩阵乘法时，重放 CUDA Graph 相对循环的加速比',
    'the graph changes little here': 'CUDA Graph 在这里作用不大',
    'the graph wins: the launches are recorded once and replayed together': 'CUDA Graph 胜出：所有启动只录制一次，之后整体重放',
    'No GPU here: the GPU version of this experiment needs a GPU.': '这里没有 GPU：这个实验的 GPU 版本需要 GPU 才能运行。',
    'our threads against intra-op threads': '我们的线程与算子内线程的加速比',
    'intra-op parallelism wins here': '这里算子内并行更快',
    'about the same: both use the cores': '大致相同：二者都用上了这些核心',
    'our threads win here': '这里我们的线程更快',
    'small products: intra-op threads over one core': '小矩阵乘法下，算子内线程相对单核的加速比',
    'intra-op threads make small operators slower': '算子内线程让小算子变慢',
    'intra-op threads change nothing for small operators': '算子内线程对小算子没有影响',
    'intra-op threads help even small operators here': '这里算子内线程连小算子也能加速',
    'small products: two Python threads over one core': '小矩阵乘法下，两个 Python 线程相对单核的加速比',
    'two Python threads make small operators slower': '两个 Python 线程让小算子变慢',
    'two Python threads change nothing for small operators': '两个 Python 线程对小算子没有影响',
    'two Python threads help small operators here': '这里两个 Python 线程能加速小算子',
    'small products: one batched call over the loop': '小矩阵乘法下，一次批量调用相对循环的加速比',
    'the batched call is slower than the loop here': '这里批量调用比循环更慢',
    'batching changes little: the per-call cost is a small share here':
        '批量化作用不大：这里每次调用的成本占比很小',
    'batching wins: it removes the per-call cost': '批量化胜出：它消除了每次调用的成本',
    'eight independent products: one after the other, then in our threads':
        '八个相互独立的矩阵乘法：先依次执行，再放到我们的线程中执行',
    'dependency depth': '依赖深度',
    'one data-parallel training step: what depends on what': '一个数据并行训练步骤：谁依赖谁',
    'time (illustrative units)': '时间（示意单位）',
    'list schedule: {m} units, versus {w} units one task at a time':
        '列表调度：{m} 个单位，逐个执行则需 {w} 个单位',
    # 04
    'a + b': '向量加法 a + b', 'matrix × vector': '矩阵 × 向量',
    "roofline from this notebook's measurements": '由本节测量得到的屋顶线', 'estimated peak': '估计的峰值',
    'arithmetic intensity (FLOP per byte)': '算术强度（每字节的浮点运算次数）',
    'the roofline of this machine': '这台机器的屋顶线',
    'matrix × vector, share of its memory roof': '矩阵 × 向量达到其内存屋顶的比例',
    'far below the memory roof: caches, threads or overhead limit it, not bandwidth alone':
        '远低于内存屋顶：限制它的是缓存、线程或开销，而不只是带宽',
    'on the scale of the memory roof: a matrix–vector product is memory-bound, as its intensity predicts':
        '与内存屋顶处于同一量级：正如其算术强度所预示的，矩阵–向量乘法受内存带宽限制',
    'matrix product, share of the estimated peak': '矩阵乘法达到估计峰值的比例',
    'far below the estimate: the estimate is likely too high for this chip, or other work shares the cores':
        '远低于估计值：这个估计对这块芯片多半偏高，或者有其他工作在占用核心',
    'below the estimate, as a well-tuned library should be': '低于估计值，调优良好的库本应如此',
    'above the estimate: the clock runs faster than the value used, so the estimate is too low':
        '高于估计值：实际主频比计算所用的值更高，所以估计偏低',
    'measured read throughput (1 thread)': '实测读取吞吐量（1 个线程）',
    'working set (bytes)': '工作集大小（字节）',
    'reading the same block again and again': '反复读取同一块数据',
    ' one element per 64-byte line': ' 每个 64 字节缓存行只读一个元素',
    'stride (elements)': '步长（元素个数）', 'ns per element read': '每读取一个元素的耗时（ns）',
    'reading every k-th float32': '每隔 k 个读取一个 float32',
    'busy cells of a 4×4 array multiplying two 4×4 matrices': '4×4 阵列计算两个 4×4 矩阵乘积时的忙碌单元',
    'cycle {t}': '周期 {t}', 'matrix side n': '矩阵边长 n', 'utilisation (%)': '利用率（%）',
    '{p}×{p} systolic array, n×n product': '{p}×{p} 脉动阵列，n×n 矩阵乘法',
    'CPU: {model}, {cores} physical cores ({threads} hardware threads), clock {clock} GHz ({source})':
        'CPU：{model}，{cores} 个物理核心（{threads} 个硬件线程），主频 {clock} GHz（{source}）',
    'vector units: {bits}-bit, fused multiply-add: {fma}': '向量单元：{bits} 位，乘加融合：{fma}',
    'data caches:': '数据缓存：',
    'copy of {mib:.0f} MiB: {all:.1f} GB/s with {threads} threads, {one:.1f} GB/s with one':
        '复制 {mib:.0f} MiB：{threads} 个线程 {all:.1f} GB/s，单线程 {one:.1f} GB/s',
    'ns per element, by stride:': '按步长，每个元素的耗时（ns）：',
    'stride 16 costs {r:.0f}× more per element than stride 1': '步长 16 时每个元素的耗时是步长 1 时的 {r:.0f} 倍',
    'NumPy flags: aligned {a} | byte-offset view {b}': 'NumPy 标志位：对齐的数组 {a} | 字节偏移的视图 {b}',
    'NumPy sum: aligned {a:.2f} ms, misaligned by 1 byte {b:.2f} ms ({r:.1f}×)':
        'NumPy 求和：对齐 {a:.2f} ms，错开 1 字节 {b:.2f} ms（{r:.1f}×）',
    'PyTorch sum: aligned {a:.2f} ms, one element later {b:.2f} ms ({r:.2f}×)':
        'PyTorch 求和：对齐 {a:.2f} ms，晚一个元素开始 {b:.2f} ms（{r:.2f}×）',
    'peak = {cores} cores × {clock:.2f} GHz × {lanes} lanes × 2 (FMA) × {units} FMA units = {peak:.0f} GFLOP/s (an estimate)':
        '峰值 = {cores} 个核心 × {clock:.2f} GHz × {lanes} 个通道 × 2（FMA）× {units} 个 FMA 单元 = {peak:.0f} GFLOP/s（估计值）',
    'matmul {n}×{n}: {rate:.0f} GFLOP/s = {share:.0%} of that peak': '矩阵乘法 {n}×{n}：{rate:.0f} GFLOP/s = 该峰值的 {share:.0%}',
    'matmul {n}×{n}: {rate:.0f} GFLOP/s (clock or vector width unknown: no peak estimate)':
        '矩阵乘法 {n}×{n}：{rate:.0f} GFLOP/s（主频或向量宽度未知：无法估计峰值）',
    'roofs: memory {m:.1f} GB/s, compute {c:.0f} GFLOP/s; ridge at {r:.1f} FLOP/byte':
        '屋顶：内存 {m:.1f} GB/s，计算 {c:.0f} GFLOP/s；脊点在 {r:.1f} FLOP/字节',
    'memory-bound': '受内存带宽限制',
    '  {name:<16} {i:8.2f} FLOP/byte {g:8.1f} GFLOP/s = {s:4.0%} of its roof ({bound})':
        '  {name:<16} {i:8.2f} FLOP/字节 {g:8.1f} GFLOP/s = 其屋顶的 {s:4.0%}（{bound}）',
    '{n}×{k} times {k}×{m} on a 4×4 array: matches torch.mm, {c} cycles, utilisation {u:.0%}':
        '在 4×4 阵列上计算 {n}×{k} 乘以 {k}×{m}：与 torch.mm 一致，{c} 个周期，利用率 {u:.0%}',
    'utilisation': '利用率',
    'knees found (first size that is clearly slower):': '找到的拐点（明显变慢的第一个大小）：',
    'caches the OS reports:': '操作系统报告的缓存：',
    '  {level}: {inside:5.1f} GB/s at {small} (fits) -> {outside:5.1f} GB/s at {large} (does not): {change:+.0%}':
        '  {level}：{small} 时 {inside:5.1f} GB/s（放得下）-> {large} 时 {outside:5.1f} GB/s（放不下）：{change:+.0%}',
    'dependent loads (pointer chasing, C)': '相互依赖的加载（指针追踪，C 程序）', 'ns per load': '每次加载的耗时（ns）',
    'the latency of one load, by working-set size': '单次加载的延迟与工作集大小',
    'cycles': '个周期',
    'while one dependent load waits for memory, a sequential read streams {b:,.0f} bytes':
        '一次依赖加载等待内存的时间里，顺序读取能传输 {b:,.0f} 字节',
    'memory latency / L1 latency': '内存延迟 / L1 延迟',
    'hardly a ladder: the largest block may still fit in a cache (raise sweep_max_mb)':
        '几乎看不出阶梯：最大的数据块可能仍然放得进缓存（请调大 sweep_max_mb）',
    'a ladder: every level is slower than the one before, memory by far the slowest':
        '阶梯分明：每一级都比上一级慢，内存远比其他各级都慢',
    'One core only: the two threads take turns, no cache line moves between cores, and there is nothing to measure here.':
        '只有一个核心：两个线程轮流执行，缓存行不会在核心之间移动，这里没有什么可测的。',
    'two threads, 10^8 increments each: counters in one line {a:.3f} s, two lines apart {b:.3f} s':
        '两个线程，各递增 10^8 次：计数器在同一缓存行 {a:.3f} s，相距两行（128 字节）{b:.3f} s',
    'one shared line / separate lines': '共享一个缓存行 / 位于不同缓存行',
    'no clear penalty: the two threads probably shared one core, taking turns':
        '没有明显的性能损失：两个线程多半共用了一个核心，轮流执行',
    'false sharing: the line moves between the cores on every increment':
        '伪共享：每递增一次，这个缓存行就要在两个核心之间移动一次',
    'a 256 → 64 layer in {p} NFU passes: largest error of the output {e:.4f}; the 16-bit inputs alone move the sums by at most {a:.4f}':
        '一层 256 → 64 的网络用了 {p} 趟 NFU：输出的最大误差 {e:.4f}；仅 16 位定点输入带来的求和偏差最多 {a:.4f}',
    'measured | datasheet | share': '实测 | 数据手册 | 占比',
    'not in common.GPU_DATASHEETS: compare with its datasheet by hand': '不在 common.GPU_DATASHEETS 中：请自行与它的数据手册对比',
    'matmul FP32 (CUDA cores)': '矩阵乘法 FP32（CUDA 核心）', 'matmul TF32 (tensor cores)': '矩阵乘法 TF32（张量核心）',
    'matmul BF16 (tensor cores)': '矩阵乘法 BF16（张量核心）', 'copy in device memory': '显存内复制',
    'host → device, pageable': '主机 → 设备，可分页内存', 'host → device, pinned': '主机 → 设备，锁页内存',
    'BF16 on tensor cores / FP32 on CUDA cores': '张量核心上的 BF16 / CUDA 核心上的 FP32',
    'little gain: no BF16 tensor cores on this GPU': '提升不大：这块 GPU 没有支持 BF16 的张量核心',
    'the tensor cores at work: the same product in a narrower type runs many times faster':
        '张量核心在起作用：同样的乘法换用更窄的数据类型，快了许多倍',
    'GPU 0 → GPU 1: {rate:.1f} GB/s (direct peer access: {peer})': 'GPU 0 → GPU 1：{rate:.1f} GB/s（点对点直接访问：{peer}）',
    'No GPU here: the GPU rungs of the latency ladder below stay textbook figures.':
        '这里没有 GPU：下文延迟阶梯中与 GPU 有关的台阶仍是教科书中的数字。',
    'L1 cache reference': '访问 L1 缓存', 'L2 cache reference': '访问 L2 缓存', 'L3 cache hit': 'L3 缓存命中',
    'memory reference, 64 MB block': '访问内存，64 MB 数据块', 'one PyTorch call on a tiny tensor': '对很小的张量调用一次 PyTorch',
    'launch a CUDA kernel': '启动一个 CUDA 内核', 'send 4 KB over 10 Gbit/s Ethernet': '经 10 Gbit/s 以太网发送 4 KB',
    'copy 1 MB in memory': '在内存中复制 1 MB', 'transfer 1 MB to the GPU over PCIe': '经 PCIe 向 GPU 传输 1 MB',
    'read 4 KB randomly from an NVMe SSD': '从 NVMe 固态硬盘随机读取 4 KB',
    'read 1 MB sequentially from an NVMe SSD': '从 NVMe 固态硬盘顺序读取 1 MB',
    'round trip within a data centre': '数据中心内的一次往返', 'read 1 MB sequentially from a disk': '从磁盘顺序读取 1 MB',
    'random disk access (seek + rotation)': '随机访问磁盘（寻道 + 旋转）',
    'one {n}×{n} float32 matmul': '一次 {n}×{n} 的 float32 矩阵乘法',
    'packet California → Netherlands → California': '数据包往返：加州 → 荷兰 → 加州',
    'textbook (Eshelman)': '教科书（Eshelman）', 'this machine': '这台机器', 'the latency ladder': '延迟阶梯',
    'textbook {t}': '教科书 {t}',
    # 05
    'activations / gradients': '激活值 / 梯度', 'partial results after every layer': '每层之后交换部分结果',
    'all-reduce of the gradients': '梯度的 all-reduce',
    'time per epoch, k replicas over one device': 'k 个副本与单个设备的每轮耗时之比',
    'the replicas were faster: they ran on separate devices': '多副本更快：各副本运行在不同的设备上',
    'about the same: the replicas shared the same hardware': '大致相同：各副本共用同一套硬件',
    'the replicas were slower: smaller shards and the allreduce cost more than they saved':
        '多副本更慢：更小的分片和 allreduce 的开销超过了节省的时间',
    'across layers\n(pipeline)': '按层拆分\n（流水线并行）',
    'within layers\n(tensor parallel)': '层内拆分\n（张量并行）',
    'across data\n(data parallel)': '按数据拆分\n（数据并行）',
    'layer {i}: GPU {g}': '第 {i} 层：GPU {g}', 'L{i}, half {h}': '第 {i} 层，第 {h} 部分',
    'layer {i}': '第 {i} 层', 'data shard {h}': '数据分片 {h}',
    'epoch': '轮数', 'test accuracy': '测试准确率',
    # 06
    '{n} buckets; share of all-reduce time during the backward pass: overlapped {a:.0%}, after backward {b:.0%}':
        '{n} 个桶；all-reduce 时间中落在反向传播期间的比例：重叠：{a:.0%}，反向传播之后再做：{b:.0%}',
    'step time, all-reduce after backward / overlapped': '每步耗时：反向传播之后再 all-reduce / 重叠',
    'overlapping cost time here: the all-reduce took cores that the backward pass needed':
        '在这里重叠反而费时：all-reduce 占用了反向传播需要的核心',
    'about the same: the all-reduce moved into the backward pass, but competes with it for the same cores':
        '差不多：all-reduce 挪进了反向传播期间，但与它争用同一批核心',
    'the overlap pays: part of the all-reduce hid behind the backward pass': '重叠有收益：一部分 all-reduce 隐藏在了反向传播背后',
    'forward': '前向传播', 'backward (gradients ready)': '反向传播（梯度就绪）',
    'all-reduce (bucket {k}, {kb:.0f} kB)': 'all-reduce（桶 {k}，{kb:.0f} kB）', 'optimiser step': '优化器更新',
    'DDP: each bucket is all-reduced as soon as it is ready': 'DDP：每个桶一就绪就做 all-reduce',
    'baseline: all buckets are all-reduced after backward': '对照：反向传播结束后再对所有桶做 all-reduce',
    'step {step:.0f} ms, {overlap:.0%} of all-reduce time during backward (median of {n} steps)':
        '每步 {step:.0f} ms，{overlap:.0%} 的 all-reduce 时间落在反向传播期间（{n} 步的中位数）',
    'time since the step began ({unit}); rank 0': '自本步开始以来的时间（{unit}）；rank 0',
    "a parameter's gradient is ready (colour: its bucket)": '某个参数的梯度就绪（颜色：所在的桶）',
    'backward() waits for the all-reduce': 'backward() 在等待 all-reduce',
    'all gradients of rank 0 computed': 'rank 0 的梯度全部算完', '... and of the slowest rank': '……以及最慢的 rank 的梯度全部算完',
    '{n} process(es): {rate:.0f} images/s, accuracy {acc:.3f}, speed-up {s:.2f}×, scaling efficiency {e:.0%}':
        '{n} 个进程：{rate:.0f} 张图像/秒，准确率 {acc:.3f}，加速比 {s:.2f}×，扩展效率 {e:.0%}',
    '{n} process(es)': '{n} 个进程',
    '{mode} mode: largest gradient difference, relative to the gradient: {gap:.1e}':
        '{mode}模式：梯度的最大差值（相对于梯度本身）：{gap:.1e}',
    'two replicas against one model, training mode': '训练模式下，两个副本与单个模型的梯度相对差异',
    'training': '训练', 'evaluation': '评估',
    'the same step: this model keeps no per-batch statistics': '步骤相同：这个模型不使用按批量计算的统计量',
    "a different step: each replica's BatchNorm normalises its own chunk with its own statistics":
        '不同的一步：每个副本的 BatchNorm 都用自己那一块数据的统计量做归一化',
    '1 process': '1 个进程', '2 processes': '2 个进程', 'perfect scaling': '理想的线性扩展',
    'images/s': '每秒图像数', 'DDP throughput on this machine': '这台机器上的 DDP 吞吐量',
    # 07
    's=0 against the synchronous server, first 10 steps: largest loss difference {g:.1e}':
        's=0 与同步服务器对比，前 10 步：损失的最大差值 {g:.1e}',
    '{run}: {s:.2f} s, steps per worker {steps}, at most {ahead} steps ahead, test loss {loss:.3f}, test accuracy {acc:.3f}':
        '{run}：{s:.2f} 秒，各工作节点的步数 {steps}，最多领先 {ahead} 步，测试损失 {loss:.3f}，测试准确率 {acc:.3f}',
    's=0, straggler, seed 1': 's=0，掉队者，随机种子 1',
    'synchronous ps_process': '同步 ps_process',
    's=0, straggler': 's=0，掉队者', 's=∞, straggler': 's=∞，掉队者', 's=0, hiccups': 's=0，间歇停顿',
    's=2, hiccups': 's=2，间歇停顿',
    'seconds': '秒', 'training loss (mean of 10 steps)': '训练损失（10 步的均值）', 'against time': '按时间',
    'updates applied': '已应用的更新次数', 'against updates': '按更新次数',
    'with a straggler, time at s=0 / at s=∞': '有掉队者时，s=0 与 s=∞ 的耗时之比',
    'no gain: the straggler barely held the others back': '没有收益：掉队者几乎没有拖慢其他节点',
    'asynchronous SGD finishes sooner: nobody waits for the straggler': '异步 SGD 更早完成：谁都不必等待掉队者',
    'with hiccups, time at s=0 / at s=2': '有间歇停顿时，s=0 与 s=2 的耗时之比',
    'no gain: the pauses were too short to matter': '没有收益：停顿太短，影响不大',
    'bounded staleness absorbs the hiccups: one worker runs ahead while the other pauses':
        '有界延迟吸收了间歇停顿：一个工作节点暂停时，另一个可以先走几步',
    'test loss after the same updates, s=∞ minus s=0, in units of what a rerun changes':
        '应用相同次数的更新之后的测试损失，s=∞ 减去 s=0，以重新运行一次带来的变化为单位',
    'lower with asynchrony, by more than a rerun changes it': '异步时更低，差别超过了重新运行一次带来的变化',
    'within what a rerun changes: at this size, the harm of staleness is too small to measure':
        '在重新运行一次带来的变化之内：在这样的规模下，过时造成的损害小到测不出来',
    'higher with asynchrony, by more than a rerun changes it: stale gradients hurt':
        '异步时更高，差别超过了重新运行一次带来的变化：过时的梯度造成了损害',
    's=∞, straggler, again': 's=∞，掉队者，再运行一次',
    '4 KiB over 1024 devices, tree over ring': '1024 个设备上的 4 KiB：树与环的耗时之比',
    'the tree wins for small messages on many devices: fewer steps, each paying alpha':
        '设备很多、消息很小时树胜出：步数更少，而每一步都要付出 alpha',
    "the ring still wins here: this link's alpha is small beside its beta":
        '这里环仍然胜出：这条链路的 alpha 比起 beta 来很小',
    'via GPU 0': '经由 GPU 0', 'via the CPU': '经由 CPU', 'split over all': '分块聚合', 'ring': '环同步',
    'ring over model, worst payload': '环的实测耗时与模型预测之比（偏差最大的数据量）',
    'the model follows the ring at every payload': '在每种数据量下，模型都与环的实测相符',
    'some payloads took several times the model: a ring step waited for the other process':
        '某些数据量的耗时是模型的好几倍：环的某一步在等待另一个进程',
    'ring over model, largest payload': '环的实测耗时与模型预测之比（最大数据量）',
    'the ring beat the model at the largest payload': '在最大数据量下，环的实测耗时比模型预测的短',
    'the model predicts the largest transfer well': '模型很好地预测了最大的那次传输',
    'the ring took longer than the model: costs the model leaves out grow with the size':
        '环的实测耗时超过模型预测：模型没有计入的开销随数据量增长',
    'number of devices': '设备数', 'sync time (ms)': '同步时间（ms）',
    '{s:.0f} MB of gradients over {b:.0f} GB/s links': '{s:.0f} MB 梯度，{b:.0f} GB/s 链路',
    'two rings over the NVLinks of 8 GPUs\n(green: 2 links per hop, purple: 1)':
        '8 块 GPU 的 NVLink 上的两个环\n（绿色：每跳 2 条链路，紫色：1 条）',
    'device': '设备', 'start': '开始', 'chunk': '块', 'step {t}': '第 {t} 步', 'step': '步数',
    'our ring_allreduce (measured)': '我们的 ring_allreduce（实测）',
    'dist.all_reduce, gloo (measured)': 'dist.all_reduce，gloo（实测）',
    'alpha-beta model of the ring': '环的 α–β 模型',
    'one message (ping-pong)': '单条消息（乒乓）',
    'payload (bytes)': '数据量（字节）', 'all-reduce over 2 CPU processes': '2 个 CPU 进程上的 all-reduce',
    'every GPU to 1 server': '每块 GPU 各自发往 1 个服务器', 'every GPU to m servers': '每块 GPU 各自发往 m 个服务器',
    'hierarchical, m servers': '分层同步，m 个服务器', 'machines m (8 GPUs each)': '机器数 m（每台 8 块 GPU）',
    '{s:.0f} MB, NVLink inside machines, {b:.0f} GB/s network':
        '{s:.0f} MB，机器内 NVLink，网络 {b:.0f} GB/s',
    'training loss (worker 0)': '训练损失（工作节点 0）',
    # 08: memory, sharded, tensor and pipeline parallelism
    'CPU cores: {c}; each experiment below runs {n} CPU processes over gloo':
        'CPU 核心数：{c}；下面的每个实验都运行 {n} 个通过 gloo 连接的 CPU 进程',
    '{n:,} parameters, batch {b}; bytes:': '{n:,} 个参数，批量大小 {b}；字节数：',
    'measured': '测量值', 'formula': '公式', 'total': '合计',
    'parameters': '参数', 'gradients': '梯度', 'optimizer state': '优化器状态', 'activations': '激活值',
    'every part is within 0.1 % of its formula': '每一部分与公式的偏差都在 0.1% 以内',
    'stage {s}: {ours:7.3f} GB per GPU (paper: {gb} GB)': '阶段 {s}：每块 GPU {ours:7.3f} GB（论文：{gb} GB）',
    'ZeRO stage {s}': 'ZeRO 阶段 {s}', '80 GB device': '80 GB 的设备', 'ranks N': 'rank 数 N',
    'GB per rank': '每个 rank 的 GB 数',
    '7.5B parameters, Adam, bf16 mixed precision': '75 亿参数，Adam，bf16 混合精度',
    '{k} trainings on {n} processes took {t:.1f} s': '在 {n} 个进程上进行 {k} 次训练，用时 {t:.1f} 秒',
    'largest difference from DDP, over every rank and step: {d:.1e}':
        '所有 rank 和所有步中与 DDP 的最大差值：{d:.1e}',
    'rank {r}, measured': 'rank {r}，测量值', '{mode}: ZeRO stage {s}': '{mode}：ZeRO 阶段 {s}',
    'largest ZeRO-1 share over the formula': 'ZeRO-1 中最大的份额与公式之比',
    'the shares are even': '各份额是均匀的',
    'uneven shares: whole tensors go to one rank each': '份额不均匀：每个完整的张量只分给一个 rank',
    'counted collectives': '统计到的集合通信', 'sent per rank (ring)': '每个 rank 的发送量（环形）',
    'step time': '每步耗时',
    'FSDP step time over DDP step time': 'FSDP 与 DDP 每步耗时之比',
    'no visible cost: the extra all-gathers hide behind the computation':
        '看不出代价：额外的 all-gather 隐藏在计算背后',
    'FSDP is slower here: its extra collectives and copies are not hidden':
        '这里 FSDP 更慢：它额外的集合通信和复制没有被隐藏',
    "07's example: DDP {a:.1f} ms, FSDP {b:.1f} ms of communication per step":
        '第 07 节的例子：每步的通信时间，DDP {a:.1f} ms，FSDP {b:.1f} ms',
    'partial {i}': '部分和 {i}', 'split by columns': '按列切分', 'split by rows': '按行切分',
    'Megatron MLP block on {n} ranks: colour = rank': '{n} 个 rank 上的 Megatron MLP 块：颜色表示 rank',
    'columns then rows: largest difference {d:.1e}': '先按列、再按行：最大差值 {d:.1e}',
    'rows first, GELU on partial sums: largest difference {d:.1e}':
        '先按行切分，对部分和做 GELU：最大差值 {d:.1e}',
    'first': '第一个', 'second': '第二个',
    '{name} Linear: weight {whole} split into {local} on each rank':
        '{name}线性层：权重 {whole} 切分为每个 rank 上的 {local}',
    'collectives: forward {f}, backward {b}': '集合通信：前向 {f}，反向 {b}',
    'largest relative difference from the unsplit block: {d:.1e}': '与未切分的块相比，最大相对差值：{d:.1e}',
    '{k} schedules on {n} stages took {t:.1f} s': '在 {n} 个阶段上运行 {k} 种调度，用时 {t:.1f} 秒',
    'largest relative difference from the unsplit model: {d:.1e}': '与未切分的模型相比，最大相对差值：{d:.1e}',
    'stage {r}': '阶段 {r}', 'schedule': '调度', 'held': '同时保存',
    'formula (p-1)/(m+p-1)': '公式 (p-1)/(m+p-1)', 'measured, GPipe': '测量值，GPipe', 'measured, 1F1B': '测量值，1F1B',
    'micro-batches m': '微批量数 m', 'idle fraction': '空闲比例', '{p} stages': '{p} 个阶段',
    'idle fraction at m=1 over the formula': 'm=1 时空闲比例与公式之比',
    'below the formula: the stages overlapped more than the schedule allows':
        '低于公式：各阶段的重叠超出了调度所允许的程度',
    'the formula predicts the one-micro-batch pipeline': '公式准确预测了只有一个微批量的流水线',
    'above the formula: hand-overs between the stages cost time': '高于公式：阶段之间的交接花费了时间',
    'replay': '重放', 'replay, free hand-overs': '重放，交接不花时间',
    'idle fraction at m={m}, measured over the replay': 'm={m} 时空闲比例的测量值与重放值之比',
    'hand-overs cost little: the rest of the gap is unequal stages': '交接的开销很小：其余的差距来自各阶段耗时不均',
    'hand-overs cost a visible part of every step: a stage waits for data':
        '交接占去了每一步中明显的一部分时间：有阶段在等待数据',
    'activations held at once with m={m}: GPipe {g} micro-batches, 1F1B {o}':
        'm={m} 时同时保存激活值的微批量数：GPipe {g} 个，1F1B {o} 个',
}

# Fonts that cover Chinese, best first: Linux packages, then Windows and macOS.
CJK_FONTS = ('Noto Sans CJK SC', 'Noto Sans SC', 'Source Han Sans SC', 'WenQuanYi Micro Hei',
             'WenQuanYi Zen Hei', 'Noto Sans CJK JP', 'Microsoft YaHei', 'SimHei', 'PingFang SC',
             'Hiragino Sans GB', 'Heiti SC', 'Arial Unicode MS')
_CJK_STATE = {}


def cjk_font():
    """Name of an installed font with Chinese glyphs, registered with matplotlib; None if none.

    Looks through matplotlib's font list first, then through the system's
    font files (a font installed after matplotlib built its cache).
    Used by tr() and by the set-up's font check.
    """
    if 'font' not in _CJK_STATE:
        from matplotlib import font_manager
        names = {f.name for f in font_manager.fontManager.ttflist}
        found = next((n for n in CJK_FONTS if n in names), None)
        if found is None:
            hints = ('cjk', 'wqy', 'sourcehan', 'msyh', 'simhei', 'pingfang', 'hiragino')
            for path in font_manager.findSystemFonts():
                if any(h in Path(path).name.lower().replace('-', '') for h in hints):
                    try:
                        font_manager.fontManager.addfont(path)
                    except (OSError, RuntimeError):
                        continue
            names = {f.name for f in font_manager.fontManager.ttflist}
            found = next((n for n in CJK_FONTS if n in names), None)
        _CJK_STATE['font'] = found
    return _CJK_STATE['font']


def _use_cjk_font():
    # Chinese glyphs come from the CJK font; Latin ones stay in the default font.
    import matplotlib
    font = cjk_font()
    if font and not _CJK_STATE.get('active'):
        # matplotlib falls back along font.family: glyphs the first family lacks come from the next
        families = [f for f in matplotlib.rcParams['font.family'] if f != font]
        matplotlib.rcParams['font.family'] = families + [font]
        _CJK_STATE['active'] = True
    return font


def tr(text, **fields):
    """Figure text in the notebook's language: tr('time (ms)'), tr('step {t}', t=3).

    In Chinese notebooks the text is looked up in FIGURE_TEXT and the figure
    font gains Chinese glyphs. Without a Chinese font the text stays English
    (a one-time notice says how to install one), so no figure shows boxes.
    Used in: 00-08 (every figure).
    """
    out = text
    if course_language() == 'zh' and text in FIGURE_TEXT:
        if _use_cjk_font():
            out = FIGURE_TEXT[text]
        elif not _CJK_STATE.get('warned'):
            _CJK_STATE['warned'] = True
            print('没有找到中文字体，图中文字暂用英文。安装方法：sudo apt-get install fonts-wqy-microhei'
                  '（Debian/Ubuntu），然后重启内核。')
    return out.format(**fields) if fields else out


def _in_notebook():
    # True inside a Jupyter kernel (not in a plain script, a test or a worker process).
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and 'IPKernelApp' in shell.config


# Import-time adjustment (one of two; the other silences cpp_extension above):
# a Chinese notebook's figures need the Chinese font before the first figure is
# made. matplotlib fixes a text's font family when the axes are created, so
# turning it on at the first tr() would be too late for labels set afterwards.
if course_language() == 'zh' and 'IPython' in sys.modules and _in_notebook():
    _use_cjk_font()


# ---------------------------------------------------------- devices, tiers


def num_gpus():
    """Number of CUDA GPUs this process can see. Used in: 00, 05, 06.

    Every decision the course makes about GPUs goes through torch.cuda's
    is_available() and device_count(): the tests fake a GPU count there.
    """
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _check_index(i):
    if isinstance(i, bool) or not isinstance(i, int) or i < 0:
        raise ValueError(f'GPU index must be a whole number >= 0, got {i!r}.')


def try_gpu(i=0):
    """Return cuda:i if it exists, otherwise the CPU. Used in: 01, 02, 04, 05."""
    _check_index(i)
    return torch.device(f'cuda:{i}') if i < num_gpus() else torch.device('cpu')


def gpu(i=0):
    """Return cuda:i, or raise a clear error when this machine has no such GPU. Used in: 00, 04."""
    _check_index(i)
    n = num_gpus()
    if i >= n:
        have = 'no GPU' if n == 0 else f'{n} GPU(s): cuda:0..cuda:{n - 1}'
        raise RuntimeError(
            f'cuda:{i} was requested, but this machine has {have}. '
            f'Use common.try_gpu({i}) to fall back to the CPU, or check '
            'CUDA_VISIBLE_DEVICES and nvidia-smi.')
    return torch.device(f'cuda:{i}')


def try_all_gpus():
    """All GPUs as a list; [cpu] when there is none (never empty). Used in: 00, 03, 06."""
    return [torch.device(f'cuda:{i}') for i in range(num_gpus())] or [torch.device('cpu')]


TIER_TEXT = {
    'T0': ('CPU only', '仅 CPU'),
    'T1': ('one GPU', '单 GPU'),
    'T2': ('two or more GPUs', '两块及以上 GPU'),
    'T3': ('several machines (torchrun multi-node)', '多台机器（torchrun 多节点）'),
}


def detect_tier():
    """The hardware tier: 'T0' (CPU only), 'T1' (one GPU), 'T2' (several GPUs), 'T3' (several machines).

    T3 is recognised under torchrun when WORLD_SIZE exceeds LOCAL_WORLD_SIZE.
    Used by settings() and environment_report().
    """
    world = int(os.environ.get('WORLD_SIZE', '1'))
    local = int(os.environ.get('LOCAL_WORLD_SIZE', world))
    if world > local:
        return 'T3'
    n = num_gpus()
    return 'T0' if n == 0 else 'T1' if n == 1 else 'T2'


def hardware_summary():
    """A dict describing this machine: Python, PyTorch, CPU, GPUs, tier.

    Used by environment_report() (00).
    """
    gpus = [torch.cuda.get_device_name(i) for i in range(num_gpus())]
    return {
        'python': platform.python_version(),
        'torch': torch.__version__,
        'os': f'{platform.system()} {platform.machine()}',
        'cpu_cores': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'gpus': gpus,
        'tier': detect_tier(),
    }


def environment_report(data_root=None):
    """Print what this machine is and what the course can do for real on it. Used in: 00."""
    info = hardware_summary()
    tier = info['tier']
    try:
        data = str(find_fashion_mnist(data_root, download=False))
    except FileNotFoundError:
        data = None
    gpus = ', '.join(info['gpus']) or say('none', '无')
    compiler = next(filter(None, map(shutil.which, ('c++', 'g++', 'clang++', 'cl'))), None)
    rows = [
        ('Python', info['python']),
        ('PyTorch', info['torch']),
        (say('system', '系统'), info['os']),
        (say('CPU cores', 'CPU 核数'), f"{info['cpu_cores']} ({say('PyTorch threads', 'PyTorch 线程')}: "
                                        f"{info['torch_threads']})"),
        ('GPU', gpus),
        ('Fashion-MNIST', data or say('NOT FOUND (sections 05-06 need it; see README)',
                                      '未找到（第 05–06 节需要，见 README）')),
        (say('C++ compiler', 'C++ 编译器'), compiler or say(
            'NOT FOUND: torch.compile cannot build CPU kernels (see README)',
            '未找到：torch.compile 无法生成 CPU 内核（见 README）')),
        (say('tier', '档位'), f"{tier}: {TIER_TEXT[tier][course_language() == 'zh']}"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f'{k:<{width}}  {v}')
    real = {
        'T0': say('Real here: compilation, CPU timing, threads, several CPU processes over '
                  'torch.distributed (gloo).\nSimulated or quoted: GPU asynchrony, streams, '
                  'multi-GPU speed-ups (reference figures are labelled with their hardware).',
                  '本机真实可测：编译、CPU 计时、多线程、基于 torch.distributed（gloo）的多个 CPU 进程。\n'
                  '模拟或引用：GPU 异步、CUDA 流、多 GPU 加速（引用的参考数据都注明了硬件）。'),
        'T1': say('Real here: everything on one GPU (asynchrony, streams, copies).\n'
                  'Simulated or quoted: two-GPU parallelism (two CUDA streams or CPU processes '
                  'stand in).',
                  '本机真实可测：单 GPU 上的一切（异步、CUDA 流、数据拷贝）。\n'
                  '模拟或引用：双 GPU 并行（由两个 CUDA 流或多个 CPU 进程代替）。'),
        'T2': say('Real here: multi-GPU training with NCCL. Quoted: multi-machine runs.',
                  '本机真实可测：基于 NCCL 的多 GPU 训练。引用：多机运行。'),
        'T3': say('Real here: multi-machine training with torchrun.',
                  '本机真实可测：用 torchrun 进行多机训练。'),
    }
    print(real[tier])
    return info


# ------------------------------------------------------ settings by hardware

SETTINGS_ENV = 'COURSE_SETTINGS'


def _split_top_level(text):
    # "T0, sizes=[1, 2], lr=0.1" -> ['T0', 'sizes=[1, 2]', 'lr=0.1']: commas inside brackets stay.
    parts, depth, current = [], 0, ''
    for ch in text:
        depth += (ch in '([{') - (ch in ')]}')
        if ch == ',' and depth == 0:
            parts.append(current)
            current = ''
        else:
            current += ch
    return [p.strip() for p in parts + [current] if p.strip()]


def _parse_override(text):
    tier, values = None, {}
    for part in _split_top_level(text):
        if '=' not in part:
            if part.upper() not in TIER_TEXT:
                raise ValueError(
                    f'{SETTINGS_ENV}={text!r}: {part!r} is neither a tier '
                    f'({", ".join(TIER_TEXT)}) nor key=value.')
            tier = part.upper()
            continue
        key, value = (s.strip() for s in part.split('=', 1))
        try:
            values[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            values[key] = value
    return tier, values


def _kind(value):
    # The kinds an override is checked against: an int may stand where a float is
    # expected, a list where a tuple is, and bool is not a number here.
    if isinstance(value, bool) or value is None:
        return type(value).__name__.replace('NoneType', 'None')
    return {int: 'number', float: 'number', list: 'list', tuple: 'list'}.get(type(value), type(value).__name__)


def _fits(value, examples):
    # Does an override have the kind of the notebook's own values for that key?
    # A whole-number setting refuses a float (epochs=2.5); a float setting takes an int.
    if isinstance(value, float) and all(isinstance(e, int) and not isinstance(e, bool) for e in examples):
        return False
    return _kind(value) in {_kind(e) for e in examples}


def _type_names(examples):
    return ' or '.join(sorted({'int' if isinstance(e, int) and not isinstance(e, bool)
                                else _kind(e) for e in examples}))


def settings(**per_tier):
    """Pick this notebook's settings by hardware tier, apply COURSE_SETTINGS, print them.

    Call as settings(T0=dict(...), T1=dict(...), ...). T0 is required and
    names every setting with its CPU value; a higher tier lists only what
    changes there and inherits the rest from the tiers below it. So a
    CPU-sized experiment (threads, CPU processes) keeps its T0 size on a
    machine with GPUs unless a tier changes it on purpose.

    COURSE_SETTINGS may name a tier and/or change values, for example
    COURSE_SETTINGS="T0,epochs=3"; each value must have the type the notebook
    uses for that key. The printed line says which tier's settings were used
    and, only when there was one, what the override changed.
    Used in: 01-08 (first code cell).
    """
    if 'T0' not in per_tier or set(per_tier) - set(TIER_TEXT):
        raise ValueError('settings() needs T0=dict(...) and accepts only T0..T3.')
    keys = set(per_tier['T0'])
    for name, values in per_tier.items():
        extra = set(values) - keys
        if extra:
            raise ValueError(f'settings(): {name} sets {sorted(extra)}, which T0 lacks; '
                             'T0 must name every setting (with its CPU value).')
    forced, overrides = _parse_override(os.environ.get(SETTINGS_ENV, ''))
    tier = forced or detect_tier()
    order = list(TIER_TEXT)
    values, used = {}, []
    for name in order[:order.index(tier) + 1]:
        if name in per_tier:
            values.update(per_tier[name])
            used.append(name)
    unknown = set(overrides) - keys
    if unknown:
        raise ValueError(f'{SETTINGS_ENV}: unknown setting(s) {sorted(unknown)}; '
                         f'this notebook has {sorted(keys)}.')
    for key, value in overrides.items():
        examples = [v[key] for v in per_tier.values() if key in v]
        if not _fits(value, examples):
            raise ValueError(f'{SETTINGS_ENV}: {key}={value!r} is not a {_type_names(examples)} '
                             f'(this notebook uses {key}={per_tier["T0"][key]!r} on T0).')
        if isinstance(value, (list, tuple)) and isinstance(examples[0], (list, tuple)):
            value = type(examples[0])(value)
        values[key] = value
    shown = ', '.join(f'{k}={v!r}' for k, v in values.items())
    source = used[-1] if len(used) == 1 else ' + '.join(reversed(used))
    line = say(f'tier {tier} ({TIER_TEXT[tier][0]}), settings of {source}: {shown}',
               f'档位 {tier}（{TIER_TEXT[tier][1]}），采用 {source} 的设置：{shown}')
    if forced or overrides:
        changed = ([f'tier={forced}'] if forced else []) + [f'{k}={v!r}' for k, v in overrides.items()]
        line += f'  [override: {SETTINGS_ENV} ' + ', '.join(changed) + ']'
    print(line)
    return SimpleNamespace(tier=tier, **values)


# ------------------------------------------------- worker processes (00, 05-08)
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

    fn must live in an importable module (common.py or a .py file), not in a
    notebook. Returns the list of return values by rank. A worker's exception
    is re-raised here with its traceback; a worker that dies without a word
    is named; a hang raises TimeoutError after `timeout` seconds. No process
    or port outlives the call. `threads` is each worker's PyTorch thread
    count (default: the cores shared out). `op_timeout` (seconds) bounds every
    single send, receive or collective inside the workers (torch's default
    is 30 minutes); `names` labels the ranks in error messages, e.g. 'worker 1'.
    Workers are daemon processes, so they cannot start DataLoader worker
    processes of their own (num_workers must stay 0 inside fn).
    Used in: 00, 05, 07, 08.
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
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    ctx = mp.get_context('spawn')
    results = ctx.Queue()
    # The store lives here, on a port the OS picks, so parallel notebooks never collide.
    store = dist.TCPStore('127.0.0.1', 0, world_size + 1, is_master=True, wait_for_workers=False)
    procs = []
    try:
        for rank in range(world_size):
            p = ctx.Process(target=_worker_main, daemon=True,
                            args=(rank, world_size, store.port, backend, threads, fn, args,
                                  results, os.getpid(), op_timeout))
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
    Used by the workers of 00, 05 and 07.
    """
    return torch.device(f'cuda:{dist.get_rank()}') if dist.get_backend() == 'nccl' else torch.device('cpu')


def allreduce_check(rank, world_size):
    """Worker for launch(): all-reduce each rank's number; every rank returns the sum.

    Rank r contributes r + 1, so every rank returns world_size·(world_size+1)/2.
    Works over gloo and, with launch(..., backend='nccl'), on GPUs. Used in: 00.
    """
    t = torch.tensor([float(rank + 1)], device=worker_device())
    dist.all_reduce(t)
    return t.item()


class WorkerError(RuntimeError):
    """A worker process failed; the message holds its rank and traceback."""


def free_port():
    """A TCP port on 127.0.0.1 that was free a moment ago (another process may take it first).

    Used in: 06 (torchrun rendezvous) and the browser test.
    """
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
    Used in: 06.
    """
    base = [sys.executable, '-m', 'torch.distributed.run', f'--nproc-per-node={nproc_per_node}']
    if nnodes == 1:
        commands = [base + ['--standalone', str(script), *map(str, args)]]
    else:
        rendezvous = [f'--nnodes={nnodes}', '--rdzv-backend=c10d', f'--rdzv-id={uuid.uuid4().hex[:8]}',
                      f'--rdzv-endpoint=127.0.0.1:{free_port()}']
        commands = [base + rendezvous + [str(script), *map(str, args)]] * nnodes
    visible = node_gpus(nnodes, nproc_per_node)
    if show:
        for node, command in enumerate(commands):
            prefix = f'CUDA_VISIBLE_DEVICES={visible[node]} ' if visible[node] is not None else ''
            print(f'node {node}: {prefix}' + shlex.join(['torchrun'] + command[3:]))
    logs = [tempfile.TemporaryFile(mode='w+') for _ in commands]
    procs = [subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                              env=None if gpus is None else {**os.environ, 'CUDA_VISIBLE_DEVICES': gpus},
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
                raise RuntimeError(f'torchrun {script} (node {node}) exited with code {p.returncode}:\n'
                                   + '\n'.join(output(node).splitlines()[-60:]))
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
    GPUs i·nproc_per_node … (i+1)·nproc_per_node − 1. Used by torchrun().
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
    group is not enough. Used by torchrun() and the browser test.
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
    # Exit if the launching process disappears (kernel killed): no orphans.
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True).start()


def _worker_main(rank, world_size, port, backend, threads, fn, args, results, parent_pid,
                 op_timeout=None):
    """Entry point of a worker process started by launch()."""
    _watch_parent(parent_pid)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR='127.0.0.1',
                      MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    joined = False
    try:
        if backend == 'nccl':
            torch.cuda.set_device(rank)
        store = dist.TCPStore('127.0.0.1', port, world_size + 1, is_master=False)
        extra = {} if op_timeout is None else {'timeout': datetime.timedelta(seconds=op_timeout)}
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **extra)
        joined = True
        outcome = (rank, 'ok', fn(rank, world_size, *args))
    except BaseException as e:
        tb = traceback.format_exc()
        try:
            pickle.dumps(e)
            exc = e
        except Exception:
            exc = None
        outcome = (rank, 'error', (exc, tb, time.time()))
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
        if status == 'error':
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
        if status == 'error':
            _raise_first_error(rank, payload, results, procs, names)
        done[rank] = payload
    return [done[r] for r in range(len(procs))]


# --------------------------------------------------------------- measuring (00-05)


def synchronize(device=None):
    """Wait for queued kernels on a CUDA device, or on every GPU when device is None (no-op on the CPU).

    Used in: 02, 03, 05, and by every timing helper below.
    """
    if device is None:
        for i in range(num_gpus()):
            torch.cuda.synchronize(i)
    elif torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


class Timer:
    """Record several running times (d2l's Timer). Used in: 05."""

    def __init__(self):
        self.times = []
        self.start()

    def start(self):
        """Start the clock."""
        self.tik = time.perf_counter()

    def stop(self):
        """Stop the clock, record and return the time since start()."""
        self.times.append(time.perf_counter() - self.tik)
        return self.times[-1]

    def avg(self):
        """Average of the recorded times."""
        return sum(self.times) / len(self.times)

    def sum(self):
        """Sum of the recorded times."""
        return sum(self.times)


class Benchmark:
    """Context manager that times its block, synchronising the device at both ends.

    sync=False stops the clock without waiting for queued GPU work: it then
    measures how long it took to *submit* the work (notebook 02 shows why).
    Used in: 02, 04.
    """

    def __init__(self, description='Done', device=None, verbose=True, sync=True):
        self.description, self.device, self.verbose = description, device, verbose
        self.sync, self.elapsed = sync, None

    def __enter__(self):
        synchronize(self.device)
        self.timer = Timer()
        return self

    def __exit__(self, *exc):
        if self.sync:
            synchronize(self.device)
        self.elapsed = self.timer.stop()
        if self.verbose and exc[0] is None:
            print(f'{self.description}: {self.elapsed:.4f} sec')


def measure(fn, *args, repeats=None, sync=True, device=None, min_run_time=0.2):
    """Median seconds per call of fn(*args), after a warm-up call, device synchronised.

    Without `repeats`, torch.utils.benchmark's blocked_autorange runs fn in
    blocks until `min_run_time` seconds have passed, synchronising the current
    GPU around each block, and returns the median time per call. We give it all of
    PyTorch's threads: its own default is ONE thread, which would quietly time
    a different program than the one you run.

    With `repeats`, each of `repeats` calls is timed on its own (everything
    synchronised before each call) and the median returned. sync=False then
    stops the clock as soon as fn returns, without waiting for the device
    (every GPU if device is None): notebook 02 uses that to see asynchrony.
    Used in: 01-04, 07.
    """
    if repeats is None:
        if not sync:
            raise ValueError('sync=False needs repeats=...: blocked_autorange always synchronises.')
        from torch.utils import benchmark  # imported late: it loads cpp_extension, which logs
        fn(*args)  # warm-up: first-call costs (allocation, compilation) stay out
        synchronize(device)
        timer = benchmark.Timer(stmt='fn(*args)', globals={'fn': fn, 'args': args},
                                            num_threads=torch.get_num_threads())
        return timer.blocked_autorange(min_run_time=min_run_time).median
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f'repeats must be a whole number >= 1, got {repeats!r}.')
    fn(*args)
    synchronize(device)
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        fn(*args)
        if sync:
            synchronize(device)
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def text(message):
    """A sentence printed for the reader, in the notebook's language.

    English is looked up in FIGURE_TEXT, so code cells stay the same, and free
    of Chinese, in both languages; an (English, Chinese) pair works too.
    Used in: 01, 02, 03, 08, and by verdict(), sync_calculator() and memory_calculator().
    """
    if isinstance(message, (tuple, list)):
        return say(*message)
    return FIGURE_TEXT.get(message, message) if course_language() == 'zh' else message


class Case(str):
    """The key of the case verdict() chose: an ordinary string that a notebook does not echo.

    A cell that ends with common.verdict(...) shows only the printed verdict line.
    Used by verdict().
    """

    def _ipython_display_(self):
        pass


def verdict(what, value, cases, unit='×', digits=2, shown=None):
    """Print the conclusion a measurement supports, in the notebook's language; return its case.

    `what` names the measured quantity and each case's text says what it
    means, in English; a Chinese notebook prints their FIGURE_TEXT entries
    (a test checks that every text the notebooks pass has one). An explicit
    (English, Chinese) pair works too. `cases` is a list of
    (upper_bound, key, text) with increasing bounds: the first case whose
    bound exceeds `value` applies (use math.inf for the last). `shown`
    replaces the printed number, e.g. to show both sides of a comparison.

        verdict('compile/eager at batch 1', 0.64,
                [(0.9, 'slower', 'compile is slower: overhead-bound'),
                 (1.1, 'same', 'no difference'),
                 (math.inf, 'faster', 'compile is faster')])
        # Verdict: compile/eager at batch 1: 0.64× → compile is slower: overhead-bound

    The prose then explains the cases and points at the verdict, so it never
    has to copy a number from one particular run. Used in: 01-08.
    """
    if not cases:
        raise ValueError('verdict() needs at least one case.')
    bounds = [bound for bound, _, _ in cases]
    if bounds != sorted(bounds):
        raise ValueError(f'the cases\' upper bounds must increase, got {bounds}.')
    if not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f'verdict() needs a measured number, got {value!r}.')
    for bound, key, case_text in cases:
        if value < bound:
            break
    else:
        raise ValueError(f'{value!r} is not below any case bound {bounds}: add a last case '
                         'with math.inf.')
    number = shown if shown is not None else f'{value:.{digits}f}{unit}'
    print(say('Verdict: ', '结论：') + f'{text(what)}{say(": ", "：")}{number} → {text(case_text)}')
    return Case(key)


def cache_knees(sizes, rates, drop=0.8):
    """Working-set sizes at which read throughput falls clearly: the first size of each step down.

    On a 3-point running median (one noisy point is not a knee), a knee is
    where the rate falls below `drop` times the best rate since the last knee.
    A knee closer than a factor of 4 to the previous one belongs to the same
    step. Heuristic, for the print-out beside the plot. Used in: 04.
    """
    if len(sizes) != len(rates) or len(sizes) < 3:
        raise ValueError(f'need as many rates as sizes, at least 3; got {len(sizes)} and {len(rates)}.')
    smooth = [rates[0]] + [float(np.median(rates[i - 1:i + 2])) for i in range(1, len(rates) - 1)] \
        + [rates[-1]]
    knees, plateau = [], smooth[0]
    for size, rate in zip(sizes[1:], smooth[1:]):
        if rate < drop * plateau:
            if not knees or size >= 4 * knees[-1]:
                knees.append(size)
            plateau = rate
        else:
            plateau = max(plateau, rate)
    return knees


def compile_c(source, *flags):
    """Compile a C file with the machine's compiler; return the path of the program.

    The program is written next to the source. Tries cc, gcc and clang, then
    the C++ compiler the course already needs for torch.compile (the course's
    C files are valid C++ too). A failed compilation raises with the
    compiler's own message. Used in: 04.
    """
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f'no C source at {source}.')
    compiler = next(filter(None, map(shutil.which, ('cc', 'gcc', 'clang', 'c++', 'g++', 'clang++'))), None)
    if compiler is None:
        raise RuntimeError(say('No C or C++ compiler found; install one (sudo apt-get install g++) '
                               'and run this cell again.',
                               '没有找到 C 或 C++ 编译器；请先安装（sudo apt-get install g++），再运行本单元格。'))
    program = source.with_suffix('.exe' if os.name == 'nt' else '')
    done = subprocess.run([compiler, '-O2', str(source), '-o', str(program), *flags],
                          capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise RuntimeError(f'{Path(compiler).name} could not compile {source}:\n{done.stderr[-3000:]}')
    return program


# Datasheet figures of common NVIDIA GPUs (source: NVIDIA's datasheets). Tensor-core rates are
# dense: datasheets quote them "with sparsity", twice the dense rate. The first matching row wins.
GPU_DATASHEETS = [  # (pattern in the device name, FP32, TF32, BF16 in TFLOP/s, memory GB/s)
    (r'GH200', 67, 494.7, 989.5, 4000),             # the 96 GB HBM3 Grace Hopper; 4900 with HBM3e
    (r'H200.*NVL', 60, 417.5, 835.5, 4800),
    (r'H200', 67, 494.7, 989.5, 4800),
    (r'H100.*NVL', 60, 417.5, 835.5, 3900),
    (r'H100.*PCIe', 51, 378, 756, 2000),
    (r'H100', 67, 494.7, 989.5, 3350),
    (r'A100.*(80GB.*PCIe|PCIE.*80GB)', 19.5, 156, 312, 1935),
    (r'A100.*80GB', 19.5, 156, 312, 2039),
    (r'A100', 19.5, 156, 312, 1555),
    (r'L4\b', 30.3, 60, 121, 300),
    (r'V100', 15.7, None, None, 900),
    (r'T4\b', 8.1, None, None, 320),
]


def gpu_datasheet(name):
    """The datasheet row for a GPU name as torch.cuda.get_device_name reports it, or None.

    Returns a dict with fp32, tf32, bf16 (TFLOP/s; None where the chip has no
    such tensor-core mode) and memory_gbs. Used in: 04.
    """
    for pattern, fp32, tf32, bf16, memory in GPU_DATASHEETS:
        if re.search(pattern, name, re.IGNORECASE):
            return {'fp32': fp32, 'tf32': tf32, 'bf16': bf16, 'memory_gbs': memory}
    return None


@contextlib.contextmanager
def full_fp32():
    """Inside the block, float32 matrix products and convolutions on GPUs use full FP32, no TF32.

    On Ampere and newer GPUs PyTorch lets cuDNN convolutions use TF32 by
    default (10-bit mantissa inputs), which changes results at about 1e-3
    relative. Equivalence checks ("one data-parallel step equals one
    single-device step") compare two computations that should agree to
    float32 rounding, so they run inside this block. Uses PyTorch's
    fp32_precision settings and restores them afterwards; no effect on CPUs.
    Used in: 05, 07.
    """
    knobs = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    saved = [k.fp32_precision for k in knobs]
    try:
        for k in knobs:
            k.fp32_precision = 'ieee'
        yield
    finally:
        for k, v in zip(knobs, saved):
            k.fp32_precision = v


def step_difference(before, after_a, after_b):
    """How far apart two training steps are: max |Δa − Δb| / max |Δb| over the parameter tensors.

    Δ is a parameter's change in the step (after − before). Dividing by the
    largest change of each tensor makes the number comparable across tensors
    and runs: 0 means the same step; a real algorithmic difference (a
    gradient not summed, a wrong batch size) shows up as 0.5 or more.
    Used in: 05 and the tests.
    """
    worst = 0.0
    for p, a, b in zip(before, after_a, after_b):
        p, a, b = (t.detach().double().cpu() for t in (p, a, b))
        worst = max(worst, float((a - b).abs().max() / (b - p).abs().max().clamp_min(1e-30)))
    return worst


def step_tolerance(dtype=torch.float32, device='cpu'):
    """The largest step_difference that two correct computations of one step may show.

    Splitting a batch changes the order of floating-point additions, never the
    maths, so the tolerance follows the dtype's rounding. On GPUs it is far
    larger: even with TF32 off (full_fp32), cuDNN picks its convolution
    algorithms by shape, and some trade precision for speed. Measured on an
    H200 (the course's GPU check, see tools/gpu_precision.py): a LeNet step on
    two shards of 128 and on one batch of 256 differed by 4e-3 of the step in
    one bias, and by 6e-6 on a CPU. Used in: 05 and the tests.
    """
    dtype = torch.tensor([], dtype=dtype).dtype
    table = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
    if dtype not in table:
        raise ValueError(f'no tolerance for {dtype}; use a floating-point dtype.')
    on_cpu = torch.device(device).type == 'cpu'
    return table[dtype] if on_cpu else max(2e-2, table[dtype])


@contextlib.contextmanager
def quiet_native_stderr():
    """Silence what C++ libraries (the profiler's kineto, say) print straight to fd 2. Used in: 01, 02."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    os.close(devnull)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


# ----------------------------------------------------------------- pictures


def plot_timeline(spans, lanes=None, ax=None, title=None, unit='ms'):
    """Draw (lane, start, end, label) spans as a timeline, one row per lane; return ax.

    Times are in seconds and drawn in `unit` ('s', 'ms' or 'us'); lane names are
    shown through tr(), so a Chinese notebook labels its lanes in Chinese. Used in: 02, 03, 08.
    """
    import matplotlib.pyplot as plt
    scale = {'s': 1, 'ms': 1e3, 'us': 1e6}[unit]
    lanes = list(lanes or dict.fromkeys(lane for lane, *_ in spans))
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.6 + 0.45 * len(lanes)))
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for lane, start, end, label in spans:
        row = lanes.index(lane)
        width = (end - start) * scale
        ax.broken_barh([(start * scale, width)], (row - 0.38, 0.76),
                       facecolors=colors[row % len(colors)], edgecolor='white', linewidth=0.5)
        if label:
            ax.text(start * scale + width / 2, row, label, ha='center', va='center',
                    fontsize=7, clip_on=True)
    ax.set_yticks(range(len(lanes)), [tr(lane) for lane in lanes])
    ax.invert_yaxis()
    ax.set_xlabel(tr('time ({unit})', unit=unit))
    ax.grid(True, axis='x', alpha=0.3)
    if title:
        ax.set_title(title)
    return ax


def show_source(obj):
    """Show the source code of a function or class from common.py, highlighted in a notebook.

    For code a section teaches that must live in an importable file (a
    worker process's entry point). Used in: 05, 07, 08.
    """
    code = inspect.getsource(obj)
    try:
        from IPython import get_ipython
        from IPython.display import Markdown, display
        if get_ipython() is not None:
            display(Markdown(f'```python\n{code}```'))
            return
    except ImportError:
        pass
    print(code)


# ------------------------------------------------------------ data (00, 05-07)

DATA_DIR = ROOT / 'data'
DEBIAN_DIR = Path('/usr/share/datasets/fashion-mnist')
FASHION_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
FASHION_LABELS = ['t-shirt', 'trouser', 'pullover', 'dress', 'coat',
                  'sandal', 'shirt', 'sneaker', 'bag', 'ankle boot']


def _fashion_dirs(root):
    root = Path(root) if root is not None else DATA_DIR
    return [root / 'fashion-mnist', root / 'FashionMNIST' / 'raw', DEBIAN_DIR]


def _find_file(folder, name):
    for candidate in (folder / name, folder / f'{name}.gz'):
        if candidate.is_file():
            return candidate
    return None


def _complete(folder):
    names = [n for pair in FASHION_FILES.values() for n in pair]
    return all(_find_file(folder, n) for n in names)


def _read_idx(path):
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rb') as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big') for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _missing_data_message(root, reason):
    root = Path(root) if root is not None else DATA_DIR
    return (
        'Fashion-MNIST was not found on this machine'
        + (f' and could not be downloaded ({reason})' if reason else '') + '.\n'
        'Get it in one of three ways:\n'
        '  1. Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist\n'
        f'     (installs the four files into {DEBIAN_DIR})\n'
        '  2. Copy train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,\n'
        '     t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz into\n'
        f'     {root / "fashion-mnist"}\n'
        '  3. With internet access: load_data_fashion_mnist(..., download=True)\n'
        f'     lets torchvision download them into {root / "FashionMNIST" / "raw"}')


def find_fashion_mnist(root=None, download=True, timeout=15):
    """Folder that holds Fashion-MNIST: data/, then Debian's package, then a download.

    With none of them available it raises FileNotFoundError within about
    `timeout` seconds, naming the three ways to get the data.
    Used in: 00, 07, and by the set-up's data check.
    """
    for folder in _fashion_dirs(root):
        if _complete(folder):
            return folder
    reason = 'download=False'
    if download:
        import torchvision
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            torchvision.datasets.FashionMNIST(root=str(root or DATA_DIR), train=True, download=True)
            torchvision.datasets.FashionMNIST(root=str(root or DATA_DIR), train=False, download=True)
            reason = None
        except Exception as e:  # no network, proxy, mirror down, ...
            reason = f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'
        finally:
            socket.setdefaulttimeout(old)
        folder = _fashion_dirs(root)[1]
        if reason is None and _complete(folder):
            return folder
    raise FileNotFoundError(_missing_data_message(root, reason))


_ARRAYS = {}


def fashion_mnist_arrays(split='train', root=None, download=True):
    """(images uint8 N×28×28, labels int64 N) of one split, read once per process (clear_cache() forgets).

    Used by fashion_mnist_datasets().
    """
    folder = find_fashion_mnist(root, download)
    key = (str(folder), split)
    if key not in _ARRAYS:
        img_name, lbl_name = FASHION_FILES[split]
        images = _read_idx(_find_file(folder, img_name))
        labels = _read_idx(_find_file(folder, lbl_name)).astype(np.int64)
        if len(images) != len(labels):
            raise ValueError(f'{folder}: {len(images)} images but {len(labels)} labels.')
        _ARRAYS[key] = images, labels
    return _ARRAYS[key]


def clear_cache():
    """Forget the Fashion-MNIST arrays read so far (tests use it to switch data folders).

    Used by the tests.
    """
    _ARRAYS.clear()


def fashion_mnist_datasets(subset=None, root=None, download=True, seed=0):
    """(train, test) TensorDatasets of float images in [0, 1], shape N×1×28×28.

    `subset` keeps that many training examples, drawn at random with `seed`.
    Used in: 05, and by the workers of 05 and 07.
    """
    out = []
    for split in ('train', 'test'):
        images, labels = fashion_mnist_arrays(split, root, download)
        if split == 'train' and subset is not None:
            if not 0 < subset <= len(labels):
                raise ValueError(f'subset must be between 1 and {len(labels)}, got {subset}.')
            keep = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:subset]
            images, labels = images[keep.numpy()], labels[keep.numpy()]  # convert only what is kept
        X = torch.from_numpy(images.copy()).unsqueeze(1).float().div_(255)
        out.append(torch.utils.data.TensorDataset(X, torch.from_numpy(labels.copy())))
    return tuple(out)


def default_num_workers():
    """Loader processes worth starting here: 0 where processes are costly or cores few.

    Used by load_data_fashion_mnist().
    """
    if sys.platform in ('win32', 'darwin') or (os.cpu_count() or 1) <= 2:
        return 0
    return min(4, os.cpu_count() // 2)


def load_data_fashion_mnist(batch_size, resize=None, subset=None, num_workers=None,
                            root=None, download=True):
    """(train_iter, test_iter) DataLoaders for Fashion-MNIST, offline first.

    `resize` scales each batch to resize×resize; `subset` keeps that many
    training examples; `num_workers=None` picks default_num_workers() when
    resizing and 0 otherwise (the data already sits in memory). Used in: 05, 06.
    """
    train, test = fashion_mnist_datasets(subset, root, download)
    collate = None
    if resize:
        def collate(batch):
            X, y = torch.utils.data.default_collate(batch)
            return torch.nn.functional.interpolate(X, size=resize, mode='bilinear'), y
    if num_workers is None:
        num_workers = default_num_workers() if resize else 0
    kw = dict(batch_size=batch_size, num_workers=num_workers, collate_fn=collate,
              persistent_workers=num_workers > 0)
    return (torch.utils.data.DataLoader(train, shuffle=True, **kw),
            torch.utils.data.DataLoader(test, shuffle=False, **kw))


# ------------------------------------------------------------ training (05, 06)


def accuracy(y_hat, y):
    """Number of correct predictions (y_hat holds logits or class indices). Used in: 05-07."""
    if y_hat.ndim > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(dim=1)
    return float((y_hat.type(y.dtype) == y).sum())


def evaluate_accuracy(net, data_iter, device=None):
    """Fraction of correct predictions of `net` over `data_iter`, computed on `device`. Used in: 05, 06."""
    if device is None:
        device = next(iter(net.parameters())).device if isinstance(net, torch.nn.Module) else 'cpu'
    if isinstance(net, torch.nn.Module):
        net.eval()
    correct = total = 0
    with torch.no_grad():
        for X, y in data_iter:
            X, y = X.to(device), y.to(device)
            correct += accuracy(net(X), y)
            total += y.numel()
    return correct / total


class Animator:
    """A live line plot: call add(x, ys) during training; the figure redraws in place.

    In JupyterLab the figure updates in place (display handle); in a script
    or under torchrun nothing is shown and .fig can be saved at the end.
    Outside a notebook it draws on a plain matplotlib Figure, so it never
    changes matplotlib's backend behind the caller's back. Used in: 05.
    """

    def __init__(self, xlabel=None, ylabel=None, legend=(), xlim=None, ylim=None,
                 yscale='linear', figsize=(4.5, 3)):
        if _in_notebook():
            import matplotlib.pyplot as plt  # pyplot sets up the notebook's figure display
            self.fig, self.ax = plt.subplots(figsize=figsize)
            plt.close(self.fig)  # we display it ourselves, once, through a handle
        else:
            from matplotlib.figure import Figure
            self.fig = Figure(figsize=figsize)
            self.ax = self.fig.subplots()
        self.legend, self.xlabel, self.ylabel = list(legend), xlabel, ylabel
        self.xlim, self.ylim, self.yscale = xlim, ylim, yscale
        self.X, self.Y, self._handle = None, None, None

    def add(self, x, ys):
        """Append one point per line (ys: a number or a list, None to skip a line)."""
        ys = list(ys) if hasattr(ys, '__len__') else [ys]
        if self.X is None:
            self.X, self.Y = [[] for _ in ys], [[] for _ in ys]
        if len(ys) != len(self.Y):
            raise ValueError(f'Animator got {len(ys)} values, expected {len(self.Y)}.')
        for i, y in enumerate(ys):
            if y is not None:
                self.X[i].append(x)
                self.Y[i].append(y)
        self._draw()

    def _draw(self):
        ax = self.ax
        ax.cla()
        for x, y, fmt in zip(self.X, self.Y, ('-', 'm--', 'g-.', 'r:', 'b-', 'c--')):
            ax.plot(x, y, fmt)
        ax.set_xlabel(self.xlabel)
        ax.set_ylabel(self.ylabel)
        ax.set_yscale(self.yscale)
        if self.xlim:
            ax.set_xlim(self.xlim)
        if self.ylim:
            ax.set_ylim(self.ylim)
        if self.legend:
            ax.legend(self.legend)
        ax.grid(True)
        self.fig.tight_layout()
        if _in_notebook():
            from IPython.display import display
            if self._handle is None:
                self._handle = display(self.fig, display_id=True)
            else:
                self._handle.update(self.fig)


def sgd(params, lr, batch_size):
    """One SGD step in place, for gradients summed over `batch_size` examples; zero the gradients.

    Used in: 05 (train_batch, dp_worker).
    """
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad / batch_size
            p.grad.zero_()


# ----------------------------------------------- data parallelism by hand (05)

LENET_SHAPES = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]


def lenet_params(seed=0):
    """LeNet parameters [W1, b1, W2, b2, W3, b3, W4, b4]: He-initialised weights, zero biases.

    Used in: 05, 07.
    """
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in LENET_SHAPES:
        fan_in = int(np.prod(shape[1:])) if len(shape) == 4 else shape[0]
        params.append(torch.zeros(shape) if len(shape) == 1
                      else torch.randn(shape, generator=gen) * (2 / fan_in) ** 0.5)
    return params


def lenet(X, params):
    """LeNet on raw tensors: conv(3×3)-ReLU-avgpool, conv(5×5)-ReLU-avgpool, dense-ReLU, dense.

    Used in: 05, 07.
    """
    F = torch.nn.functional
    h = F.avg_pool2d(F.relu(F.conv2d(X, params[0], params[1])), kernel_size=2)
    h = F.avg_pool2d(F.relu(F.conv2d(h, params[2], params[3])), kernel_size=2)
    h = F.relu(h.reshape(h.shape[0], -1) @ params[4] + params[5])
    return h @ params[6] + params[7]








def batch_indices(order, step, batch_size, part=0, parts=1):
    """Indices of `part` (of `parts`) of global minibatch number `step`.

    Every rank walks the same `order` (a seeded permutation), cyclically, so
    every global batch has exactly batch_size examples; each rank then takes
    its own slice of it. Data-parallel workers and parameter-server workers
    use this one rule, which is why their training steps can be compared.
    Used by dp_worker (05) and the parameter-server workers (07).
    """
    batch = order[(step * batch_size + torch.arange(batch_size)) % len(order)]
    return torch.tensor_split(batch, parts)[part]




def replica_devices(k):
    """Devices for k replicas: k distinct GPUs if the machine has them, else k times the best one.

    On one GPU all k replicas share cuda:0; on a CPU-only machine they share the CPU. Used in: 05.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f'the number of replicas must be a whole number >= 1, got {k!r}.')
    return [torch.device(f'cuda:{i}') for i in range(k)] if num_gpus() >= k else [try_gpu()] * k


def dp_worker(rank, world_size, run):
    """Worker for launch(): data-parallel LeNet training, gradients summed with dist.all_reduce.

    `run` is a dict with batch_size (global), lr, steps, and optionally seed, subset
    and full_fp32 (True: no TF32 on GPUs, for comparing with another device).
    Every rank walks the same shuffled global batches and trains on its slice of each.
    Runs on the CPU over gloo, or on cuda:<rank> when launched with backend='nccl'.
    Returns the device, throughput and a checksum of the parameters (rank 0 also
    returns them). Used in: 05.
    """
    batch_size, lr, steps = run['batch_size'], run['lr'], run['steps']
    seed, subset = run.get('seed', 0), run.get('subset')
    device = worker_device()
    X_all, y_all = fashion_mnist_datasets(subset=subset, download=False)[0].tensors
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(seed))
    params = [p.to(device).requires_grad_() for p in lenet_params(seed)]   # this rank's replica
    precision = full_fp32() if run.get('full_fp32') else contextlib.nullcontext()
    dist.barrier()
    start = time.perf_counter()
    with precision:
        for step in range(steps):
            mine = batch_indices(order, step, batch_size, rank, world_size)
            X, y = X_all[mine].to(device), y_all[mine].to(device)
            torch.nn.functional.cross_entropy(lenet(X, params), y, reduction='sum').backward()
            for p in params:
                dist.all_reduce(p.grad)
            sgd(params, lr, batch_size)
    synchronize(device)
    dist.barrier()
    elapsed = time.perf_counter() - start
    return {'device': str(device), 'images_per_s': steps * batch_size / elapsed, 'seconds': elapsed,
            'checksum': float(sum(p.detach().double().sum() for p in params)),
            'params': [p.detach().cpu() for p in params] if rank == 0 else None}


# ----------------------------------------------- concise multi-GPU training (06)


class Residual(torch.nn.Module):
    """A ResNet basic block: two 3×3 convolutions with batch norm, plus a (projected) shortcut.

    Used by resnet18() (06).
    """

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        nn = torch.nn
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = nn.Identity() if stride == 1 and in_channels == out_channels else \
            nn.Sequential(nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                          nn.BatchNorm2d(out_channels))

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.shortcut(x))


def resnet18(num_classes=10, width=64, in_channels=1):
    """ResNet-18 for 28×28 inputs: a 3×3 stem without max-pool, stages of width w, 2w, 4w, 8w.

    Used in: 06 (and its torchrun script).
    """
    nn = torch.nn
    layers = [nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    channels = width
    for stage in range(4):
        out = width * 2 ** stage
        layers += [Residual(channels, out, stride=1 if stage == 0 else 2), Residual(out, out)]
        channels = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes)]
    return nn.Sequential(*layers)


def _covered(spans, lo=-float('inf'), hi=float('inf')):
    """Seconds covered by the union of (start, end) spans, counting only the part in [lo, hi]."""
    total, reach = 0.0, lo
    for start, end in sorted(spans):
        start, end = max(start, reach), min(end, hi)
        if end > start:
            total, reach = total + end - start, end
    return total


def ddp_timeline(rank, world_size, run):
    """Worker for launch(): when DDP all-reduces its gradient buckets during the backward pass.

    `run` is a dict with width (of common.resnet18), batch_size (per process),
    bucket_cap_mb, warmup and steps. The model is trained in two modes, by two DDP
    communication hooks that do the same all-reduce: 'overlapped' sends each bucket
    the moment DDP hands it over (what DDP always does); 'after backward' holds every
    bucket until the last one is ready and then sends them one by one, as a loop of
    all-reduces after loss.backward() would. The modes take turns, step by step.
    Each step records, in seconds from its start, when each parameter's gradient was
    accumulated, when each bucket's all-reduce started and finished, when the slowest
    rank had all its gradients, and the forward, backward and optimiser phases.
    Rank 0 returns, per mode, the events of the median step and medians over steps of
    the step time, the gradient computation, the all-reduce time and the overlap: the
    share of all-reduce time that passed while backward was still computing
    gradients; also each bucket's parameter names and size in bytes, and whether both
    hooks give exactly the gradients of DDP's built-in all-reduce. Runs over gloo on
    CPU processes. Used in: 06.
    """
    clock = time.perf_counter
    torch.manual_seed(0)
    net = resnet18(width=run['width'])
    gen = torch.Generator().manual_seed(rank)  # each rank has its own (random) batch
    X = torch.randn(run['batch_size'], 1, 28, 28, generator=gen)
    y = torch.randint(0, 10, (run['batch_size'],), generator=gen)

    def send(log, bucket):
        # The hook contract: return a Future holding the bucket's new (averaged) values.
        # Dividing by the world size first is what DDP's built-in all-reduce does.
        start = clock() - log['t0']
        work = dist.all_reduce(bucket.buffer().div_(world_size), async_op=True)

        def done(fut):  # runs when the all-reduce has finished
            log['allreduce'].append((bucket.index(), start, clock() - log['t0']))
            log['buckets'][bucket.index()] = ([log['names'][p] for p in bucket.parameters()],
                                              bucket.buffer().nbytes)
            return fut.value()[0]
        return work.get_future().then(done)

    def hold_until_last(log, bucket):  # the baseline: nothing is sent during backward
        mine = torch.futures.Future()  # a promise of this bucket's result, kept below
        log['held'].append((bucket, mine))
        if bucket.is_last():  # DDP hands buckets over in order: every gradient is computed
            for held, fut in log['held']:
                fut.set_result(send(log, held).wait())
            log['held'] = []
        return mine

    def make(hook):  # a DDP replica of the same model, with its own event log
        model = DDP(copy.deepcopy(net), bucket_cap_mb=run['bucket_cap_mb'])
        log = {'held': [], 'buckets': {}, 'names': {p: n for n, p in model.module.named_parameters()}}
        if hook:
            model.register_comm_hook(log, hook)
        for p in model.parameters():  # fires once p.grad holds this step's local gradient
            p.register_post_accumulate_grad_hook(
                lambda p: log['grad'].append((log['names'][p], clock() - log['t0'])))
        return model, log, torch.optim.SGD(model.parameters(), lr=0.01)

    def step(model, log, opt):  # one training step; returns its events, in s from its start
        dist.barrier()  # all ranks start the step together
        log.update(t0=clock(), grad=[], allreduce=[])
        loss = torch.nn.functional.cross_entropy(model(X), y)
        forward_end = clock() - log['t0']
        opt.zero_grad()
        loss.backward()  # returns once DDP has the last bucket's all-reduce back
        backward_end = clock() - log['t0']
        opt.step()
        end = clock() - log['t0']
        computed = max(t for _, t in log['grad'])  # the last local gradient is ready
        # A bucket's all-reduce cannot finish before the slowest rank has handed it over:
        # when did the last rank finish its gradients? (perf_counter is machine-wide.)
        slowest = torch.tensor([log['t0'] + computed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        spans = [(a, b) for _, a, b in log['allreduce']]
        return {'forward': (0.0, forward_end), 'backward': (forward_end, backward_end),
                'computed': computed, 'all computed': slowest.item() - log['t0'],
                'optimizer': (backward_end, end), 'step_s': end, 'grad': log['grad'],
                'allreduce': sorted(log['allreduce']), 'compute_s': computed - forward_end,
                'allreduce_s': _covered(spans),
                'overlap': _covered(spans, forward_end, computed) / max(_covered(spans), 1e-12)}

    modes = {'built-in': make(None), 'overlapped': make(send), 'after backward': make(hold_until_last)}
    for replica in modes.values():  # the first step, on the same batch, must give the same gradients
        step(*replica)
    grads = {mode: [p.grad for p in model.parameters()] for mode, (model, _, _) in modes.items()}
    out = {'same_grads': all(torch.equal(a, b) for mode in ('overlapped', 'after backward')
                             for a, b in zip(grads[mode], grads['built-in']))}
    del modes['built-in']
    # Alternate the two modes step by step, so that a busy machine slows both alike.
    # DDP re-orders its buckets after the first step; the warm-up steps are dropped.
    steps = {mode: [] for mode in modes}
    for _ in range(run['warmup'] + run['steps']):
        for mode, replica in modes.items():
            steps[mode].append(step(*replica))
    for mode, seen in steps.items():
        seen = seen[run['warmup']:]
        out[mode] = {key: statistics.median(s[key] for s in seen)
                     for key in ('step_s', 'compute_s', 'allreduce_s', 'overlap')}
        out[mode]['median step'] = sorted(seen, key=lambda s: s['step_s'])[len(seen) // 2]
        out[mode]['steps_s'] = [s['step_s'] for s in seen]
    buckets = modes['overlapped'][1]['buckets']
    out['buckets'] = [buckets[k][0] for k in sorted(buckets)]
    out['bucket_bytes'] = [buckets[k][1] for k in sorted(buckets)]
    return out if rank == 0 else None


_DDP_MODES = (('overlapped', 'DDP: each bucket is all-reduced as soon as it is ready'),
         ('after backward', 'baseline: all buckets are all-reduced after backward'))



def plot_ddp_timeline(result, unit='ms'):
    """Draw the median step of both modes of ddp_timeline() on one time axis; return the figure.

    One row of lanes per mode: forward, backward (a tick per parameter when its gradient
    is ready, coloured by its bucket; hatched while backward() waits for the all-reduce),
    one lane per bucket's all-reduce, and the optimiser step. Labels go through tr().
    Used in: 06.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    scale = {'s': 1, 'ms': 1e3}[unit]
    buckets = result['buckets']
    bucket_of = {name: k for k, names in enumerate(buckets) for name in names}
    colors = plt.get_cmap('tab10').colors
    lanes = ([tr('forward'), tr('backward (gradients ready)')]
             + [tr('all-reduce (bucket {k}, {kb:.0f} kB)', k=k, kb=size / 1e3)
                for k, size in enumerate(result['bucket_bytes'])]
             + [tr('optimiser step')])
    fig, axes = plt.subplots(2, 1, figsize=(8, 1.6 + 0.5 * len(lanes)), sharex=True)
    for ax, (mode, title) in zip(axes, _DDP_MODES):
        step = result[mode]['median step']

        def bar(row, start, end, **style):
            ax.broken_barh([(start * scale, (end - start) * scale)], (row - 0.35, 0.7), **style)

        bar(0, *step['forward'], color='0.7')
        bar(1, step['backward'][0], step['computed'], color='0.88')
        bar(1, step['computed'], step['backward'][1], facecolor='white', edgecolor='0.55', hatch='////')
        for name, t in step['grad']:  # one tick per parameter, when its gradient is ready
            ax.vlines(t * scale, 0.65, 1.35, color=colors[bucket_of[name] % 10], lw=1.2)
        for k, start, end in step['allreduce']:
            bar(2 + k, start, end, color=colors[k % 10])
        bar(len(lanes) - 1, *step['optimizer'], color='0.35')
        ax.axvline(step['computed'] * scale, color='k', ls='--', lw=0.8)
        if step['all computed'] - step['computed'] > 0.01 * step['step_s']:
            ax.axvline(step['all computed'] * scale, color='tab:red', ls=':', lw=1)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.invert_yaxis()
        ax.grid(True, axis='x', alpha=0.3)
        stats = result[mode]
        ax.set_title(tr(title) + '\n' + tr('step {step:.0f} ms, {overlap:.0%} of all-reduce time '
                                            'during backward (median of {n} steps)',
                                            step=stats['step_s'] * 1e3, overlap=stats['overlap'],
                                            n=len(stats['steps_s'])), fontsize=9)
    axes[-1].set_xlabel(tr('time since the step began ({unit}); rank 0', unit=unit))
    axes[-1].set_xlim(0, 1.02 * scale * max(result[m]['median step']['step_s'] for m, _ in _DDP_MODES))
    fig.legend(handles=[
        Line2D([], [], color=colors[0], lw=1.2, ls='', marker='|', markersize=10,
               label=tr("a parameter's gradient is ready (colour: its bucket)")),
        Patch(facecolor='white', edgecolor='0.55', hatch='////',
              label=tr('backward() waits for the all-reduce')),
        Line2D([], [], color='k', ls='--', lw=0.8, label=tr('all gradients of rank 0 computed')),
        Line2D([], [], color='tab:red', ls=':', lw=1, label=tr('... and of the slowest rank')),
    ], loc='lower center', ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


# -------------------------------------------------------- parameter servers (07)
# 07 §1-4: the cost model and ring all-reduce; §5: the key-value store;
# §6-7: a sharded parameter server over processes, with faults, and its asynchronous form
# with bounded staleness (infrastructure below ps_process: you need not read it to follow).

SYNC_STRATEGIES = ('gpu0', 'cpu', 'split', 'ring')
# How figures and the calculator name them (Chinese in FIGURE_TEXT).
SYNC_LABELS = {'gpu0': 'via GPU 0', 'cpu': 'via the CPU', 'split': 'split over all', 'ring': 'ring'}


def sync_time(strategy, size_bytes, devices, bandwidth, links=1):
    """Seconds to sum `size_bytes` of gradients over `devices` and return the sum to all of them.

    bandwidth is bytes/s per link and direction. The strategies:
      gpu0  - all send to device 0 over its one link, it sends the sum back: 2(n-1)·s/b
      cpu   - all n send to the CPU over its one link, it sends back: 2n·s/b
      split - cut into n parts, each summed on a different device at once: 2(n-1)·(s/n)/b
      ring  - reduce-scatter then all-gather round a ring of `links` parallel rings:
              2(n-1)/n · s/(links·b), which barely grows with n
    Used in: 07, 08.
    """
    n = devices
    if strategy not in SYNC_STRATEGIES:
        raise ValueError(f'strategy must be one of {SYNC_STRATEGIES}, got {strategy!r}.')
    if n < 1 or size_bytes < 0 or bandwidth <= 0 or links < 1:
        raise ValueError('need devices >= 1, size >= 0, bandwidth > 0 and links >= 1.')
    one = size_bytes / bandwidth
    return {'gpu0': 2 * (n - 1) * one, 'cpu': 2 * n * one, 'split': 2 * (n - 1) * one / n,
            'ring': 2 * (n - 1) / n * one / links}[strategy]


def ring_allreduce(tensor):
    """Sum `tensor` over all ranks in place with a ring: reduce-scatter, then all-gather.

    Each of the 2(n-1) steps sends one n-th of the tensor to the right neighbour and
    receives one from the left, so every link carries the same, small amount at once.
    Used in: 07 (shown on the page).
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = list(torch.tensor_split(tensor.view(-1), n))
    right, left = (rank + 1) % n, (rank - 1) % n
    buffer = torch.empty_like(chunks[0])  # the largest chunk; reused at every step
    for step in range(2 * (n - 1)):
        send_index = (rank - step) % n
        recv_index = (rank - step - 1) % n
        incoming = buffer[:chunks[recv_index].numel()]
        request = dist.isend(chunks[send_index].contiguous(), right)
        dist.recv(incoming, left)
        request.wait()
        if step < n - 1:
            chunks[recv_index] += incoming       # reduce-scatter: accumulate
        else:
            chunks[recv_index].copy_(incoming)   # all-gather: take the finished sum
    return tensor


def ring_check(rank, world_size, numel, algorithm='ring'):
    """Worker for launch(): a ring all-reduce (RING_ALGORITHMS) against dist.all_reduce.

    Returns the largest difference. Runs over gloo or NCCL. Used in: 07.
    """
    data = torch.randn(numel, generator=torch.Generator().manual_seed(rank)).to(worker_device())
    mine, reference = data.clone(), data.clone()
    RING_ALGORITHMS[algorithm](mine)
    dist.all_reduce(reference)
    return float((mine - reference).abs().max())


def ring_allreduce_both_ways(tensor):
    """ring_allreduce with half of the tensor going clockwise and half counter-clockwise.

    Every link carries traffic in both of its directions at once, so on
    full-duplex links each half needs half the time. The worked solution of
    07's exercise 1 (named in its solution block; the tests run it).
    Used by comm_benchmark and ring_check in 07's exercise 1.
    """
    rank, n = dist.get_rank(), dist.get_world_size()
    flat = tensor.view(-1)
    half = flat.numel() // 2
    rings = [(list(torch.tensor_split(flat[:half], n)), +1),   # to rank+1, from rank-1
             (list(torch.tensor_split(flat[half:], n)), -1)]   # to rank-1, from rank+1
    buffers = [torch.empty_like(chunks[0]) for chunks, _ in rings]
    for step in range(2 * (n - 1)):
        requests, arrivals = [], []
        for tag, ((chunks, d), buffer) in enumerate(zip(rings, buffers)):
            send_index, recv_index = (rank - d * step) % n, (rank - d * (step + 1)) % n
            incoming = buffer[:chunks[recv_index].numel()]
            requests.append(dist.isend(chunks[send_index], (rank + d) % n, tag=tag))
            requests.append(dist.irecv(incoming, (rank - d) % n, tag=tag))
            arrivals.append((chunks, recv_index, incoming))
        for request in requests:
            request.wait()
        for chunks, i, incoming in arrivals:
            if step < n - 1:
                chunks[i] += incoming
            else:
                chunks[i].copy_(incoming)
    return tensor


RING_ALGORITHMS = {'ring': ring_allreduce, 'ring both ways': ring_allreduce_both_ways}


def comm_benchmark(rank, world_size, sizes, repeats=5, algorithms=('ring', 'all_reduce')):
    """Worker for launch(): median seconds of point-to-point and all-reduce messages.

    sizes are in bytes (float32 payloads). Returns, on rank 0, a dict with
    'pingpong' (one-way time between ranks 0 and 1: half a round trip),
    'exchange' (ranks 0 and 1 send to each other at once) and one list per
    algorithm ('ring', 'ring both ways', 'all_reduce'): medians over
    `repeats` after a warm-up (5 times more repeats below 1 MB), every rank
    starting together. Runs over gloo, or over NCCL on cuda:<rank> (each
    timing then waits for the GPU). Used in: 07.
    """

    def pingpong(t):  # one message at a time: there and back
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        elif rank == 1:
            dist.recv(t, 0)
            dist.send(t, 0)

    def exchange(t):  # both send at once, as in every step of a ring
        if rank < 2:
            incoming = torch.empty_like(t)
            request = dist.isend(t, 1 - rank)
            dist.recv(incoming, 1 - rank)
            request.wait()

    device = worker_device()
    ops = {'pingpong': pingpong, 'exchange': exchange, 'all_reduce': dist.all_reduce,
           **RING_ALGORITHMS}
    unknown = set(algorithms) - set(ops)
    if unknown:
        raise ValueError(f'unknown algorithm(s) {sorted(unknown)}; choose from {sorted(ops)}.')
    out = {}
    for name in ('pingpong', 'exchange', *algorithms):
        out[name] = []
        for size in sizes:
            t = torch.ones(max(1, size // 4), device=device)
            samples = []
            for i in range(repeats * (5 if size < 2 ** 20 else 1) + 1):
                dist.barrier()
                synchronize(device)
                start = time.perf_counter()
                ops[name](t)
                synchronize(device)
                if i:  # the first round is the warm-up
                    samples.append(time.perf_counter() - start)
            median = float(np.median(samples))
            out[name].append(median / 2 if name == 'pingpong' else median)
    return out if rank == 0 else None


def fit_alpha_beta(sizes, seconds):
    """(alpha, beta): latency in s and s/byte of t = alpha + beta*size, fitted on relative error.

    Weighting each point by 1/time makes small messages count as much as large ones.
    Used in: 07.
    """
    sizes, seconds = np.asarray(sizes, float), np.asarray(seconds, float)
    if sizes.shape != seconds.shape or len(sizes) < 2:
        raise ValueError('need at least two (size, time) pairs of equal length.')
    beta, alpha = np.polyfit(sizes, seconds, 1, w=1 / seconds)
    return float(alpha), float(beta)


def ring_model(size_bytes, n, alpha, beta):
    """alpha-beta time of ring_allreduce: 2(n-1) steps, each one message of size/n.

    Used in: 07.
    """
    return 2 * (n - 1) * (alpha + beta * size_bytes / n)


def ps_time(size_bytes, workers, servers, bandwidth):
    """Seconds for `workers` to push gradients to, and pull parameters from, `servers`.

    Each server holds 1/servers of the parameters and talks to every worker
    over its own link; each worker talks to every server over its own link.
    The busier end sets the pace: 2·max(workers/servers, 1)·size/bandwidth.
    Used in: 07.
    """
    if min(workers, servers) < 1 or size_bytes < 0 or bandwidth <= 0:
        raise ValueError('need workers >= 1, servers >= 1, size >= 0 and bandwidth > 0.')
    return 2 * max(workers / servers, 1) * size_bytes / bandwidth


def hierarchical_time(size_bytes, machines, gpus, local_bandwidth, network_bandwidth, servers=1):
    """Sum on each machine first (fast links), then across machines through sharded servers.

    Local reduce and local broadcast each cost (g-1)/g·size/local_bandwidth
    (split aggregation, like a ring's two halves); only one gradient per
    machine crosses the network. Compare ps_time(size, machines*gpus, ...).
    Used in: 07.
    """
    if gpus < 1 or local_bandwidth <= 0:
        raise ValueError('need gpus >= 1 and local_bandwidth > 0.')
    local = 2 * (gpus - 1) / gpus * size_bytes / local_bandwidth
    return local + ps_time(size_bytes, machines, servers, network_bandwidth)


def _bar_rows(rows, longest):
    """HTML table rows (label, shown value, bar) for the calculators; bars scale to `longest`."""
    longest = longest or 1
    return ''.join(f'<tr><td style="text-align:left">{label}</td><td>{shown}</td>'
                   f'<td style="text-align:left"><div style="background:#4c72b0;height:0.9em;'
                   f'width:{max(1, round(240 * value / longest))}px"></div></td></tr>'
                   for label, shown, value in rows)


def sync_calculator(size_mb=160, devices=4, bandwidth_gbs=16, links=1):
    """An ipywidgets calculator: sliders for the sync_time inputs, a bar per strategy.

    Used in: 07.
    """
    import ipywidgets as widgets
    labels = {k: text(label) for k, label in SYNC_LABELS.items()}
    style = {'description_width': '11em'}
    size = widgets.FloatLogSlider(value=size_mb, base=10, min=0, max=4, step=0.05, style=style,
                                  description=say('gradients (MB)', '梯度大小（MB）'))
    n = widgets.IntSlider(value=devices, min=2, max=64, style=style,
                          description=say('devices', '设备数'))
    bw = widgets.FloatLogSlider(value=bandwidth_gbs, base=10, min=-1, max=3, step=0.05, style=style,
                                description=say('link bandwidth (GB/s)', '链路带宽（GB/s）'))
    rings = widgets.IntSlider(value=links, min=1, max=6, style=style,
                              description=say('parallel rings', '并行环数'))
    table = widgets.HTML()

    def update(_=None):
        times = {k: 1e3 * sync_time(k, size.value * 1e6, n.value, bw.value * 1e9,
                                    rings.value if k == 'ring' else 1) for k in SYNC_STRATEGIES}
        rows = _bar_rows([(labels[k], f'{t:,.2f} ms', t) for k, t in times.items()], max(times.values()))
        table.value = f'<table>{rows}</table>'

    for w in (size, n, bw, rings):
        w.observe(update, names='value')
    update()
    return widgets.VBox([size, n, bw, rings, table])


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
    Used in: 07 and by ps_process.
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


def _ps_wait(requests, what, timeout=None):
    with _ps_link(what):
        for request in requests:
            if timeout is None:
                request.wait()          # the process group's timeout (launch's op_timeout)
            else:
                request.wait(datetime.timedelta(seconds=timeout))


def _ps_fault(run, role, index, step):
    fault = run.get('fault')
    if fault and (fault['role'], fault['index'], fault['step']) == (role, index, step):
        if fault.get('stamp'):
            Path(fault['stamp']).write_text(repr(time.time()))
        if fault.get('kind', 'kill') == 'kill':
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # 'hang': alive but silent


def ps_process(rank, world_size, run):
    """Worker for launch(): LeNet trained through a sharded parameter server.

    Ranks 0 … servers-1 are servers, the rest workers. `run` holds servers,
    steps, batch_size (global), lr, and optionally seed, subset, piece (see
    shard_keys), test_subset, timeout (seconds a server waits for a push;
    workers wait twice as long for a pull, so that the server, which knows
    who is missing, reports a silent worker first), fault (role, index,
    step, kind 'kill' or 'hang', stamp file) and checkpoint (dir, every,
    resume). It runs on CPU processes: launch it over gloo (the default).
    Used in: 07.
    """
    servers = _ps_check(world_size, run, 'ps_process')
    plan = shard_keys(LENET_SHAPES, servers, run.get('piece'))
    workers = list(range(servers, world_size))
    worker_group = dist.new_group(workers)  # every rank must take part in creating it
    start = _ps_resume_step(rank, servers, run)
    if rank < servers:
        return _ps_server(rank, run, plan, workers, start)
    return _ps_worker(rank - servers, run, plan, workers, start, worker_group)


def _ps_check(world_size, run, name):
    """The number of servers, after checking the backend and the roles."""
    if dist.get_backend() != 'gloo':
        raise ValueError(f"{name} runs on CPU processes; launch it with backend='gloo', "
                         f'not {dist.get_backend()!r}.')
    servers = run['servers']
    if not 1 <= servers < world_size:
        raise ValueError(f'need 1 <= servers < processes; got {servers} servers of {world_size}.')
    return servers

def _ps_checkpoint_files(run, s):
    ckpt = run.get('checkpoint')
    return sorted(Path(ckpt['dir']).glob(f'server{s}-step*.pt'),
                  key=lambda f: int(f.stem.split('step')[1])) if ckpt else []


def _ps_resume_step(rank, servers, run):
    # Resume from the newest step that every server has saved (0: from scratch).
    ckpt = run.get('checkpoint') or {}
    latest = 0
    if ckpt.get('resume') and rank < servers:
        files = _ps_checkpoint_files(run, rank)
        latest = int(files[-1].stem.split('step')[1]) if files else 0
    t = torch.tensor([latest if rank < servers else 2 ** 62], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t)


def _ps_server(s, run, plan, workers, start):
    lr, batch_size = run['lr'], run['batch_size']
    mine = [p for p in plan if p['server'] == s]

    def sgd_update(key, grad_sum, weight):  # the optimiser runs on the server
        weight -= lr * grad_sum / batch_size

    store = KVStore(updater=sgd_update)
    init = lenet_params(run.get('seed', 0))
    saved = torch.load(Path(run['checkpoint']['dir']) / f'server{s}-step{start}.pt') if start else {}
    for p in mine:
        store.init(p['key'], saved[p['key']] if start else
                   init[p['param']].reshape(-1)[p['start']:p['stop']])

    def send_to_workers(step):
        values = {p['key']: store.pull(p['key']) for p in mine}  # alive until sent
        what = f'server {s} (rank {s}) sending the parameters for step {step} to the workers'
        with _ps_link(what):
            requests = [dist.isend(values[p['key']], r, tag=plan.index(p))
                        for p in mine for r in workers]
        _ps_wait(requests, what, run.get('timeout'))

    send_to_workers(start)  # the first pull
    pushes, t0 = 0, time.perf_counter()
    for step in range(start, run['steps']):
        _ps_fault(run, 'server', s, step)
        for p in mine:
            grads = [torch.empty(p['stop'] - p['start']) for _ in workers]
            for w, (r, g) in enumerate(zip(workers, grads)):
                what = (f'server {s} (rank {s}) waiting for the push of key {p["key"]} '
                        f'from worker {w} (rank {r}) at step {step}')
                with _ps_link(what):
                    request = dist.irecv(g, r, tag=plan.index(p))
                _ps_wait([request], what, run.get('timeout'))
            store.push(p['key'], grads)
            pushes += len(grads)
        send_to_workers(step + 1)
        _ps_save(run, s, step + 1, store)
    return {'role': 'server', 'index': s, 'keys': [p['key'] for p in mine],
            'elements': sum(p['stop'] - p['start'] for p in mine), 'pushes': pushes,
            'seconds': time.perf_counter() - t0}


def _ps_save(run, s, step, store):
    ckpt = run.get('checkpoint')
    if not ckpt or step % ckpt['every']:
        return
    folder = Path(ckpt['dir'])
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f'server{s}.tmp'
    torch.save({k: store.pull(k) for k in store.keys()}, tmp)
    tmp.replace(folder / f'server{s}-step{step}.pt')  # atomic: never a half-written checkpoint
    for old in _ps_checkpoint_files(run, s)[:-2]:   # keep the last two
        old.unlink()


def _ps_worker(w, run, plan, workers, start, worker_group):
    rank, servers = workers[w], run['servers']
    batch_size, lr, seed = run['batch_size'], run['lr'], run.get('seed', 0)
    X_all, y_all = fashion_mnist_datasets(subset=run.get('subset'), download=False)[0].tensors
    order = torch.randperm(len(y_all), generator=torch.Generator().manual_seed(seed))
    params = [torch.zeros(shape, requires_grad=True) for shape in LENET_SHAPES]
    patience = run.get('timeout') and 2 * run['timeout']  # a pull may wait for a slow peer

    def pull(step):
        bufs = [torch.empty(p['stop'] - p['start']) for p in plan]
        what = (f'worker {w} (rank {rank}) pulling the parameters for step {step} '
                f'from the servers (ranks 0-{servers - 1})')
        with _ps_link(what):
            requests = [dist.irecv(b, p['server'], tag=i) for i, (p, b) in enumerate(zip(plan, bufs))]
        _ps_wait(requests, what, patience)
        with torch.no_grad():
            for p, b in zip(plan, bufs):
                params[p['param']].view(-1)[p['start']:p['stop']] = b

    pull(start)
    losses, step_diff, t0 = [], None, time.perf_counter()
    for step in range(start, run['steps']):
        _ps_fault(run, 'worker', w, step)
        mine = batch_indices(order, step, batch_size, w, len(workers))
        loss = torch.nn.functional.cross_entropy(lenet(X_all[mine], params), y_all[mine],
                                                 reduction='sum')
        loss.backward()
        losses.append(loss.item() / len(mine))
        what = f'worker {w} (rank {rank}) pushing the gradients of step {step}'
        with _ps_link(what):
            requests = [dist.isend(params[p['param']].grad.reshape(-1)[p['start']:p['stop']].clone(),
                                   p['server'], tag=i) for i, p in enumerate(plan)]
        if step == start:  # the same step done with all-reduce, for comparison
            with torch.no_grad():
                grads = [q.grad.clone() for q in params]
                for g in grads:
                    dist.all_reduce(g, group=worker_group)
                by_allreduce = [q - lr * g / batch_size for q, g in zip(params, grads)]
        pull(step + 1)
        _ps_wait(requests, what, run.get('timeout'))
        if step == start:
            step_diff = max(float((q.detach() - a).abs().max()) for q, a in zip(params, by_allreduce))
        for q in params:
            q.grad = None
    seconds = time.perf_counter() - t0
    out = {'role': 'worker', 'index': w, 'losses': losses, 'allreduce_diff': step_diff,
           'images_per_s': (run['steps'] - start) * batch_size / seconds,
           'params': [q.detach().clone() for q in params] if w == 0 else None}
    if w == 0 and run.get('test_subset'):
        out.update(_ps_test(params, run['test_subset']))
    return out


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
    Used in: 07.
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
        what = f'server {s} (rank {s}) answering worker {w} (rank {servers + w})'
        with _ps_link(what):
            request = dist.isend(message, servers + w)
        _ps_wait([request], what, run.get('timeout'))

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
        with _ps_link(what):
            request = dist.irecv(push)
        _ps_wait([request], what, run.get('timeout'))
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
        what = f'worker {w} (rank {rank}) pulling from the servers (ranks 0-{servers - 1})'
        with _ps_link(what):
            requests = [dist.irecv(b, k) for k, b in enumerate(bufs)]
        _ps_wait(requests, what, patience)
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
        with _ps_link(what):
            requests = [dist.isend(m, k) for k, m in enumerate(messages)]
        got = pull()
        _ps_wait(requests, what, run.get('timeout'))
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
    runs do not overlap. Returns this rank's results, one per run. Used in: 07.
    """
    out = []
    for run in runs:
        dist.barrier()
        out.append((ps_async_process if 'staleness' in run else ps_process)(rank, world_size, run))
    return out


# ------------------------------------- 08: memory, sharded, tensor and pipeline parallelism
# Every worker below runs on CPU processes over gloo (launch's default): 08 uses
# no GPU code path. On GPUs the same calls run over NCCL (see 08's last part).

PRECISIONS = {  # bytes per parameter: (weights, gradients, Adam's state)
    'fp32': (4, 4, 8),          # fp32 weights and gradients; Adam's m and v in fp32
    'bf16 mixed': (2, 2, 12),   # bf16 weights and gradients; fp32 master weights, m and v
}
ZERO_SHARDS = {  # which of (weights, gradients, optimiser state) each ZeRO stage shards
    0: (False, False, False), 1: (False, False, True), 2: (False, True, True), 3: (True, True, True)}
MEMORY_PARTS = ('parameters', 'gradients', 'optimizer state')


def zero_memory(params, ranks=1, stage=0, precision='bf16 mixed'):
    """Bytes per rank of weights, gradients and Adam's state, by ZeRO stage (a dict).

    Stage 0 is plain data parallelism (everything replicated); stage 1 shards
    the optimiser state over the ranks, stage 2 also the gradients, stage 3
    also the weights (FSDP). precision is a key of PRECISIONS. Activations are
    not included: they depend on batch and sequence, and no ZeRO stage shards
    them. Used in: 08.
    """
    if not params > 0 or isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f'need params > 0 and a whole number of ranks >= 1, got {params!r}, {ranks!r}.')
    if stage not in ZERO_SHARDS:
        raise ValueError(f'ZeRO stage must be 0, 1, 2 or 3, got {stage!r}.')
    if precision not in PRECISIONS:
        raise ValueError(f'precision must be one of {sorted(PRECISIONS)}, got {precision!r}.')
    return {part: per_param * params / (ranks if sharded else 1)
            for part, per_param, sharded in zip(MEMORY_PARTS, PRECISIONS[precision], ZERO_SHARDS[stage])}


def local_bytes(tensors):
    """Bytes of memory that these tensors occupy in this process, each storage counted once.

    A DTensor (a parameter of fully_shard or parallelize_module) counts its local
    shard only; None entries (no gradient yet) count nothing. Used in: 08.
    """
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if hasattr(t, 'to_local') else t
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def training_memory(model, optimizer):
    """Measured bytes of parameters, gradients and optimiser state in this process (a dict).

    Call it after optimizer.step() and before zero_grad(). The optimiser
    state includes Adam's one-number step counters. Used in: 08.
    """
    optimizer = getattr(optimizer, 'optim', optimizer)  # ZeroRedundancyOptimizer: the local part
    params = list(model.parameters())
    return {'parameters': local_bytes(params),
            'gradients': local_bytes(p.grad for p in params),
            'optimizer state': local_bytes(t for s in optimizer.state.values() for t in s.values()
                                           if torch.is_tensor(t))}


def saved_activation_bytes(fn, *args, exclude=()):
    """(result, bytes): run fn(*args) and count what autograd saves for the backward pass.

    Tensors in `exclude` (the parameters, which are counted as weights) and
    repeated storages count once or not at all. Used in: 08.
    """
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    seen = set()

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and ptr not in seen:
            seen.add(ptr)
            sizes.append(t.untyped_storage().nbytes())
        return t

    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args)
    return result, sum(sizes)


def memory_calculator(params_b=7.5, ranks=64, stage=3, precision='bf16 mixed', device_gb=80):
    """An ipywidgets calculator: sliders for zero_memory's inputs, a bar per part and a verdict.

    Used in: 08.
    """
    import ipywidgets as widgets
    style = {'description_width': '13em'}
    n = widgets.FloatLogSlider(value=params_b, base=10, min=-1, max=3, step=0.05, style=style,
                               description=say('parameters (billions)', '参数量（十亿）'))
    k = widgets.IntSlider(value=ranks, min=1, max=1024, style=style, description=say('ranks', 'rank 数'))
    z = widgets.IntSlider(value=stage, min=0, max=3, style=style, description=say('ZeRO stage', 'ZeRO 阶段'))
    p = widgets.Dropdown(options=list(PRECISIONS), value=precision, style=style,
                         description=say('precision', '精度'))
    d = widgets.FloatSlider(value=device_gb, min=8, max=192, step=8, style=style,
                            description=say('memory per device (GB)', '每个设备的显存（GB）'))
    table = widgets.HTML()

    def update(_=None):
        parts = zero_memory(n.value * 1e9, k.value, z.value, p.value)
        total = sum(parts.values())
        rows = _bar_rows([(text(name), f'{b / 1e9:,.2f} GB', b) for name, b in parts.items()],
                         max(total, d.value * 1e9))
        room = d.value * 1e9 - total
        line = (say(f'{room / 1e9:,.1f} GB left for activations and buffers',
                    f'还剩 {room / 1e9:,.1f} GB 留给激活值和缓冲区') if room > 0 else
                say(f'does not fit: {-room / 1e9:,.1f} GB too much', f'放不下：超出 {-room / 1e9:,.1f} GB'))
        table.value = (f'<table>{rows}<tr><td style="text-align:left"><b>{text("total")}</b></td>'
                       f'<td><b>{total / 1e9:,.2f} GB</b></td><td style="text-align:left">{line}</td>'
                       '</tr></table>')

    for w in (n, k, z, p, d):
        w.observe(update, names='value')
    update()
    return widgets.VBox([n, k, z, p, d, table])


def count_collectives(comm_mode):
    """{'all-reduce': 1, ...}: the collectives a torch.distributed.tensor.debug.CommDebugMode saw.

    Used in: 08.
    """
    names = (('reduce_scatter', 'reduce-scatter'), ('allgather', 'all-gather'), ('all_gather', 'all-gather'),
             ('allreduce', 'all-reduce'), ('all_reduce', 'all-reduce'), ('broadcast', 'broadcast'))
    out = {}
    for op, count in comm_mode.get_comm_counts().items():
        name = next((label for key, label in names if key in str(op)), str(op))
        out[name] = out.get(name, 0) + count
    return out


def ring_bytes(collective, size_bytes, n):
    """Bytes each of n ranks sends in a ring all-reduce, all-gather or reduce-scatter of size_bytes.

    A ring all-reduce is a reduce-scatter followed by an all-gather (07):
    each half sends (n-1)/n of the data. Used in: 08.
    """
    steps = {'all-reduce': 2, 'all-gather': 1, 'reduce-scatter': 1}
    if collective not in steps or n < 1:
        raise ValueError(f'collective must be one of {sorted(steps)}, and n >= 1.')
    return steps[collective] * (n - 1) / n * size_bytes


def mlp(widths, seed=0):
    """Linear layers of the given widths with ReLU between them, initialised from `seed`.

    mlp([256, 512, 10]) is Linear(256, 512), ReLU, Linear(512, 10). Used in: 08.
    """
    torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers += [torch.nn.Linear(a, b)] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
    return torch.nn.Sequential(*layers)


def teacher_batches(steps, batch_size, d_in, classes, seed=0):
    """`steps` batches (x, y) of a synthetic task: y is the best class of a fixed random linear map.

    Every process that calls it with the same arguments gets the same batches.
    Used in: 08.
    """
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(d_in, classes, generator=g)
    out = []
    for _ in range(steps):
        x = torch.randn(batch_size, d_in, generator=g)
        out.append((x, (x @ teacher).argmax(1)))
    return out


def sharded_training(rank, world_size, run):
    """Worker for launch(): one model and one data stream trained with DDP, ZeRO-1 and fully_shard.

    `run` has widths (of common.mlp), batch_size (global), steps, lr, modes (from
    'ddp', 'zero1', 'fsdp', 'fsdp, no reshard') and count_step. Every mode starts
    from the same initial weights (seed run['seed'], or seed + rank when
    run['seed_by_rank'] is set, the bug a test plants) and sees the same batches;
    each rank trains on its half of every batch. Returns, per mode, this rank's
    losses, the measured bytes of parameters, gradients and optimiser state after
    the last step, the collectives of step count_step, and the median step time.
    Used in: 08.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.distributed.tensor.debug import CommDebugMode
    # fully_shard's own default is a CUDA mesh wherever CUDA exists: say CPU, as the process group is gloo
    mesh = init_device_mesh('cpu', (world_size,))
    # fully_shard warns that its output is a view, in case the caller changes it in place; we never do
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module')
    batches = teacher_batches(run['steps'], run['batch_size'], run['widths'][0], run['widths'][-1])
    seed = run.get('seed', 0) + (rank if run.get('seed_by_rank') else 0)
    out = {}
    for mode in run['modes']:
        model = mlp(run['widths'], seed)
        if mode in ('ddp', 'zero1'):
            model = DDP(model)                       # broadcasts rank 0's weights to every rank
        elif mode in ('fsdp', 'fsdp, no reshard'):
            keep = mode == 'fsdp, no reshard'        # keep gathered weights from forward to backward
            for layer in model[:-1]:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)   # a unit per layer
            fully_shard(model, mesh=mesh, reshard_after_forward=not keep)           # root: last layer
        else:
            raise ValueError(f"unknown mode {mode!r}: use 'ddp', 'zero1', 'fsdp' or 'fsdp, no reshard'.")
        if mode == 'zero1':
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=run['lr'])
        else:
            opt = torch.optim.Adam(model.parameters(), lr=run['lr'])
        losses, times, counts, memory = [], [], {}, None
        for step, (x, y) in enumerate(batches):
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]   # this rank's half
            counting = step == run['count_step']
            comm = CommDebugMode() if counting else contextlib.nullcontext()
            dist.barrier()
            start = time.perf_counter()
            with comm:
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            times.append(time.perf_counter() - start)
            if counting:
                counts = count_collectives(comm)
            if step == len(batches) - 1:
                memory = training_memory(model, opt)
            opt.zero_grad()
            losses.append(loss.item())
        timed = [t for i, t in enumerate(times) if i >= 2 and i != run['count_step']] or times
        out[mode] = dict(losses=losses, memory=memory, collectives=counts,
                         step_time=float(np.median(timed)), device=str(next(model.parameters()).device))
    return out


def mlp_block(d, hidden, seed=0):
    """A transformer's MLP block: Linear(d, hidden), GELU, Linear(hidden, d). Used in: 08."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, d))


def tensor_parallel_check(rank, world_size, run):
    """Worker for launch(): an MLP block split Megatron-style over the ranks, against the unsplit block.

    `run` has d, hidden, batch_size and seed (seed_by_rank plants a bug: each
    rank starts from different weights). The first Linear is split by columns
    (each rank computes hidden/world_size of the hidden units, GELU included),
    the second by rows (each rank adds its part of every output). Returns the
    largest differences from the unsplit block (output, input gradient, weight
    gradients), the collectives of forward and backward, and the local shapes.
    Used in: 08.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh('cpu', (world_size,))
    seed = run.get('seed', 0) + (rank if run.get('seed_by_rank') else 0)
    block, reference = mlp_block(run['d'], run['hidden'], seed), mlp_block(run['d'], run['hidden'], seed)
    parallelize_module(block, mesh, {'0': ColwiseParallel(), '2': RowwiseParallel()})
    g = torch.Generator().manual_seed(1)
    x = torch.randn(run['batch_size'], run['d'], generator=g)
    x_split, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    with CommDebugMode() as forward:
        y = block(x_split)
    with CommDebugMode() as backward:
        y.square().sum().backward()
    y_ref = reference(x_ref)
    y_ref.square().sum().backward()
    full = lambda t: t.full_tensor() if hasattr(t, 'full_tensor') else t  # noqa: E731
    weight_grads = [(full(block[i].weight.grad) - reference[i].weight.grad).abs().max().item() for i in (0, 2)]
    return dict(output=(y.detach() - y_ref.detach()).abs().max().item(),
                input_grad=(x_split.grad - x_ref.grad).abs().max().item(),
                weight_grad=max(weight_grads),
                scale=y_ref.detach().abs().max().item(),
                forward=count_collectives(forward), backward=count_collectives(backward),
                shapes={name: (tuple(block[i].weight.to_local().shape), tuple(reference[i].weight.shape))
                        for name, i in (('first', 0), ('second', 2))})


class _TimedStage(torch.nn.Module):
    """A pipeline stage that records when each micro-batch's forward and backward run."""

    def __init__(self, inner, log):
        super().__init__()
        self.inner, self.log = inner, log
        first = next(inner.parameters())
        # the first layer's weight gets its gradient last: the end of this stage's backward
        first.register_post_accumulate_grad_hook(lambda p: self._backward_end())

    def forward(self, x):
        start = time.perf_counter()
        y = self.inner(x)
        self.log.append(['F', start, time.perf_counter()])
        if y.requires_grad:
            y.register_hook(self._backward_start)
        return y

    def _backward_start(self, grad):
        self.log.append(['B', time.perf_counter(), None])

    def _backward_end(self):
        open_spans = [s for s in self.log if s[0] == 'B' and s[2] is None]
        if open_spans:
            open_spans[-1][2] = time.perf_counter()


def pipeline_model(hidden, layers, classes, seed=0):
    """`layers` blocks of Linear(hidden, hidden) + ReLU, then Linear(hidden, classes). Used in: 08."""
    torch.manual_seed(seed)
    blocks = [torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU()) for _ in range(layers)]
    return torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, classes))


def pipeline_stage_part(model, rank, world_size):
    """The consecutive blocks of `model` that stage `rank` of `world_size` holds (the last one the head).

    The hidden blocks are shared out evenly; the small output layer joins the last stage.
    Used in: 08.
    """
    blocks = len(model) - 1
    if blocks % world_size:
        raise ValueError(f'{blocks} blocks cannot be shared evenly by {world_size} stages.')
    per = blocks // world_size
    part = list(model[rank * per:(rank + 1) * per]) + ([model[-1]] if rank == world_size - 1 else [])
    return torch.nn.Sequential(*part)


def bubble_fraction(p, m):
    """Idle fraction of a GPipe or 1F1B schedule with p equal stages and m micro-batches: (p-1)/(m+p-1).

    Used in: 08.
    """
    if min(p, m) < 1:
        raise ValueError('need p >= 1 stages and m >= 1 micro-batches.')
    return (p - 1) / (m + p - 1)


def pipeline_run(rank, world_size, run):
    """Worker for launch(): one model split into world_size pipeline stages, run with micro-batches.

    `run` has hidden, layers, classes, batch_size, repeats and schedules, a list of
    (name, m) with name 'GPipe' or '1F1B' and m micro-batches (scale_grads=False
    plants a bug: gradients summed over micro-batches instead of averaged).
    Returns for each schedule the largest difference of this stage's gradients
    from the unsplit model's (and grad_scale, their largest size) and of the
    last stage's micro-batch losses, the
    forward ('F') and backward ('B') spans of every repeat (seconds, from a
    common barrier), and the most micro-batches whose activations were held
    at once. Used in: 08.
    """
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    schedules = {'GPipe': ScheduleGPipe, '1F1B': Schedule1F1B}
    last = rank == world_size - 1
    x, y = teacher_batches(1, run['batch_size'], run['hidden'], run['classes'], seed=2)[0]
    reference = pipeline_model(run['hidden'], run['layers'], run['classes'])
    torch.nn.functional.cross_entropy(reference(x), y).backward()
    mine = pipeline_stage_part(reference, rank, world_size)
    grad_scale = max(p.grad.abs().max().item() for p in mine.parameters())
    out = []
    for name, m in run['schedules']:
        if name not in schedules:
            raise ValueError(f'unknown schedule {name!r}: use one of {sorted(schedules)}.')
        log = []
        part = pipeline_stage_part(pipeline_model(run['hidden'], run['layers'], run['classes']),
                                   rank, world_size)
        stage = PipelineStage(_TimedStage(part, log), rank, world_size, torch.device('cpu'))
        schedule = schedules[name](stage, n_microbatches=m, loss_fn=torch.nn.functional.cross_entropy,
                                   scale_grads=run.get('scale_grads', True))
        spans = []
        for repeat in range(run['repeats'] + 1):     # the first one is a warm-up
            part.zero_grad()
            log.clear()
            losses = []
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                schedule.step(x)
            elif last:
                schedule.step(target=y, losses=losses)
            else:
                schedule.step()
            if repeat == 0:
                grad_diff = max((a.grad - b.grad).abs().max().item()
                                for a, b in zip(part.parameters(), mine.parameters()))
                loss_diff = max(abs(l.item() - torch.nn.functional.cross_entropy(reference(xs), ys).item())
                                for l, xs, ys in zip(losses, x.chunk(m), y.chunk(m))) if last else 0.0
            else:
                spans.append([(kind, s - start, e - start) for kind, s, e in log])
        held = peak = 0
        for kind, *_ in sorted(spans[-1], key=lambda s: s[1]):
            held += 1 if kind == 'F' else -1
            peak = max(peak, held)
        out.append(dict(schedule=name, m=m, grad_diff=grad_diff, grad_scale=grad_scale, loss_diff=loss_diff,
                        spans=spans, peak_held=peak))
    return out


def measured_bubble(spans_by_rank):
    """Idle fraction of a pipeline step from every stage's (kind, start, end) spans.

    The step lasts from the first span's start to the last span's end, over all
    stages; each stage is idle whenever it computes nothing. Returns the mean over
    the stages. Used in: 08.
    """
    start = min(s for spans in spans_by_rank for _, s, _ in spans)
    end = max(e for spans in spans_by_rank for _, _, e in spans)
    busy = [_covered([(s, e) for _, s, e in spans]) for spans in spans_by_rank]
    return 1 - sum(busy) / len(busy) / (end - start)
