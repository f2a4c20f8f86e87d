# Source me (bash): make and activate the project's virtual environment, installing what is missing.
# Safe under `set -euo pipefail`: a failure prints what failed (with pip's own error) and returns 1.
#
#   EXDYNA_VENV   where the venv lives            (default: <repo>/.venv)
#   EXDYNA_MPI    "wheel" installs the PyPI mpich wheel (default); "system" uses the MPI that the
#                 mpi4py already in the environment was built against (clusters: module load first)
#   EXDYNA_TORCH  torch requirement to install    (default: torch==2.13.0, the CPU wheel here; "" skips)
_exdyna_env() {
    local root venv mpi torch extras want stamp log
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="${EXDYNA_VENV:-$root/.venv}"
    mpi="${EXDYNA_MPI:-wheel}"
    torch="${EXDYNA_TORCH-torch==2.13.0}"
    if [ ! -x "$venv/bin/python" ]; then
        echo "[env] creating $venv" >&2
        if ! python3 -m venv "$venv"; then
            echo "[env] FAILED: 'python3 -m venv $venv' (Debian/Ubuntu: install python3-venv)" >&2
            return 1
        fi
    fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    extras="test,jobs"
    [ "$mpi" = "wheel" ] && extras="$extras,mpich"
    want="$(cat "$root/setup.py") $extras $torch"
    stamp="$venv/.exdyna-installed"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "[env] installing exdyna_mpi[$extras] $torch into $venv" >&2
        log="$venv/.exdyna-install.log"
        # shellcheck disable=SC2086
        if ! python -m pip install -q --disable-pip-version-check -e "$root[$extras]" $torch >"$log" 2>&1; then
            grep -v -e "^WARNING: Location" -e "is ignored" "$log" >&2 || true
            echo "[env] FAILED: pip install -e '$root[$extras]' $torch (full log: $log)" >&2
            return 1
        fi
        if ! python -c "import exdyna_mpi, mpi4py.MPI" >>"$log" 2>&1; then
            tail -n 20 "$log" >&2
            echo "[env] FAILED: the install finished but 'import exdyna_mpi, mpi4py.MPI' does not work (log: $log)" >&2
            return 1
        fi
        printf '%s' "$want" >"$stamp"
    fi
}
_exdyna_env || return 1 2>/dev/null || exit 1
unset -f _exdyna_env
# MPICH busy-polls; with more ranks than cores these keep oversubscribed runs fast.
export MPIR_CVAR_CH4_PROGRESS_THROTTLE="${MPIR_CVAR_CH4_PROGRESS_THROTTLE:-1}"
export MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT="${MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT:-16}"
export PYTHONUNBUFFERED=1
