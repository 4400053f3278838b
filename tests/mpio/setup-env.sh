#!/usr/bin/env bash
# Build a private environment with *parallel* HDF5 for the loader's driver="mpio" test:
# Debian's python3-h5py-mpi and python3-mpi4py (Debian's Open MPI 4.1) for the system
# python3.11, plus the torch wheel, all under one directory. Nothing is installed into the
# system: the .deb files are downloaded and unpacked into $DIR/root (so Debian's libmpi,
# libibverbs, libpsm2, ... never land in the default library path, where they could change
# how the main .venv's Open MPI wheel starts), and only the wrappers $DIR/bin/python and
# $DIR/bin/mpiexec point at them. Idempotent: a finished environment is left alone.
#
#   tests/mpio/setup-env.sh [DIR]     (default $HPCTRAIN_MPIO_ENV or ~/.cache/hpctrain/mpio-env)
#   HPCTRAIN_REQUIRE_MPIO=1 .venv/bin/pytest -q tests/test_data_mpio.py
#
# Needs: Debian 12 (bookworm) apt lists (`apt-get update` done), /usr/bin/python3.11 with
# the venv module, and a pip that can install torch==2.13.0 (a local wheel or PyPI).
set -euo pipefail

DIR="${1:-${HPCTRAIN_MPIO_ENV:-$HOME/.cache/hpctrain/mpio-env}}"
STAMP="hpctrain-mpio-env v1: python3-h5py-mpi python3-mpi4py torch==2.13.0 pytest pytest-timeout"
PY=/usr/bin/python3.11

if [[ -f "$DIR/.complete" && "$(cat "$DIR/.complete")" == "$STAMP" ]]; then
    echo "mpio environment ready: $DIR"
    exit 0
fi
for tool in apt-get dpkg-deb "$PY"; do
    command -v "$tool" >/dev/null || { echo "setup-env.sh: $tool not found (needs Debian 12 with python3.11)" >&2; exit 2; }
done

rm -rf "$DIR.tmp"
mkdir -p "$DIR.tmp/debs" "$DIR.tmp/root" "$DIR.tmp/bin"
cd "$DIR.tmp/debs"

# Exactly the packages this system lacks for them (the rest are already installed here).
PKGS=$(apt-get install -s --no-install-recommends python3-h5py-mpi python3-mpi4py 2>/dev/null | awk '/^Inst /{print $2}')
if [[ -z "$PKGS" ]]; then
    echo "setup-env.sh: apt-get found nothing to fetch (are python3-h5py-mpi and python3-mpi4py installed system-wide?" \
         "then use them directly) -- HINT: apt-get update" >&2
    exit 2
fi
echo "downloading: $PKGS"
# shellcheck disable=SC2086
apt-get download $PKGS >/dev/null
for deb in *.deb; do dpkg-deb -x "$deb" "$DIR.tmp/root"; done

"$PY" -m venv "$DIR.tmp/venv"
SITE=$("$DIR.tmp/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# Debian's numpy/h5py/mpi4py come first on sys.path (the final path: the directory is renamed below).
echo "$DIR/root/usr/lib/python3/dist-packages" > "$SITE/00-debian-mpio.pth"
# python -m pip (and later python -m pytest): the venv is renamed below, which breaks
# the shebangs of its console scripts, not the interpreter.
"$DIR.tmp/venv/bin/python" -m pip install -q torch==2.13.0 pytest pytest-timeout

R="$DIR/root"
cat > "$DIR.tmp/bin/env.sh" <<ENV
# Sourced by the wrappers: Debian's Open MPI and parallel HDF5 from $R.
export OPAL_PREFIX="$R/usr"
export LD_LIBRARY_PATH="$R/usr/lib/x86_64-linux-gnu:$R/lib/x86_64-linux-gnu:$R/usr/lib/x86_64-linux-gnu/openmpi/lib:$R/usr/lib/x86_64-linux-gnu/blas:$R/usr/lib/x86_64-linux-gnu/lapack:$R/usr/lib/libpsm1\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export PATH="$DIR/bin:$R/usr/bin:\$PATH"
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_mtl=^ofi,psm,psm2 OMPI_MCA_osc=^ucx
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export H5PY_ALWAYS_USE_MPI=1  # Debian's h5py picks its MPI build only under a launcher otherwise
ENV
cat > "$DIR.tmp/bin/python" <<WRAP
#!/usr/bin/env bash
source "$DIR/bin/env.sh"
exec "$DIR/venv/bin/python" "\$@"
WRAP
cat > "$DIR.tmp/bin/mpiexec" <<WRAP
#!/usr/bin/env bash
source "$DIR/bin/env.sh"
exec "$R/usr/bin/orterun" "\$@"
WRAP
chmod +x "$DIR.tmp/bin/python" "$DIR.tmp/bin/mpiexec"
cd /
rm -rf "$DIR.tmp/debs"

rm -rf "$DIR"
mv "$DIR.tmp" "$DIR"
"$DIR/bin/mpiexec" -n 2 "$DIR/bin/python" -c \
    'import h5py, torch; from mpi4py import MPI; assert h5py.get_config().mpi, "h5py without MPI"; assert MPI.COMM_WORLD.size == 2'
echo "$STAMP" > "$DIR/.complete"
echo "mpio environment ready: $DIR"
