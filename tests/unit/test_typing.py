"""The package is typed (PEP 561): ``exdyna_mpi/py.typed`` ships, and pyproject.toml configures the
type checker that the lint lane runs (``python -m mypy exdyna_mpi``; not run here)."""
import os

import pytest

import exdyna_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _pyproject():
    tomllib = pytest.importorskip("tomllib")   # Python >= 3.11 (test_pyproject_has_a_mypy_section: any)
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def test_the_source_tree_marks_the_package_typed():
    marker = os.path.join(ROOT, "exdyna_mpi", "py.typed")
    assert os.path.isfile(marker)
    assert os.path.getsize(marker) == 0


def test_the_imported_package_holds_the_marker():
    assert os.path.isfile(os.path.join(os.path.dirname(exdyna_mpi.__file__), "py.typed"))


def test_the_marker_is_package_data():
    assert "py.typed" in _pyproject()["tool"]["setuptools"]["package-data"]["exdyna_mpi"]


def test_pyproject_configures_mypy_not_strict():
    conf = _pyproject()["tool"]["mypy"]
    assert conf["ignore_missing_imports"] is True
    assert not conf.get("strict", False)
    test_extra = _pyproject()["project"]["optional-dependencies"]["test"]
    assert any(r.startswith("mypy==") for r in test_extra)


def test_pyproject_has_a_mypy_section():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        lines = [line.strip() for line in f]
    assert "[tool.mypy]" in lines
