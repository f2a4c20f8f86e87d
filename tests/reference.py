"""Independent re-implementation of the authors' ExDyna bookkeeping (kljp/exdyna, cnn-lstm/gradient_reducers.py).

Written as a literal transcription of the spec's pseudo-code, with blk_pos kept explicitly as the
authors do, and sharing no code with exdyna_mpi: tests compare the library against it step by step.
"""
import math

import numpy as np


class AuthorsExDyna:
    def __init__(self, numel, density, n, nb=1024, align=32):
        self.N, self.n = numel, n
        a = numel // nb
        self.sz_blk = a - (a % align)
        assert self.sz_blk > 0, "reference covers the authors' regime only"
        self.rem = numel - self.sz_blk * nb
        q, r = nb // n, nb % n
        self.blk_part = [q + 1 if i < r else q for i in range(n)]
        self.blk_pos = [0] * n
        for i in range(1, n):
            self.blk_pos[i] = self.blk_pos[i - 1] + self.blk_part[i - 1]
        self.min_blk = nb / (4 * n)
        self.k = int(density * numel)
        self.thr = 1 / (2 * math.sqrt(self.k))
        self.t = 0

    def bounds(self):
        b = [self.blk_pos[p] * self.sz_blk for p in range(self.n)]
        b.append(self.N)
        return b

    def owned(self):
        return [((self.t % self.n) + r) % self.n for r in range(self.n)]

    def select(self, acc, r):
        """Rank r's selection (no dummy index: the library's deliberate change)."""
        p = self.owned()[r]
        b = self.bounds()
        st, en = b[p], b[p + 1]
        return st + np.flatnonzero(np.abs(acc[st:en].astype(np.float64)) >= self.thr)

    def advance(self, ks):
        """End of step t with per-rank counts ks: rebalance and update thr for step t+1."""
        n, t = self.n, self.t + 1
        k_prev = sum(ks)
        part_load = [0] * n
        for i in range(n):
            part_load[((t - 1) % n + i) % n] = ks[i]
        mean = k_prev // n
        dens = k_prev / self.N
        if n > 1 and mean > 0:
            for i in range(n - 1):
                a = part_load[i] / mean
                b = part_load[i + 1] / mean
                if a > 1.05 and b < 1 / 1.05:
                    if self.blk_part[i] - 1 < self.min_blk:
                        continue
                    self.blk_part[i] -= 1
                    self.blk_part[i + 1] += 1
                    self.blk_pos[i + 1] -= 1
                    m = int(self.sz_blk * dens)
                    part_load[i] -= m
                    part_load[i + 1] += m
                if a < 1 / 1.05 and b > 1.05:
                    if self.blk_part[i + 1] - 1 < self.min_blk:
                        continue
                    self.blk_part[i] += 1
                    self.blk_part[i + 1] -= 1
                    self.blk_pos[i + 1] += 1
                    m = int(self.sz_blk * dens)
                    part_load[i] += m
                    part_load[i + 1] -= m
        ratio = k_prev / self.k
        if ratio > 1.1:
            self.thr *= 1.005
        elif ratio > 0.909:
            self.thr *= 1.00125
        else:
            self.thr *= 0.995
        self.t = t


def laplace_grad(rank, step, numel, dtype=np.float32, scale=0.01, seed=0):
    """A heavy-tailed gradient, different on every rank and step, reproducible."""
    rng = np.random.default_rng([seed, rank, step])
    return (rng.laplace(0.0, scale, numel)).astype(dtype)
