"""Sparsifier base: collective validation, stats and state common to every sparsifier."""
import time
import zlib

import numpy as np

from . import _transport
from ._arrays import DTYPE_CODES, DTYPE_NAMES, as_input, check_vector
from ._errors import InputCode, StepError, refusal
from ._ops import gpu_available, ops_for

NONFINITE_POLICIES = ("raise", "skip")
DEVICES = ("auto", "cpu", "cuda")


class Stats:
    """What the last step did. Attributes, also readable as ``stats["name"]``."""

    FIELDS = ("iteration", "counts", "selected", "density", "threshold", "bounds", "owned",
              "bytes_sent", "bytes_received", "seconds", "skipped")

    def __init__(self, **kw):
        for f in self.FIELDS:
            setattr(self, f, kw.pop(f, None))
        for k, v in kw.items():
            setattr(self, k, v)

    def __getitem__(self, key):
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def keys(self):
        return [k for k in vars(self)]

    def as_dict(self):
        return dict(vars(self))

    def __repr__(self):
        body = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "seconds")
        return f"Stats({body})"


def _fingerprint(text):
    return zlib.crc32(text.encode()) | (zlib.adler32(text.encode()) << 32)


class Sparsifier:
    """One rank's end of a sparse gradient exchange. Subclasses implement ``_step``.

    Construction and every step are collective over ``comm``: all ranks must call them, and a bad
    argument on any rank raises the same ``ValueError`` on every rank.
    """

    name = "base"
    #: option name -> (default, validator returning an error text or None)
    OPTIONS = {}

    def __init__(self, numel, density, comm=None, *, device="auto", nonfinite="raise", **options):
        self.comm = _transport.world() if comm is None else comm
        self.xch = _transport.Exchange(self.comm)
        self.rank, self.nranks = self.xch.rank, self.xch.size
        errors = []
        if isinstance(numel, (bool, np.bool_)) or not isinstance(numel, (int, np.integer)) or numel <= 0:
            errors.append(f"numel must be a positive integer, got {numel!r}")
        try:
            density = float(density)
            if not 0.0 < density <= 1.0:
                raise ValueError
        except (TypeError, ValueError):
            errors.append(f"density must be in (0, 1], got {density!r}")
        if nonfinite not in NONFINITE_POLICIES:
            errors.append(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        if device not in DEVICES:
            errors.append(f"device must be one of {DEVICES}, got {device!r}")
        elif device == "cuda" and not gpu_available():
            errors.append("device='cuda' but no CUDA device is available to CuPy")
        opts = {}
        for key, (default, check) in self.OPTIONS.items():
            val = options.pop(key, default)
            problem = check(val)
            if problem:
                errors.append(f"{key} {problem}, got {val!r}")
            opts[key] = val
        for key in sorted(options):
            errors.append(f"unknown option {key!r} for {self.name}")
        config = f"{self.name} numel={numel!r} density={density!r} nonfinite={nonfinite!r} device={device!r} " + " ".join(
            f"{k}={v!r}" for k, v in sorted(opts.items()))
        words = [1 if errors else 0, _fingerprint(config) & 0x7FFFFFFFFFFFFFFF]
        got = self.xch.agree(words)
        if got[:, 0].any():
            msgs = self.comm.allgather("; ".join(errors))
            parts = [f"rank {r}: {m}" for r, m in enumerate(msgs) if m]
            raise ValueError(f"{self.name}: bad arguments: " + "; ".join(parts))
        if (got[:, 1] != got[0, 1]).any():
            configs = self.comm.allgather(config)
            parts = [f"rank {r}: {c}" for r, c in enumerate(configs)]
            raise ValueError(f"{self.name}: ranks disagree on the arguments: " + "; ".join(parts))
        self.xch.reset_counters()
        self.numel = int(numel)
        self.density = density
        self.nonfinite = nonfinite
        self.options = opts
        self._device, self._ops = None, None
        if device != "auto":
            self._use_device(device)
        self._dtype = None
        self._residual = None
        self._spare = None
        self.iteration = 0
        self.stats = None

    # ------------------------------------------------------------------ buffers and inputs
    @property
    def device(self):
        return self._device or "cpu"

    @property
    def dtype(self):
        return self._dtype or np.dtype(np.float32)

    @property
    def residual(self):
        """A copy of the error-feedback buffer (zeros before the first step), on the host."""
        if self._residual is None:
            return np.zeros(self.numel, dtype=self.dtype)
        return np.array(self._ops.to_host(self._residual), copy=True)

    def _take(self, grad, out=None):
        """View ``grad`` (and ``out``) as backend arrays; the local problem, if any, as (code, detail)."""
        inp = as_input(grad)
        err = check_vector(inp, self.numel, self._dtype, self._device)
        if err is None and out is not None:
            o = as_input(out)
            err = check_vector(o, self.numel, np.dtype(inp.array.dtype), inp.device)
            if err is not None:
                err = (InputCode.BAD_OUT, 0)
            out = o.array if err is None else None
        return inp, err, out

    def _use_device(self, device):
        """Bind the per-element ops and the transport to ``device`` ("cpu" or "cuda")."""
        self._device = device
        self._ops = ops_for(device)
        if device == "cuda":
            from ._device_transport import DeviceExchange

            self.xch = DeviceExchange(self.xch)

    def _bind(self, inp):
        """Fix device and dtype from the first good gradient; allocate the residual there."""
        if self._residual is not None:
            return
        if self._device is None:
            self._use_device(inp.device)
        self._dtype = np.dtype(inp.array.dtype)
        self._residual = self._ops.zeros(self.numel, self._dtype)

    def _acc_buffer(self):
        acc = self._spare
        self._spare = None
        return acc if acc is not None else self._ops.empty(self.numel, self._dtype)

    def _settle(self, acc, out):
        """After a good step: ``acc`` becomes the residual; return the zeroed output buffer."""
        old = self._residual
        self._residual = acc
        if out is None:
            out = old
        else:
            self._spare = old
        self._ops.fill_zero(out)
        return out

    # ------------------------------------------------------------------ collective checks
    def _words(self, count, err):
        code, detail = err if err is not None else (InputCode.OK, 0)
        return [count, int(code), int(detail), self._dtype_code_of_step]

    def _check_words(self, words, local_err):
        """Raise the same StepError on every rank if any rank reported a problem.

        Returns True when the step must be skipped (only non-finite values, policy ``skip``).
        """
        codes = words[:, 1]
        if codes.any():
            bad = [(r, int(words[r, 1]), int(words[r, 2])) for r in range(self.nranks) if words[r, 1]]
            if self.nonfinite == "skip" and all(c == InputCode.NONFINITE for _, c, _ in bad):
                return True
            raise StepError(f"{self.name}: " + refusal(bad, self.numel, DTYPE_NAMES))
        dts = words[:, 3]
        if (dts != dts[0]).any():
            names = ", ".join(f"rank {r}: {DTYPE_NAMES.get(int(d), '?')}" for r, d in enumerate(dts))
            raise StepError(f"{self.name}: step refused on all ranks, state unchanged: "
                            f"ranks pass different dtypes ({names})")
        return False

    def _verdict(self, words, err, acc):
        """After the step's first collective: raise the refusal on every rank, or return True when
        the step is skipped (``nonfinite="skip"``). Either way a computed ``acc`` is kept for reuse,
        and nothing else has changed.
        """
        try:
            skip = self._check_words(words, err)
        except Exception:
            self._keep_spare(acc)
            raise
        if skip:
            self._keep_spare(acc)
        return skip

    def _keep_spare(self, acc):
        if acc is not None:
            self._spare = acc

    def _average_at(self, acc, union, out, sec):
        """The end of a union step: sum every rank's ``acc[union]`` (bit-identical everywhere),
        ``acc`` becomes the residual with ``union`` zeroed, and the returned buffer holds the sum / P
        at ``union``, 0 elsewhere. Phase times go into ``sec``.
        """
        ops = self._ops
        t0 = time.perf_counter()
        vals = ops.empty(union.shape[0], self._dtype)
        ops.gather(acc, union, vals)
        sec["gather"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.xch.sum_identical(vals)
        sec["reduce"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = self._settle(acc, out)
        ops.scatter_mean_zero(res, self._residual, union, vals, self._dtype.type(self.nranks))
        sec["scatter"] = time.perf_counter() - t0
        return res

    def _skip(self, inp, out):
        """A step skipped on every rank: zero update, nothing else changes."""
        if self._ops is None:
            res = np.zeros(self.numel, dtype=inp.array.dtype) if inp.array is not None else None
        else:
            res = out if out is not None else self._ops.zeros(self.numel, inp.array.dtype)
            self._ops.fill_zero(res)
        self.stats = Stats(iteration=self.iteration, counts=np.zeros(self.nranks, np.int64), selected=0,
                           density=0.0, threshold=None, bounds=None, owned=None,
                           bytes_sent=self.xch.bytes_sent, bytes_received=self.xch.bytes_received,
                           seconds={}, skipped=True)
        return inp.wrap(res)

    # ------------------------------------------------------------------ state
    def _extra_state(self):
        return {}

    def _load_extra_state(self, d):
        pass

    def state_dict(self):
        """Everything needed to resume bit-exactly on this rank (host copies; safe to pickle)."""
        return {
            "name": self.name, "numel": self.numel, "density": self.density, "nranks": self.nranks,
            "rank": self.rank, "options": dict(self.options), "iteration": self.iteration,
            "dtype": None if self._dtype is None else self._dtype.str,
            "residual": None if self._residual is None else self.residual,
            **self._extra_state(),
        }

    def load_state_dict(self, d):
        """Restore ``state_dict()`` output. Collective: every rank loads its own rank's dict."""
        problem = None
        try:
            for key, mine in (("name", self.name), ("numel", self.numel), ("nranks", self.nranks),
                              ("rank", self.rank), ("density", self.density)):
                if d[key] != mine:
                    problem = f"state_dict has {key}={d[key]!r}, this sparsifier has {mine!r}"
                    break
            it = int(d["iteration"])
        except (KeyError, TypeError, ValueError) as e:
            problem, it = f"state_dict is malformed ({e!r})", -1
        got = self.xch.agree([1 if problem else 0, it])
        if got[:, 0].any():
            msgs = self.comm.allgather(problem)
            parts = [f"rank {r}: {m}" for r, m in enumerate(msgs) if m]
            raise ValueError(f"{self.name}: load_state_dict refused: " + "; ".join(parts))
        if (got[:, 1] != got[0, 1]).any():
            raise ValueError(f"{self.name}: load_state_dict refused: ranks hold different iterations "
                             f"{got[:, 1].tolist()}")
        self.xch.reset_counters()
        self.iteration = it
        self._spare = None
        if d["residual"] is None:
            self._dtype, self._residual = None, None
        else:
            self._dtype = np.dtype(d["dtype"])
            if self._ops is None:
                self._use_device("cpu")
            host = np.array(d["residual"], dtype=self._dtype, copy=True)
            self._residual = self._ops.from_host(host)
        self._load_extra_state(d)

    # ------------------------------------------------------------------ step
    def step(self, grad, out=None):
        """Sparsify ``grad``, exchange, and return the averaged sparse gradient (dense, same kind).

        ``out`` (optional): a buffer of the same kind, dtype and device to write the result into
        (it may be ``grad`` itself). Collective over ``comm``.
        """
        t0 = time.perf_counter()
        self.xch.reset_counters()
        inp, err, out_arr = self._take(grad, out)
        self._dtype_code_of_step = DTYPE_CODES.get(np.dtype(inp.array.dtype), 0) if err is None else 0
        res = self._step(inp, err, out_arr)
        if self.stats is not None and not self.stats.skipped:
            self.stats.seconds["total"] = time.perf_counter() - t0
        return res

    def _step(self, inp, err, out):  # pragma: no cover - abstract
        raise NotImplementedError
