#!/usr/bin/env bash
# Regenerate protos/epd/v1/*_pb2*.py from the .proto files (tests check the copy is current).
set -euo pipefail
cd "$(dirname "$0")/.."
cd protos && python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. epd/v1/*.proto
