#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, in two phases (tests/conftest.py):
# the timing-bound modules (marker "serial") alone on the machine, then everything else on
# two pytest-xdist workers, whole modules per worker. Exit 1 when a test fails, and also
# when neither phase collected a test (pytest's exit code 5): an empty run is not green.
# Arguments go to both phases (e.g. a test path: the phase it is not in collects nothing).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
PYTEST=(.venv/bin/python -m pytest -p no:cacheprovider)
"${PYTEST[@]}" -m serial --durations=25 "$@"
serial=$?
"${PYTEST[@]}" -m "not serial" -n 2 --dist loadfile --no-loadscope-reorder --durations=40 "$@"
parallel=$?
if [ "$serial" -eq 5 ] && [ "$parallel" -eq 5 ]; then
    echo "test.sh: pytest ran no tests; failing" >&2
    exit 1
fi
for rc in "$serial" "$parallel"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
