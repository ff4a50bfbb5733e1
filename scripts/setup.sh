#!/usr/bin/env bash
# Installs everything rdmasock needs on Debian 12 (as root) and builds it into .venv.
# Idempotent: safe to run again.  Build base is Debian's /usr/bin/python3 so that service
# users (e.g. postgres) can read the interpreter the library embeds.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
# build base + the real programs the tests and the demo run (PostgreSQL, Redis, curl)
PKGS="python3 python3-venv python3-dev python3-cffi python3-setuptools python3-wheel libpython3.11-dev gcc libc6-dev util-linux procps postgresql-15 postgresql-client-15 redis-server redis-tools curl python3-matplotlib"
missing=""
for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -n "$missing" ]; then
  apt-get update -qq
  apt-get install -y -qq $PKGS >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "psutil>=5.9" "pytest>=7" "hypothesis>=6"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation -e .
.venv/bin/python -c "import rdmasock._native"
test -f rdmasock/librdmasock.so || { echo "setup: rdmasock/librdmasock.so was not built" >&2; exit 1; }

# Preloaded servers run as other users (PostgreSQL as postgres): they must be able to
# reach the venv, the package and the library.  Directories above the checkout that other
# users cannot search get search permission only (o+x: no listing, no reading).
if ! setpriv --reuid=nobody --regid=nogroup --clear-groups -- test -r rdmasock/librdmasock.so 2>/dev/null; then
  d="$(pwd)"
  while [ "$d" != "/" ]; do
    if [ "$(stat -c %A "$d" | cut -c10)" != "x" ] && [ "$(stat -c %A "$d" | cut -c10)" != "t" ]; then
      chmod o+x "$d"
      echo "rdmasock: gave other users search permission on $d (preloaded services must reach the checkout)"
    fi
    d="$(dirname "$d")"
  done
fi
echo "rdmasock: set up in $(pwd)/.venv"

# --- Soft-RoCE VM prerequisites for the RDMA tests (packages + cached initramfs) ---
# (scripts/softroce/setup.sh; set RDMASOCK_SKIP_SOFTROCE=1 to leave them out)
if [ "${RDMASOCK_SKIP_SOFTROCE:-0}" != 1 ]; then
  bash scripts/softroce/setup.sh
fi
