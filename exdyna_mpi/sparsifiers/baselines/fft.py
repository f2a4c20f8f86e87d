"""Frequency-domain sparsification with range-based low-bit floats (after "FFT-based gradient
compression with range-based low-bit floats").

One step on rank r (B = ``block``, k = density * numel real coefficients per rank):

1. ``acc = residual + grad``, cut into rows of B elements (the last row zero-padded), and
   ``F = rfft(rows)``: B/2 + 1 complex bins per row.
2. Keep the ``k/2`` bins of largest ``|F|`` (threshold ``tau`` = the (k/2)-th largest ``|F|``;
   ties at it are kept): each kept bin sends its real and imaginary part, so about k reals.
3. Code the kept parts as ``bits``-bit range floats (``rangefloat``: sign, exponent relative to
   the message maximum, mantissa; the layout and its error bound are in that module's docstring),
   with the exponent width chosen so parts down to ``tau / 2`` are representable (a kept bin has a
   part of at least ``tau / sqrt 2``); ``bits=32`` sends float32 parts instead.
4. The count exchange carries the bin count, the error word, ``tau`` and the format header
   (``e_max``, ``e_bits``); ``Allgatherv`` of the bin positions (int32) and of the codes.
5. Every rank decodes every message into one dense spectrum in rank order and takes ONE inverse
   FFT (linearity): ``out = irfft(sum_r D_r) / P`` — identical on every rank because every rank runs
   the same arithmetic on the same gathered bytes (same NumPy build assumed across ranks).
6. Error feedback on the reconstruction error: ``residual = acc - irfft(D_r)``, the part of acc
   this rank's message did not carry (dropped bins, quantisation, the padding of the last row).

A transform that overflows is a non-finite step (the ``nonfinite`` policy, on every rank): a rank
whose spectrum is not finite says so in the count exchange, and before the inverse transforms every
rank bounds them from the decoded bins it holds (``_check_rows``), so no rank's output or residual
takes an inf or a NaN.

So ``residual_after + contribution == residual_before + grad`` holds to rounding for
``contribution = irfft(D_r)``, and ``out`` is the mean of the contributions to FFT round-off.
``stats.density`` is the fraction of reals each rank sends (``2 * bins / numel``, mean over ranks).

The per-bin error of the decoded spectrum is bounded by the format: for a part ``v``,
``|v_hat - v| <= 2^-(m+1) |v|`` when ``|v| >= 2^e_min`` else ``< 2^e_min``; by Parseval a row's
time-domain error is at most ``sqrt(2 / B * sum |dF|^2)`` (tests/mpi/test_baselines.py checks it).
"""
import dataclasses
from typing import Any

import numpy as np

from ...arrays import HALF_DTYPES
from ..capabilities import Capabilities
from ..base import Selection, Sparsifier
from ..config import Option, positive_int
from ..roles import SumNotFinite
from ..timing import timed
from . import rangefloat
from ._common import float_to_word, kth_largest_magnitude, target_count, word_to_float

BITS = (8, 16, 32)


def _bits(v):
    if v not in BITS or isinstance(v, bool):
        raise ValueError(f"must be one of {BITS}")


def _block(v):
    positive_int(v)
    if v < 2:
        raise ValueError("must be at least 2")


@dataclasses.dataclass(eq=False)
class _SpectrumSelection(Selection):
    """What ``select`` kept of this rank's spectrum, for ``combine``: the spectrum ``spec``, the
    level ``tau`` of its kept bins ``kept`` and their coded parts ``codes``."""

    spec: Any = None
    tau: float = 0.0
    kept: Any = None
    codes: Any = None


class FFTSparsifier(Sparsifier):
    """FFT sparsification: top bins of each ``block``-row spectrum, low-bit range floats, EF.

    Options: ``block=4096`` (row length of the FFT), ``bits=8`` (8 or 16: range-float codes; 32:
    float32 parts, no quantisation).

    Example::

        >>> sp = exdyna_mpi.make("fft", numel, 0.01, comm, bits=8)
        >>> avg = sp.step(flat_grad); sp.stats.rel_error
    """

    name = "fft"
    #: host NumPy code in its step (numpy.fft, host sorts): refused on a real CUDA device
    CAPABILITIES = Capabilities(device_step=False)
    OPTIONS = {"block": Option(4096, _block, "FFT row length"),
               "bits": Option(8, _bits, "bits per kept coefficient part (32: float32)")}

    def __init__(self, numel, density, comm=None, **kw):
        super().__init__(numel, density, comm, **kw)
        self.block = min(int(self.options["block"]), max(2, self.numel))
        self.rows = -(-self.numel // self.block)
        self.nbins = self.rows * (self.block // 2 + 1)
        self.k_bins = min(self.nbins, max(1, target_count(self.density, self.numel) // 2))
        if self.density >= 1.0:
            self.k_bins = self.nbins
        self._pos_dtype = np.dtype(np.int32) if self.nbins < 2**31 else np.dtype(np.int64)

    # ------------------------------------------------------------------ transforms
    def _spectrum(self, acc):
        rows = np.zeros(self.rows * self.block, dtype=acc.dtype)
        rows[: self.numel] = acc
        return np.fft.rfft(rows.reshape(self.rows, self.block), axis=1).ravel()

    def _signal(self, spec):
        x = np.fft.irfft(spec.reshape(self.rows, self.block // 2 + 1), n=self.block, axis=1)
        return x.ravel()[: self.numel]

    def _code(self, parts, tau):
        bits = self.options["bits"]
        if bits == 32:
            return parts.astype(np.float32), 0, 0
        return rangefloat.encode(parts, bits, floor=float(tau) / 2)

    def _decode(self, codes, e_max, e_bits, cdtype):
        bits = self.options["bits"]
        parts = codes if bits == 32 else rangefloat.decode(codes, e_max, e_bits, bits)
        parts = parts.astype(np.dtype(cdtype).type(0).real.dtype)
        return parts[0::2] + 1j * parts[1::2]

    def _check_rows(self, row_mass):
        """Before the inverse transforms: every value of a row's inverse transform, and every partial
        sum on the way, is at most 2 sqrt(2) times the row's sum of ``|bins|`` (Hermitian symmetry
        doubles the bins, real and imaginary parts add). ``row_mass`` (every rank's decoded bins summed
        per row, the same on every rank) bounds both the average's rows and each rank's own
        contribution, whose residual is that rank's alone; so a row whose mass is not below a quarter
        of the largest finite value makes the step non-finite on every rank together
        (``SumNotFinite``) before a transform can overflow."""
        limit = float(np.finfo(self._dtype).max) / 4
        over = int(np.count_nonzero(~(row_mass <= limit)))
        if over:
            raise SumNotFinite(f"the sum over ranks is not finite: the spectra of {over} of the {self.rows} rows "
                               f"overflow {self._dtype} in the inverse transform")

    # ------------------------------------------------------------------ the step
    def report_size(self, step):
        return 3   # tau (float64 bits), e_max, e_bits: the format header of this rank's codes

    def select(self, step, grad, acc):
        bad = self.accumulate(grad, acc)
        if bad:
            return Selection(acc, 0, (), bad)
        with np.errstate(over="ignore", invalid="ignore"):   # an overflow is this step's refusal, just below
            spec = self._spectrum(acc)
            mag = np.abs(spec)
        over = mag.shape[0] - int(np.count_nonzero(np.isfinite(mag)))
        if over:   # finite values whose transform overflows: a non-finite step (the nonfinite policy)
            return Selection(acc, 0, (), 0, overflow=over)
        tau = kth_largest_magnitude(mag, self.k_bins) if self.k_bins < self.nbins else mag.dtype.type(0)
        kept = np.flatnonzero(mag >= tau).astype(self._pos_dtype)
        count = kept.shape[0]
        parts = np.empty(2 * count, dtype=mag.dtype)
        parts[0::2] = spec.real[kept]
        parts[1::2] = spec.imag[kept]
        codes, e_max, e_bits = self._code(parts, tau)
        return _SpectrumSelection(acc, count, [float_to_word(float(tau)), e_max, e_bits], 0, spec=spec, tau=tau,
                                  kept=kept, codes=codes)

    def combine(self, step, sel, words):
        sec, acc, spec, kept = step.sec, sel.acc, sel.spec, sel.kept
        counts, header = words.counts, words.report   # per rank: tau, e_max, e_bits
        with timed(sec, "exchange"):
            pos = self.exchange.allgatherv(kept, counts)
            all_codes = self.exchange.allgatherv(sel.codes, 2 * counts)
        with timed(sec, "decode"):
            total = np.zeros(self.nbins, dtype=spec.dtype)
            offs = np.concatenate(([0], np.cumsum(counts)))
            own = None
            row_mass = np.zeros(self.rows, dtype=np.float64)   # sum over ranks of each row's |bins|
            row = self.block // 2 + 1
            with np.errstate(over="ignore", invalid="ignore"):   # an overflow is refused below (_check_rows)
                for r in range(self.nranks):  # P small decodes; each is vectorised over its message
                    a, b = int(offs[r]), int(offs[r + 1])
                    vals = self._decode(all_codes[2 * a: 2 * b], int(header[r, 1]), int(header[r, 2]),
                                        spec.dtype)
                    total[pos[a:b]] += vals
                    row_mass += np.bincount(pos[a:b] // row, weights=np.abs(vals), minlength=self.rows)
                    if r == self.rank:
                        own = vals
            self._check_rows(row_mass)
            mine = np.zeros(self.nbins, dtype=spec.dtype)
            mine[kept] = own
            contribution = self._signal(mine).astype(self._dtype, copy=False)
            avg = self._signal(total).astype(self._dtype, copy=False)
            if self._grad_dtype in HALF_DTYPES:   # finite (the rows' bound); its half rounding may not be
                self.check_sums(avg, self.nranks)
        norm = float(np.linalg.norm(acc))
        res = self.memory.commit(acc, step.out)
        np.divide(avg, self._dtype.type(self.nranks), out=res)
        residual = self.memory.residual
        np.subtract(residual, contribution, out=residual)
        return res, dict(
            counts=counts, selected=int(counts.sum()), density=float(2 * counts.mean() / self.numel),
            threshold=float(sel.tau), bounds=None, owned=None,
            thresholds=word_to_float(header[:, 0]).copy(), e_max=header[:, 1].copy(),
            e_bits=header[:, 2].copy(), bits=self.options["bits"], block=self.block,
            rel_error=float(np.linalg.norm(residual)) / norm if norm > 0 else 0.0)
