"""Shared pytest configuration.

- ``--run-slow`` (or ``TRTPIPE_RUN_SLOW=1``) runs tests marked ``slow`` (INT4 AWQ calibration,
  long real-model runs); the default run skips them so it stays well under 20 minutes.
- ``--run-gpu`` runs tests marked ``gpu`` (need a GPU and TensorRT-LLM; never in CI here).
- ``TRTPIPE_CACHE_DIR`` points at a repo-local ``.trtpipe-cache/`` so the converted SmolLM2
  checkpoint is shared across tests and runs, and no test writes to ``~``.
"""

from __future__ import annotations

import os
import subprocess
import sys
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


@pytest.fixture(scope="session", autouse=True)
def _no_measured_host(tmp_path_factory: pytest.TempPathFactory):
    """The planner's cpu target uses the shipped reference host in every test (and in the CLIs tests start), whether
    or not this machine has run ``trtpipe plan measure-host``: ``TRTPIPE_HOST_FILE`` names a file that does not
    exist (:func:`pipeline.core.hardware.host_file`). A test that measures sets its own."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRTPIPE_HOST_FILE", str(tmp_path_factory.mktemp("host") / "cpu_host.yaml"))
    yield
    mp.undo()


# --- quantize fixtures ---
# Shared by tests/test_sources.py, tests/test_calib.py, tests/test_quantize.py (owner: the quantize stage).


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct HF checkpoint in TRTPIPE_CACHE_DIR (converted once, ~35–60 s)."""
    from pipeline.quantize.sources import embedded_smollm2_dir

    return embedded_smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir: Path):
    """The SmolLM2 tokenizer (fast; eos = pad = id 2 ``<|im_end|>``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)


@pytest.fixture(scope="session")
def quant_one_thread():
    """One torch thread in the quantize stage (TRTPIPE_NUM_THREADS) and in the test process: the
    2 cores are shared with other work."""
    import torch

    mp = pytest.MonkeyPatch()
    mp.setenv("TRTPIPE_NUM_THREADS", "1")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
    mp.undo()


# --- end-to-end fixtures ---
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


@pytest.fixture(scope="session")
def cpu_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped CPU default built for real by the CLI, once per session: ``trtpipe build
    recipes/smollm2_135m_cpu_fp8.yaml`` (ModelOpt FP8 → CPU engine → Triton repo), run from a
    temp working directory whose ``artifacts/.last_build`` then points at it (~1–3 min)."""
    work = tmp_path_factory.mktemp("e2e")
    out = work / "artifacts" / "smollm2_135m_cpu_fp8"
    res = subprocess.run([TRTPIPE, "build", str(CPU_RECIPE), "--out", str(out)], cwd=work,
                         capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out
