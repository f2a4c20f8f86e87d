"""docs/reference.md against the code: every public name, every sparsifier option, every adapter
argument is on the page, with the default the code has; no row names an option that does not exist."""
import ast
import inspect
import re
from pathlib import Path

import pytest

import exdyna_mpi
from exdyna_mpi.sparsifiers.base import Sparsifier
from exdyna_mpi.sparsifiers.registry import REGISTRY

PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference.md"
#: options the base class takes from ``**options`` by hand (not in its signature or OPTIONS)
BASE_POPPED = ("wire_dtype",)


def _sections():
    """``{heading: text}`` for every ``##``/``###`` heading of the page."""
    out, head = {}, None
    for line in PAGE.read_text().splitlines():
        if line.startswith("#"):
            head = line.lstrip("#").strip()
            out[head] = []
        elif head is not None:
            out[head].append(line)
    return {h: "\n".join(lines) for h, lines in out.items()}


def _rows(text):
    """``{name: default cell}`` of the option tables in ``text`` (``**options`` as ``options``)."""
    rows = {}
    for m in re.finditer(r"^\| `(\*\*)?(\w+)` \|([^|]*)\|", text, re.M):
        rows[m.group(2)] = m.group(3).strip()
    return rows


def _check_default(where, name, cell, default):
    """A literal default cell must equal the code's default (``—``: required; others are prose)."""
    if default is inspect.Parameter.empty:
        assert cell in ("—", ""), f"{where}: `{name}` is required, the page gives the default {cell!r}"
        return
    try:
        value = ast.literal_eval(cell.strip("`"))
    except (ValueError, SyntaxError):
        return   # e.g. `MPI.COMM_WORLD` for None, a function's name
    assert value == default and type(value) is type(default), \
        f"{where}: `{name}` defaults to {default!r} in the code, {cell!r} on the page"


def _section(heads, key):
    found = [h for h in heads if key in h]
    assert found, f"docs/reference.md has no section for {key}"
    return found[0]


def test_every_public_name_is_on_the_page():
    torch_names = []
    try:
        import exdyna_mpi.adapters.torch as xt
        torch_names = list(xt.__all__)
    except ImportError:
        pass
    text = PAGE.read_text()
    missing = [n for n in list(exdyna_mpi.__all__) + torch_names if not re.search(rf"`{n}[`(]", text)]
    assert not missing, f"public names missing from docs/reference.md: {missing}"


def test_every_sparsifier_option_is_documented_with_its_default():
    sections = _sections()
    common = _rows(sections[_section(sections, "Options every sparsifier takes")])
    params = inspect.signature(Sparsifier.__init__).parameters
    for name, p in params.items():
        if name in ("self", "options"):
            continue
        assert name in common, f"the common option `{name}` is missing"
        _check_default("every sparsifier", name, common[name], p.default)
    for name in BASE_POPPED:
        assert name in common, f"the common option `{name}` is missing"
    for name, cls in sorted(REGISTRY.items()):
        head = _section(sections, f"`{name}`")
        rows = _rows(sections[head])
        for key, (default, _) in cls.OPTIONS.items():
            assert key in rows, f"`{name}`'s option `{key}` is missing from the section {head!r}"
            _check_default(name, key, rows[key], default)
    # no row names an option that none of its section's sparsifiers has
    for head, text in sections.items():
        names = re.findall(r"`(\w+)`", head)
        if names and all(n in REGISTRY for n in names):
            known = {k for n in names for k in REGISTRY[n].OPTIONS}
            stale = sorted(set(_rows(text)) - known)
            assert not stale, f"section {head!r} documents options that do not exist: {stale}"


def test_every_adapter_argument_is_documented_with_its_default():
    xt = pytest.importorskip("exdyna_mpi.adapters.torch", reason="PyTorch is not installed")
    sections = _sections()
    for obj in (xt.DistributedOptimizer, xt.ExDynaHookState, xt.DiLoCo, xt.GroupAveragingOptimizer):
        head = _section(sections, f"`{obj.__name__}(")
        rows = _rows(sections[head])
        params = {n: p for n, p in inspect.signature(obj).parameters.items() if n != "self"}
        for name, p in params.items():
            assert name in rows, f"{obj.__name__}'s argument `{name}` is missing from docs/reference.md"
            if p.kind is not inspect.Parameter.VAR_KEYWORD:
                _check_default(obj.__name__, name, rows[name], p.default)
        stale = sorted(set(rows) - set(params))
        assert not stale, f"{obj.__name__}: the page documents arguments that do not exist: {stale}"


def test_the_checks_fail_on_a_wrong_default():
    with pytest.raises(AssertionError, match="defaults to 1024"):
        _check_default("exdyna", "n_blocks", "`512`", 1024)
    with pytest.raises(AssertionError, match="is required"):
        _check_default("DiLoCo", "sync_every", "`16`", inspect.Parameter.empty)
    _check_default("x", "comm", "`MPI.COMM_WORLD`", None)   # prose for a None default passes
