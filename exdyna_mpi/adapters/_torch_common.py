"""What the torch adapters share: torch loaded on first use, the parameter checks, rank 0's model
broadcast, and the wrapped optimizer's class.

``torch.py`` (``DistributedOptimizer``) and ``torch_wagma.py`` (``GroupAveragingOptimizer``) both
import from here; this module imports neither, so the adapters form no import cycle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Sequence

from exdyna_mpi import transport

if TYPE_CHECKING:
    import torch
    from mpi4py import MPI


def _torch():
    """The torch module, imported on first use (``import exdyna_mpi`` never imports torch)."""
    import torch

    return torch


def _to_torch(obj):
    """NumPy arrays and scalars inside ``obj`` as torch tensors and Python numbers (``weights_only`` safe)."""
    import numpy as np

    torch = _torch()
    if isinstance(obj, dict):
        return {k: _to_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_torch(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.array(obj, copy=True))
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def _from_torch(obj):
    """Inverse of ``_to_torch``: tensors back to NumPy arrays (host copies)."""
    torch = _torch()
    if isinstance(obj, dict):
        return {k: _from_torch(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_from_torch(v) for v in obj)
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    return obj


def _unique_params(params: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def _flat_layout(params: Iterable[torch.Tensor], who: str) -> tuple[list[torch.Tensor], int]:
    """The distinct parameters that require grad, and their total size; one dtype and device."""
    params = _unique_params(params)
    if not params:
        raise ValueError(f"{who}: no parameters that require grad")
    dtypes = {p.dtype for p in params}
    devices = {p.device for p in params}
    if len(dtypes) != 1 or len(devices) != 1:
        raise ValueError(f"{who}: parameters must share one dtype and device, got {dtypes}, {devices}")
    return params, sum(p.numel() for p in params)


def _wrapped_params(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None, comm: MPI.Comm | None,
                    who: str) -> tuple[MPI.Comm, list[torch.Tensor]]:
    """``(comm, the optimizer's parameters)``, after checking that they all belong to ``model``."""
    comm = transport.world() if comm is None else comm
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if model is not None:
        in_model = {id(p) for p in model.parameters()}
        missing = [p for p in params if id(p) not in in_model]
        if missing:
            raise ValueError(f"{who}: {len(missing)} optimizer parameters are not in the model")
    return comm, params


def _broadcast_model(model: torch.nn.Module | None, params: Sequence[torch.Tensor], comm: MPI.Comm) -> None:
    """Rank 0's parameters and buffers of ``model`` (or ``params`` without a model) on every rank."""
    broadcast_parameters(list(model.parameters()) + list(model.buffers()) if model is not None else params, comm)


if TYPE_CHECKING:   # the mixins sit before a torch optimizer class (``_wrap``); object at run time
    _OptimizerMixinBase = torch.optim.Optimizer
else:
    _OptimizerMixinBase = object


def _wrap(optimizer: torch.optim.Optimizer, mixin: type, prefix: str, **attrs: Any) -> Any:
    """An instance of ``mixin`` + the optimizer's class sharing the optimizer's state (so LR
    schedulers accept it), with ``attrs`` set on it."""
    base = optimizer.__class__
    # the methods that exchange (``mixin._not_compiled``) run eagerly inside a torch.compile'd
    # region: dynamo breaks the graph there instead of tracing MPI and NumPy calls it cannot follow
    eager = {name: _torch().compiler.disable(getattr(mixin, name)) for name in getattr(mixin, "_not_compiled", ())}
    cls: Any = type(f"{prefix}{base.__name__}", (mixin, base), eager)
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)
    wrapped.__dict__.update(attrs)
    return wrapped


def broadcast_parameters(tensors: Iterable[torch.Tensor], comm: MPI.Comm | None = None, root: int = 0) -> None:
    """Copy ``root``'s values of ``tensors`` (parameters, buffers) to every rank. Collective.

    Packs everything of one dtype into one host buffer and broadcasts it once per dtype.

    Args:
        tensors: the tensors, in the same order and shapes on every rank (changed in place).
        comm: the communicator (``MPI.COMM_WORLD`` when None).
        root: the rank whose values every rank ends with.

    Returns:
        None.

    Raises:
        Nothing of its own; an MPI error ends the job.
    """
    torch = _torch()
    comm = transport.world() if comm is None else comm
    by_dtype: dict[Any, list[Any]] = {}   # dtype -> its tensors
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in sorted(by_dtype, key=str):
        group = by_dtype[dtype]
        with torch.no_grad():
            flat = torch.cat([t.detach().reshape(-1).cpu() for t in group]).contiguous()
            # NumPy has no bfloat16: broadcast its bits (the same memory as int16)
            buf = (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy()
            transport.broadcast(buf, comm, root)
            off = 0
            for t in group:
                n = t.numel()
                t.copy_(flat[off:off + n].view_as(t))
                off += n
