"""Section 08, memory as the constraint: bytes per parameter by ZeRO stage (zero_memory),
the bytes a training process really holds (measured), their calculator and the
calculator's static figure.
"""
import torch

from comp_perf.language import course_language, tr
from comp_perf.pictures import bar_rows

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
    them.
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
    shard only; None entries (no gradient yet) count nothing.
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
    state includes Adam's one-number step counters.
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
    repeated storages count once or not at all.
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


def parameter_count(n):
    """A parameter count as each language writes it: 7.5e9 is '7.5B' in English, '75 亿' in Chinese."""
    unit = 1e8 if course_language() == 'zh' else 1e9   # Chinese counts large numbers in units of 10⁸
    return tr('{n:g}B', n=n / unit)


def memory_calculator(params_b=7.5, ranks=64, stage=3, precision='bf16 mixed', device_gb=80):
    """An ipywidgets calculator: sliders for zero_memory's inputs, a bar per part and a verdict."""
    import ipywidgets as widgets
    style = {'description_width': '13em'}
    n = widgets.FloatLogSlider(value=params_b, base=10, min=-1, max=3, step=0.05, style=style,
                               description=tr('parameters (billions)'))
    k = widgets.IntSlider(value=ranks, min=1, max=1024, style=style, description=tr('ranks'))
    z = widgets.IntSlider(value=stage, min=0, max=3, style=style, description=tr('ZeRO stage'))
    p = widgets.Dropdown(options=list(PRECISIONS), value=precision, style=style,
                         description=tr('precision'))
    d = widgets.FloatSlider(value=device_gb, min=8, max=192, step=8, style=style,
                            description=tr('memory per device (GB)'))
    table = widgets.HTML()

    def update(_=None):
        parts = zero_memory(n.value * 1e9, k.value, z.value, p.value)
        total = sum(parts.values())
        rows = bar_rows([(tr(name), f'{b / 1e9:,.2f} GB', b) for name, b in parts.items()],
                         max(total, d.value * 1e9))
        room = d.value * 1e9 - total
        line = (tr('{gb:,.1f} GB left for activations and buffers', gb=room / 1e9) if room > 0 else
                tr('does not fit: {gb:,.1f} GB too much', gb=-room / 1e9))
        table.value = (f'<table>{rows}<tr><td style="text-align:left"><b>{tr("total")}</b></td>'
                       f'<td><b>{total / 1e9:,.2f} GB</b></td><td style="text-align:left">{line}</td>'
                       '</tr></table>')

    for w in (n, k, z, p, d):
        w.observe(update, names='value')
    update()
    return widgets.VBox([n, k, z, p, d, table])


def memory_figure(**values):
    """The memory calculator's bars as a static figure, at its starting values unless given; returns it.

    The same zero_memory the calculator calls, for pages and decks that have no kernel.
    """
    import inspect

    import matplotlib.pyplot as plt
    start = {k: v.default for k, v in inspect.signature(memory_calculator).parameters.items()}
    v = {**start, **values}
    parts = zero_memory(v['params_b'] * 1e9, v['ranks'], v['stage'], v['precision'])
    fig, ax = plt.subplots(figsize=(6, 2.6))
    names = [tr(name) for name in parts]
    gb = [b / 1e9 for b in parts.values()] + [sum(parts.values()) / 1e9]
    ax.barh(names + [tr('total')], gb, color=['#4c72b0'] * len(parts) + ['#55a868'])
    for row, value in enumerate(gb):
        ax.text(value, row, f' {value:,.2f} GB', va='center', fontsize=7)
    ax.axvline(v['device_gb'], color='grey', ls='--', lw=1)
    ax.invert_yaxis()
    ax.set(xlabel=tr('GB per rank'),
           title=tr('static figure at the calculator\'s starting values') + '\n'
           + tr('{size} parameters, {n} ranks, ZeRO stage {s}, {prec}; dashed: the device\'s {d:g} GB',
                size=parameter_count(v['params_b'] * 1e9), n=v['ranks'], s=v['stage'], prec=tr(v['precision']),
                d=v['device_gb']))
    ax.title.set_fontsize(8)
    fig.tight_layout()
    return fig
