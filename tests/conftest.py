"""Shared fixtures: a fake GPU count at the torch.cuda boundary."""
import pytest
import torch


@pytest.fixture
def fake_gpus(monkeypatch):
    """Call fake_gpus(n) to make this process believe it sees n CUDA GPUs.

    The course decides everything about GPUs through torch.cuda.is_available()
    and torch.cuda.device_count(), so that is where the count is faked (not in
    common.num_gpus): a helper that asked torch.cuda directly would be caught too.
    Spawned worker processes see the real machine.
    """
    def fake(n):
        monkeypatch.setattr(torch.cuda, 'is_available', lambda: n > 0)
        monkeypatch.setattr(torch.cuda, 'device_count', lambda: n)
    return fake
