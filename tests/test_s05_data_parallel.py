"""Section 05: the data-parallel code on its page and comp_perf/s05_data_parallel.py."""
import re

import pytest
import torch
from helpers import ROOT
from notebook_code import definitions

import common


def test_step_tolerance_follows_dtype_and_device():
    assert common.step_tolerance() == 1e-4
    assert common.step_tolerance(torch.float32, 'cuda:0') > common.step_tolerance()
    assert common.step_tolerance(torch.float64) < common.step_tolerance(torch.bfloat16)
    with pytest.raises(ValueError, match='floating-point'):
        common.step_tolerance(torch.int64)


def test_step_difference_sees_a_wrong_step_but_not_rounding():
    before = [torch.zeros(3), torch.ones(2)]
    step = [torch.tensor([0.1, -0.2, 0.3]), torch.tensor([1.0, 1.1])]
    good = [torch.tensor([0.1, -0.2, 0.3000001]), torch.tensor([1.0, 1.1])]
    half = [torch.tensor([0.05, -0.1, 0.15]), torch.tensor([1.0, 1.05])]   # a gradient halved
    assert common.step_difference(before, good, step) < common.step_tolerance()
    assert common.step_difference(before, half, step) == pytest.approx(0.5, rel=1e-4)


def test_full_fp32_turns_tf32_off_and_restores_it():
    knobs = [torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn]
    before = [k.fp32_precision for k in knobs]
    torch.backends.cudnn.conv.fp32_precision = 'tf32'
    try:
        with pytest.raises(KeyError):
            with common.full_fp32():
                assert [k.fp32_precision for k in knobs] == ['ieee'] * 3
                raise KeyError('restored even after an error')
        assert torch.backends.cudnn.conv.fp32_precision == 'tf32'
        with common.full_fp32():   # what its docstring warns about: the legacy flag refuses
            with pytest.raises(RuntimeError):
                torch.backends.cudnn.allow_tf32
    finally:
        for k, v in zip(knobs, before):
            k.fp32_precision = v


def test_accuracy_and_evaluate_accuracy():
    y = torch.tensor([0, 1, 2, 3])
    logits = torch.nn.functional.one_hot(torch.tensor([0, 1, 2, 0]), 4).float()
    assert common.accuracy(logits, y) == 3
    assert common.accuracy(torch.tensor([0, 1, 0, 3]), y) == 3
    data = [(logits[:2], y[:2]), (logits[2:], y[2:])]
    assert common.evaluate_accuracy(torch.nn.Identity(), data, 'cpu') == 0.75


def test_animator_collects_points_outside_a_notebook():
    anim = common.Animator(xlabel='epoch', legend=['loss', 'acc'])
    for epoch in range(3):
        anim.add(epoch, [1.0 / (epoch + 1), None if epoch == 0 else 0.5])
    assert anim.X == [[0, 1, 2], [1, 2]]
    assert len(anim.ax.get_lines()) == 2
    with pytest.raises(ValueError, match='expected 2'):
        anim.add(3, [1.0])


@pytest.fixture(scope='module')
def page():
    """The functions section 05 defines on its page: the tests run that code."""
    return definitions('05-multi-gpu-from-scratch', 'get_params', 'allreduce', 'split_batch', 'train_batch')


def test_get_params_copies_even_on_the_same_device(page):
    params = common.lenet_params(seed=1)
    copy = page['get_params'](params, 'cpu')
    with torch.no_grad():
        copy[0].add_(1.0)
    assert not torch.equal(copy[0], params[0]) and copy[0].requires_grad


def test_allreduce_leaves_the_sum_everywhere(page):
    data = [torch.full((2, 3), float(i + 1)) for i in range(3)]
    page['allreduce'](data)
    assert all(torch.equal(t, torch.full((2, 3), 6.0)) for t in data)


def test_split_batch_uneven_and_bad_input(page):
    split_batch = page['split_batch']
    X, y = torch.arange(14).reshape(7, 2), torch.arange(7)
    xs, ys = split_batch(X, y, ['cpu'] * 3)
    assert [len(s) for s in xs] == [3, 2, 2] and torch.equal(torch.cat(ys), y)
    with pytest.raises(ValueError, match='X has 7 examples but y has 6'):
        split_batch(X, y[:6], ['cpu'] * 2)
    with pytest.raises(ValueError, match='cannot split 2 examples over 3 devices'):
        split_batch(X[:2], y[:2], ['cpu'] * 3)


@pytest.mark.parametrize('k', [2, 3])
def test_data_parallel_step_equals_single_device_step(page, k):
    get_params, train_batch = page['get_params'], page['train_batch']
    torch.manual_seed(0)
    X, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    params = common.lenet_params(seed=2)
    replicas = [get_params(params, 'cpu') for _ in range(k)]
    single = [get_params(params, 'cpu')]
    train_batch(X, y, replicas, ['cpu'] * k, lr=0.5)
    train_batch(X, y, single, ['cpu'], lr=0.5)
    for i, reference in enumerate(single[0]):
        assert not torch.equal(reference, params[i])  # the step changed every parameter
        assert all(torch.equal(r[i], replicas[0][i]) for r in replicas)
    assert common.step_difference(params, replicas[0], single[0]) < common.step_tolerance()


def test_a_broken_train_batch_fails_the_equivalence_check():
    """The equivalence check can fail: a step that forgets the allreduce differs from one device."""
    source = definitions('05-multi-gpu-from-scratch', 'get_params', 'split_batch', 'train_batch')
    source['allreduce'] = lambda data: None   # replicas keep their own shard's gradient
    torch.manual_seed(0)
    X, y = torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,))
    params = common.lenet_params(seed=2)
    replicas = [source['get_params'](params, 'cpu') for _ in range(2)]
    single = [source['get_params'](params, 'cpu')]
    source['train_batch'](X, y, replicas, ['cpu'] * 2, lr=0.5)
    source['train_batch'](X, y, single, ['cpu'], lr=0.5)
    assert common.step_difference(params, replicas[0], single[0]) > common.step_tolerance()


def test_replica_devices_falls_back_and_refuses_nonsense(monkeypatch, fake_gpus):
    fake_gpus(1)
    assert common.replica_devices(2) == [torch.device('cuda:0')] * 2
    fake_gpus(0)
    assert common.replica_devices(3) == [torch.device('cpu')] * 3
    with pytest.raises(ValueError, match='whole number >= 1'):
        common.replica_devices(0)


def test_batch_indices_wrap_and_split_the_same_global_batch():
    order = torch.arange(10)
    assert common.batch_indices(order, 0, 4).tolist() == [0, 1, 2, 3]
    assert common.batch_indices(order, 2, 4).tolist() == [8, 9, 0, 1]   # full size at the wrap
    parts = [common.batch_indices(order, 2, 4, p, 3).tolist() for p in range(3)]
    assert parts == [[8, 9], [0], [1]]


@pytest.mark.procs
def test_dp_worker_ranks_agree_and_match_one_process(fashion_mnist):
    run = dict(batch_size=64, lr=0.2, steps=1, subset=256)
    two = common.launch(common.dp_worker, 2, run)
    one = common.launch(common.dp_worker, 1, run)
    assert two[0]['checksum'] == two[1]['checksum'] and two[1]['params'] is None
    assert common.step_difference(common.lenet_params(0), two[0]['params'], one[0]['params']) \
        < common.step_tolerance()


@pytest.mark.procs
def test_the_worker_recipe_of_05s_exercise_runs_and_matches_dp_worker(fashion_mnist, tmp_path, monkeypatch):
    """Solution 2 of 05: %%writefile my_worker.py, import it, launch it. It must work as written."""
    import importlib
    (tmp_path / 'my_worker.py').write_text(_writefile_block('05-multi-gpu-from-scratch', 'my_worker.py'))
    monkeypatch.syspath_prepend(str(tmp_path))   # the spawned processes inherit sys.path
    my_worker = importlib.import_module('my_worker')
    run = dict(batch_size=64, lr=0.2, steps=2, subset=256)
    flat = common.launch(my_worker.flat_dp_worker, 2, run)
    per_tensor = common.launch(common.dp_worker, 2, run)
    assert flat[0]['checksum'] == flat[1]['checksum']
    assert abs(flat[0]['checksum'] - per_tensor[0]['checksum']) < 1e-4 * abs(per_tensor[0]['checksum'])


def test_05s_sharded_allreduce_solution_leaves_the_same_sums(page):
    """Solution 5 of 05 (reduce-scatter, then all-gather) against the notebook's allreduce."""
    import nbformat
    stored = nbformat.read(ROOT / 'notebooks' / 'en' / '05-multi-gpu-from-scratch.ipynb', as_version=4)
    code = next(re.search(r'```python\n(.*?)```', c.source.split('Solution 5</summary>')[1], re.S).group(1)
                for c in stored.cells if c.cell_type == 'markdown' and 'Solution 5</summary>' in c.source)
    namespace = dict(page, devices=[torch.device('cpu')] * 3)
    exec(code.split('\n\n\ndata = ')[0], namespace)
    data = [torch.randn(1001) * (i + 1) for i in range(3)]      # 1001: slices of unequal length
    expected = [t.clone() for t in data]
    namespace['allreduce'](expected)
    namespace['sharded_allreduce'](data)
    for got, want in zip(data, expected):
        torch.testing.assert_close(got, want)


def _writefile_block(notebook, filename):
    """The one ```python block of a notebook's markdown that starts with %%writefile filename."""
    import nbformat
    stored = nbformat.read(ROOT / 'notebooks' / 'en' / f'{notebook}.ipynb', as_version=4)
    blocks = [b for c in stored.cells if c.cell_type == 'markdown'
              for b in re.findall(r'```python\n(.*?)```', c.source, re.S)
              if b.startswith(f'%%writefile {filename}')]
    assert len(blocks) == 1, f'{notebook} shows one %%writefile {filename} block'
    return blocks[0].split('\n', 1)[1]


@pytest.mark.procs
def test_the_worker_recipe_of_07s_exercise_runs(tmp_path, monkeypatch):
    """Solution 1 of 07: the ring in a file written with %%writefile, imported, launched."""
    import importlib
    (tmp_path / 'my_ring.py').write_text(_writefile_block('07-parameter-servers', 'my_ring.py'))
    monkeypatch.syspath_prepend(str(tmp_path))
    my_ring = importlib.import_module('my_ring')
    assert max(common.launch(my_ring.check, 3, 100_003)) < 1e-4


def _drawn_rows(ax, width):
    """What plot_device_rows wrote into its cells: {stage: {device: [text, …]}}, read back from the axes."""
    import matplotlib.text
    step, cells = width + 2.5, {}
    for text in ax.texts:
        x, y = text.get_position()
        if isinstance(text, matplotlib.text.Annotation) or y < 0:
            continue                                    # arrows and stage titles
        stage, column = divmod(x - 0.5, step)
        cells.setdefault(int(stage), {}).setdefault(round(y), {})[round(column)] = text.get_text()
    return {s: {d: [row[i] for i in sorted(row)] for d, row in rows.items()} for s, rows in cells.items()}


def _allreduce_figure(allreduce, k=3):
    """Run the page's all-reduce demonstration on k CPU 'replicas' and draw it as the page does."""
    import matplotlib
    matplotlib.use('Agg')
    gen = torch.Generator().manual_seed(0)
    data = [torch.randint(-5, 6, (6,), generator=gen).float() for _ in range(k)]
    before = [t.tolist() for t in data]
    allreduce(data)
    after = [t.tolist() for t in data]
    ax = common.plot_device_rows([before, [after[0]] + before[1:], after],
                                 moves=[[(i, 0) for i in range(1, k)], [(0, i) for i in range(1, k)]],
                                 titles=['before', 'gather', 'broadcast'], rows=[f'replica {i}' for i in range(k)])
    return ax, before


def _shows_the_sum_everywhere(ax, before):
    total = [f'{sum(column):g}' for column in zip(*before)]
    last = _drawn_rows(ax, len(before[0]))[2]
    return all(last[d] == total for d in range(len(before)))


def test_the_allreduce_figure_draws_the_run_and_sees_a_missing_broadcast():
    allreduce = definitions('05-multi-gpu-from-scratch', 'allreduce')['allreduce']
    ax, before = _allreduce_figure(allreduce)
    drawn = _drawn_rows(ax, 6)
    assert drawn[0] == {d: [f'{v:g}' for v in row] for d, row in enumerate(before)}   # the values, as given
    assert drawn[1][1] == drawn[0][1] and drawn[1][0] == drawn[2][0]                  # gather: only replica 0 changed
    assert _shows_the_sum_everywhere(ax, before)
    arrows = sorted(((a.xyann[0] > 8.5, round(a.xyann[1]), round(a.xy[1])) for a in ax.texts if hasattr(a, 'xyann')))
    assert arrows == [(False, 1, 0), (False, 2, 0), (True, 0, 1), (True, 0, 2)]      # in to replica 0, then out

    def no_broadcast(data):                          # a planted bug: the sum stays on replica 0
        for i in range(1, len(data)):
            data[0][:] += data[i]
    ax, before = _allreduce_figure(no_broadcast)
    assert not _shows_the_sum_everywhere(ax, before)


def test_plot_device_rows_refuses_ragged_stages_and_missing_moves():
    with pytest.raises(ValueError, match='one vector per device'):
        common.plot_device_rows([[[1, 2], [3, 4]], [[1, 2], [3]]], moves=[[]], titles=['a', 'b'], rows=['0', '1'])
    with pytest.raises(ValueError, match='need 1 lists of moves'):
        common.plot_device_rows([[[1], [2]], [[3], [3]]], moves=[], titles=['a', 'b'], rows=['0', '1'])
