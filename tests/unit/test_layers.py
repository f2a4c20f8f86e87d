"""The layers of docs/architecture.md in the package layout: imports point down only, MPI only in transport.

Static checks over the source (ast), so they cost nothing at run time and fail on the offending line:
an upward import, ``mpi4py`` imported outside ``transport/``, or an MPI call anywhere else.
"""
import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: layer rank of each top-level part of ``exdyna_mpi`` (kernels/ is installed as exdyna_mpi.kernels)
RANK = {"kernels": 0, "_errors": 0, "arrays": 1, "transport": 2, "algorithm": 3,
        "sparsifiers": 4, "averaging": 5, "__init__": 6, "adapters": 7}
#: the algorithm layer is pure host logic: it imports nothing else of the package
ONLY = {"algorithm": {"algorithm"}, "kernels": {"kernels"}, "_errors": set()}
MPI_CALL = re.compile(r"\.(Allgatherv?|allgather|Bcast|bcast|Alltoallv?|alltoall|Isend|Irecv|Send|Recv|"
                      r"Sendrecv|Reduce_scatter|Allreduce|allreduce|Reduce|Barrier|Waitall|Split_type)\(")


def _modules():
    for path in sorted((ROOT / "exdyna_mpi").rglob("*.py")):
        rel = path.relative_to(ROOT / "exdyna_mpi").with_suffix("")
        yield path, ("exdyna_mpi",) + rel.parts
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        rel = path.relative_to(ROOT / "kernels").with_suffix("")
        yield path, ("exdyna_mpi", "kernels") + rel.parts


def _part(mod):
    """The layer a dotted module path ``exdyna_mpi.X...`` belongs to."""
    return "__init__" if len(mod) == 1 or mod[1] == "__init__" else mod[1]


def imports_of(source, mod):
    """(line, imported exdyna_mpi module as a tuple, raw name) for every import in ``source``."""
    pkg = mod[:-1] if mod[-1] != "__init__" else mod[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((node.lineno, tuple(a.name.split(".")), a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)]
                target = base + (tuple(node.module.split(".")) if node.module else ())
            else:
                target = tuple(node.module.split("."))
            if target[-1:] != ("*",):
                for a in node.names:  # ``from . import x`` imports the module x
                    sub = target + (a.name,) if not node.module else target
                    out.append((node.lineno, sub, ".".join(sub)))
    return out


def violations(source, mod):
    me = _part(mod)
    bad = []
    for line, target, raw in imports_of(source, mod):
        if target[0] == "mpi4py" and me != "transport":
            bad.append(f"line {line}: imports {raw} outside transport/")
        if target[0] != "exdyna_mpi":
            continue
        other = _part(target)
        if other not in RANK:
            continue
        if RANK[other] > RANK[me] or (me in ONLY and other not in ONLY[me]):
            bad.append(f"line {line}: {me} imports {raw} ({other}): upward")
    if me != "transport":
        for i, text in enumerate(source.splitlines(), 1):
            code = text.split("#", 1)[0]
            if MPI_CALL.search(code) and not code.lstrip().startswith(('"', "'")):
                bad.append(f"line {i}: MPI call outside transport/: {text.strip()}")
    return bad


@pytest.mark.parametrize("path,mod", list(_modules()), ids=lambda v: str(v) if isinstance(v, tuple) else "")
def test_imports_point_down(path, mod):
    bad = violations(path.read_text(), mod)
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_check_catches_an_upward_import_and_a_stray_mpi_call():
    mod = ("exdyna_mpi", "arrays", "ops")
    assert violations("from ..sparsifiers import base\n", mod)
    assert violations("from ..transport.exchange import Exchange\n", mod)
    assert violations("import exdyna_mpi.adapters.torch\n", mod)
    assert violations("from mpi4py import MPI\n", mod)
    assert violations("x = comm.Bcast(buf, root=0)\n", ("exdyna_mpi", "adapters", "torch"))
    assert violations("from ..arrays import ops_for\n", ("exdyna_mpi", "algorithm", "layout"))
    assert not violations("from ..kernels import cpu\nfrom .dlpack import Input\n", mod)
    assert not violations("from ..arrays import ops_for\n", ("exdyna_mpi", "sparsifiers", "base"))


def test_jobs_import_no_private_module():
    """jobs/ use the public surface only (no ``exdyna_mpi._x`` / ``exdyna_mpi.x._y``)."""
    bad = []
    for path in sorted((ROOT / "jobs").rglob("*.py")):
        for line, target, raw in imports_of(path.read_text(), ("jobs", path.stem)):
            if target[0] == "exdyna_mpi" and any(p.startswith("_") and p != "__init__" for p in target[1:]):
                bad.append(f"{path.name}:{line}: {raw}")
    assert not bad, bad


def ops_signature_problems(impl):
    """Methods of the ``Ops`` protocol that ``impl`` lacks or declares with other parameters."""
    import inspect

    from exdyna_mpi.arrays import Ops

    bad = []
    for name, proto in vars(Ops).items():
        if name.startswith("_") or not callable(proto):
            continue
        fn = getattr(impl, name, None)
        if fn is None:
            bad.append(f"{name}: missing")
            continue
        want = list(inspect.signature(proto).parameters.values())[1:]   # drop self
        if list(inspect.signature(fn).parameters.values()) != want:
            bad.append(f"{name}: {inspect.signature(fn)} != {want}")
    return bad


def test_host_ops_implements_the_ops_protocol():
    from exdyna_mpi.arrays import HostOps, Ops

    assert isinstance(HostOps, Ops) and HostOps.device == "cpu"
    assert not ops_signature_problems(HostOps), ops_signature_problems(HostOps)
