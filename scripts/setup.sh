#!/usr/bin/env bash
# Installs everything rdmasock needs on Debian 12 (as root) and builds it into .venv.
# Idempotent: safe to run again.  Order matters: the build dependencies (headers) are
# installed before anything is compiled, and the result is checked, so a library without
# RDMA support cannot come out of here unnoticed.  The venv is made from Debian's
# /usr/bin/python3 so that service users (e.g. postgres) can read the interpreter the
# library embeds, with --system-site-packages so that it sees Debian's pyverbs.
set -euo pipefail
cd "$(dirname "$0")/.."
export DEBIAN_FRONTEND=noninteractive
# 1. build dependencies; 2. the real programs the tests and the demo run
BUILD="gcc libc6-dev python3 python3-venv python3-dev libpython3.11-dev python3-cffi python3-setuptools python3-wheel libibverbs-dev rdma-core ibverbs-providers python3-pyverbs"
PROGRAMS="util-linux procps bash git socat openssl rsync postgresql-15 postgresql-client-15 redis-server redis-tools mariadb-server mariadb-client curl python3-matplotlib nginx-light sockperf wrk apache2-utils libpython3.11-testsuite memcached haproxy iperf3 nodejs ruby php-cli"
missing=""
for p in $BUILD $PROGRAMS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  echo "setup: installing$missing"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  /usr/bin/python3 -m venv --system-site-packages .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check "psutil>=5.9" "pytest>=7" "hypothesis>=6"
.venv/bin/python -m pip install -q --disable-pip-version-check --no-build-isolation -e .
test -f rdmasock/librdmasock.so || { echo "setup: rdmasock/librdmasock.so was not built" >&2; exit 1; }
if ! .venv/bin/python -c "import sys; from rdmasock import doctor; sys.exit(doctor.build_has_verbs() is not True)"; then
  echo "setup: $(.venv/bin/python -c 'from rdmasock import doctor; print(doctor.NO_VERBS_BUILD)')" >&2
  exit 1
fi

# Preloaded servers run as other users (PostgreSQL as postgres, MariaDB as mysql): they must be able to
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
