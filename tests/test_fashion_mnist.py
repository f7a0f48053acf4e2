"""Fashion-MNIST offline first (comp_perf/fashion_mnist.py), on a tiny fake copy and the real one."""
import gzip
import time

import numpy as np
import pytest
import torch
from helpers import ROOT

import common
import comp_perf.fashion_mnist
import comp_perf.language
import comp_perf.measure
from comp_perf.fashion_mnist import DATA_DIR, FASHION_FILES, clear_cache


def _write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b''.join(d.to_bytes(4, 'big') for d in array.shape)
    with gzip.open(path, 'wb') as f:
        f.write(header + array.astype(np.uint8).tobytes())


@pytest.fixture
def tiny_fashion(tmp_path, monkeypatch):
    """A fake Fashion-MNIST in tmp/fashion-mnist: 20 training and 10 test images."""
    monkeypatch.setattr(comp_perf.fashion_mnist, 'DEBIAN_DIR', tmp_path / 'no-debian')
    clear_cache()
    folder = tmp_path / 'fashion-mnist'
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (('train', 20), ('test', 10)):
        images, labels = FASHION_FILES[split]
        _write_idx(folder / f'{images}.gz', rng.integers(0, 256, (n, 28, 28)))
        _write_idx(folder / f'{labels}.gz', np.arange(n) % 10)
    yield tmp_path
    clear_cache()


def test_loader_reads_idx_files(tiny_fashion):
    train_iter, test_iter = common.load_data_fashion_mnist(4, root=tiny_fashion, download=False)
    X, y = next(iter(test_iter))
    assert X.shape == (4, 1, 28, 28) and X.dtype == torch.float32
    assert 0 <= X.min() and X.max() <= 1
    assert y.tolist() == [0, 1, 2, 3]
    assert len(train_iter.dataset) == 20 and train_iter.num_workers == 0


def test_loader_keeps_a_subset(tiny_fashion):
    train_iter, _ = common.load_data_fashion_mnist(5, subset=7, root=tiny_fashion, download=False)
    X, _ = next(iter(train_iter))
    assert X.shape == (5, 1, 28, 28)
    assert len(train_iter.dataset) == 7


def test_loader_refuses_impossible_subset(tiny_fashion):
    with pytest.raises(ValueError, match='subset must be between 1 and 20'):
        common.load_data_fashion_mnist(4, subset=21, root=tiny_fashion, download=False)


def test_incomplete_folder_is_not_accepted(tiny_fashion):
    (tiny_fashion / 'fashion-mnist' / 't10k-labels-idx1-ubyte.gz').unlink()
    with pytest.raises(FileNotFoundError):
        common.find_fashion_mnist(tiny_fashion, download=False)


def test_missing_data_message_names_three_ways(tmp_path, monkeypatch):
    monkeypatch.setattr(comp_perf.fashion_mnist, 'DEBIAN_DIR', tmp_path / 'no-debian')
    with pytest.raises(FileNotFoundError) as info:
        common.load_data_fashion_mnist(8, root=tmp_path, download=False)
    message = str(info.value)
    assert 'apt-get install dataset-fashion-mnist' in message
    assert str(tmp_path / 'fashion-mnist') in message
    assert 'download=True' in message


def test_failed_download_stops_within_seconds(tmp_path, monkeypatch):
    import torchvision
    monkeypatch.setattr(comp_perf.fashion_mnist, 'DEBIAN_DIR', tmp_path / 'no-debian')
    # A closed port on this machine: the download fails at once, as with no network.
    monkeypatch.setattr(torchvision.datasets.FashionMNIST, 'mirrors', ['http://127.0.0.1:9/'])
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match='could not be downloaded'):
        common.find_fashion_mnist(tmp_path, download=True, timeout=5)
    assert time.monotonic() - start < 30


def test_real_fashion_mnist_when_installed(fashion_mnist):
    clear_cache()
    train, test = common.fashion_mnist_datasets()
    assert (len(train), len(test)) == (60000, 10000)
    assert sorted(test.tensors[1].unique().tolist()) == list(range(10))
    images = train.tensors[0]
    assert images.shape == (60000, 1, 28, 28) and images.dtype == torch.float32
    assert 0 <= float(images.min()) < float(images.max()) <= 1
    assert common.find_fashion_mnist(download=False) == fashion_mnist


def test_the_course_data_folder_is_the_checkouts_data_folder():
    # README: "Fashion-MNIST is looked for in data/fashion-mnist/ …" of the checkout.
    assert DATA_DIR == ROOT / 'data'
    assert (DATA_DIR / 'README.md').is_file()


def test_the_loader_takes_its_options_by_name():
    # d2l's second argument was `resize`, which this loader does not have: say so, do not subset.
    with pytest.raises(TypeError):
        common.load_data_fashion_mnist(256, 32)
