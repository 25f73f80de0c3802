#!/usr/bin/env bash
# Create .venv with the pinned, tested stack and epd installed in editable mode. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
# decord2 installs the `decord` module that decord 0.6 (pinned before it) also installed: remove
# both where the old one is there, so that the module left is decord2's whole.
if .venv/bin/python -m pip show -q decord >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y decord decord2
fi
.venv/bin/python -m pip install -q -r requirements/ci.txt -e .
