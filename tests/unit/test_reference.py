"""docs/reference.md against the code: every public name, every sparsifier option, every adapter
argument is on the page, with the default the code has; no row names an option that does not exist."""
import ast
import importlib.util
import inspect
import re
from pathlib import Path

import pytest

import exdyna_mpi
from exdyna_mpi.sparsifiers import Option, Sparsifier, positive_int
from exdyna_mpi.sparsifiers.capabilities import Capabilities
from exdyna_mpi.sparsifiers.registry import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference.md"
EXAMPLE = ROOT / "examples" / "topk_sparsifier.py"
#: options the base class takes from ``**options`` by name (not in its signature or OPTIONS)
BASE_POPPED = ("wire_dtype", "output")


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


def option_problems(name, cls, sections):
    """What the page lacks of sparsifier class ``cls``'s own options (registered as ``name``): a
    section naming it, a row per option of ``OPTIONS``, each with the code's default. A class
    with no options of its own needs no section."""
    options = cls.OPTIONS
    if not options:
        return []
    found = [h for h in sections if f"`{name}`" in h]
    if not found:
        return [f"docs/reference.md has no section for `{name}`, whose options are {sorted(options)}"]
    rows = _rows(sections[found[0]])
    problems = []
    for key, option in options.items():
        if key not in rows:
            problems.append(f"`{name}`'s option `{key}` is missing from the section {found[0]!r}")
            continue
        try:
            _check_default(name, key, rows[key], option.default)
        except AssertionError as e:
            problems.append(str(e))
    return problems


def _example():
    spec = importlib.util.spec_from_file_location("example_topk_sparsifier", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.ExampleTopK


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
    example = _example()
    problems = [p for name, cls in sorted(REGISTRY.items()) for p in option_problems(name, cls, sections)]
    problems += option_problems(example.name, example, sections)
    assert not problems, "; ".join(problems)
    # no row names an option that none of its section's sparsifiers has
    for head, text in sections.items():
        names = re.findall(r"`(\w+)`", head)
        if names and all(n in REGISTRY for n in names):
            known = {k for n in names for k in REGISTRY[n].OPTIONS}
            stale = sorted(set(_rows(text)) - known)
            assert not stale, f"section {head!r} documents options that do not exist: {stale}"


def test_an_undocumented_option_fails_the_check():
    """A sparsifier that gains an option the page lacks, or whose default moved, is reported; a
    new sparsifier with options and no section is too."""
    sections = _sections()
    topk = REGISTRY["topk"]

    class Planted(topk):
        OPTIONS = {**topk.OPTIONS, "planted": Option(3, positive_int, "an option the page lacks")}

    class Moved(topk):
        OPTIONS = {**topk.OPTIONS, "max_loss": Option(0.5, lambda v: None, "a default the page lacks")}

    class Unlisted(Sparsifier):
        name = "unlisted"
        CAPABILITIES = Capabilities(device_step=False)   # named in no error text of other tests
        OPTIONS = {"period": Option(4, positive_int, "an option of a sparsifier with no section")}

    assert not option_problems("topk", topk, sections)
    assert option_problems("topk", Planted, sections) == [
        "`topk`'s option `planted` is missing from the section '`topk`, `cltk`, `threshold`'"]
    assert "defaults to 0.5 in the code" in " ".join(option_problems("topk", Moved, sections))
    assert "no section for `unlisted`" in " ".join(option_problems("unlisted", Unlisted, sections))


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
