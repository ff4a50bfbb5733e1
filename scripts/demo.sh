#!/usr/bin/env bash
# Sets up and runs the demo: pgbench (TPC-B, 1 client) against a local PostgreSQL over
# plain TCP and with server and client under rdmasock (LD_PRELOAD, unmodified binaries),
# same run, pinned with taskset, median of 3; prints both tps and the speed-up.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec .venv/bin/rdmasock demo "$@"                 # the same as `rdmasock demo` anywhere
