"""jobs/e2e_methods.py: the method table of jobs/e2e.py (no MPI, no torch): every row fits its kind and
serialises to plain JSON, rows that do not fit are refused, the recipe follows the run's arguments,
and ``--help`` names every method in the table's order."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from tests.launch import ROOT

sys.path.insert(0, os.path.join(ROOT, "jobs"))
from e2e_methods import DEFAULT_METHODS, METHODS, REFERENCE, Kind, MethodSpec, Outer, Recipe  # noqa: E402


def test_every_row_is_plain_json_and_names_existing_methods():
    assert METHODS[REFERENCE].kind is Kind.DDP and METHODS[REFERENCE].default
    assert DEFAULT_METHODS == tuple(m for m, s in METHODS.items() if s.default) and REFERENCE in DEFAULT_METHODS
    for name, spec in METHODS.items():
        row = spec.as_dict()
        assert row["name"] == name and row["kind"] == spec.kind.value, name
        assert json.loads(json.dumps(row)) == row, name
        if spec.same_arithmetic is not None:
            twin = METHODS[spec.same_arithmetic]
            assert twin.kind is spec.kind and twin.sparsifier == spec.sparsifier and twin.adam == spec.adam, name
    assert METHODS["sloco-h16"].as_dict()["outer"] == "sgd"
    assert METHODS["exdyna-dw"].as_dict()["recipe"] == "density-warmup"


def test_the_options_cannot_change_after_construction():
    spec = METHODS["exdyna-q"]
    with pytest.raises(TypeError):
        spec.options["max_imbalance"] = 0.5
    assert spec.options["max_imbalance"] == 0.05


@pytest.mark.parametrize("fields, message", [
    (dict(kind=Kind.LIBRARY), "sparsifier missing"),
    (dict(kind=Kind.DDP, h=4), "h set"),
    (dict(kind=Kind.DILOCO, h=4, outer=Outer.SGD), "Nesterov"),
    (dict(kind=Kind.DILOCO_LIB, h=4, sparsifier="exdyna", recipe=Recipe.ADAM_WARMUP), "recipe"),
    (dict(kind=Kind.DDP_HOOK, sparsifier="exdyna"), "scope missing"),
    (dict(kind=Kind.LIBRARY, sparsifier="exdyna", accumulate=True), "DDP's"),
    (dict(kind=Kind.WAGMA, adam="demo"), "Adam path"),
    (dict(kind=Kind.LIBRARY, sparsifier="exdyna", optimizer="adam"), "not sgd or adamw"),
    (dict(kind=Kind.FSDP_LIB), "sparsifier missing"),
    (dict(kind=Kind.FSDP, sparsifier="exdyna"), "sparsifier set"),
])
def test_a_row_that_does_not_fit_its_kind_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        MethodSpec("x", description="d", **fields)


def test_the_recipe_follows_the_run_s_arguments():
    args = SimpleNamespace(momentum=0.8, steps=80, adam_warmup=7)
    assert Recipe.MOMENTUM_CORRECTION.options(args) == {"momentum_correction": 0.8}
    assert Recipe.DENSITY_WARMUP.options(args) == {"density_warmup": (0.25, 0.0625, 0.015625),
                                                   "density_warmup_steps": 10}
    assert Recipe.DENSITY_WARMUP.options(SimpleNamespace(steps=3))["density_warmup_steps"] == 1
    assert Recipe.ADAM_WARMUP.options(args) == {"warmup_steps": 7}


def test_help_lists_every_method_in_the_table_s_order():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "jobs", "e2e.py"), "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    # argparse wraps the help at spaces and hyphens: compare without the whitespace
    want = f"of {', '.join(METHODS)} (default: {', '.join(DEFAULT_METHODS)})"
    assert "".join(want.split()) in "".join(p.stdout.split())
