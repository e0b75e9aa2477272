#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. Exit 1 on failures, and also
# when pytest collected no tests (its exit code 5): an empty run is not a green run.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/python -m pytest -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "test.sh: pytest ran no tests; failing" >&2
    exit 1
fi
exit "$rc"
