"""Section 09: the augmented dataset, step timing, and the page's claims of equal gradients."""
import time

import pytest
import torch
from notebook_code import definitions
from torch.nn import functional as F

import common

@pytest.fixture(scope='module')
def page():
    """The model and the gradient checks section 09 defines on its page: the tests run that code."""
    return definitions('09-one-training-step', 'Block', 'ViT', 'gradients', 'largest_difference', 'autocast_dtype')


@pytest.fixture
def small_vit(page):
    """small_vit(**changes): the page's ViT, small, from the same weights each time."""
    def make(**changes):
        torch.manual_seed(0)
        return page['ViT'](d=32, heads=2, layers=2, patch=7, **changes)
    return make


def batch(n=8):
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def test_augmented_images_are_deterministic_per_index_and_refuse_bad_input():
    X, y = batch()
    data = common.AugmentedImages(X, y, passes=2)
    a, b = data[3][0], data[3][0]
    assert torch.equal(a, b) and a.shape == (1, 28, 28)
    assert not torch.equal(data[3][0], data[4][0])
    assert not torch.equal(data[3][0], X[3])       # it did distort the image
    with pytest.raises(ValueError, match='N×C×H×W'):
        common.AugmentedImages(X[0], y)
    with pytest.raises(ValueError, match='passes'):
        common.AugmentedImages(X, y, passes=0)


@pytest.mark.procs
def test_a_dataloader_worker_sees_the_same_samples():
    X, y = batch()
    data = common.AugmentedImages(X, y, passes=1)
    workers = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1)
    here = torch.utils.data.DataLoader(data, batch_size=4, num_workers=0)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(workers, here))


def test_timed_steps_separates_waiting_for_data_from_the_step():
    def slow_batches():
        while True:
            time.sleep(0.02)
            yield None, None
    total, wait = common.timed_steps(lambda X, y: time.sleep(0.01), slow_batches(), steps=5, warmup=1)
    assert 0.5 < wait / total < 0.85   # 20 ms of 30


def test_checkpointing_and_accumulation_give_the_plain_gradients(page, small_vit):
    X, y = batch()
    reference = page['gradients'](small_vit(), X, y)
    assert page['largest_difference'](page['gradients'](small_vit(checkpointed=True), X, y), reference) < 1e-6
    assert page['largest_difference'](page['gradients'](small_vit(), X, y, parts=4), reference) < 1e-5


def test_the_gradient_checks_fail_on_planted_bugs(page, small_vit):
    X, y = batch()
    net = small_vit()
    reference = page['gradients'](net, X, y)
    net.zero_grad(set_to_none=True)
    for xp, yp in zip(X.chunk(4), y.chunk(4)):        # planted: the micro-batch losses are not divided by 4
        F.cross_entropy(net(xp), yp).backward()
    assert page['largest_difference']([p.grad for p in net.parameters()], reference) > 1
    broken = small_vit()
    broken.blocks[0].forward = lambda x, block=broken.blocks[0]: type(block).forward(block, x.detach())  # cut graph
    assert page['largest_difference'](page['gradients'](broken, X, y), reference) > 0.5


def test_bf16_autocast_changes_the_loss_only_a_little(small_vit):
    X, y = batch(32)
    net = small_vit()
    with torch.no_grad():
        fp32 = F.cross_entropy(net(X), y).item()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            bf16 = F.cross_entropy(net(X), y).item()
    assert abs(bf16 - fp32) < 0.02 * max(1.0, abs(fp32))
    assert bf16 != fp32   # it did run in bf16


@pytest.mark.procs
def test_compiled_gradients_equal_eager_and_the_check_catches_other_weights(page, small_vit):
    X, y = batch()
    eager = page['gradients'](small_vit(), X, y)
    compiled = small_vit()
    grads = page['gradients'](torch.compile(compiled), X, y)
    assert page['largest_difference'](grads, eager) < 1e-4
    torch.manual_seed(5)   # planted: the compiled model starts from other weights
    other = page['ViT'](d=32, heads=2, layers=2, patch=7)
    assert page['largest_difference'](page['gradients'](torch.compile(other), X, y), eager) > 0.1


def test_the_bf16_tolerance_check_catches_a_wrong_loss(small_vit):
    X, y = batch(32)
    net = small_vit()
    with torch.no_grad():
        fp32 = F.cross_entropy(net(X), y).item()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            wrong = F.cross_entropy(net(X), y, reduction='sum').item()   # planted: summed, not averaged
    assert not abs(wrong - fp32) < 0.02 * max(1.0, abs(fp32))


def test_the_autocast_dtype_follows_the_device(page, monkeypatch):
    choose = page['autocast_dtype']
    assert choose(torch.device('cpu')) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: True)    # an A100 or H100
    assert choose(torch.device('cuda:0')) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', lambda *a, **k: False)   # a V100 or T4: fp16 + GradScaler
    assert choose(torch.device('cuda:0')) == torch.float16
