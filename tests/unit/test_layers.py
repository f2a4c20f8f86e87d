"""The layers of docs/architecture.md in the package layout: imports point down only, MPI only in transport.

Static checks over the source (ast), so they cost nothing at run time and fail on the offending line:
an upward import, ``mpi4py`` imported outside ``transport/``, an MPI call anywhere else, or a cycle in
the package's import graph (imports inside functions included).

An MPI call is a call ``x.name(...)`` whose ``name`` is a method of mpi4py's communicators, requests,
windows, statuses or groups (``dir()`` of ``MPI.Comm`` and its subclasses, ``MPI.Request`` and its
subclasses, ``MPI.Win``, ``MPI.Status``, ``MPI.Group``), or a call ``MPI.name(...)`` of a callable of
the ``MPI`` module itself (``MPI.Wtime``, ``MPI.Query_thread``, ...). A method name that everyday
objects share (``wait``, ``cancel``, ``gather``, ``scatter``, ``reduce``, ``free``, ``Lock``, ...: the
overlap with ``dir()`` of threading and its ``Event``, ``concurrent.futures.Future``,
``torch.futures.Future``, ``list``, ``dict``, ``set``, ``numpy.ndarray``, ``numpy.ufunc``,
``torch.Tensor``, ``queue.Queue``, ``str``, ``bytes``, the arrays layer's ``Ops`` and the transport
objects the layers above call) counts only when the receiver's name says it is an MPI object: its
text contains ``comm``, ``req``, ``win``, ``status``, ``group`` or ``mpi``, in any case.
"""
import ast
import concurrent.futures
import importlib.util
import pathlib
import queue
import re
import threading

import numpy as np
import pytest
from mpi4py import MPI

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: layer rank of each top-level part of ``exdyna_mpi``
RANK = {"kernels": 0, "_errors": 0, "arrays": 1, "transport": 2, "algorithm": 3,
        "sparsifiers": 4, "averaging": 5, "__init__": 6, "adapters": 7}
#: the algorithm layer is pure host logic: it imports nothing else of the package
ONLY = {"algorithm": {"algorithm"}, "kernels": {"kernels"}, "_errors": set()}

#: the mpi4py classes whose methods are MPI calls, by the receiver name a planted call uses
MPI_CLASSES = {"comm": (MPI.Comm, MPI.Intracomm, MPI.Intercomm, MPI.Topocomm, MPI.Cartcomm, MPI.Graphcomm,
                        MPI.Distgraphcomm),
               "req": (MPI.Request, MPI.Prequest, MPI.Grequest),
               "win": (MPI.Win,), "status": (MPI.Status,), "group": (MPI.Group,)}
#: a receiver whose name says it is an MPI object
MPI_RECEIVER = re.compile(r"comm|req|win|status|group|mpi", re.IGNORECASE)


def _callables(obj):
    return {n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))}


#: the method names of each kind of MPI object, and the callables of the MPI module
MPI_METHODS = {kind: set().union(*map(_callables, classes)) for kind, classes in MPI_CLASSES.items()}
MPI_FUNCTIONS = _callables(MPI)


def _everyday_objects():
    """The objects whose method names are not MPI calls on their own (see the module docstring)."""
    from exdyna_mpi.arrays import Ops
    from exdyna_mpi.transport import DeadlineTransport, Exchange, Worker
    from exdyna_mpi.transport.group import AsyncRounds, GroupTransport

    objs = [threading, threading.Event, concurrent.futures.Future, list, dict, set, np.ndarray, np.ufunc,
            queue.Queue, str, bytes, Ops, Exchange, GroupTransport, AsyncRounds, DeadlineTransport, Worker]
    if importlib.util.find_spec("torch") is not None:
        import torch
        import torch.futures

        objs += [torch.Tensor, torch.futures.Future]
    return objs


#: MPI method names that everyday objects have too: MPI calls only on an MPI-named receiver
SHARED = set().union(*MPI_METHODS.values()) & set().union(*(dir(o) for o in _everyday_objects()))


def mpi_calls(source):
    """(line, call) for every MPI call in ``source`` (the rule of the module docstring)."""
    methods = set().union(*MPI_METHODS.values())
    out = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        name, receiver = node.func.attr, ast.unparse(node.func.value)
        mpi_named = MPI_RECEIVER.search(receiver) is not None
        if ((name in methods and (name not in SHARED or mpi_named))
                or (name in MPI_FUNCTIONS and receiver.split(".")[-1] == "MPI")):
            out.append((node.lineno, f"{receiver}.{name}(...)"))
    return sorted(out)


def _modules():
    for path in sorted((ROOT / "exdyna_mpi").rglob("*.py")):
        rel = path.relative_to(ROOT / "exdyna_mpi").with_suffix("")
        yield path, ("exdyna_mpi",) + rel.parts


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


def typing_only_lines(source):
    """Lines of the imports under ``if TYPE_CHECKING:``: read by type checkers, never run."""
    lines = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            for stmt in node.body:
                for sub in ast.walk(stmt):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        lines.add(sub.lineno)
    return lines


def violations(source, mod):
    me = _part(mod)
    bad = []
    typing_only = typing_only_lines(source)
    for line, target, raw in imports_of(source, mod):
        # a type hint may name ``MPI.Comm``: only an import that runs counts as using MPI
        if target[0] == "mpi4py" and me != "transport" and line not in typing_only:
            bad.append(f"line {line}: imports {raw} outside transport/")
        if target[0] != "exdyna_mpi":
            continue
        other = _part(target)
        if other not in RANK:
            continue
        if RANK[other] > RANK[me] or (me in ONLY and other not in ONLY[me]):
            bad.append(f"line {line}: {me} imports {raw} ({other}): upward")
    if me != "transport":
        bad += [f"line {line}: MPI call outside transport/: {call}" for line, call in mpi_calls(source)]
    return bad


@pytest.mark.parametrize("path,mod", list(_modules()), ids=lambda v: str(v) if isinstance(v, tuple) else "")
def test_imports_point_down(path, mod):
    bad = violations(path.read_text(), mod)
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_walk_sees_every_module_once_in_its_layer():
    """Each module of the package is checked once, under its own layer: the kernels (in
    ``exdyna_mpi/kernels/``) as layer 0, their CUDA package included."""
    mods = [mod for _, mod in _modules()]
    assert len(mods) == len(set(mods)), "a module is walked twice"
    assert set(RANK) <= {_part(m) for m in mods}, "a layer the walk does not reach"
    kernels = {m for m in mods if _part(m) == "kernels"}
    assert ("exdyna_mpi", "kernels", "cpu") in kernels and ("exdyna_mpi", "kernels", "cuda", "launch") in kernels
    assert RANK["kernels"] == 0


def test_the_check_catches_an_upward_import_and_a_stray_mpi_call():
    mod = ("exdyna_mpi", "arrays", "ops")
    assert violations("from ..sparsifiers import base\n", mod)
    assert violations("from ..transport.exchange import Exchange\n", mod)
    assert violations("import exdyna_mpi.adapters.torch\n", mod)
    assert violations("from mpi4py import MPI\n", mod)
    assert not violations("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from mpi4py import MPI\n", mod)
    assert violations("if TYPE_CHECKING:\n    from ..sparsifiers import base\n", mod)
    assert violations("x = comm.Bcast(buf, root=0)\n", ("exdyna_mpi", "adapters", "torch"))
    for call in ("self._comm = comm.Dup()", "comm.Free()", "comm.Abort(1)", "r = comm.Get_rank()",
                 "req.Wait()", "MPI.Request.Waitall(reqs)", "comm.Iallreduce(a, b)", "req.Test()"):
        assert violations(call + "\n", ("exdyna_mpi", "adapters", "torch_hook", "state")), call
    assert not violations("done.wait()\nx.get_rank()\n", ("exdyna_mpi", "adapters", "torch_hook", "state"))
    assert not violations("x = comm.Bcast(buf, root=0)\n", ("exdyna_mpi", "transport", "exchange"))
    assert violations("from ..arrays import ops_for\n", ("exdyna_mpi", "algorithm", "layout"))
    assert not violations("from ..kernels import cpu\nfrom .dlpack import Input\n", mod)
    assert not violations("from ..arrays import ops_for\n", ("exdyna_mpi", "sparsifiers", "base"))


def test_the_check_catches_every_mpi_call_of_mpi4py():
    """Every method of mpi4py's MPI objects, called on a receiver named for its kind, and every
    callable of the MPI module, called as ``MPI.name(...)``, outside transport/: each is caught."""
    planted = [f"{kind}.{name}()" for kind, names in MPI_METHODS.items() for name in sorted(names)]
    planted += [f"MPI.{name}()" for name in sorted(MPI_FUNCTIONS)]
    assert len(planted) > 300 and {"Allreduce", "send", "isend", "Sendrecv", "Scan", "wait"} <= MPI_METHODS["comm"] | \
        MPI_METHODS["req"], "mpi4py's lists look empty: the check would be blind"
    for mod in (("exdyna_mpi", "adapters", "torch_hook", "state"), ("exdyna_mpi", "sparsifiers", "base")):
        bad = violations("\n".join(planted) + "\n", mod)
        caught = {int(b.split()[1].rstrip(":")) for b in bad}
        missed = [call for line, call in enumerate(planted, 1) if line not in caught]
        assert not missed, f"MPI calls not caught: {missed}"
    assert not violations("\n".join(planted) + "\n", ("exdyna_mpi", "transport", "exchange"))


def test_the_check_reads_shared_names_by_their_receiver():
    """A name everyday objects share is an MPI call on an MPI-named receiver only; any other MPI
    name is one on any receiver."""
    mod = ("exdyna_mpi", "averaging", "wagma")
    assert {"wait", "cancel", "gather", "scatter", "free"} <= SHARED
    for fine in ("done.wait()", "fut.wait()", "x.get_rank()", "d.copy()", "q.get()", "np.bitwise_and.reduce(a)",
                 "lock = threading.Lock()", "self._worker.free()", "self.ops.gather(acc, idx, vals)",
                 "text = 'comm.Allreduce(a, b)'  # comm.Barrier()"):
        assert not violations(fine + "\n", mod), fine
    for call in ("req.wait()", "self.status.cancel()", "self.comm.gather(x)", "mpi_group.free()",
                 "self._private.Sendrecv(a, 1, 0, b, 1, 0)", "self.tx.xch.comm.send(x, 1)", "peer.isend(x, 1)",
                 "f(self.link.Scan(a, b))", "x = MPI.Wtime()", "MPI.COMM_WORLD.Get_rank()"):
        assert violations(call + "\n", mod), call


def _dotted(mod):
    """``("exdyna_mpi", "arrays", "__init__")`` -> ``"exdyna_mpi.arrays"``."""
    return ".".join(mod[:-1] if mod[-1] == "__init__" else mod)


def import_graph(sources):
    """The package's import graph: ``{module: [(line, imported module), ...]}`` over ``sources``
    (``{dotted module name: (source text, module tuple)}``), every import statement counted wherever
    it sits (module level, inside a function, under ``if TYPE_CHECKING``).

    An import of ``a.b.c`` also runs the packages ``a`` and ``a.b``: those count as edges too, except
    the packages that already enclose the importing module (they are mid-import when it runs).
    ``from pkg import x`` with ``x`` a submodule is an edge to ``pkg.x``; with ``x`` a name defined in
    ``pkg/__init__.py``, an edge to ``pkg``. Imports from outside ``sources`` are left out."""
    graph = {}
    for me, (source, mod) in sources.items():
        pkg = mod[:-1]
        edges = []

        def add(line, target):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                t = ".".join(parts[:i])
                enclosing = me == t or me.startswith(t + ".")
                if t in sources and (i == len(parts) or not enclosing) and t != me:
                    edges.append((line, t))

        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                for a in node.names:
                    add(node.lineno, a.name)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg[: len(pkg) - (node.level - 1)]
                    target = ".".join(base + (tuple(node.module.split(".")) if node.module else ()))
                else:
                    target = node.module
                subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in sources]
                if len(subs) < len(node.names):
                    add(node.lineno, target)
                for sub in subs:
                    add(node.lineno, sub)
        graph[me] = edges
    return graph


def cycles(graph):
    """One cycle per strongly connected component of more than one module (or a module importing
    itself), as ``["a (line 3) -> b", "b (line 9) -> a"]``; empty when the graph has none."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):   # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for _, w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    found = []
    for comp in comps:
        start = min(comp)
        # a shortest way back to ``start`` inside the component (breadth first)
        prev, frontier, back = {start: None}, [start], None
        while frontier and back is None:
            nxt = []
            for v in frontier:
                for line, w in sorted(graph.get(v, ()), key=lambda e: e[1]):
                    if w == start and back is None:
                        back = (v, line)
                    elif w in comp and w not in prev:
                        prev[w] = (v, line)
                        nxt.append(w)
            frontier = nxt
        if back is None:
            continue    # a single module with no edge to itself
        path, (v, line) = [f"{back[0]} (line {back[1]}) -> {start}"], back
        while prev[v] is not None:
            u, line = prev[v]
            path.insert(0, f"{u} (line {line}) -> {v}")
            v = u
        found.append(path)
    return found


def package_sources():
    return {_dotted(mod): (path.read_text(), mod) for path, mod in _modules()}


def test_no_import_cycles():
    """No module of the package imports, directly or through others, a module that imports it back:
    not at module level, not inside a function."""
    found = cycles(import_graph(package_sources()))
    assert not found, "import cycles:\n" + "\n".join("  " + "; ".join(c) for c in found)


def test_the_cycle_check_sees_imports_inside_functions_and_through_packages():
    def graph(files):
        return import_graph({name: (text, tuple(name.split(".")) + (("__init__",) if pkg else ()))
                             for name, (text, pkg) in files.items()})

    lazy = {"p": ("", True), "p.a": ("from .b import f\n", False),
            "p.b": ("def f():\n    from .a import g\n", False)}
    assert cycles(graph(lazy)) == [["p.a (line 1) -> p.b", "p.b (line 2) -> p.a"]]
    # p.c imports p.q.x, which runs p.q's __init__, which imports p.c
    through = {"p": ("", True), "p.q": ("from ..c import h\n", True), "p.q.x": ("", False),
               "p.c": ("import p.q.x\n", False)}
    assert cycles(graph(through))
    # a package importing its own submodules, which import siblings: no cycle
    down = {"p": ("from .a import f\n", True), "p.a": ("from . import b\n", False), "p.b": ("", False)}
    assert not cycles(graph(down))
    # ``from . import name`` where the name lives in the package's __init__: back up into it
    up = {"p": ("from .a import f\nX = 1\n", True), "p.a": ("from . import X\n", False)}
    assert cycles(graph(up))

#: what jobs/ import of the library without a word: the public API
PUBLIC = {"exdyna_mpi", "exdyna_mpi.adapters.torch", "exdyna_mpi.adapters.torch_fsdp"}


def internal_imports(source):
    """``(line, module, names)`` for every import in a job's ``source`` of a library module beyond
    ``PUBLIC`` (imports inside functions included); ``names``: what ``from module import ...`` takes,
    empty for ``import module``."""
    def internal(module):
        return module.split(".")[0] == "exdyna_mpi" and module not in PUBLIC

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names if internal(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and internal(node.module):
            out.append((node.lineno, node.module, tuple(a.name for a in node.names)))
    return sorted(out)


def exported(package):
    """The names of ``package``'s ``__all__`` (``"exdyna_mpi.arrays"``), read from its source."""
    init = ROOT.joinpath("exdyna_mpi", *package.split(".")[1:], "__init__.py")
    if not init.exists():
        return set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def job_import_problems(source):
    """``line N: ...`` for every internal import of a job (``internal_imports``) with no comment, on the
    line above or at the end of its own line, saying why the job reaches past the public API; and for a
    name taken from below a package that exports it itself (``from exdyna_mpi.arrays.ops import
    HostOps``: ``exdyna_mpi.arrays`` exports ``HostOps``)."""
    lines = source.splitlines()
    bad = []
    for line, module, names in internal_imports(source):
        above = lines[line - 2].strip() if line > 1 else ""
        if not above.startswith("#") and "#" not in lines[line - 1]:
            bad.append(f"line {line}: {module}: no comment on why it reaches past the public API")
        parts = module.split(".")
        for i in range(1, len(parts)):
            package = ".".join(parts[:i])
            shown = sorted(set(names) & exported(package))
            if shown:
                bad.append(f"line {line}: {module}: import {', '.join(shown)} from {package}, which exports it")
    return bad


def test_jobs_import_the_public_api_or_say_why():
    """jobs/ import the public API (``exdyna_mpi``, ``exdyna_mpi.adapters.torch``, ``.torch_fsdp``); a job
    whose subject is a library internal imports it from the module that exports it, with a comment on why."""
    bad = []
    for path in sorted((ROOT / "jobs").rglob("*.py")):
        bad += [f"{path.relative_to(ROOT)}: {p}" for p in job_import_problems(path.read_text())]
    assert not bad, "\n".join(bad)
    assert job_import_problems("from exdyna_mpi.transport import SendDelay\n")
    assert job_import_problems("def f():\n    import exdyna_mpi.kernels.cuda as kc\n")
    assert not job_import_problems("def f():\n    # what it times\n    import exdyna_mpi.kernels.cuda\n")
    assert not job_import_problems("from exdyna_mpi.transport import SendDelay  # the hook it drives\n")
    assert job_import_problems("# the host ops\nfrom exdyna_mpi.arrays.ops import HostOps\n")
    assert job_import_problems("# a sparsifier\nfrom exdyna_mpi.sparsifiers.exdyna import ExDyna\n")
    assert not job_import_problems("# the marks\nfrom exdyna_mpi.arrays.ops import Marks\n")
    assert not job_import_problems("import exdyna_mpi\nfrom exdyna_mpi.adapters.torch import FlatGrad\n")


def test_jobs_internal_imports_exist():
    """Every library internal a job imports still exists where the job takes it from (a library
    refactor that moves one fails here, not in a job run)."""
    import importlib
    import importlib.util

    missing = []
    for path in sorted((ROOT / "jobs").rglob("*.py")):
        for line, module, names in internal_imports(path.read_text()):
            where = f"{path.relative_to(ROOT)} line {line}: {module}"
            if importlib.util.find_spec(module) is None:
                missing.append(where)
                continue
            missing += [f"{where}.{n}" for n in names if not hasattr(importlib.import_module(module), n)]
    assert not missing, missing


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


def test_capability_flags_say_what_the_class_has():
    """Callers read ``Ops.finishes_ahead`` and ``Controller.picks_fine`` instead of probing with
    ``hasattr``: each flag must be true exactly where the methods it stands for exist."""
    from exdyna_mpi.algorithm import controllers
    from exdyna_mpi.arrays import HostOps
    from exdyna_mpi.arrays.ops import DEVICE_ONLY

    assert HostOps.finishes_ahead is False and not any(hasattr(HostOps, m) for m in DEVICE_ONLY)
    classes = [c for c in vars(controllers).values()
               if isinstance(c, type) and issubclass(c, controllers.Controller)]
    assert len(classes) >= 5
    for cls in classes:
        has = hasattr(cls, "fine_pick") and hasattr(cls, "fine_tol")
        assert cls.picks_fine is has, f"{cls.__name__}.picks_fine is {cls.picks_fine}, fine_pick present: {has}"
    assert controllers.MeasuredController.picks_fine
