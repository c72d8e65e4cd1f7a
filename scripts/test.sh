#!/usr/bin/env bash
# Set up .venv if needed (scripts/setup.sh) and run the default test suite: unit, contract and
# the real CPU end-to-end tests (ModelOpt on SmolLM2, real Triton, real gRPC bench).
# Extra arguments go to pytest, e.g. `scripts/test.sh --run-slow` or `scripts/test.sh -k recipe`.
# Two test modules run at once (pytest-xdist; the tests mostly wait on a server: tests/parallel.py has the rules);
# TRTPIPE_TEST_WORKERS=0 runs them in one process, `-n N` among the arguments overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n "${TRTPIPE_TEST_WORKERS:-2}" --dist loadgroup "$@"
