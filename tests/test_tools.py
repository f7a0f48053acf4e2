"""The maintainers' tools: their code paths run here on the CPU."""
import importlib.util
from pathlib import Path

import pytest
import torch

import common

ROOT = Path(__file__).resolve().parent.parent


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / 'tools' / f'{name}.py')
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpu_precision(fashion_mnist):
    return _tool('gpu_precision')


def test_gpu_precision_runs_section_05s_step_on_the_cpu(gpu_precision, fake_gpus, capsys):
    fake_gpus(0)
    gaps = gpu_precision.main(examples=64)
    assert list(gaps) == [('cpu', 'full fp32')]
    assert gaps['cpu', 'full fp32'] < common.step_tolerance(torch.float32, 'cpu')
    assert 'k=2 vs k=1' in capsys.readouterr().out


def test_gpu_precision_sees_a_data_parallel_step_that_loses_an_example(gpu_precision, fake_gpus,
                                                                       monkeypatch):
    fake_gpus(0)
    split_batch = gpu_precision.SECTION_05['split_batch']

    def drop_last(X, y, devices):  # the planted bug: with k > 1 the last shard loses an example
        Xs, ys = split_batch(X, y, devices)
        if len(devices) == 1:
            return Xs, ys
        return Xs[:-1] + [Xs[-1][:-1]], ys[:-1] + [ys[-1][:-1]]

    monkeypatch.setitem(gpu_precision.SECTION_05['train_batch'].__globals__, 'split_batch', drop_last)
    gaps = gpu_precision.main(examples=64)
    assert gaps['cpu', 'full fp32'] > common.step_tolerance(torch.float32, 'cpu')
