"""Section 08, combining strategies: a 2-D device mesh (FSDP across 'dp', tensor parallelism
within 'tp') trained on CPU processes against the unsplit model, and the arithmetic of a
back-of-envelope plan for one model on one cluster, from the course's own formulas; a
picture of the mesh and bars of a plan's memory per GPU.
"""
import logging
import warnings

import torch

from comp_perf.language import tr
from comp_perf.processes import run_keys
from comp_perf.s07_ring import sync_time
from comp_perf.s08_beyond_data_parallel import bubble_fraction, count_collectives, mlp_block
from comp_perf.s08_memory import zero_memory


def mesh_2d_training(rank, world_size, run):
    """Worker for launch(): 08's MLP block on a (dp, tp) mesh, FSDP over 'dp' and tensor parallelism over 'tp'.

    `run` has dp, tp (dp * tp = world_size), d, hidden, batch_size (global),
    steps, lr and seed. Within a 'tp' group the block is split Megatron-style
    (first Linear by columns, second by rows); fully_shard then shards every
    parameter over 'dp'. Each 'dp' group trains on its own slice of every
    batch; the ranks of one 'tp' group see the same slice. Every rank also
    trains the unsplit block on the whole batch. run['bug'] plants one of
    'same data' (every 'dp' group trains on the first slice) or 'sum over dp'
    (the gradients summed over 'dp' instead of averaged). Returns the
    placements and local shapes of every parameter, the collectives of the
    first step, and the largest differences from the unsplit block: of the
    gradients after the first step and of the parameters after the last.
    """
    run_keys(run, ('dp', 'tp', 'd', 'hidden', 'batch_size', 'steps', 'lr'), ('seed', 'bug'))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    if run['dp'] * run['tp'] != world_size:
        raise ValueError(f"a {run['dp']} x {run['tp']} mesh needs {run['dp'] * run['tp']} processes, "
                         f'not {world_size}.')
    warnings.filterwarnings('ignore', message='FSDP2-wrapped module')   # its output is a view; we never change it
    # full_tensor() below gathers over both mesh dims one after the other, and says so: only the check does it
    logging.getLogger('torch.distributed.tensor._redistribute').setLevel(logging.ERROR)
    mesh = init_device_mesh('cpu', (run['dp'], run['tp']), mesh_dim_names=('dp', 'tp'))
    block = mlp_block(run['d'], run['hidden'], run.get('seed', 0))
    reference = mlp_block(run['d'], run['hidden'], run.get('seed', 0))
    parallelize_module(block, mesh['tp'], {'0': ColwiseParallel(), '2': RowwiseParallel()})  # within a tp group
    fully_shard(block, mesh=mesh['dp'])                                                      # across dp groups
    opt = torch.optim.SGD(block.parameters(), lr=run['lr'])
    opt_ref = torch.optim.SGD(reference.parameters(), lr=run['lr'])
    dp_rank = mesh['dp'].get_local_rank()
    mine = 0 if run.get('bug') == 'same data' else dp_rank
    g = torch.Generator().manual_seed(1)
    teacher = torch.randn(run['d'], run['d'], generator=g)
    full = lambda t: t.full_tensor() if hasattr(t, 'full_tensor') else t  # noqa: E731
    grad_diff = param_diff = grad_scale = 0.0
    for step in range(run['steps']):
        x = torch.randn(run['batch_size'], run['d'], generator=g)
        y = x @ teacher
        with CommDebugMode() as comm:
            loss = torch.nn.functional.mse_loss(block(x.chunk(run['dp'])[mine]), y.chunk(run['dp'])[mine])
            if run.get('bug') == 'sum over dp':
                loss = loss * run['dp']      # the dp groups' gradients summed, not averaged
            loss.backward()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        if step == 0:
            collectives = count_collectives(comm)
            for p, q in zip(block.parameters(), reference.parameters()):
                grad_diff = max(grad_diff, (full(p.grad) - q.grad).abs().max().item())
                grad_scale = max(grad_scale, q.grad.abs().max().item())
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    for p, q in zip(block.parameters(), reference.parameters()):
        param_diff = max(param_diff, (full(p.detach()) - q.detach()).abs().max().item())
    param_scale = max(q.detach().abs().max().item() for q in reference.parameters())
    return dict(coords=(dp_rank, mesh['tp'].get_local_rank()), collectives=collectives,
                grad_diff=grad_diff, grad_scale=grad_scale, param_diff=param_diff, param_scale=param_scale,
                placements={name: dict(zip(mesh.mesh_dim_names, map(repr, p.placements)),
                                       local=tuple(p.to_local().shape), whole=tuple(p.shape))
                            for name, p in block.named_parameters()})


def plan_estimate(model, cluster, dp, tp=1, pp=1, zero=0):
    """Memory per GPU and seconds per step of one layout (dp x tp x pp GPUs), from the course's formulas.

    model: params, layers, hidden, seq, batch (sequences per step), micro_batch
    (sequences per micro-batch). cluster: nodes, gpus_per_node, memory_gb,
    nvlink_gbs and network_gbs (GB/s per GPU and direction), peak_tflops, mfu.
    Memory: bf16 weights and gradients with fp32 Adam (zero_memory's 'bf16
    mixed') of the 1/(tp·pp) of the model a GPU holds, ZeRO stage `zero` over dp;
    plus activations, s·b·h·(10 + 24/t) bytes per layer (Korthikanti et al.,
    2022: 16-bit, fused attention that keeps no scores, no recomputation), of
    min(pp, m) micro-batches on the first stage (1F1B). Time: 6 FLOPs per
    parameter and token (Kaplan et al., 2020) at mfu of the peak; the ring over dp
    (once per step for DDP and ZeRO-1, a reduce-scatter per micro-batch for ZeRO-2,
    also two all-gathers per micro-batch for ZeRO-3), over NVLink if the dp·tp
    GPUs fit in a node; four all-reduces of the activations per layer and
    micro-batch over tp, inside a node; an activation sent forward and a gradient
    back per micro-batch between stages; the bubble. hidden_step assumes the dp
    ring hides behind the computation, exposed_step that nothing does.
    """
    ranks = cluster['nodes'] * cluster['gpus_per_node']
    if dp * tp * pp != ranks or tp > cluster['gpus_per_node'] or model['layers'] % pp:
        raise ValueError(f'dp·tp·pp = {dp}·{tp}·{pp} must be the {ranks} GPUs, tp must stay within a node '
                         f'and pp must divide the layers.')
    m, rest = divmod(model['batch'], dp * model['micro_batch'])   # micro-batches per step and pipeline
    if rest or m < 1:
        raise ValueError(f"{model['batch']} sequences cannot be shared into micro-batches of "
                         f"{model['micro_batch']} over {dp} data-parallel groups.")
    states = sum(zero_memory(model['params'] / (tp * pp), dp, zero, 'bf16 mixed').values())
    tokens = model['seq'] * model['micro_batch']                            # s·b of one micro-batch
    activations = min(pp, m) * (model['layers'] // pp) * tokens * model['hidden'] * (10 + 24 / tp)
    flops = 6 * model['params'] * model['batch'] * model['seq']            # forward 2, backward 4 per token
    compute = flops / (ranks * cluster['peak_tflops'] * 1e12 * cluster['mfu'])
    bubble = bubble_fraction(pp, m)
    pipeline = compute / (1 - bubble)
    inside = dp * tp <= cluster['gpus_per_node']                         # does one dp ring stay in a node?
    dp_bw = 1e9 * (cluster['nvlink_gbs'] if inside else cluster['network_gbs'])
    gradients = 2 * model['params'] / (tp * pp)                           # bf16 bytes per rank
    halves = {0: 2, 1: 2, 2: m + 1, 3: 3 * m}[zero]                     # ring halves: reduce-scatter or all-gather
    dp_comm = halves * (dp - 1) / dp * gradients / dp_bw
    act = 2 * tokens * model['hidden']                                    # one micro-batch's bf16 activations
    tp_comm = 4 * (model['layers'] // pp) * m * sync_time('ring', act, tp, 1e9 * cluster['nvlink_gbs'])
    pp_comm = 2 * m * act / (1e9 * cluster['network_gbs']) if pp > 1 else 0.0
    return dict(states=states, activations=activations, total=states + activations,
                fits=states + activations <= cluster['memory_gb'] * 1e9, micro_batches=m,
                compute=compute, bubble=bubble, dp_comm=dp_comm, tp_comm=tp_comm, pp_comm=pp_comm,
                hidden_step=max(pipeline, dp_comm) + tp_comm + pp_comm,
                exposed_step=pipeline + dp_comm + tp_comm + pp_comm)


def draw_mesh_2d():
    """Draw the 2 x 2 (dp, tp) mesh of mesh_2d_training: rows are 'tp' groups, columns 'dp' groups."""
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 2.6))
    for rank in range(4):
        d, t = divmod(rank, 2)
        ax.add_patch(plt.Rectangle((2.2 * t, 1.6 * (1 - d)), 1.6, 1.0, color=f'C{d}', alpha=0.3 + 0.3 * t))
        ax.text(2.2 * t + 0.8, 2.1 - 1.6 * d, f'rank {rank}\ndp {d}, tp {t}', ha='center', va='center', fontsize=8)
    for i in range(2):
        ax.plot([1.6, 2.2], [2.1 - 1.6 * i] * 2, 'k-', [0.8 + 2.2 * i] * 2, [1.0, 1.6], 'k--', lw=2)
        ax.text(4.1, 2.1 - 1.6 * i, tr("'tp' group {d}: the block split, all-reduce of activations", d=i),
                va='center', fontsize=8)
    ax.text(-0.1, -0.35, tr("'dp' groups (dashed): weights sharded, all-gather and reduce-scatter, "
                            'each group its own half of the batch'), fontsize=8)
    ax.set(xlim=(-0.2, 10), ylim=(-0.6, 2.7))
    ax.axis('off')
    ax.set_title(tr('a 2 × 2 device mesh: rows are tp groups, columns dp groups'), fontsize=9)
    return fig


def plot_plan_memory(ax, plans, memory_gb, title):
    """Bars of memory per GPU ({layout: plan_estimate(...)}), model states and activations, against the device.

    Bars above twice the device's memory are cut, their total written at the top.
    """
    names, top = list(plans), 2 * memory_gb
    states = [plans[k]['states'] / 1e9 for k in names]
    ax.bar(names, states, color='C0', label=tr('weights, gradients, Adam'))
    ax.bar(names, [plans[k]['activations'] / 1e9 for k in names], bottom=states, color='C1', label=tr('activations'))
    ax.axhline(memory_gb, color='grey', ls='--', lw=1)
    for i, k in enumerate(names):
        if plans[k]['total'] / 1e9 > top:
            ax.text(i, 0.97 * top, f"{plans[k]['total'] / 1e9:,.0f} GB", ha='center', va='top', fontsize=7,
                    color='white')
    ax.set(ylim=(0, top), ylabel=tr('GB per GPU'), title=title)
    ax.tick_params(axis='x', labelsize=7, rotation=30)
