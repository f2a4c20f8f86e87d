"""Every public function of ``exdyna_mpi`` and ``exdyna_mpi.adapters.torch`` documents its
arguments, result and errors (``Args:``, ``Returns:``, ``Raises:``), and every argument by name;
every public method of the public adapter classes has a one-line summary and the sections its
arguments, return statements and raise statements call for."""
import ast
import inspect
import textwrap

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


def _adapter_classes():
    """The public adapter classes (docs/reference.md), and for each factory that wraps an optimizer
    the class whose methods the wrapped optimizer gains."""
    try:
        import exdyna_mpi.adapters.torch as xt
        from exdyna_mpi.adapters import torch_wagma
    except ImportError:
        return {}
    return {"DiLoCo": xt.DiLoCo, "ExDynaHookState": xt.ExDynaHookState, "FlatGrad": xt.FlatGrad,
            "FlatParams": xt.FlatParams, "DistributedOptimizer": xt._DistributedMixin,
            "GroupAveragingOptimizer": torch_wagma._GroupAveragingMixin}


def _methods():
    """(qualified name, the class's own public function or property) for every adapter class."""
    out = []
    for cls in _adapter_classes().values():
        for name, attr in vars(cls).items():
            if not name.startswith("_") and (inspect.isfunction(attr) or isinstance(attr, property)):
                out.append((f"{cls.__name__}.{name}", attr))
    return out


def _statements(func):
    """The return-with-a-value and raise statements of ``func``'s own body (nested functions aside)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(func))))
    found = {"return": False, "raise": False}
    todo = list(ast.iter_child_nodes(tree.body[0]))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and node.value is not None and not (
                isinstance(node.value, ast.Constant) and node.value.value is None):
            found["return"] = True
        found["raise"] |= isinstance(node, ast.Raise)
        todo.extend(ast.iter_child_nodes(node))
    return found


def _summary_problem(doc):
    lines = doc.splitlines()
    if not lines or not lines[0].strip():
        return "a summary line"
    if len(lines) > 1 and lines[1].strip():
        return "a one-line summary (a blank line after it)"
    return None


@pytest.mark.parametrize("name,attr", _methods(), ids=[n for n, _ in _methods()])
def test_public_method_has_summary_args_returns_raises(name, attr):
    if isinstance(attr, property):
        doc = inspect.getdoc(attr) or ""
        missing = [p for p in [_summary_problem(doc)] if p]
        if any(_statements(f)["raise"] for f in (attr.fget, attr.fset) if f is not None) and "Raises:" not in doc:
            missing.append("Raises:")
        assert not missing, f"{name} (property): docstring lacks {missing}"
        return
    doc = inspect.getdoc(attr) or ""
    missing = [p for p in [_summary_problem(doc)] if p]
    sig = inspect.signature(attr)
    params = [p for p in sig.parameters if p != "self"]
    if params:
        if "Args:" not in doc:
            missing.append("Args:")
        else:
            args = doc.split("Args:", 1)[1].split("Returns:", 1)[0].split("Raises:", 1)[0]
            missing += [f"argument {p!r}" for p in params if p not in args]
    found = _statements(attr)
    returns = sig.return_annotation not in (inspect.Signature.empty, "None", None)
    if (returns or found["return"]) and "Returns:" not in doc:
        missing.append("Returns:")
    if found["raise"] and "Raises:" not in doc:
        missing.append("Raises:")
    assert not missing, f"{name}: docstring lacks {missing}"


def test_the_method_check_covers_the_adapters():
    classes = _adapter_classes()
    if not classes:
        pytest.skip("torch is not installed")
    import exdyna_mpi.adapters.torch as xt
    public = {n for n in xt.__all__ if inspect.isclass(getattr(xt, n))} | {"DistributedOptimizer",
                                                                            "GroupAveragingOptimizer"}
    assert public == set(classes)
    names = {n for n, _ in _methods()}
    assert {"_DistributedMixin.step", "_GroupAveragingMixin.close", "DiLoCo.load_state_dict",
            "ExDynaHookState.state_dict", "ExDynaHookState.comm", "FlatGrad.attach"} <= names
