#!/usr/bin/env bash
# Create .venv with the pinned, tested stack and epd installed in editable mode. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
.venv/bin/python -m pip install -q -r requirements/ci.txt -e .
