#!/usr/bin/env bash
# The GPU lane in one command, for a machine with a CUDA GPU:
#   venv (jobs/env.sh) + CuPy and Numba CUDA with the toolkit wheels, then
#   1. tests/gpu serially and under mpiexec -n 2 (CuPy buffers, real kernels, staged + direct transport)
#   2. tests/cudasim (the simulator lane, as CI runs it)
#   3. jobs/bench_gpu.py (table on stdout, JSON under $out)
# Usage: bash jobs/gpu_lane.sh [bench_gpu.py args, e.g. --numel 1e7,1e8 --reps 50]
# Env: EXDYNA_GPU_OUT (default out/gpu), EXDYNA_MPI_TIMEOUT (default 900 s), EXDYNA_CUDA_AWARE.
set -uo pipefail
cd "$(dirname "$0")/.."
source jobs/env.sh || exit 1
python -m pip install -q --disable-pip-version-check cupy-cuda12x "numba-cuda[cu12]" || exit 1
if ! python -c "import sys, exdyna_mpi._ops as o; sys.exit(0 if o.gpu_available() else 1)"; then
    echo "gpu_lane: no CUDA device visible to CuPy" >&2
    exit 1
fi
out=${EXDYNA_GPU_OUT:-out/gpu}
mpi_timeout=${EXDYNA_MPI_TIMEOUT:-900}
mkdir -p "$out"
status=0
step() {  # step NAME CMD...
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@"
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; fi
}
py="python -m pytest -p no:cacheprovider --color=no -q -rs"
step gpu $py tests/gpu --with-mpi --junitxml="$out/gpu.xml"
step gpu-mpi-2 timeout -k 10 "$mpi_timeout" mpiexec -n 2 $py tests/gpu --with-mpi \
    --junitxml="$out/gpumpi2.xml"
step cudasim env NUMBA_ENABLE_CUDASIM=1 $py tests/cudasim --junitxml="$out/cudasim.xml"
step bench python jobs/bench_gpu.py --json "$out/bench_gpu.json" "$@"
exit $status
