"""Devices, hardware tiers and settings (comp_perf/machine.py), bad input included."""
import os
import re

import pytest
import torch

import common
import comp_perf.fashion_mnist
import comp_perf.language
import comp_perf.measure
from comp_perf.machine import SETTINGS_ENV, detect_tier


def test_try_gpu_falls_back_to_cpu(monkeypatch, fake_gpus):
    fake_gpus(0)
    assert common.try_gpu() == torch.device('cpu')
    assert common.try_gpu(3) == torch.device('cpu')
    assert common.try_all_gpus() == [torch.device('cpu')]


def test_try_gpu_uses_gpus_that_exist(monkeypatch, fake_gpus):
    fake_gpus(2)
    assert common.try_gpu(1) == torch.device('cuda:1')
    assert common.try_gpu(2) == torch.device('cpu')
    assert common.try_all_gpus() == [torch.device('cuda:0'), torch.device('cuda:1')]


@pytest.mark.parametrize('bad', [-1, 1.5, '0', True])
def test_impossible_device_index_is_refused(bad):
    with pytest.raises(ValueError, match='whole number'):
        common.try_gpu(bad)


def test_gpu_that_does_not_exist_gives_clear_error(monkeypatch, fake_gpus):
    fake_gpus(1)
    with pytest.raises(RuntimeError, match=r'cuda:3 was requested, but this machine has 1 GPU'):
        common.gpu(3)
    assert common.gpu(0) == torch.device('cuda:0')


@pytest.mark.parametrize('gpus,env,tier', [
    (0, {}, 'T0'), (1, {}, 'T1'), (4, {}, 'T2'),
    (2, {'WORLD_SIZE': '4', 'LOCAL_WORLD_SIZE': '2'}, 'T3'),
])
def test_detect_tier_counts_gpus_and_machines(monkeypatch, fake_gpus, gpus, env, tier):
    fake_gpus(gpus)
    for key in ('WORLD_SIZE', 'LOCAL_WORLD_SIZE'):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert detect_tier() == tier


def test_environment_report_names_tier_and_data(monkeypatch, fake_gpus, tmp_path, capsys):
    fake_gpus(0)
    monkeypatch.setattr(comp_perf.fashion_mnist, 'DEBIAN_DIR', tmp_path / 'none')
    info = common.environment_report(data_root=tmp_path)
    out = capsys.readouterr().out
    assert info['tier'] == 'T0' and 'T0: CPU only' in out
    assert 'NOT FOUND' in out


def test_environment_report_speaks_chinese_in_zh_folder(monkeypatch, fake_gpus, tmp_path, capsys):
    folder = tmp_path / 'notebooks' / 'zh'
    folder.mkdir(parents=True)
    monkeypatch.chdir(folder)
    monkeypatch.delenv('COURSE_LANG', raising=False)
    fake_gpus(0)
    common.environment_report()
    assert '档位' in capsys.readouterr().out


def test_settings_pick_tier_and_fall_back(monkeypatch, fake_gpus, capsys):
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    fake_gpus(4)
    cfg = common.settings(T0=dict(epochs=1), T1=dict(epochs=5))
    assert (cfg.tier, cfg.epochs) == ('T2', 5)  # no T2 entry: falls back to T1
    assert 'tier T2' in capsys.readouterr().out


def test_settings_override_by_environment(monkeypatch, fake_gpus, capsys):
    fake_gpus(1)
    monkeypatch.setenv(SETTINGS_ENV, 'T0, epochs=3, name=fast')
    cfg = common.settings(T0=dict(epochs=1, name='x', lr=0.1), T1=dict(epochs=9, name='y', lr=0.2))
    assert (cfg.tier, cfg.epochs, cfg.name, cfg.lr) == ('T0', 3, 'fast', 0.1)
    assert "epochs=3" in capsys.readouterr().out


@pytest.mark.parametrize('value,message', [('T9', 'neither a tier'), ('epoch=3', 'unknown setting')])
def test_settings_bad_override_is_explained(monkeypatch, value, message):
    monkeypatch.setenv(SETTINGS_ENV, value)
    with pytest.raises(ValueError, match=message):
        common.settings(T0=dict(epochs=1))


def test_settings_print_no_override_note_without_an_override(monkeypatch, fake_gpus, capsys):
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    fake_gpus(0)
    common.settings(T0=dict(epochs=1))
    out = capsys.readouterr().out
    assert 'override' not in out and 'epochs=1' in out
    monkeypatch.setenv(SETTINGS_ENV, 'T1')
    common.settings(T0=dict(epochs=1), T1=dict(epochs=4))
    assert 'override: COURSE_SETTINGS tier=T1]' in capsys.readouterr().out


def test_settings_higher_tiers_inherit_so_cpu_sizes_stay(monkeypatch, fake_gpus, capsys):
    # A CPU stand-in experiment keeps its T0 size on a GPU machine unless a tier changes it.
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    fake_gpus(1)
    cfg = common.settings(T0=dict(cpu_matrix=512, gpu_matrix=512), T1=dict(gpu_matrix=4096))
    assert (cfg.tier, cfg.cpu_matrix, cfg.gpu_matrix) == ('T1', 512, 4096)
    assert 'settings of T1 + T0' in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"T1 sets \['steps'\], which T0 lacks"):
        common.settings(T0=dict(epochs=1), T1=dict(steps=3))


@pytest.mark.parametrize('value,ok', [
    ('epochs=abc', "epochs='abc' is not a int"), ('epochs=2.5', 'is not a int'),
    ('lr=1', None), ('subset=None', None), ('subset=12', None), ('sizes=[1,2]', None),
    ('sizes=3', 'is not a list'), ('flag=1', 'is not a bool'), ('flag=False', None),
])
def test_settings_overrides_must_have_the_notebooks_types(monkeypatch, fake_gpus, capsys, value, ok):
    fake_gpus(0)
    monkeypatch.setenv(SETTINGS_ENV, value)
    call = lambda: common.settings(  # noqa: E731
        T0=dict(epochs=1, lr=0.1, subset=100, sizes=(1, 4), flag=True), T1=dict(subset=None))
    if ok is None:
        cfg = call()
        key = value.split('=')[0]
        assert f'[override: COURSE_SETTINGS {key}=' in capsys.readouterr().out
        assert isinstance(cfg.sizes, tuple)  # a list override keeps the notebook's own type
    else:
        with pytest.raises(ValueError, match=re.escape(ok)):
            call()


def test_settings_need_t0():
    with pytest.raises(ValueError, match='T0'):
        common.settings(T1=dict(epochs=1))


def test_a_gpu_this_pytorch_cannot_use_is_reported_with_its_driver(monkeypatch, fake_gpus, capsys):
    # A laptop whose driver is older than the CUDA build: torch sees no GPU, nvidia-smi sees one.
    import subprocess as sp

    import comp_perf.machine
    fake_gpus(0)
    monkeypatch.setattr(comp_perf.machine.shutil, 'which',
                        lambda name: '/usr/bin/nvidia-smi' if name == 'nvidia-smi' else None)
    monkeypatch.setattr(comp_perf.machine.subprocess, 'run', lambda *a, **k: sp.CompletedProcess(
        a, 0, stdout='NVIDIA GeForce RTX 3060 Laptop GPU, 535.183.01\n', stderr=''))
    monkeypatch.setattr(comp_perf.machine, 'CUDA_WARNINGS', ['CUDA initialization: The NVIDIA driver on your '
                                                            'system is too old (found version 12020).'])
    monkeypatch.setenv('COURSE_LANG', 'en')
    assert comp_perf.machine.unusable_gpus() == ['NVIDIA GeForce RTX 3060 Laptop GPU, 535.183.01']
    info = common.environment_report()
    out = capsys.readouterr().out
    assert info['tier'] == 'T0'
    assert 'RTX 3060 Laptop GPU, 535.183.01' in out and 'newer NVIDIA driver' in out and 'too old' in out


def test_without_nvidia_smi_no_gpu_is_just_none(monkeypatch, fake_gpus, capsys):
    import comp_perf.machine
    fake_gpus(0)
    monkeypatch.setattr(comp_perf.machine.shutil, 'which', lambda name: None)
    assert comp_perf.machine.unusable_gpus() == []


def test_chinese_rows_line_up_by_display_width():
    from comp_perf.language import display_width, pad
    assert display_width('档位') == 4 and display_width('GPU') == 3
    assert display_width(pad('档位', 8)) == display_width(pad('Python', 8)) == 8
    assert pad('档位', 6, right=True) == '  档位'


def test_usable_cores_follow_the_affinity_mask_not_the_machine(monkeypatch):
    # A container that may use 1 of the machine's 8 CPUs (docker --cpuset-cpus=0)
    monkeypatch.setattr(os, 'cpu_count', lambda: 8)
    monkeypatch.setattr(os, 'sched_getaffinity', lambda pid: {0}, raising=False)
    assert common.usable_cores() == 1
