#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite.  Exits non-zero on any failure,
# including "no tests collected" (pytest exit code 5).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# In a PID namespace of its own: servers the tests start (PostgreSQL, Redis, the VM, ...)
# end with the run, even one that is killed or times out.
isolate=()
if unshare --pid --fork --kill-child --mount-proc true 2>/dev/null; then
    isolate=(unshare --pid --fork --kill-child --mount-proc)
fi
set +e
"${isolate[@]}" timeout 2700 .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "test.sh: no tests were collected" >&2; exit 1; fi
exit "$rc"
