# Sourced by scripts/test, scripts/demo and the benchmarks: make a fresh machine ready.
# Installs the Debian packages faultfs needs when they are absent, loads the fuse module,
# and keeps .venv in step with pyproject.toml (re-installs when it changes).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

need_pkgs=()
# scripts/test adds the tools its tests drive through real mounts (FAULTFS_EXTRA_PKGS)
for pkg in fuse3 libfuse3-dev pkg-config gcc ${FAULTFS_EXTRA_PKGS:-}; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need_pkgs+=("$pkg")
done
PY="${PYTHON:-python3}"
"$PY" -c 'import sysconfig,os,sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)' \
    || need_pkgs+=(python3-dev)
"$PY" -c 'import venv, ensurepip' 2>/dev/null || need_pkgs+=(python3-venv)
if [ "${#need_pkgs[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "faultfs: these Debian packages are missing and need root to install: ${need_pkgs[*]}" >&2
        exit 1
    fi
    echo "faultfs: installing Debian packages: ${need_pkgs[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
fi
if [ ! -e /dev/fuse ]; then
    modprobe fuse 2>/dev/null || true
fi

stamp=".venv/.faultfs-installed"
# the compiled fast read path (setup.py) is rebuilt when its source changes, too
want="$(cat pyproject.toml setup.py faultfs/fuse/_fastread.c faultfs/stream/_cut.c | sha256sum | cut -d' ' -f1)"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    echo "faultfs: installing the project into .venv" >&2
    .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
    # (PYTHONWARNINGS: the build backend's notes about editable installs are not the user's)
    PYTHONWARNINGS=ignore .venv/bin/python -m pip install -q -e ".[test]" 2>&1 \
        | grep -vE '^(WARNING: Location|\s*$)' >&2 || true
    .venv/bin/python -c 'import faultfs, pyfuse3, trio, fsspec, s3fs, xxhash' \
        || { echo "faultfs: installing into .venv failed" >&2; exit 1; }
    .venv/bin/python -c 'import faultfs.fuse._fastread' 2>/dev/null \
        || echo "faultfs: the fast read path did not build; mounts serve every read through pyfuse3" >&2
    echo "$want" > "$stamp"
fi
export PATH="$ROOT/.venv/bin:$PATH"
