#!/usr/bin/env python
"""Data-parallel TensorFlow training with ExDyna: concatenate the gradients, step, split them back.

    mpiexec -n 4 python -m mpi4py jobs/examples/tf_train.py

``sp.step`` reads the TensorFlow tensor through DLPack without a copy and returns a TensorFlow
tensor (host results are handed over zero-copy when 64-byte aligned, else copied once).
"""
import hashlib
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import exdyna_mpi  # noqa: E402


def train(comm=None, steps=60, density=0.05, lr=0.05, sparsifier="exdyna"):
    """Returns (first loss, last loss, flat parameters as NumPy), losses averaged over ranks."""
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    rng = np.random.default_rng(1000 + rank)             # each rank: its own data shard
    x = rng.standard_normal((256, 16)).astype(np.float32)
    y = (np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]).astype(np.float32)
    tf.keras.utils.set_random_seed(0)                    # same seed: identical start on every rank
    model = tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(64, activation="tanh"),
                                 tf.keras.layers.Dense(1)])
    shapes = [v.shape for v in model.trainable_variables]
    sizes = [int(np.prod(s)) for s in shapes]
    sp = exdyna_mpi.make(sparsifier, sum(sizes), density, comm)
    losses = []
    for _ in range(steps):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x)[:, 0] - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        flat = tf.concat([tf.reshape(g, [-1]) for g in grads], axis=0)
        avg = sp.step(flat)                              # a tf.Tensor, identical on every rank
        for v, d, s in zip(model.trainable_variables, tf.split(avg, sizes), shapes):
            v.assign_sub(lr * tf.reshape(d, s))
        losses.append(comm.allreduce(float(loss)) / comm.Get_size())
    params = np.concatenate([v.numpy().ravel() for v in model.trainable_variables])
    return losses[0], losses[-1], params


if __name__ == "__main__":
    first, last, p = train()
    digests = MPI.COMM_WORLD.allgather(hashlib.sha256(p.tobytes()).hexdigest())
    if MPI.COMM_WORLD.Get_rank() == 0:
        same = all(d == digests[0] for d in digests)
        print(f"loss {first:.4f} -> {last:.4f}; parameters identical on all ranks: {same}")
        sys.exit(0 if same and last < first else 1)
