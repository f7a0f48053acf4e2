"""Section 12, a mixture of experts: the layer on one process, and the same layer with its experts split
over processes, tokens sent to their experts and back with all-to-all.

MixtureOfExperts routes each token to its top-k experts (softmax router, Switch Transformer's
capacity factor and load-balancing loss); expert_parallel_forward() computes the same function
with rank r holding experts r·E/P … (r+1)·E/P − 1: the router's counts are exchanged first (so
each rank knows how many rows it receives), then the rows with all_to_all_single and uneven
splits, the experts' work, and the reverse all-to-all. Each rank routes its own tokens, with a
capacity per rank's group of tokens, as GShard's local group dispatching does; the one-process
reference applies the layer to each rank's tokens in turn. expert_parallel_check() holds it to
that reference in outputs and gradients.
"""
import math
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from comp_perf.processes import run_keys


class MixtureOfExperts(nn.Module):
    """A mixture-of-experts MLP layer: E experts (d → hidden → d, ReLU), a linear softmax router, top-k.

    forward(x) takes tokens (n, d) and returns (y, aux): y is each token's experts' outputs
    weighted by their router probabilities (a token an expert has no room for gets nothing from
    it), aux the load-balancing loss of the Switch Transformer (Fedus et al. 2021, eq. 4):
    E · Σ_i f_i · P_i, where f_i is the share of tokens whose first choice is expert i and P_i
    the mean router probability of expert i; it is 1 when both are uniform. Each expert takes
    at most capacity(n) = ⌈capacity_factor · n · k / E⌉ tokens, first come, first served.
    """

    def __init__(self, d, hidden, experts, top_k=1, capacity_factor=1.25, seed=0):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f'top_k must be between 1 and the number of experts ({experts}), got {top_k}.')
        gen = torch.Generator().manual_seed(seed)
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Parameter(torch.randn(d, experts, generator=gen) / math.sqrt(d))
        self.w1 = nn.Parameter(torch.randn(experts, d, hidden, generator=gen) / math.sqrt(d))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, d, generator=gen) / math.sqrt(hidden))

    def capacity(self, n):
        return math.ceil(self.capacity_factor * n * self.top_k / self.experts)

    def route(self, x):
        """(probs (n, E), slots): slots holds the kept (token, expert, gate) rows, token-major, the
        choices beyond an expert's capacity dropped."""
        probs = F.softmax(x @ self.router, -1)
        gate, expert = probs.topk(self.top_k, -1)
        token = torch.arange(len(x)).repeat_interleave(self.top_k)
        expert, gate = expert.flatten(), gate.flatten()
        # the place of each choice in its expert's queue, counted in token order
        place = (F.one_hot(expert, self.experts).cumsum(0) - 1).gather(1, expert[:, None]).squeeze(1)
        keep = place < self.capacity(len(x))
        return probs, (token[keep], expert[keep], gate[keep])

    def expert(self, e, rows, w1=None, w2=None):
        """Expert e's MLP on rows (m, d); w1 and w2 default to this layer's own stacks."""
        w1, w2 = (self.w1, self.w2) if w1 is None else (w1, w2)
        return F.relu(rows @ w1[e]) @ w2[e]

    def forward(self, x):
        probs, (token, expert, gate) = self.route(x)
        y = torch.zeros_like(x)
        for e in range(self.experts):
            mine = expert == e
            y = y.index_add(0, token[mine], self.expert(e, x[token[mine]]) * gate[mine, None])
        return y, balance_loss(probs, self.experts)


def balance_loss(probs, experts):
    """Switch's load-balancing loss E · Σ_i f_i · P_i from the router probabilities (n, E)."""
    first = F.one_hot(probs.argmax(-1), experts).float().mean(0)   # f_i: not differentiable, as in the paper
    return experts * (first * probs.mean(0)).sum()


def tokens_per_expert(layer, x):
    """How many tokens each expert is given (after the capacity), a list of E counts."""
    with torch.no_grad():
        _, (_, expert, _) = layer.route(x)
    return torch.bincount(expert, minlength=layer.experts).tolist()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits, inside autograd: the backward pass sends the gradients back
    the way the rows came (the splits swapped)."""

    @staticmethod
    def forward(ctx, rows, send_splits, receive_splits):
        ctx.splits = send_splits, receive_splits
        out = rows.new_empty(sum(receive_splits), *rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), receive_splits, send_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, receive_splits = ctx.splits
        out = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), send_splits, receive_splits)
        return out, None, None


def all_to_all(rows, send_splits, receive_splits):
    """Rank r sends send_splits[j] rows to rank j and receives receive_splits[j] from it, with gradients."""
    return _AllToAll.apply(rows, send_splits, receive_splits)


def expert_parallel_forward(layer, x, timings=None):
    """layer(x) with this rank holding only experts rank·E/P … (rank+1)·E/P − 1: (y, aux, sent rows).

    x is this rank's tokens. The layer's router and expert weights are the same on every rank
    (a rank uses only its own experts' weights). `timings`, a dict, gets the seconds spent in
    the all-to-alls ('communication') and in the experts ('experts').
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if layer.experts % world_size:
        raise ValueError(f'{layer.experts} experts do not split evenly over {world_size} ranks.')
    per_rank = layer.experts // world_size
    timings = {} if timings is None else timings
    timings.update(communication=0.0, compute=0.0)
    probs, (token, expert, gate) = layer.route(x)
    order = torch.argsort(expert, stable=True)          # rows grouped by expert, so by destination rank
    token, expert, gate = token[order], expert[order], gate[order]
    send = torch.bincount(expert // per_rank, minlength=world_size)
    start = time.perf_counter()
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send)               # first the counts: each rank learns what it will get
    send, receive = send.tolist(), receive.tolist()
    rows = all_to_all(x[token], send, receive)
    their_expert = torch.empty(sum(receive), dtype=expert.dtype)
    dist.all_to_all_single(their_expert, expert, receive, send)
    timings['communication'] += time.perf_counter() - start
    start = time.perf_counter()
    outputs = torch.zeros_like(rows)
    for e in range(rank * per_rank, (rank + 1) * per_rank):
        mine = their_expert == e
        outputs = outputs.index_put((mine.nonzero().squeeze(1),), layer.expert(e, rows[mine]))
    timings['compute'] += time.perf_counter() - start
    start = time.perf_counter()
    back = all_to_all(outputs, receive, send)           # the reverse: every row goes home
    timings['communication'] += time.perf_counter() - start
    y = torch.zeros_like(x).index_add(0, token, back * gate[:, None])
    return y, balance_loss(probs, layer.experts), sum(n for j, n in enumerate(send) if j != rank)


def moe_inputs(world_size, tokens, d, seed=0):
    """Every rank's tokens (tokens, d) and targets, the same on every rank for a given seed."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen))
            for _ in range(world_size)]


def expert_parallel_check(rank, world_size, run):
    """Worker for launch(): the expert-parallel layer against the one-process layer on every rank's tokens.

    run: d, hidden, experts, top_k, capacity_factor, tokens, seed. The loss is Σ_r ⟨y_r, target_r⟩
    plus the balancing losses; the reference computes it on one process, rank by rank's tokens.
    Returns this rank's largest output difference, the largest difference of its own experts'
    gradients and of the router's (summed over the ranks), each relative to the largest value,
    the rows it sent to other ranks and received, and its seconds in communication and experts.
    """
    run_keys(run, ('d', 'hidden', 'experts', 'top_k', 'capacity_factor', 'tokens', 'seed'), ('source',))
    forward = expert_parallel_forward
    if run.get('source'):   # another version of it, in a file (the tests plant mistakes this way)
        from comp_perf.s12_ring import load_module
        forward = load_module(run['source']).expert_parallel_forward
    make = lambda: MixtureOfExperts(run['d'], run['hidden'], run['experts'], run['top_k'],   # noqa: E731
                                    run['capacity_factor'], seed=run['seed'])
    data = moe_inputs(world_size, run['tokens'], run['d'], run['seed'])
    whole, split = make(), make()
    loss, outputs = 0.0, []
    for x, target in data:
        y, aux = whole(x)
        outputs.append(y.detach())
        loss = loss + (y * target).sum() + aux
    loss.backward()
    timings = {}
    x, target = data[rank]
    y, aux, sent = forward(split, x, timings)
    ((y * target).sum() + aux).backward()
    dist.all_reduce(split.router.grad)
    own = slice(rank * run['experts'] // world_size, (rank + 1) * run['experts'] // world_size)
    gap = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()   # noqa: E731
    received = sum(int(torch.bincount(split.route(x)[1][1], minlength=run['experts'])[own].sum()) for x, _ in data)
    return dict(output=gap(y.detach(), outputs[rank]),
                experts=max(gap(split.w1.grad[own], whole.w1.grad[own]), gap(split.w2.grad[own], whole.w2.grad[own])),
                router=gap(split.router.grad, whole.router.grad), sent=sent, received=received, **timings)


EXPERT_CHECK_RUN = dict(d=16, hidden=32, experts=6, top_k=2, capacity_factor=1.0, tokens=64, seed=1)
EXPERT_TOL = 1e-5   # fp32: the same sums in another order


def check_expert_parallel(procs=(2, 3), source=None):
    """The expert-parallel layer against the one-process layer at each number of processes: one line each
    (outputs, the experts' and the router's gradients, allowed EXPERT_TOL of the largest value); True when all pass."""
    from comp_perf.language import tr
    from comp_perf.processes import launch
    passed = True
    for n in procs:
        try:
            results = launch(expert_parallel_check, n, {**EXPERT_CHECK_RUN, 'source': source}, threads=1, timeout=60,
                             op_timeout=10)
            worst = max(max(r['output'], r['experts'], r['router']) for r in results)
        except Exception as error:   # a mistake that breaks the exchange: sizes that do not match, a hang
            print(tr('FAIL: {n} processes: the expert-parallel layer raised {error}', n=n,
                     error=str(error).strip().splitlines()[-1]))
            passed = False
            continue
        ok = worst <= EXPERT_TOL
        passed &= ok
        print(tr('{verdict}: {n} processes, {e} experts, top-{k}: outputs and gradients (experts, router) differ '
                 'from the one-process layer\'s by at most {gap:.1e} of the largest value (allowed {tol:.0e})',
                 verdict=tr('pass') if ok else tr('FAIL'), n=n, e=EXPERT_CHECK_RUN['experts'],
                 k=EXPERT_CHECK_RUN['top_k'], gap=worst, tol=EXPERT_TOL))
    return passed
