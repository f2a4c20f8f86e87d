"""The comparison set: every sparsifier ExDyna is measured against, one class per method.

All follow ExDyna's contract (``out = sp.step(grad)``, ``sp.residual``, ``sp.stats``,
``state_dict``) and are built by name through ``exdyna_mpi.make``:

- ``dense``     (``dense.DenseAllreduce``): the average of every gradient, the accuracy and bytes baseline.
- ``topk``      (``topk.TopK``): exact local top-k, union of all ranks' indices (gradient build-up).
- ``cltk``      (``topk.CLTK``): a rotating leader picks top-k, everyone sums there.
- ``threshold`` (``topk.HardThreshold``): a fixed hard threshold, union exchange.
- ``gaussiank`` (``topk.GaussianK``): threshold from a Gaussian fit of acc, with the adjust loop.
- ``dgc``       (``topk.DGC``): threshold from top-k on a ~1 % sample, with the correction loop.
- ``oktopk``    (``oktopk.OkTopk``): Ok-Topk's sparse allreduce (balanced regions, split-and-reduce).
- ``fft``       (``fft.FFTSparsifier``): frequency-domain sparsification, range-based low-bit floats.
"""
from .dense import DenseAllreduce
from .fft import FFTSparsifier
from .oktopk import OkTopk
from .topk import CLTK, DGC, GaussianK, HardThreshold, TopK

BASELINES = (DenseAllreduce, TopK, CLTK, HardThreshold, GaussianK, DGC, OkTopk, FFTSparsifier)

__all__ = ["BASELINES", "CLTK", "DGC", "DenseAllreduce", "FFTSparsifier", "GaussianK", "HardThreshold",
           "OkTopk", "TopK"]
