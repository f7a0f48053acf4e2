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

# Seconds a worker's collective may wait for its peer before the check calls it a hang (a rank
# that skipped a collective). A whole passing check takes 2-4 s here, so 10 s leaves a loaded
# machine room and a student's hang still ends quickly.
HANG_SECONDS = 10


class Zero1(torch.optim.Optimizer):
    """ZeRO stage 1 over the default process group: each rank updates 1/N of the parameters.

    Zero1(model.parameters(), torch.optim.Adam, lr=1e-3) is a torch.optim.Optimizer:
    params may be tensors or param-group dicts ({'params': ..., 'lr': ...}), an
    LR scheduler drives it, zero_grad() clears the gradients. After loss.backward()
    on this rank's part of the batch, step() averages the gradients over the ranks,
    updates this rank's shard of each group with an inner optimiser_class (whose
    state covers the shards only) and gathers the whole parameters back on every rank.

    Each param group is flattened into one buffer padded to N equal shards; rank r
    keeps shard r of it, a copy of its own. Every parameter given is trained.
    state_dict() is this rank's shard of the optimiser state only (the inner
    optimiser's); a checkpoint is one file per rank, loaded by the same rank of
    the same number of ranks. (torch's ZeroRedundancyOptimizer gathers the whole
    state on one rank with consolidate_state_dict; this class does not.)
    """

    def __init__(self, params, optimizer_class, **defaults):
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.optimizer_class, self.optimizer, self.shards = optimizer_class, None, []
        super().__init__(params, defaults)   # checks the groups, then hands each to add_param_group

    def add_param_group(self, param_group):
        """Add a group (torch's checks and defaults), shard it, and give the shard to the inner optimiser."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self.shards.append(self.shard_of(group['params']))
        inner = dict(group, params=[self.shards[-1]])   # the group's hyperparameters, over its shard only
        if self.optimizer is None:
            self.optimizer = self.optimizer_class([inner])
        else:
            self.optimizer.add_param_group(inner)

    def flatten(self, tensors):
        """The tensors laid end to end in one buffer of N equal shards (zeros in the padding)."""
        numel = sum(t.numel() for t in tensors)
        flat = torch.zeros(self.world * -(-numel // self.world), dtype=tensors[0].dtype)   # ceil
        flat[:numel] = torch.cat([t.reshape(-1) for t in tensors])
        return flat

    def shard_of(self, params):
        """This rank's shard of the flattened params: a copy of its own, the only thing its optimiser sees."""
        flat = self.flatten([p.detach() for p in params])
        size = flat.numel() // self.world
        start = self.rank * size
        # a clone, not a view: a view would keep the whole flat buffer alive on every rank
        return flat[start:start + size].clone().requires_grad_()

    def average_shard(self, params):
        """This rank's shard of the gradients of params, averaged over the ranks."""
        grads = self.flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
        grad_shard = torch.empty(grads.numel() // self.world, dtype=grads.dtype)
        dist.reduce_scatter_single(grad_shard, grads, op=dist.ReduceOp.SUM)   # my shard of the sum
        return grad_shard / self.world                                        # the sum -> the average

    def gather(self, params, shard):
        """Every rank's updated shard, laid end to end and copied back into params."""
        whole = torch.empty(self.world * shard.numel(), dtype=shard.dtype)
        dist.all_gather_single(whole, shard.detach())
        offset = 0
        for p in params:
            p.copy_(whole[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def pass_hyperparameters_on(self):
        """Copy each group's lr (and the rest) to the inner optimiser: a scheduler changes self.param_groups."""
        for group, inner in zip(self.param_groups, self.optimizer.param_groups):
            inner.update({key: value for key, value in group.items() if key != 'params'})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.pass_hyperparameters_on()
        for group, shard in zip(self.param_groups, self.shards):
            shard.grad = self.average_shard(group['params'])
        self.optimizer.step()                                   # updates my shards only
        for group, shard in zip(self.param_groups, self.shards):
            self.gather(group['params'], shard)
        return loss

    def state_dict(self):
        """This rank's shard of the optimiser state: the inner optimiser's state_dict."""
        self.pass_hyperparameters_on()
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict):
        """Load what state_dict() returned on this rank, hyperparameters included."""
        self.optimizer.load_state_dict(state_dict)
        for group, inner in zip(self.param_groups, self.optimizer.param_groups):
            group.update({key: value for key, value in inner.items() if key != 'params'})


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


def _two_groups(model, lr):
    """Param groups as dicts, with two learning rates: the first layer at lr, the rest at lr / 2."""
    return [dict(params=model[0].parameters(), lr=lr), dict(params=model[1:].parameters(), lr=lr / 2)]


def _train(make_optimizer, run, part, grouped=False):
    """(optimiser, model) after run['steps'] steps of the MLP on batches (the part of each given by `part`).

    make_optimizer(params) builds the optimiser; with grouped=True it gets two
    param groups as dicts, and a StepLR halves every group's lr after each step.
    In float64: the sharded and the whole-batch runs, trained apart, round differently, and the
    check's trajectory brings a ReLU input within 2e-5 of its layer's largest one, close enough
    for some CPU's float32 rounding to move it across zero and change a gradient; float64's
    roundings (about 1e-16) cannot, so `tol` then measures the optimiser, not the CPU.
    """
    model = mlp(run['widths']).double()
    params = _two_groups(model, run['lr']) if grouped else model.parameters()
    optimizer = make_optimizer(params)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5) if grouped else None
    for x, y in teacher_batches(run['steps'], run['batch_size'], run['widths'][0], run['widths'][-1]):
        torch.nn.functional.cross_entropy(*part(model, x.double(), y)).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler:
            scheduler.step()
    return optimizer, model


def _difference(model, reference):
    """Largest parameter difference between two models, relative to the reference's largest parameter."""
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
    return diff / max(p.abs().max().item() for p in reference.parameters())


def _as_optimizer(Zero1, run, whole, mine, cls, defaults):
    """Part (d): two param groups as dicts and a StepLR, against the unsharded optimiser; or the error."""
    try:
        zero, model = _train(lambda params: Zero1(params, cls, **defaults), run, mine, grouped=True)
    except (TypeError, AttributeError, KeyError, ValueError) as error:   # not an Optimizer, or no groups
        return dict(problem=f'{type(error).__name__}: {error}')
    _, reference = _train(lambda params: cls(params, **defaults), run, whole, grouped=True)
    return dict(diff=_difference(model, reference))


def _gap_probes(zero, world_size, rank):
    """{gap: True when right} for the skeleton's three methods, each on inputs whose answer is known.

    Two tensors of 37 numbers in all (uneven over 2 and 3 ranks, so the padding is used); the
    gradients are rank + 1 times the values, so their mean over the ranks is (N + 1) / 2 times them.
    """
    params = [torch.arange(35.0, dtype=torch.float64).reshape(7, 5), torch.arange(35.0, 37.0, dtype=torch.float64)]
    flat = zero.flatten(params)
    size = flat.numel() // world_size
    mine = slice(rank * size, (rank + 1) * size)
    found = {}
    shard = zero.shard_of(params)
    found[1] = tuple(shard.shape) == (size,) and torch.equal(shard.detach(), flat[mine])
    for p in params:
        p.grad = (rank + 1) * p.detach().clone()
    average = zero.average_shard(params)
    found[2] = tuple(average.shape) == (size,) and torch.allclose(average, flat[mine] * (world_size + 1) / 2)
    targets = [torch.zeros_like(p) for p in params]
    with torch.no_grad():
        zero.gather(targets, 10 * flat[mine])
    found[3] = all(torch.equal(t, 10 * p) for t, p in zip(targets, params))
    return found


def zero1_check_worker(rank, world_size, run):
    """Worker for launch(): a Zero1 class from run['source'] trained against plain single-process training.

    Every rank builds the same small MLP twice; one copy is trained by the
    unsharded optimiser on the whole batch, the other by Zero1 on this rank's
    part of it. Both optimisers of run['optimizers'] are tried: Adam (whose update
    hardly changes when every gradient is scaled, so it cannot tell whether the
    gradients were averaged) and SGD with momentum (which can). Returns, per
    optimiser, the largest parameter difference (relative to the largest
    parameter), the bytes of optimiser state on this rank and in the unsharded
    optimiser, and the bytes the shards occupy over the bytes of the parameters;
    under 'optimizer', part (d): the difference after a run with two param groups
    and a StepLR (SGD), or the error that run raised; or {'not_built': message}
    when the file still raises NotImplementedError.
    """
    run_keys(run, ('source', 'widths', 'batch_size', 'steps', 'lr', 'optimizers'))
    if run['batch_size'] % world_size:
        raise ValueError(f"batch_size {run['batch_size']} does not split evenly over {world_size} ranks.")
    warnings.filterwarnings('ignore', category=FutureWarning)   # older collective names, if a student uses them
    whole = lambda model, x, y: (model(x), y)                                          # noqa: E731
    mine = lambda model, x, y: (model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])   # noqa: E731
    try:
        Zero1 = _load(run['source']).Zero1
        out = {}
        for name in run['optimizers']:
            cls, defaults = {'Adam': (torch.optim.Adam, dict(lr=run['lr'])),
                             'SGD': (torch.optim.SGD, dict(lr=10 * run['lr'], momentum=0.9))}[name]
            zero, model = _train(lambda params: Zero1(params, cls, **defaults), run, mine)
            unsharded, reference = _train(lambda params: cls(params, **defaults), run, whole)
            shards = [p for group in zero.optimizer.param_groups for p in group['params']]
            out[name] = dict(diff=_difference(model, reference), state=_state_bytes(zero.optimizer),
                             full_state=_state_bytes(unsharded),
                             shard_share=local_bytes(shards) / local_bytes(model.parameters()))
        out['optimizer'] = _as_optimizer(Zero1, run, whole, mine, torch.optim.SGD,
                                         dict(lr=10 * run['lr'], momentum=0.9))
        out['gaps'] = _gap_probes(zero, world_size, rank)
        return out
    except NotImplementedError as gap:
        return {'not_built': str(gap) or 'NotImplementedError'}


def check_zero1(source, procs=2, tol=1e-5, steps=3):
    """Run a Zero1 class on `procs` gloo processes and print pass or fail; True when it passes.

    source: the path of a student's file (e.g. 'artifacts/my_zero1.py') or the
    module name of the reference ('comp_perf.s08_zero_by_hand'). The model has
    833 parameters (7² × 17), so its shards are uneven over 2 or 3 ranks and the
    padding is used. The batch is 16 rows per process: the average over the ranks
    of each rank's mean loss gradient is the whole batch's only when the parts are
    equal (32 rows over 3 ranks would split 11/11/10). Passes when, after `steps`
    steps, (a) every rank's parameters equal those of the unsharded optimiser on
    the whole batch within `tol` of the largest parameter, with Adam and with SGD
    + momentum; (b) every rank's Adam state is 1/procs of the unsharded
    optimiser's, within 10 %; (c) the shards its optimiser updates occupy 1/procs
    of the parameters' bytes, within 10 % (a view of the whole flat buffer, not a
    clone, occupies all of them); (d) it is a torch.optim.Optimizer: given two
    param groups as dicts with two lrs and driven by a StepLR, it matches the
    unsharded SGD within `tol`. A file whose gaps still raise NotImplementedError
    prints "not built yet", not a traceback.
    """
    run = dict(source=str(source), widths=[16, 33, 8], batch_size=16 * procs, steps=steps, lr=1e-2,
               optimizers=('Adam', 'SGD'))
    try:
        results = launch(zero1_check_worker, procs, run, threads=1, timeout=60, op_timeout=HANG_SECONDS)
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
    parts = [_same_parameters(results, run['optimizers'], steps, tol), _state_shares(results, procs),
             _shard_memory(results, procs), _optimizer_part(results, tol)]
    if not all(parts):
        _name_the_gaps(results)
    print(tr('ZeRO-1 by hand: pass') if all(parts) else tr('ZeRO-1 by hand: fail'))
    return all(parts)


GAP_JOBS = {1: ('shard_of', "this rank's shard of the flat buffer (shard r of N equal parts, padding included)"),
            2: ('average_shard', "this rank's shard of the gradients, averaged over the ranks"),
            3: ('gather', 'every rank\'s shard laid end to end, written into params')}


def _name_the_gaps(results):
    """After a failed part: which of the skeleton's gaps gets its own small test wrong, on any rank."""
    wrong = [n for n in GAP_JOBS if not all(r['gaps'][n] for r in results)]
    for n in wrong:
        print(tr('    gap {n} ({name}) does not give {job}', n=n, name=GAP_JOBS[n][0], job=tr(GAP_JOBS[n][1])))
    if not wrong:
        print(tr('    gaps 1 to 3 each pass a small test of their own: the difference is elsewhere (the '
                 'optimiser groups, the step, or a shard that is a view)'))


def _verdict(ok):
    return tr('pass') if ok else tr('FAIL')


def _same_parameters(results, optimizers, steps, tol):
    """Part (a): print one line per optimiser; True when every rank's parameters are within tol."""
    ok = True
    for name in optimizers:
        diff = max(r[name]['diff'] for r in results)
        ok &= diff <= tol
        print(tr('{verdict} (a) {opt}: parameters after {k} steps differ from the unsharded optimiser\'s by '
                 '{d:.1e} of the largest parameter (allowed {tol:.0e})',
                 verdict=_verdict(diff <= tol), opt=name, k=steps, d=diff, tol=tol))
    return ok


def _near_share(ratios, procs):
    """Whether every ratio is 1/procs within 10 %."""
    return all(abs(ratio * procs - 1) <= 0.1 for ratio in ratios)


def _state_shares(results, procs):
    """Part (b): each rank's Adam state over the unsharded optimiser's, about 1/procs."""
    ratios = [r['Adam']['state'] / r['Adam']['full_state'] for r in results]
    print(tr('{verdict} (b) Adam state per rank: {ratios} of the unsharded optimiser\'s (should be about 1/{n})',
             verdict=_verdict(_near_share(ratios, procs)), n=procs,
             ratios=tr(', ').join(f'{ratio:.3f}' for ratio in ratios)))
    return _near_share(ratios, procs)


def _shard_memory(results, procs):
    """Part (c): the memory each rank's shards occupy over the parameters' bytes, about 1/procs."""
    ratios = [r['Adam']['shard_share'] for r in results]
    print(tr('{verdict} (c) shard memory per rank: {ratios} of the parameters\' bytes (should be about 1/{n}; '
             'a view of the flat buffer instead of a copy keeps all of it)',
             verdict=_verdict(_near_share(ratios, procs)), n=procs,
             ratios=tr(', ').join(f'{ratio:.3f}' for ratio in ratios)))
    return _near_share(ratios, procs)


def _optimizer_part(results, tol):
    """Part (d): two param groups as dicts and a StepLR, against the unsharded SGD."""
    problems = [r['optimizer']['problem'] for r in results if 'problem' in r['optimizer']]
    if problems:
        print(tr('FAIL (d) as a torch.optim.Optimizer: with two param groups as dicts and a StepLR it raised '
                 '{error}', error=problems[0]))
        return False
    diff = max(r['optimizer']['diff'] for r in results)
    print(tr('{verdict} (d) as a torch.optim.Optimizer: with two param groups as dicts (two lrs) and a StepLR, '
             'parameters differ from the unsharded SGD\'s by {d:.1e} of the largest parameter (allowed {tol:.0e})',
             verdict=_verdict(diff <= tol), d=diff, tol=tol))
    return diff <= tol
