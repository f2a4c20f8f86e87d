# Source me (bash): the lane runner shared by tests/run_all.sh and jobs/gpu_lane.sh.
#
#   lane NAME CMD...        run CMD, print its rc and time; a failing lane sets status=1 (rc 5,
#                           "no tests collected", is not a failure)
#   mpi_lane NAME N ARGS... pytest ARGS on N ranks: under `timeout` (a mismatched collective spins
#                           forever) and `python -m mpi4py` (a rank that dies outside a test aborts
#                           the others instead of leaving them in a collective)
# Reads/sets: status (0 until a lane fails), PYTEST (the pytest command line), MPI_TIMEOUT (seconds).
status=${status:-0}
PYTEST=${PYTEST:-"-m pytest -p no:cacheprovider --color=no -q"}
MPI_TIMEOUT=${EXDYNA_MPI_TIMEOUT:-900}

lane() {
    local name=$1; shift
    echo "=== lane $name: $*"
    local t0=$SECONDS
    "$@"
    local rc=$?
    echo "=== lane $name: rc=$rc in $((SECONDS - t0)) s"
    if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then status=1; fi
    return 0
}

mpi_lane() {
    local name=$1 n=$2; shift 2
    # shellcheck disable=SC2086
    lane "$name" timeout -k 10 "$MPI_TIMEOUT" mpiexec -n "$n" python -m mpi4py $PYTEST --with-mpi "$@"
}

gpu_visible() {
    python -c "import sys, exdyna_mpi.arrays as a; sys.exit(0 if a.gpu_available() else 1)" 2>/dev/null
}
