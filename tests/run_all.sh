#!/usr/bin/env bash
# The whole test suite: sets up the venv (jobs/env.sh), then runs every lane and fails if any fails.
#   1. serial: unit tests and the MPI tests at P=1
#   2. cudasim: CUDA kernels under the Numba CUDA simulator
#   3. mpi: the MPI tests at P=2, 3, 4, each mpiexec under `timeout` (a deadlock fails, never hangs)
#   4. gpu: only where CuPy sees a CUDA device
# Usage: bash tests/run_all.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
source jobs/env.sh || exit 1
source tests/lanes.sh
out=${EXDYNA_TEST_OUT:-out/tests}
rm -rf "$out" && mkdir -p "$out"
start=$SECONDS
# shellcheck disable=SC2086
lane serial python $PYTEST tests/unit tests/mpi --with-mpi --junitxml="$out/serial.xml" "$@"
# shellcheck disable=SC2086
lane cudasim env NUMBA_ENABLE_CUDASIM=1 python $PYTEST tests/cudasim --junitxml="$out/cudasim.xml" "$@"
for np in 2 3 4; do
    mpi_lane "mpi-$np" $np tests/mpi --junitxml="$out/mpi$np.xml" "$@"
done
if gpu_visible; then
    # shellcheck disable=SC2086
    lane gpu python $PYTEST tests/gpu --with-mpi --junitxml="$out/gpu.xml" "$@"
    mpi_lane gpu-mpi-2 2 tests/gpu --junitxml="$out/gpumpi2.xml" "$@"
else
    echo "=== lane gpu: skipped, no CUDA device visible to CuPy"
fi
echo "=== all lanes: $((SECONDS - start)) s"
python tests/summarize.py "$out" || status=1
exit $status
