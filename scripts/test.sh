#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite.  Exits non-zero on any failure,
# including "no tests collected" (pytest exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
set +e
timeout 2700 .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "test.sh: no tests were collected" >&2; exit 1; fi
exit "$rc"
