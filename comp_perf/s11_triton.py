"""Section 11: Triton on any machine. How it runs here (compiled for a GPU, interpreted on the CPU, or
absent), a counter of the bytes a kernel's loads and stores move, the check of the FlashAttention kernel
the student builds, and the autograd wrapper that trains 10's model with it.

Nothing here imports Triton at `import common`: macOS has no Triton wheel, and `@triton.jit` decides
when a kernel is defined whether it is compiled or interpreted, so Triton is imported once the mode is set.
"""
import contextlib
import importlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from comp_perf.language import tr
from comp_perf.s10_flash_attention import flash_attention_backward
from comp_perf.s10_flash_checks import check_attention_inputs, forward_parts, graded_check, lengths_part, load_solution

INTERPRET = 'TRITON_INTERPRET'
REFERENCE = Path(__file__).with_name('s11_flash_kernel.py')
CHECK_BATCH = (1, 2)   # (batch, heads): the interpreter spends milliseconds per tile; 10's six heads triple it


class _Absent:
    """Stands in for triton and triton.language where Triton cannot be imported, so that a page's
    kernel definitions (decorators, tl.constexpr annotations) still run; launching is guarded by Kit.runs."""

    def __getattr__(self, name):
        return _Absent()

    def __call__(self, *args, **kwargs):
        return _Absent()

    def __getitem__(self, item):
        return _Absent()


@dataclass
class Kit:
    """What load_triton found: the modules (stand-ins when absent), the mode and why."""
    triton: object
    tl: object
    mode: str      # 'native' (compiled for the GPU), 'interpreter' (NumPy on the CPU) or 'missing'
    why: str

    @property
    def runs(self):
        return self.mode != 'missing'


def load_triton(device):
    """Import Triton for `device` and say in one line how its kernels will run.

    A CUDA device gets compiled kernels, unless TRITON_INTERPRET=1 was set by hand (then interpreted,
    and the line says so); any other device gets the interpreter, switched on here before the import.
    Where the import fails (macOS, Windows without the community build) the kit holds stand-ins and
    the page's launching cells print skipped() instead of raising.
    """
    _interpret_on(device)
    try:
        triton = importlib.import_module('triton')
        tl = importlib.import_module('triton.language')
    except ImportError as error:
        kit = Kit(_Absent(), _Absent(), 'missing', f'{type(error).__name__}: {error}')
        print(tr('Triton cannot be imported here ({why}): the cells that launch kernels say so and skip; '
                 'their stored outputs show a run on the course\'s CI machine', why=kit.why))
        return kit
    if interpreting():
        kit = Kit(triton, tl, 'interpreter', 'TRITON_INTERPRET=1')
        print(tr('Triton {v}, interpreter: each program instance runs in NumPy on the CPU, one after another; '
                 'results are right, times mean nothing', v=triton.__version__))
    else:
        kit = Kit(triton, tl, 'native', torch.cuda.get_device_name(device))
        print(tr('Triton {v}, compiled for {gpu}: kernels run on the GPU and can be timed',
                 v=triton.__version__, gpu=kit.why))
    return kit


def interpreting():
    """True when kernels defined now are interpreted (TRITON_INTERPRET set to a true value)."""
    return os.environ.get(INTERPRET, '0').lower() in ('1', 'true', 'on', 'yes')


def skipped():
    print(tr('skipped: Triton is not installed here'))


def refuse_bfloat16(*tensors):
    """A clear error for bfloat16 in the interpreter, which returns garbage for it without a word
    (tl.dot, element-wise arithmetic: measured with Triton 3.8.0); fp32 and fp16 are exact there."""
    if interpreting() and any(t.dtype == torch.bfloat16 for t in tensors):
        raise TypeError('Triton\'s interpreter computes bfloat16 wrongly without an error: use float32 or '
                        'float16 on the CPU, bfloat16 on a GPU that has it')


# ----- counting what a kernel moves -----

@dataclass
class Traffic:
    """Bytes a kernel's tl.load and tl.store calls moved, counting only the lanes their masks let through."""
    loaded: int = 0
    stored: int = 0
    loads: int = 0
    stores: int = 0

    @property
    def total(self):
        return self.loaded + self.stored


def _lanes_bytes(ptrs, mask):
    return int(mask.data.sum()) * (ptrs.get_element_ty().primitive_bitwidth // 8)


@contextlib.contextmanager
def counted_traffic():
    """Count, while it is open, every pointer load and store an interpreted kernel performs.

    The interpreter routes tl.load and tl.store (masked or not) through its builder's
    create_masked_load and create_masked_store; the counter wraps those two methods on the one
    builder instance and removes the wrappers on leaving. Tensor-descriptor loads (TMA) are not counted.
    """
    from triton.runtime import interpreter
    builder, traffic = interpreter.interpreter_builder, Traffic()
    load, store = builder.create_masked_load, builder.create_masked_store

    def counted_load(ptrs, mask, *rest):
        traffic.loaded += _lanes_bytes(ptrs, mask)
        traffic.loads += 1
        return load(ptrs, mask, *rest)

    def counted_store(ptrs, value, mask, *rest):
        traffic.stored += _lanes_bytes(ptrs, mask)
        traffic.stores += 1
        return store(ptrs, value, mask, *rest)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    try:
        yield traffic
    finally:
        del builder.create_masked_load, builder.create_masked_store


def traffic_of(kernel, grid, *args, **kwargs):
    """Traffic of one launch kernel[grid](*args, **kwargs), run in the interpreter: a compiled kernel
    gets an interpreted twin of its Python function, so a GPU machine counts the same bytes."""
    from triton.runtime.interpreter import InterpretedFunction
    twin = kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)
    with counted_traffic() as traffic:
        twin[grid](*args, **kwargs)
    return traffic


def _storages(tensors):
    return {t.untyped_storage().data_ptr() for t in tensors}


def eager_traffic(fn, *args):
    """Traffic of fn(*args) run by eager PyTorch: each operator counted as reading every tensor it is
    given and writing every tensor it returns, as an unfused kernel does (one read and one write of
    DRAM each). Views, which move nothing, are left out: an operator whose output shares its input's storage."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    traffic = Traffic()

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            if not _storages(outputs) & _storages(inputs):
                traffic.loaded += sum(t.nbytes for t in inputs)
                traffic.stored += sum(t.nbytes for t in outputs)
                traffic.loads += len(inputs)
                traffic.stores += len(outputs)
            return out

    with Counter():
        fn(*args)
    return traffic


# ----- the build's check -----

def _gap_in(error):
    """'gap N' when the error comes from a gap still raising NotImplementedError: the interpreter wraps
    it in InterpreterError, the GPU compiler refuses the raise statement and quotes its line."""
    seen = error
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return str(seen) or 'NotImplementedError'
        seen = seen.__cause__
    found = re.search(r"NotImplementedError\(['\"](gap \d+)", str(error))
    return found.group(1) if found else None


def _graded_on(flash, device):
    """flash called on `device` with the check's CPU inputs, its results brought back; a gap's error
    turned back into the NotImplementedError that the checks report as 'not built yet'."""
    def run(q, k, v, **kwargs):
        refuse_bfloat16(q, k, v)
        try:
            result = flash(*(x.to(device) for x in (q, k, v)), **kwargs)
        except Exception as error:
            gap = _gap_in(error)
            if gap:
                raise NotImplementedError(gap) from None
            raise
        return tuple(x.cpu() for x in result) if isinstance(result, (tuple, list)) else result
    run.__name__ = getattr(flash, '__name__', 'triton_flash_attention')
    return run


def _interpret_on(device):
    """Switch the interpreter on for good unless `device` is a GPU. For good: Triton defines its own
    helpers (tl.max, tl.cdiv, …) interpreted or compiled when it is imported, so a kernel interpreted
    after a compiled import fails inside ("Cannot call @triton.jit'd outside of the scope of a kernel");
    that case gets a clear error here instead."""
    if torch.device(device).type == 'cuda':
        return
    os.environ[INTERPRET] = '1'
    language = sys.modules.get('triton.language')
    if language is not None and type(language.max).__name__ != 'InterpretedFunction':
        raise RuntimeError('Triton was imported before its interpreter was switched on, so its kernels cannot '
                           'run on the CPU in this process: restart the kernel and run the first cell first '
                           '(or set TRITON_INTERPRET=1 before anything imports triton)')


def load_kernel_file(source=REFERENCE, name='triton_flash_attention', device='cpu'):
    """The function `name` of a kernel file, loaded afresh so that its kernels are defined for `device`."""
    _interpret_on(device)
    return load_solution(str(source), name)


def check_triton_flash(source=REFERENCE, device='cpu', block=32):
    """Hold the Triton triton_flash_attention(q, k, v, causal=False, block_q=..., block_k=...) in `source`
    (a .py file) to plain attention in float64, with 10's forward parts (a)–(e) and (g): no mask,
    causal with equal and unequal blocks, a length that is not a multiple of the block, large scores,
    the logsumexp, unequal query and key lengths with a value head size of 24, on one sequence of two
    heads (CHECK_BATCH). Tolerances are 10's.
    On the CPU the kernel runs in Triton's interpreter; on a CUDA device it is compiled and run there.
    Part (f), memory, is 10's alone: the interpreter's NumPy arrays are not PyTorch's allocations.
    """
    def parts():
        flash = _graded_on(load_kernel_file(source, device=device), device)
        return forward_parts(flash, block, CHECK_BATCH) + [lengths_part(flash, block, CHECK_BATCH)]
    return graded_check(parts, 'Triton FlashAttention: pass', 'Triton FlashAttention: fail')


# ----- into training: the kernel forward, 10's tiled backward -----

class KernelAttention(torch.autograd.Function):
    """out = flash(q, k, v)[0]; backward: 10's tiled flash_attention_backward from the saved out and lse."""

    @staticmethod
    def forward(ctx, q, k, v, causal, flash):
        out, lse = flash(q, k, v, causal=causal)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_attention_backward(q, k, v, out, lse, dout.contiguous(), causal=ctx.causal)
        return dq, dk, dv, None, None


def kernel_attention(flash):
    """An attention(q, k, v, is_causal=False) for 10's model, SDPA's signature, running `flash`."""
    def attention(q, k, v, is_causal=False):
        check_attention_inputs(q, k, v)
        return KernelAttention.apply(q, k, v, is_causal, flash)
    return attention

