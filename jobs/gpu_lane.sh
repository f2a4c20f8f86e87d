#!/usr/bin/env bash
# The GPU lane in one command, for a machine with a CUDA GPU:
#   venv (jobs/env.sh) + CuPy and Numba CUDA with the toolkit wheels, then
#   1. tests/gpu + the contract (tests/mpi/test_contract.py, whose backends include the GPU) serially
#      and under mpiexec -n 2 (CuPy buffers, real kernels, staged + direct transport)
#   2. tests/cudasim (the simulator lane, as CI runs it)
#   3. jobs/gpu_static.py (sm_90 registers/spills/SASS per element vs jobs/gpu_budgets.json)
#   4. jobs/bench_gpu.py (table on stdout, JSON under $out)
#   5. hashes (not in the default lanes): jobs/bit_hashes.py at P=2 for ExDyna's settings and MiCRO,
#      once on the CPU and twice on the GPU, compared (the CUDA path must give the CPU's bits, run
#      after run). EXDYNA_HASH_STREAMS (default "skewed,ar0.9", synthetic: no torch needed; "cnn16,mlp"
#      records from training first unless EXDYNA_STREAMS holds them), EXDYNA_HASH_STEPS (default 20)
# Usage: bash jobs/gpu_lane.sh [bench_gpu.py args, e.g. --numel 1e7,1e8 --reps 50]
# Env: EXDYNA_GPU_OUT (default out/gpu), EXDYNA_MPI_TIMEOUT (default 900 s), EXDYNA_CUDA_AWARE,
#      EXDYNA_GPU_LANES  the lanes to run (default "gpu gpu-mpi-2 cudasim static bench"),
#      EXDYNA_WHEELS     offline node (no PyPI): a folder of wheels (mpich, mpi4py, pytest-mpi, ...).
#                        The venv then sees this Python's own packages (CuPy, numba-cuda, torch from
#                        the node's image) and installs the project and those wheels with --no-index.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${EXDYNA_WHEELS:-}" ]; then
    # A venv of the node's python3 that also sees that python's packages, after its own (a .pth file:
    # the node's python3 may itself be a venv, whose packages --system-site-packages would not reach).
    # Their own .pth hooks do not run, so numba-cuda must be among the wheels: its hook redirects
    # numba.cuda (seen on an H100 image: numba-cuda 0.30.4 beside numpy 2.5, which it cannot import,
    # so the hook failed and numba.cuda fell back to the built-in target; numpy 2.4 among the wheels).
    venv=${EXDYNA_VENV:-/tmp/exdyna-venv}
    node_site=$(python3 -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))') \
        && rm -rf "$venv" && python3 -m venv "$venv" && . "$venv/bin/activate" \
        && echo "$node_site" >"$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/node-image.pth" \
        || { echo "gpu_lane: FAILED: python3 -m venv $venv" >&2; exit 1; }
    python -m pip install -q --no-index --no-deps --ignore-installed --disable-pip-version-check "$EXDYNA_WHEELS"/*.whl \
        || { echo "gpu_lane: FAILED: offline install from $EXDYNA_WHEELS (error above)" >&2; exit 1; }
    # No build isolation offline, so the venv's setuptools builds the project: pyproject.toml's
    # PEP 639 licence fields need 77 or newer.
    python -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
        || { echo "gpu_lane: FAILED: setuptools >= 77 must be among the wheels in $EXDYNA_WHEELS" >&2; exit 1; }
    python -m pip install -q --no-index --no-deps --no-build-isolation --use-pep517 --disable-pip-version-check -e . \
        || { echo "gpu_lane: FAILED: offline install from $EXDYNA_WHEELS (error above)" >&2; exit 1; }
    export PYTHONUNBUFFERED=1
else
    source jobs/env.sh || exit 1
    python -m pip install -q --disable-pip-version-check cupy-cuda12x "numba-cuda[cu12]" \
        || { echo "gpu_lane: FAILED: pip install cupy-cuda12x numba-cuda[cu12] (error above)" >&2; exit 1; }
fi
source tests/lanes.sh
if ! gpu_visible; then
    echo "gpu_lane: no CUDA device visible to CuPy" >&2
    python -c "import exdyna_mpi.arrays" || true
    exit 1
fi
out=${EXDYNA_GPU_OUT:-out/gpu}
lanes=" ${EXDYNA_GPU_LANES:-gpu gpu-mpi-2 cudasim static bench} "
mkdir -p "$out"
PYTEST="$PYTEST -rs"
on() { [[ $lanes == *" $1 "* ]]; }
# shellcheck disable=SC2086
on gpu && lane gpu python $PYTEST tests/gpu tests/mpi/test_contract.py --with-mpi --junitxml="$out/gpu.xml"
on gpu-mpi-2 && mpi_lane gpu-mpi-2 2 tests/gpu tests/mpi/test_contract.py --junitxml="$out/gpumpi2.xml"
# shellcheck disable=SC2086
on cudasim && lane cudasim env NUMBA_ENABLE_CUDASIM=1 python $PYTEST tests/cudasim --junitxml="$out/cudasim.xml"
on static && lane static env -u NUMBA_ENABLE_CUDASIM python jobs/gpu_static.py --json "$out/gpu_static.json"
on bench && lane bench python jobs/bench_gpu.py --json "$out/bench_gpu.json" "$@"
hash_run() {   # $1 device, $2 tag, then environment assignments for the run
    local dev=$1 tag=$2; shift 2
    env "$@" timeout -k 10 "$MPI_TIMEOUT" mpiexec -n 2 python -m mpi4py jobs/bit_hashes.py --device "$dev" \
        --streams "${EXDYNA_HASH_STREAMS:-skewed,ar0.9}" --steps "${EXDYNA_HASH_STEPS:-20}" \
        --sparsifiers exdyna,micro --out "$out/hashes_$tag.jsonl" >/dev/null
}
hashes() {
    hash_run cpu cpu && hash_run cuda cuda && hash_run cuda cuda_again || return 1
    python jobs/bit_hashes.py --compare "$out"/hashes_cpu.jsonl "$out"/hashes_cuda.jsonl "$out"/hashes_cuda_again.jsonl \
        && return 0
    # a difference: which GPU-only piece removes it (the shared-memory kernels, Numba's own launch,
    # synchronous launches), each against the CPU
    local probe
    for probe in EXDYNA_CUDA_KERNELS=safe EXDYNA_CUDA_LAUNCH=numba CUDA_LAUNCH_BLOCKING=1; do
        echo "--- with $probe"
        hash_run cuda "cuda_${probe%%=*}" "$probe" \
            && python jobs/bit_hashes.py --compare "$out"/hashes_cpu.jsonl "$out/hashes_cuda_${probe%%=*}.jsonl"
    done
    return 1
}
on hashes && lane hashes hashes
exit $status
