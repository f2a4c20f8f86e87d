#!/usr/bin/env python
"""Data-parallel JAX training with ExDyna, no adapter needed: ravel the gradient, step, unravel.

    mpiexec -n 4 python -m mpi4py jobs/examples/jax_train.py

A small MLP regression on synthetic data (each rank its own shard). ``sp.step`` takes the JAX array
through DLPack without a copy and returns a JAX array (the averaged sparse gradient).
"""
import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from mpi4py import MPI

import exdyna_mpi


def init(key, sizes=(16, 64, 1)):
    params = []
    for a, b in zip(sizes[:-1], sizes[1:]):
        key, k = jax.random.split(key)
        params.append({"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)})
    return params


def predict(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return jnp.mean((predict(params, x)[:, 0] - y) ** 2)


def train(comm=None, steps=60, density=0.05, lr=0.05, sparsifier="exdyna"):
    """Returns (first loss, last loss, flat parameters as NumPy), losses averaged over ranks."""
    comm = MPI.COMM_WORLD if comm is None else comm
    rank = comm.Get_rank()
    rng = np.random.default_rng(1000 + rank)             # each rank: its own data shard
    x = rng.standard_normal((256, 16)).astype(np.float32)
    y = np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]
    params = init(jax.random.PRNGKey(0))                 # same seed: identical start on every rank
    flat, unravel = ravel_pytree(params)
    sp = exdyna_mpi.make(sparsifier, flat.shape[0], density, comm)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    losses = []
    for _ in range(steps):
        loss, grads = grad_fn(params, x, y)
        g, _ = ravel_pytree(grads)
        avg = sp.step(g)                                 # a jax.Array, identical on every rank
        params = jax.tree_util.tree_map(lambda p, d: p - lr * d, params, unravel(avg))
        losses.append(comm.allreduce(float(loss)) / comm.Get_size())
    return losses[0], losses[-1], np.asarray(ravel_pytree(params)[0])


if __name__ == "__main__":
    first, last, p = train()
    digests = MPI.COMM_WORLD.allgather(hashlib.sha256(p.tobytes()).hexdigest())
    if MPI.COMM_WORLD.Get_rank() == 0:
        same = all(d == digests[0] for d in digests)
        print(f"loss {first:.4f} -> {last:.4f}; parameters identical on all ranks: {same}")
        sys.exit(0 if same and last < first else 1)
