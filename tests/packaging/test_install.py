"""The packaging lane: build an sdist and a wheel, install each into a fresh venv, and use it.

Every install runs in a new ``python -m venv``, once bare and once with ``wheel`` and an old
``setuptools`` already installed (as conda and many CI images have them; without a
``pyproject.toml`` that made ``pip install -e .`` take the legacy ``setup.py develop`` path, whose
installs lacked ``exdyna_mpi.kernels``). From a folder outside the source tree the installed
package is imported, its kernels are found where that kind of install puts them, and one rank
takes a step.

Slow (a venv and its dependencies per case, pip's cache helps) and needs PyPI or a mirror, so it
runs in its own lane: ``bash tests/run_all.sh --lane packaging``.
"""
import email
import os
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

# The step a user takes first: one rank, COMM_SELF; at P=1 the output holds the selected entries
# of the gradient itself and their count is the requested density.
STEP = """
import hashlib, json, numpy as np
import exdyna_mpi, exdyna_mpi.kernels as kernels
from mpi4py import MPI
n = 40_000
g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
out = exdyna_mpi.ExDyna(n, 0.01, MPI.COMM_SELF).step(g)
nz = np.flatnonzero(out)
print(json.dumps({"version": exdyna_mpi.__version__, "package": exdyna_mpi.__file__,
                  "kernels": kernels.__file__, "selected": int(nz.size),
                  "values_are_the_gradient": bool(np.array_equal(out[nz], g[nz])),
                  "sha256": hashlib.sha256(out.tobytes()).hexdigest()}))
"""


def _step_here():
    """The same step with the package of this source tree (the lane's own venv), for the bits."""
    p = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return __import__("json").loads(p.stdout.strip().splitlines()[-1])


def _run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=900, **kw)
    assert p.returncode == 0, f"{' '.join(map(str, cmd))}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


def _version():
    scope = {}
    with open(os.path.join(ROOT, "exdyna_mpi", "_version.py")) as f:
        exec(f.read(), scope)
    return scope["__version__"]


def _sources():
    """Every module of the package as the wheel must hold it: exdyna_mpi/..., its kernels included."""
    want = set()
    for d, dirs, files in os.walk(os.path.join(ROOT, "exdyna_mpi")):
        dirs[:] = [x for x in dirs if x != "__pycache__"]
        rel = os.path.relpath(d, ROOT)
        for f in files:
            if f.endswith(".py"):
                want.add(os.path.normpath(os.path.join(rel, f)))
    return want


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """``python -m build``: the sdist, then the wheel built from that sdist (as PyPI users get it)."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "build", "--outdir", str(out), ROOT])
    sdist = next(out.glob("*.tar.gz"))
    wheel = next(out.glob("*.whl"))
    return {"sdist": sdist, "wheel": wheel}


def test_the_wheel_holds_every_module_and_the_license(dists):
    with zipfile.ZipFile(dists["wheel"]) as z:
        names = set(z.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.message_from_bytes(z.read(f"{info}/METADATA"))
    py = {n for n in names if n.endswith(".py")}
    assert py == _sources(), f"missing {sorted(_sources() - py)}, extra {sorted(py - _sources())}"
    assert f"{info}/licenses/LICENSE" in names
    assert "exdyna_mpi/py.typed" in names   # PEP 561
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["Version"] == _version() and meta["Name"] == "exdyna_mpi"
    assert not any(n.startswith(("tests/", "jobs/")) for n in names)


def test_the_sdist_holds_the_sources_the_license_and_the_metadata(dists):
    with tarfile.open(dists["sdist"]) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for f in ("pyproject.toml", "README.md", "LICENSE", "exdyna_mpi/_version.py", "exdyna_mpi/py.typed",
              "exdyna_mpi/kernels/cpu.py"):
        assert f in names, f"{f} is not in the sdist"


@pytest.mark.parametrize("preinstalled", ["bare", "wheel+setuptools"])
@pytest.mark.parametrize("kind", ["wheel", "sdist", "editable"])
def test_a_fresh_venv_installs_imports_and_steps(dists, tmp_path, kind, preinstalled):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    if preinstalled != "bare":
        _run(pip + ["wheel", "setuptools<70"])
    target = {"wheel": str(dists["wheel"]), "sdist": str(dists["sdist"])}.get(kind, ROOT)
    _run(pip + (["-e"] if kind == "editable" else []) + [f"{target}[mpich]"])
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith(("PMI_", "PMIX_", "HYDRA_"))}
    got = __import__("json").loads(_run([py, "-c", STEP], cwd=outside, env=env).strip().splitlines()[-1])
    assert got["version"] == _version()
    # about 1 % selected, the values untouched, and the bits of this source tree's own step
    assert 360 <= got["selected"] <= 440 and got["values_are_the_gradient"], got
    assert got["sha256"] == _step_here()["sha256"], got
    if kind == "editable":
        assert got["kernels"] == os.path.join(ROOT, "exdyna_mpi", "kernels", "__init__.py"), got
        assert got["package"] == os.path.join(ROOT, "exdyna_mpi", "__init__.py"), got
    else:
        site = str(venv / "lib")
        assert got["kernels"].startswith(site) and got["kernels"].endswith("exdyna_mpi/kernels/__init__.py"), got
        assert got["package"].startswith(site), got
