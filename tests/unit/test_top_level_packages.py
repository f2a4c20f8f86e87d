"""The repository's root holds no importable package but the library's own and the tests'.

The root is on ``sys.path`` whenever Python starts in the checkout (``python -m pytest``,
``python -m mpi4py -m pytest``, a shell), and it comes before site-packages there: a top-level folder
with an ``__init__.py`` is then imported in place of any installed package of the same name. The
kernels' source once sat in a top-level ``kernels/`` (installed as ``exdyna_mpi.kernels``); it hid
Hugging Face's ``kernels`` package, which transformers imports, and importing a transformers model
failed. A folder without ``__init__.py`` (``jobs/``, ``docs/``) shadows nothing: a namespace portion
gives way to a regular package found later on the path.

``exdyna_mpi/`` is the library. ``tests/`` is a package so that test modules import each other as
``tests.conftest``, ``tests.launch``; nothing the library or its dependencies import is named so."""
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: the top-level packages the repository is meant to have
ALLOWED = {"exdyna_mpi", "tests"}


def top_level_packages(root):
    """The names of the folders directly under ``root`` that are regular packages (an ``__init__.py``);
    hidden folders (``.git``, ``.venv``) are left out."""
    return {p.name for p in pathlib.Path(root).iterdir()
            if p.is_dir() and not p.name.startswith(".") and (p / "__init__.py").is_file()}


def test_no_top_level_package_but_the_library_and_the_tests():
    found = top_level_packages(ROOT)
    assert "exdyna_mpi" in found and "tests" in found, f"the scan is broken: {sorted(found)}"
    extra = sorted(found - ALLOWED)
    assert not extra, (f"top-level packages {extra}: each hides an installed package of the same name whenever "
                       "the checkout's root is on sys.path; move it under exdyna_mpi/ (or jobs/, without an "
                       "__init__.py)")


def test_the_check_sees_a_top_level_package(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "common.py").write_text("")
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "__init__.py").write_text("")
    (tmp_path / "setup.py").write_text("")
    assert top_level_packages(tmp_path) == {"kernels"}
