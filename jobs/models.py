"""Models and data for jobs/train.py and jobs/fidelity.py: a small CNN on scikit-learn's digits, a big
MLP on synthetic data, and a character-level LSTM on the Python standard library's own source files.

Nothing here downloads anything. Every rank builds the same split from the same seed and keeps its
own shard of the training set (rank r takes every P-th example of a seeded permutation).
"""
import os
import sysconfig
import zlib

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


def evaluate(model, data, comm):
    """``(test accuracy, mean test cross-entropy)`` over the whole test set, split across the ranks of
    ``comm`` (one Allreduce); the same numbers on every rank."""
    from mpi4py import MPI

    rank, p = comm.Get_rank(), comm.Get_size()
    x, y = data.x_test[rank::p], data.y_test[rank::p]
    with torch.no_grad():
        logits = model(x)
        local = np.array([float((logits.argmax(1) == y).sum()),
                          float(torch.nn.functional.cross_entropy(logits, y, reduction="sum")), float(len(y))])
    tot = np.empty_like(local)
    comm.Allreduce(local, tot, op=MPI.SUM)
    return tot[0] / tot[2], tot[1] / tot[2]


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


class CharLSTM(nn.Module):
    """Byte-level language model: embedding -> 2-layer LSTM -> linear decoder over 256 bytes.

    Defaults (embed 96, hidden 384, 2 layers): 2,038,624 parameters, the analogue of the ExDyna
    authors' 2-layer LSTM on WikiText-2 at a size a CPU trains.
    """

    def __init__(self, vocab=256, embed=96, hidden=384, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTM(embed, hidden, num_layers=layers, batch_first=True)
        self.decoder = nn.Linear(hidden, vocab)

    def forward(self, x):
        """``x``: (batch, time) int64 bytes -> (batch, time, 256) logits."""
        h, _ = self.lstm(self.embed(x))
        return self.decoder(h)


def stdlib_files(root=None):
    """Relative paths of the standard library's ``*.py`` files, sorted (no site-/dist-packages)."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        out += [os.path.relpath(os.path.join(d, f), root) for f in files if f.endswith(".py")]
    return root, sorted(out)


def stdlib_corpus(train_bytes=2_000_000, val_bytes=200_000, val_every=10, root=None):
    """(train, val) uint8 arrays: the stdlib's source, split by file, deterministically.

    A file goes to validation when ``crc32(relative path) % val_every == 0``, else to training.
    Files are taken in crc32 order (a fixed shuffle of the whole library, not alphabetical runs of
    one package) until each side reaches its cap; each file is separated by a NUL byte. The same
    Python version gives the same bytes on every rank and machine; ``corpus_id`` fingerprints them.
    """
    root, files = stdlib_files(root)
    keyed = sorted((zlib.crc32(f.encode()), f) for f in files)
    parts = {"train": [], "val": []}
    size = {"train": 0, "val": 0}
    cap = {"train": train_bytes, "val": val_bytes}
    for crc, f in keyed:
        side = "val" if crc % val_every == 0 else "train"
        if size[side] >= cap[side]:
            continue
        with open(os.path.join(root, f), "rb") as fh:
            data = fh.read() + b"\0"
        data = data[:cap[side] - size[side]]
        parts[side].append(data)
        size[side] += len(data)
    return tuple(np.frombuffer(b"".join(parts[k]), dtype=np.uint8).copy() for k in ("train", "val"))


def corpus_id(train, val):
    return f"{zlib.crc32(train.tobytes()):08x}-{zlib.crc32(val.tobytes()):08x}"


class TextData:
    """Random windows of the training text (a seeded draw per rank and step), fixed validation windows.

    Rank r draws its own windows: the shard is the random stream, not a slice of the text. The
    validation set is ``val_windows`` evenly spaced windows of ``seq + 1`` bytes; rank r evaluates
    every P-th of them.
    """

    def __init__(self, train, val, seq=32, val_windows=32, val_seq=128):
        self.train, self.val, self.seq = torch.from_numpy(train.astype(np.int64)), val, seq
        starts = np.linspace(0, len(val) - val_seq - 2, val_windows).astype(np.int64)
        w = np.stack([val[s:s + val_seq + 1] for s in starts]).astype(np.int64)
        self.val_x, self.val_y = torch.from_numpy(w[:, :-1]), torch.from_numpy(w[:, 1:])

    def batch(self, step, batch, seed, rank):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank * 7919 + 17)
        starts = torch.randint(0, self.train.numel() - self.seq - 1, (batch,), generator=g)
        w = torch.stack([self.train[s:s + self.seq + 1] for s in starts.tolist()])
        return w[:, :-1], w[:, 1:]


def text_loss(model, x, y, reduction="mean"):
    """Cross-entropy of a byte-level language model's logits ``(batch, time, 256)`` against ``y``."""
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1), reduction=reduction)


def text_val_loss(model, data, comm):
    """Mean validation loss (nats per byte) over ``data``'s validation windows (a ``TextData``), rank r
    taking every P-th window of ``comm``; one Allreduce, the same number on every rank."""
    from mpi4py import MPI

    rank, p = comm.Get_rank(), comm.Get_size()
    x, y = data.val_x[rank::p], data.val_y[rank::p]
    with torch.no_grad():
        local = np.array([float(text_loss(model, x, y, reduction="sum")), float(y.numel())])
    tot = np.empty_like(local)
    comm.Allreduce(local, tot, op=MPI.SUM)
    return tot[0] / tot[1]


MODELS = {
    "cnn": (DigitsCNN, digits),
    "big": (BigMLP, synthetic),
}


def build(name, width, seed, rank, nranks):
    """(model, dataset) for ``name``; the model is initialised from ``seed`` identically on every rank."""
    cls, data = MODELS[name]
    torch.manual_seed(seed)
    return cls(width=width), data(seed, rank, nranks)


class _Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, h):
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return h + self.out(torch.nn.functional.gelu(self.fc(self.ln2(h))))


class GPT(nn.Module):
    """A GPT-style byte-level language model: token and learned position embeddings, pre-LN blocks,
    causal attention, the output layer tied to the token embedding.

    Defaults (d_model 384, 6 layers, 6 heads, context 64): 10,770,432 parameters.
    """

    def __init__(self, vocab=256, d_model=384, layers=6, heads=6, context=64):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d_model)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        nn.init.normal_(self.pos, std=0.02)

    def forward(self, x):
        """``x``: (batch, time <= context) int64 bytes -> (batch, time, vocab) logits."""
        h = self.tok(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.ln(h) @ self.tok.weight.t()
