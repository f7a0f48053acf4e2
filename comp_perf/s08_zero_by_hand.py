"""Section 08, ZeRO stage 1 built by hand: the reference optimiser a student's version is held to,
and the check that runs a student's file against plain single-process training on gloo processes.
"""
import importlib
import importlib.util
import re
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from comp_perf.language import tr
from comp_perf.processes import launch, run_keys
from comp_perf.s08_beyond_data_parallel import mlp, teacher_batches
from comp_perf.s08_memory import local_bytes


class Zero1:
    """ZeRO stage 1 over the default process group: each rank updates 1/N of the parameters.

    Zero1(model.parameters(), torch.optim.Adam, lr=1e-3) is used like an
    optimiser: after loss.backward() on this rank's part of the batch, step()
    averages the gradients over the ranks, updates this rank's shard with its
    own optimiser (whose state covers the shard only), and gathers the whole
    parameters back on every rank.
    """

    def __init__(self, params, optimizer_class, **defaults):
        self.params = [p for p in params if p.requires_grad]
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.numel = sum(p.numel() for p in self.params)
        self.shard_numel = -(-self.numel // self.world)      # ceil: N equal shards, the last one padded
        flat = self.flatten([p.detach() for p in self.params])
        start = self.rank * self.shard_numel
        # this rank's shard: a flat copy of its slice of the parameters, the only thing its optimiser sees
        self.shard = flat[start:start + self.shard_numel].clone().requires_grad_()
        self.optimizer = optimizer_class([self.shard], **defaults)

    def flatten(self, tensors):
        """The tensors laid end to end in one buffer of N shards (zeros in the padding)."""
        flat = torch.zeros(self.world * self.shard_numel, dtype=self.params[0].dtype)
        flat[:self.numel] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    @torch.no_grad()
    def step(self):
        grads = self.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        grad_shard = torch.empty(self.shard_numel, dtype=grads.dtype)
        dist.reduce_scatter_single(grad_shard, grads, op=dist.ReduceOp.SUM)   # my shard of the sum
        grad_shard /= self.world                                # the sum over ranks -> their average
        self.shard.grad = grad_shard
        self.optimizer.step()                                   # updates my shard only
        whole = torch.empty(self.world * self.shard_numel, dtype=grads.dtype)
        dist.all_gather_single(whole, self.shard.detach())      # every rank's updated shard
        offset = 0
        for p in self.params:
            p.copy_(whole[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _load(source):
    """The module of a student's file (a path ending in .py) or of the package (a module name)."""
    if str(source).endswith('.py'):
        path = Path(source).resolve()
        spec = importlib.util.spec_from_file_location(f'_zero1_{path.stem}', path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(source)


def _state_bytes(optimizer):
    """Bytes of an optimiser's state tensors in this process (Adam: m, v and a step counter per tensor)."""
    return local_bytes(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def zero1_check_worker(rank, world_size, run):
    """Worker for launch(): a Zero1 class from run['source'] trained against plain single-process training.

    Every rank builds the same small MLP and a copy of it; the copy is trained by
    the unsharded optimiser on the whole batch, the model by Zero1 on this rank's
    part of it. Both optimisers of run['optimizers'] are tried: Adam (whose update
    hardly changes when every gradient is scaled, so it cannot tell whether the
    gradients were averaged) and SGD with momentum (which can). Returns, per
    optimiser, the largest parameter difference (relative to the largest parameter)
    and the bytes of optimiser state on this rank and in the unsharded optimiser;
    or {'not_built': message} when the file still raises NotImplementedError.
    """
    run_keys(run, ('source', 'widths', 'batch_size', 'steps', 'lr', 'optimizers'))
    warnings.filterwarnings('ignore', category=FutureWarning)   # older collective names, if a student uses them
    try:
        Zero1 = _load(run['source']).Zero1
        out = {}
        for name in run['optimizers']:
            cls, defaults = {'Adam': (torch.optim.Adam, dict(lr=run['lr'])),
                             'SGD': (torch.optim.SGD, dict(lr=10 * run['lr'], momentum=0.9))}[name]
            model, reference = mlp(run['widths']), mlp(run['widths'])
            opt, ref_opt = Zero1(model.parameters(), cls, **defaults), cls(reference.parameters(), **defaults)
            for x, y in teacher_batches(run['steps'], run['batch_size'], run['widths'][0], run['widths'][-1]):
                torch.nn.functional.cross_entropy(reference(x), y).backward()   # the whole batch, one process
                ref_opt.step()
                ref_opt.zero_grad()
                xs, ys = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # this rank's part
                torch.nn.functional.cross_entropy(model(xs), ys).backward()
                opt.step()
                opt.zero_grad()
            diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
            scale = max(p.abs().max().item() for p in reference.parameters())
            out[name] = dict(diff=diff / scale, state=_state_bytes(opt.optimizer), full_state=_state_bytes(ref_opt))
        return out
    except NotImplementedError as gap:
        return {'not_built': str(gap) or 'NotImplementedError'}


def check_zero1(source, procs=2, tol=1e-5, steps=3):
    """Run a Zero1 class on `procs` gloo processes and print pass or fail; True when it passes.

    source: the path of a student's file (e.g. 'artifacts/my_zero1.py') or the
    module name of the reference ('comp_perf.s08_zero_by_hand'). Passes when
    (a) after `steps` steps, with Adam and with SGD + momentum, every rank's
    parameters equal those of the unsharded optimiser on the whole batch within
    `tol` of the largest parameter, and (b) every rank's Adam state is 1/procs of
    the unsharded optimiser's, within 10 %. A file whose gaps still raise
    NotImplementedError prints "not built yet", not a traceback.
    """
    run = dict(source=str(source), widths=[16, 32, 8], batch_size=32, steps=steps, lr=1e-2,
               optimizers=('Adam', 'SGD'))
    try:
        results = launch(zero1_check_worker, procs, run, threads=1, timeout=60, op_timeout=10)
    except Exception as error:   # the student's code failed in a worker: say so, with the worker's traceback
        print(tr('fail: your Zero1 raised an error in a worker process:'), f'{type(error).__name__}: {error}',
              str(error.__cause__ or '').strip(), sep='\n')
        return False
    gaps = [r['not_built'] for r in results if 'not_built' in r]
    if gaps:
        number = re.fullmatch(r'gap (\d+)', gaps[0])
        print(tr('not built yet: gap {n} still raises NotImplementedError (fill it in, run the %%writefile '
                 'cell again, then this one)', n=number.group(1)) if number else
              tr('not built yet: {gap}', gap=gaps[0]))
        return False
    ok = True
    worst = {name: max(r[name]['diff'] for r in results) for name in run['optimizers']}
    for name, diff in worst.items():
        same = diff <= tol
        ok &= same
        print(tr('{verdict} (a) {opt}: parameters after {k} steps differ from the unsharded optimiser\'s by '
                 '{d:.1e} of the largest parameter (allowed {tol:.0e})',
                 verdict=tr('pass') if same else tr('FAIL'), opt=name, k=steps, d=diff, tol=tol))
    ratios = [r['Adam']['state'] / r['Adam']['full_state'] for r in results]
    shared = all(abs(ratio * procs - 1) <= 0.1 for ratio in ratios)
    ok &= shared
    print(tr('{verdict} (b) Adam state per rank: {ratios} of the unsharded optimiser\'s (should be about 1/{n})',
             verdict=tr('pass') if shared else tr('FAIL'), n=procs,
             ratios=tr(', ').join(f'{ratio:.3f}' for ratio in ratios)))
    print(tr('ZeRO-1 by hand: pass') if ok else tr('ZeRO-1 by hand: fail'))
    return ok
