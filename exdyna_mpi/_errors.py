"""Error codes that travel with the first collective of a step, and the messages built from them.

Every rank builds the message from the gathered codes, so all ranks raise the same text.
"""
import enum


class InputCode(enum.IntEnum):
    OK = 0
    NOT_ARRAY = 1
    NDIM = 2
    LENGTH = 3
    DTYPE = 4
    DTYPE_MISMATCH = 5
    NOT_CONTIGUOUS = 6
    DEVICE = 7
    REQUIRES_GRAD = 8
    NONFINITE = 9
    BAD_OUT = 11
    # 12: no longer used (half gradients on a CUDA device were refused before the device kernels)
    WIRE = 13
    HOST_STEP = 14
    OVERFLOW = 15


class CollectiveError(ValueError):
    """Raised on every rank together, after the ranks agreed on it (bad arguments, a refused state
    dict, a refused step); no rank's state changed. Anything else the library raises may come from
    one rank only: a caller that must not leave the other ranks waiting treats it as fatal."""


class StepError(CollectiveError):
    """A step refused on every rank because of bad input on at least one; no state was changed."""


class RanksLost(RuntimeError):
    """Raised on every survivor by an elastic entry point (``elastic=True``) once it has recovered
    from a lost rank: the survivors revoked the old communicator, shrank it, agreed on the last
    step every survivor can resume from and rebuilt the exchange for the ranks left, with the
    parameters bit-identical on every survivor. Training goes on: take the next batch (re-sharded
    for ``nranks`` ranks, see ``rank``); the step that raised this was not applied.

    Attributes:
        comm: the survivors' communicator (the entry point now exchanges over it).
        lost: the ranks of the old communicator that died, ascending.
        old_ranks: each survivor's rank in the old communicator, in new rank order.
        rank, nranks: this rank and the number of ranks in ``comm``.
        step: the steps completed, agreed by the survivors (the most advanced survivor's count).
        seconds: how long the recovery took on this rank.
    """

    def __init__(self, comm, lost, old_ranks, rank, step, seconds):
        self.comm, self.lost, self.old_ranks = comm, tuple(lost), tuple(old_ranks)
        self.nranks, self.rank = len(self.old_ranks), int(rank)
        self.step, self.seconds = int(step), float(seconds)
        super().__init__(f"rank(s) {list(self.lost)} lost; {self.nranks} survivors go on from step {self.step} "
                         f"(recovered in {self.seconds:.2f} s)")


_DEVICE_NAMES = {1: "the CPU", 2: "a CUDA device"}


def describe(code, detail, numel, dtype_names, accepted=None):
    """The text of one rank's problem; ``accepted``: the dtype names the caller takes, listed in
    a dtype refusal."""
    code = InputCode(code)
    if code == InputCode.NOT_ARRAY:
        return "grad is not an array (need a NumPy/CuPy array or a DLPack producer)"
    if code == InputCode.NDIM:
        return f"grad has {detail} dimensions, expected a 1-D array"
    if code == InputCode.LENGTH:
        return f"grad has length {detail}, expected numel={numel}"
    if code == InputCode.DTYPE:
        name = dtype_names.get(detail, "unknown")
        what = f"grad has dtype {name}" if detail else "grad has a dtype that cannot be imported"
        return what + (f"; accepted: {', '.join(accepted)}" if accepted else "")
    if code == InputCode.DTYPE_MISMATCH:
        return f"grad is {dtype_names.get(detail, '?')}, but earlier steps fixed the dtype"
    if code == InputCode.NOT_CONTIGUOUS:
        return "grad is not contiguous"
    if code == InputCode.DEVICE:
        where = _DEVICE_NAMES.get(detail, f"DLPack device type {detail}")
        return f"grad lives on {where}, not on this sparsifier's device"
    if code == InputCode.REQUIRES_GRAD:
        return "grad requires grad; pass tensor.detach() (or the .grad buffer)"
    if code == InputCode.NONFINITE:
        return f"grad has {detail} non-finite values (NaN or inf) after error feedback"
    if code == InputCode.OVERFLOW:
        return f"{detail} sums of grad's finite values (after error feedback) are not finite: they overflow its dtype"
    if code == InputCode.WIRE:
        return (f"grad has dtype {dtype_names.get(detail, '?')}; values travel in 16 or 8 bits (wire_dtype) "
                "only from float32, float16 or bfloat16 gradients")
    if code == InputCode.HOST_STEP:
        return ("grad lives on a CUDA device, and this sparsifier's step is host NumPy code: give it host "
                "gradients (a NumPy array, tensor.cpu()), or use a sparsifier with a CUDA step")
    if code == InputCode.BAD_OUT:
        return "out must be a contiguous 1-D array of numel elements, same dtype and device as grad"
    return f"error code {int(code)}"


def refusal(codes, numel, dtype_names, what="step refused", accepted=None):
    """One message naming every failing rank; ``codes`` is a list of (rank, code, detail)."""
    parts = [f"rank {r}: {describe(c, d, numel, dtype_names, accepted)}" for r, c, d in codes]
    return f"{what} on all ranks, state unchanged: " + "; ".join(parts)
