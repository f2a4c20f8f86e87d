# Source me (bash): make and activate the project's virtual environment, installing what is missing.
#
#   EXDYNA_VENV   where the venv lives            (default: <repo>/.venv)
#   EXDYNA_MPI    "wheel" installs the PyPI mpich wheel (default); "system" uses the MPI that the
#                 mpi4py already in the environment was built against (clusters: module load first)
#   EXDYNA_TORCH  torch requirement to install    (default: torch==2.13.0, the CPU wheel here; "" skips)
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${EXDYNA_VENV:-$_root/.venv}"
_mpi="${EXDYNA_MPI:-wheel}"
_torch="${EXDYNA_TORCH-torch==2.13.0}"
if [ ! -x "$_venv/bin/python" ]; then
    python3 -m venv "$_venv" || return 1 2>/dev/null || exit 1
fi
# shellcheck disable=SC1091
. "$_venv/bin/activate"
_extras="test,jobs"
[ "$_mpi" = "wheel" ] && _extras="$_extras,mpich"
_want="$(cat "$_root/setup.py") $_extras $_torch"
_stamp="$_venv/.exdyna-installed"
if [ ! -f "$_stamp" ] || [ "$(cat "$_stamp")" != "$_want" ]; then
    echo "[env] installing exdyna_mpi[$_extras] $_torch into $_venv" >&2
    python -m pip install -q --disable-pip-version-check -e "$_root[$_extras]" $_torch 2>&1 \
        | grep -v -e "^WARNING: Location" -e "is ignored" >&2
    python -c "import exdyna_mpi, mpi4py" && printf '%s' "$_want" > "$_stamp"
fi
# MPICH busy-polls; with more ranks than cores these keep oversubscribed runs fast.
export MPIR_CVAR_CH4_PROGRESS_THROTTLE="${MPIR_CVAR_CH4_PROGRESS_THROTTLE:-1}"
export MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT="${MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT:-16}"
export PYTHONUNBUFFERED=1
unset _root _venv _mpi _torch _extras _want _stamp
