#!/usr/bin/env bash
# The whole test suite, as README and CI run it: set up, lint, then every test.
# pytest's exit 5 (no tests collected) is a failure here, not a success.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
.venv/bin/ruff check . || exit 1
# Formatting is checked, not applied: `.venv/bin/ruff format .` fixes what this reports.
.venv/bin/ruff format --check . || exit 1
.venv/bin/mypy epd || exit 1
export OMP_NUM_THREADS=1
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$rc"
