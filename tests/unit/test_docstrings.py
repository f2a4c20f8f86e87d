"""Every public function of ``exdyna_mpi`` and ``exdyna_mpi.adapters.torch`` documents its
arguments, result and errors (``Args:``, ``Returns:``, ``Raises:``), and every argument by name."""
import inspect

import pytest

import exdyna_mpi


def _functions():
    funcs = [getattr(exdyna_mpi, n) for n in exdyna_mpi.__all__]
    try:
        import exdyna_mpi.adapters.torch as xt
        funcs += [getattr(xt, n) for n in xt.__all__]
    except ImportError:
        pass
    return [f for f in funcs if inspect.isfunction(f)]


@pytest.mark.parametrize("func", _functions(), ids=lambda f: f.__name__)
def test_public_function_has_args_returns_raises(func):
    doc = inspect.getdoc(func) or ""
    missing = [s for s in ("Args:", "Returns:", "Raises:") if s not in doc]
    params = [p for p in inspect.signature(func).parameters if p != "self"]
    if params and "Args:" in doc:
        args = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
        missing += [f"argument {p!r}" for p in params if p not in args]
    elif not params:
        missing = [m for m in missing if m != "Args:"]
    assert not missing, f"{func.__module__}.{func.__name__}: docstring lacks {missing}"


def _classes():
    """Public classes with a constructor of their own (exceptions and record types aside)."""
    out = [getattr(exdyna_mpi, n) for n in ("ExDyna", "MiCRO", "Sparsifier", "GroupAverager")]
    try:
        import exdyna_mpi.adapters.torch as xt
        out += [xt.DiLoCo, xt.ExDynaHookState, xt.FlatGrad, xt.FlatParams]
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_public_class_documents_its_constructor(cls):
    doc = inspect.getdoc(cls) or ""
    missing = [s for s in ("Args:", "Raises:") if s not in doc]
    if "Args:" in doc:
        args = doc.split("Args:", 1)[1].split("Raises:", 1)[0]
        missing += [f"argument {p!r}" for p in inspect.signature(cls).parameters if p not in args]
    assert not missing, f"{cls.__name__}: docstring lacks {missing}"


def test_the_check_covers_the_entry_points():
    names = {f.__name__ for f in _functions()}
    assert {"make", "available", "register", "set_timeout"} <= names
