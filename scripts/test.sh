#!/usr/bin/env bash
# Set up .venv if needed (scripts/setup.sh) and run the default test suite: unit, contract and
# the real CPU end-to-end tests (ModelOpt on SmolLM2, real Triton, real gRPC bench).
# Extra arguments go to pytest, e.g. `scripts/test.sh --run-slow` or `scripts/test.sh -k recipe`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
