"""Fashion-MNIST, offline first, for the sections that train on it.

The data is looked for in data/fashion-mnist/, in torchvision's layout under
data/FashionMNIST/raw/, and in Debian's package (/usr/share/datasets/fashion-mnist/);
it is downloaded only when all three are missing, and without data or network the
loader stops with a message naming the three ways to get it.
"""
import gzip
import socket
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent   # the course's checkout, which holds comp_perf/


DATA_DIR = ROOT / 'data'
DEBIAN_DIR = Path('/usr/share/datasets/fashion-mnist')
FASHION_FILES = {
    'train': ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte'),
    'test': ('t10k-images-idx3-ubyte', 't10k-labels-idx1-ubyte'),
}
FASHION_LABELS = ['t-shirt', 'trouser', 'pullover', 'dress', 'coat',
                  'sandal', 'shirt', 'sneaker', 'bag', 'ankle boot']


def _fashion_dirs(root):
    root = Path(root) if root is not None else DATA_DIR
    return [root / 'fashion-mnist', root / 'FashionMNIST' / 'raw', DEBIAN_DIR]


def _find_file(folder, name):
    for candidate in (folder / name, folder / f'{name}.gz'):
        if candidate.is_file():
            return candidate
    return None


def _complete(folder):
    names = [n for pair in FASHION_FILES.values() for n in pair]
    return all(_find_file(folder, n) for n in names)


def _read_idx(path):
    opener = gzip.open if path.suffix == '.gz' else open
    with opener(path, 'rb') as f:
        data = f.read()
    ndim = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big') for i in range(ndim))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim).reshape(shape)


def _missing_data_message(root, reason):
    root = Path(root) if root is not None else DATA_DIR
    return (
        'Fashion-MNIST was not found on this machine'
        + (f' and could not be downloaded ({reason})' if reason else '') + '.\n'
        'Get it in one of three ways:\n'
        '  1. Debian/Ubuntu: sudo apt-get install dataset-fashion-mnist\n'
        f'     (installs the four files into {DEBIAN_DIR})\n'
        '  2. Copy train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz,\n'
        '     t10k-images-idx3-ubyte.gz and t10k-labels-idx1-ubyte.gz into\n'
        f'     {root / "fashion-mnist"}\n'
        '  3. With internet access: load_data_fashion_mnist(..., download=True)\n'
        f'     lets torchvision download them into {root / "FashionMNIST" / "raw"}')


def find_fashion_mnist(root=None, download=True, timeout=15):
    """Folder that holds Fashion-MNIST: data/, then Debian's package, then a download.

    With none of them available it raises FileNotFoundError within about
    `timeout` seconds, naming the three ways to get the data.
    """
    for folder in _fashion_dirs(root):
        if _complete(folder):
            return folder
    reason = 'download=False'
    if download:
        import torchvision
        old = socket.getdefaulttimeout()
        socket.setdefaulttimeout(timeout)
        try:
            torchvision.datasets.FashionMNIST(root=str(root or DATA_DIR), train=True, download=True)
            torchvision.datasets.FashionMNIST(root=str(root or DATA_DIR), train=False, download=True)
            reason = None
        except Exception as e:  # no network, proxy, mirror down, ...
            reason = f'{type(e).__name__}: {str(e).splitlines()[0][:120]}'
        finally:
            socket.setdefaulttimeout(old)
        folder = _fashion_dirs(root)[1]
        if reason is None and _complete(folder):
            return folder
    raise FileNotFoundError(_missing_data_message(root, reason))


_ARRAYS = {}


def fashion_mnist_arrays(split='train', root=None, download=True):
    """(images uint8 N×28×28, labels int64 N) of one split, read once per process (clear_cache() forgets)."""
    folder = find_fashion_mnist(root, download)
    key = (str(folder), split)
    if key not in _ARRAYS:
        img_name, lbl_name = FASHION_FILES[split]
        images = _read_idx(_find_file(folder, img_name))
        labels = _read_idx(_find_file(folder, lbl_name)).astype(np.int64)
        if len(images) != len(labels):
            raise ValueError(f'{folder}: {len(images)} images but {len(labels)} labels.')
        _ARRAYS[key] = images, labels
    return _ARRAYS[key]


def clear_cache():
    """Forget the Fashion-MNIST arrays read so far (tests use it to switch data folders)."""
    _ARRAYS.clear()


def fashion_mnist_datasets(subset=None, root=None, download=True, seed=0):
    """(train, test) TensorDatasets of float images in [0, 1], shape N×1×28×28.

    `subset` keeps that many training examples, drawn at random with `seed`.
    """
    out = []
    for split in ('train', 'test'):
        images, labels = fashion_mnist_arrays(split, root, download)
        if split == 'train' and subset is not None:
            if not 0 < subset <= len(labels):
                raise ValueError(f'subset must be between 1 and {len(labels)}, got {subset}.')
            keep = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))[:subset]
            images, labels = images[keep.numpy()], labels[keep.numpy()]  # convert only what is kept
        X = torch.from_numpy(images.copy()).unsqueeze(1).float().div_(255)
        out.append(torch.utils.data.TensorDataset(X, torch.from_numpy(labels.copy())))
    return tuple(out)


def load_data_fashion_mnist(batch_size, *, subset=None, root=None, download=True):
    """(train_iter, test_iter) DataLoaders for Fashion-MNIST, offline first (d2l's name).

    `subset` keeps that many training examples. The data already sits in
    memory, so the loaders use no worker processes.
    d2l: finds an installed copy first and never starts worker processes; d2l's downloads into ../data and reads
         with 4 workers.
    """
    train, test = fashion_mnist_datasets(subset, root, download)
    return (torch.utils.data.DataLoader(train, batch_size, shuffle=True),
            torch.utils.data.DataLoader(test, batch_size, shuffle=False))
