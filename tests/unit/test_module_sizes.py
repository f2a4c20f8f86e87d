"""Modules stay small enough to read whole: a library module (``exdyna_mpi/``, its kernels included)
at most 500 lines, a job (``jobs/``) at most 600. A longer one is split by what it holds."""
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMITS = {"exdyna_mpi": 500, "jobs": 600}


def _sources():
    for top, limit in LIMITS.items():
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, limit


def too_long(text, limit):
    """The line count of ``text`` where it is over ``limit``, else None."""
    n = len(text.splitlines())
    return n if n > limit else None


def _id(v):
    return str(v.relative_to(ROOT)) if isinstance(v, pathlib.Path) else ""


@pytest.mark.parametrize("path,limit", list(_sources()), ids=_id)
def test_module_is_at_most_its_limit(path, limit):
    n = too_long(path.read_text(), limit)
    assert n is None, f"{path.relative_to(ROOT)} has {n} lines, over {limit}: split it by what it holds"


def test_the_check_counts_lines():
    assert too_long("x = 1\n" * 501, 500) == 501
    assert too_long("x = 1\n" * 500, 500) is None
