#!/usr/bin/env bash
# Train on one node with mpiexec: sets up the venv (jobs/env.sh), then runs jobs/train.py on NP ranks.
#
#   bash jobs/run_train.sh                                   # 4 ranks, CNN on digits, ExDyna d=0.01
#   NP=8 bash jobs/run_train.sh --compare dense,exdyna --densities 0.01,0.001 --epochs 30
#   bash jobs/run_train.sh --model big --epochs 1            # >= 10M parameters, synthetic data
#   bash jobs/run_train.sh --checkpoint-every 50 --resume     # checkpoints under out/train; rerun resumes
#
# Ranks run under `python -m mpi4py`: an uncaught exception on any rank aborts the whole job within
# a second, with that rank's traceback, instead of leaving the others waiting in a collective.
#
# Environment knobs:
#   NP                     ranks (default 4)
#   TRAIN_TIMEOUT          seconds before the whole job is killed (default 3600). A collective that
#                          one rank never enters spins forever in MPI; the timeout turns it into a failure.
#   EXDYNA_MPI=system      use the site MPI that mpi4py was built against instead of the PyPI mpich wheel
#                          (module load your MPI first); see jobs/env.sh (also EXDYNA_VENV, EXDYNA_TORCH).
#   OMP_NUM_THREADS        threads per rank for OpenMP/Numba; jobs/train.py sets torch's threads to
#                          cores / ranks-on-this-node (1 when ranks >= cores) unless --threads is given.
#   MPIR_CVAR_CH4_PROGRESS_THROTTLE=1, MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT=16
#                          (set by env.sh) MPICH busy-polls; with more ranks than cores these make
#                          oversubscribed runs ~15x faster. Harmless otherwise; ignored by Open MPI.
#   MPIEXEC_ARGS           extra mpiexec flags (Open MPI as root on a laptop: "--allow-run-as-root --oversubscribe")
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck disable=SC1091
source jobs/env.sh
np_="${NP:-4}"
if [ -z "${OMP_NUM_THREADS:-}" ]; then
    cores=$(nproc)
    export OMP_NUM_THREADS=$(( cores / np_ > 0 ? cores / np_ : 1 ))
fi
# shellcheck disable=SC2086
exec timeout -k 30 "${TRAIN_TIMEOUT:-3600}" mpiexec -n "$np_" ${MPIEXEC_ARGS:-} python -m mpi4py jobs/train.py "$@"
