"""Shared pytest configuration.

- ``--run-slow`` (or ``TRTPIPE_RUN_SLOW=1``) runs tests marked ``slow`` (INT4 AWQ calibration,
  long real-model runs); the default run skips them so it stays well under 20 minutes.
- ``--run-gpu`` runs tests marked ``gpu`` (need a GPU and TensorRT-LLM; never in CI here).
- ``TRTPIPE_CACHE_DIR`` points at a repo-local ``.trtpipe-cache/`` so the converted SmolLM2
  checkpoint is shared across tests and runs, and no test writes to ``~``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRTPIPE_CACHE_DIR", str(REPO / ".trtpipe-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption("--run-gpu", action="store_true", default=False, help="run tests marked gpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--run-slow") or os.environ.get("TRTPIPE_RUN_SLOW") == "1"
    run_gpu = config.getoption("--run-gpu")
    skip_slow = pytest.mark.skip(reason="slow: use --run-slow (or TRTPIPE_RUN_SLOW=1)")
    skip_gpu = pytest.mark.skip(reason="needs a GPU + TensorRT-LLM: use --run-gpu on a GPU machine")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not run_gpu:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    """The repository root (where recipes/ and triton_repo/ live)."""
    return REPO
