"""Models and data for jobs/train.py: a small CNN on scikit-learn's digits, a big MLP on synthetic data.

Nothing here downloads anything. Every rank builds the same split from the same seed and keeps its
own shard of the training set (rank r takes every P-th example of a seeded permutation).
"""
import numpy as np
import torch
from torch import nn


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions and two linear layers for 8x8 images (width=16: ~38k parameters)."""

    def __init__(self, width=16, classes=10):
        super().__init__()
        w = width
        self.features = nn.Sequential(
            nn.Conv2d(1, w, 3, padding=1), nn.ReLU(),
            nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(2 * w * 16, 64), nn.ReLU(), nn.Linear(64, classes))

    def forward(self, x):
        return self.head(self.features(x))


class BigMLP(nn.Module):
    """A wide MLP for throughput runs (width=16: 1024 -> 4096 -> 2048 -> 10, ~12.6M parameters)."""

    def __init__(self, width=16, inputs=1024, classes=10):
        super().__init__()
        h = 256 * width
        self.net = nn.Sequential(nn.Linear(inputs, h), nn.ReLU(), nn.Linear(h, h // 2), nn.ReLU(),
                                 nn.Linear(h // 2, classes))

    def forward(self, x):
        return self.net(x)


class Dataset:
    """This rank's training shard and the whole test set, as float32/int64 tensors."""

    def __init__(self, x_train, y_train, x_test, y_test):
        self.x_train, self.y_train = x_train, y_train
        self.x_test, self.y_test = x_test, y_test

    def batches(self, epoch, batch, steps, seed, rank):
        """``steps`` shuffled minibatches of this rank's shard for ``epoch`` (same count on every rank)."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch * 1009 + rank)
        order = torch.randperm(self.x_train.shape[0], generator=g)
        for s in range(steps):
            idx = order[s * batch:(s + 1) * batch]
            yield self.x_train[idx], self.y_train[idx]


def _shard(x, y, n_test, seed, rank, nranks):
    perm = np.random.default_rng(seed).permutation(x.shape[0])
    test, train = perm[:n_test], perm[n_test:]
    mine = train[rank::nranks]
    t = torch.from_numpy
    return Dataset(t(x[mine]), t(y[mine]), t(x[test]), t(y[test]))


def digits(seed, rank, nranks, test_fraction=0.2):
    """scikit-learn's 1797 8x8 handwritten digits, scaled to [0, 1]; 20 % held out for testing."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (d.images.astype(np.float32) / 16.0)[:, None, :, :]
    y = d.target.astype(np.int64)
    return _shard(x, y, int(round(test_fraction * len(y))), seed, rank, nranks)


def synthetic(seed, rank, nranks, n=8192, inputs=1024, classes=10):
    """Gaussian inputs labelled by a fixed random linear teacher: learnable, no download."""
    rng = np.random.default_rng(12345)  # the task is fixed; ``seed`` only changes the split
    x = rng.standard_normal((n, inputs), dtype=np.float32)
    teacher = rng.standard_normal((inputs, classes), dtype=np.float32)
    y = np.argmax(x @ teacher, axis=1).astype(np.int64)
    return _shard(x, y, n // 8, seed, rank, nranks)


MODELS = {
    "cnn": (DigitsCNN, digits),
    "big": (BigMLP, synthetic),
}


def build(name, width, seed, rank, nranks):
    """(model, dataset) for ``name``; the model is initialised from ``seed`` identically on every rank."""
    cls, data = MODELS[name]
    torch.manual_seed(seed)
    return cls(width=width), data(seed, rank, nranks)
