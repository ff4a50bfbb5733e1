#!/usr/bin/env bash
# Sets up and runs the demo: an unmodified ping-pong program over plain TCP and over
# rdmasock shared memory, pinned with taskset, median of 5, speed-up printed.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh >/dev/null
exec .venv/bin/python bench/demo.py "$@"
