#!/usr/bin/env bash
# The GPU lane in one command, for a machine with a CUDA GPU:
#   venv (jobs/env.sh) + CuPy and Numba CUDA with the toolkit wheels, then
#   1. tests/gpu serially and under mpiexec -n 2 (CuPy buffers, real kernels, staged + direct transport)
#   2. tests/cudasim (the simulator lane, as CI runs it)
#   3. jobs/gpu_static.py (sm_90 registers/spills/SASS per element vs jobs/gpu_budgets.json)
#   4. jobs/bench_gpu.py (table on stdout, JSON under $out)
# Usage: bash jobs/gpu_lane.sh [bench_gpu.py args, e.g. --numel 1e7,1e8 --reps 50]
# Env: EXDYNA_GPU_OUT (default out/gpu), EXDYNA_MPI_TIMEOUT (default 900 s), EXDYNA_CUDA_AWARE.
set -uo pipefail
cd "$(dirname "$0")/.."
source jobs/env.sh || exit 1
python -m pip install -q --disable-pip-version-check cupy-cuda12x "numba-cuda[cu12]" \
    || { echo "gpu_lane: FAILED: pip install cupy-cuda12x numba-cuda[cu12] (error above)" >&2; exit 1; }
source tests/lanes.sh
if ! gpu_visible; then
    echo "gpu_lane: no CUDA device visible to CuPy" >&2
    exit 1
fi
out=${EXDYNA_GPU_OUT:-out/gpu}
mkdir -p "$out"
PYTEST="$PYTEST -rs"
# shellcheck disable=SC2086
lane gpu python $PYTEST tests/gpu --with-mpi --junitxml="$out/gpu.xml"
mpi_lane gpu-mpi-2 2 tests/gpu --junitxml="$out/gpumpi2.xml"
# shellcheck disable=SC2086
lane cudasim env NUMBA_ENABLE_CUDASIM=1 python $PYTEST tests/cudasim --junitxml="$out/cudasim.xml"
lane static env -u NUMBA_ENABLE_CUDASIM python jobs/gpu_static.py --json "$out/gpu_static.json"
lane bench python jobs/bench_gpu.py --json "$out/bench_gpu.json" "$@"
exit $status
