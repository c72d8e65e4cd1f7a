"""Shared pytest configuration.

- ``--run-slow`` (or ``TRTPIPE_RUN_SLOW=1``) runs tests marked ``slow`` (INT4 AWQ calibration,
  long real-model runs); the default run skips them so it stays well under 20 minutes.
- ``--run-gpu`` runs tests marked ``gpu`` (need a GPU and TensorRT-LLM; never in CI here).
- ``TRTPIPE_CACHE_DIR`` points at a repo-local ``.trtpipe-cache/`` so the converted SmolLM2
  checkpoint is shared across tests and runs, and no test writes to ``~``.
- Under pytest-xdist (scripts/test.sh runs ``-n 2 --dist loadgroup``) a module is the unit of work, a session build
  is made once per run and a ``serial`` test runs alone (tests/parallel.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import parallel
import pytest

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TRTPIPE_CACHE_DIR", str(REPO / ".trtpipe-cache"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The tests run as at a terminal, where Ctrl-C raises KeyboardInterrupt: a job started in the background (`nohup … &`,
# some CI runners) inherits SIGINT *ignored*, and so would every server and CLI a test starts, which then never sees
# the Ctrl-C a test sends it. (Serial runs hid this: an in-process bench's asyncio loop restores the handler on exit.)
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="run tests marked slow")
    parser.addoption("--run-gpu", action="store_true", default=False, help="run tests marked gpu")


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks (tests/parallel.py)
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
    parallel.group_slow_modules(items)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: a module (or an ``xdist_group`` of modules) is the unit of work (tests/parallel.py)."""
    return parallel.ModuleScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under xdist each test holds its turn on the host, a ``serial`` one alone (:func:`parallel.host_turn`)."""
    with parallel.host_turn(item):
        yield


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


INT4_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_int4_awq.yaml"
#: the shared INT4 AWQ run's calibration: 4 x 64 tokens (AWQ's search runs 20 scales x every calibration token)
INT4_SMALL = ["quantization.calibration.size=4", "quantization.calibration.max_seq_length=64",
              "quantization.calibration.batch_size=4", "quantization.calibration.eval_samples=2"]


@dataclasses.dataclass(frozen=True)
class Int4Awq:
    """The session's INT4 AWQ quantize stage: its recipe, build directory, result and ModelOpt's fake-quant weights."""

    recipe: Any
    root: Path
    quantized: Any
    reference: Path
    recipe_dir: Path = INT4_RECIPE.parent


@pytest.fixture(scope="session")
def int4_awq(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Int4Awq:
    """The shipped INT4 AWQ recipe (group size 64, FP8 KV) through the real quantize stage once per session, with
    a small calibration (:data:`INT4_SMALL`): ``<root>/quantize`` as ``trtpipe build`` writes it, shared by the
    export test (tests/test_quantize.py), the dequantization test (tests/test_engine_cpu.py) and the INT4 kld gate
    (tests/test_eval_kld.py builds its engine on it). ``reference`` holds ModelOpt's fake-quant effective weights of
    this very run, taken inside the stage right before ``export_hf_checkpoint`` packs them
    (:func:`support.save_fakequant_reference`)."""
    import modelopt.torch.export as mte
    from support import save_fakequant_reference

    from pipeline.core.layout import BuildLayout
    from pipeline.quantize import stage as quantize
    from pipeline.recipe import load_recipe

    recipe = load_recipe(INT4_RECIPE, INT4_SMALL)
    with parallel.built_once(tmp_path_factory, "int4_awq") as (base, first):
        root = base / "smollm2_135m_cpu_int4_awq"
        reference = base / "reference.safetensors"
        if not first:  # another xdist worker made it: the stage finds it by its cache key
            res = quantize.run(recipe, BuildLayout(root), recipe_dir=INT4_RECIPE.parent)
            assert res.cached and reference.is_file()
            return Int4Awq(recipe, root, res, reference)
        export = mte.export_hf_checkpoint

        def export_with_reference(model, *args, **kwargs):
            save_fakequant_reference(model, reference)
            return export(model, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(mte, "export_hf_checkpoint", export_with_reference)  # the stage imports it when it exports
            res = quantize.run(recipe, BuildLayout(root), recipe_dir=INT4_RECIPE.parent)
    assert not res.cached and reference.is_file(), "the quantize stage no longer exports through export_hf_checkpoint"
    return Int4Awq(recipe, root, res, reference)


# --- CPU engine fixtures ---
# Shared by tests/test_cpu_runtime.py, tests/test_prefix_reuse_cpu.py, tests/test_speculative_cpu.py and (with its own
# ``engine_dir``) tests/test_cpu_mllama.py.


@pytest.fixture(scope="session")
def engine_dir() -> Path:
    """The FP8 SmolLM2 CPU engine directory (batch 8, 1,024-token sequences, 16,384 KV tokens: ``support.CPU_BS8``),
    built once per session by the real ``cpu`` engine stage and cached across sessions (:func:`support.cpu_fp8_build`).
    A test module may override it (tests/test_cpu_mllama.py: its mllama engine); ``engine`` then opens that one."""
    from support import CPU_BS8, cpu_fp8_build

    return cpu_fp8_build("build-fp8-bs8", CPU_BS8)


@pytest.fixture(scope="module")
def engine(engine_dir: Path):
    """A :class:`~pipeline.cpu_runtime.engine.CpuEngine` on ``engine_dir`` with one thread (the cores are shared), shut
    down after the module (module scope: its weights and threads do not outlive the tests that use it, and a module's own
    ``engine_dir`` is honoured)."""
    from pipeline.cpu_runtime.engine import CpuEngine

    eng = CpuEngine(engine_dir, num_threads=1)
    yield eng
    eng.shutdown()


# --- vision fixtures ---


@pytest.fixture(scope="session")
def smollm2_mllama_dir(smollm2_dir: Path) -> Path:
    """``embedded:smollm2-135m-mllama`` (pipeline/vision/smollm2_mllama.py): SmolLM2-135M-Instruct's decoder with 2
    gated cross-attention layers and a tiny seeded vision tower, an ``MllamaForConditionalGeneration`` checkpoint
    (float32, 0.68 GB) with tokenizer (+ ``<|image|>``), chat template and ``preprocessor_config.json``. Built once
    into TRTPIPE_CACHE_DIR (~10 s) and reused across sessions; shared by the vision, quantize and CPU-engine tests."""
    from pipeline.vision.smollm2_mllama import embedded_smollm2_mllama_dir

    return embedded_smollm2_mllama_dir(smollm2_dir)


# --- end-to-end fixtures ---
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
CPU_RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"


@pytest.fixture(scope="session")
def cpu_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped CPU default built for real by the CLI, once per session: ``trtpipe build
    recipes/smollm2_135m_cpu_fp8.yaml`` (ModelOpt FP8 → CPU engine → Triton repo), run from a
    temp working directory whose ``artifacts/.last_build`` then points at it (~1–3 min).

    Under xdist the first worker builds it once for the run (:func:`parallel.built_once`); each worker's own build
    then starts from hard links of that build's quantize and engine stages, which ``trtpipe build`` reuses by their
    cache keys, so a worker's working directory (its ``artifacts/serve.json``, its eval baselines) is its own."""
    work = tmp_path_factory.mktemp("e2e")
    out = work / "artifacts" / CPU_RECIPE.stem
    if parallel.worker() is not None:
        with parallel.built_once(tmp_path_factory, "cpu_build") as (shared, first):
            donor = shared / "artifacts" / CPU_RECIPE.stem
            if first:
                _cli_build(CPU_RECIPE, shared, donor)
        for stage in ("quantize", "engine"):
            shutil.copytree(donor / stage, out / stage, copy_function=os.link)
    _cli_build(CPU_RECIPE, work, out)
    return out


def _cli_build(recipe: Path, work: Path, out: Path | None = None) -> None:
    """``trtpipe build <recipe> [--out out]`` run in ``work``; fails the test with the output's tail."""
    res = subprocess.run([TRTPIPE, "build", str(recipe), *(["--out", str(out)] if out else [])], cwd=work,
                         capture_output=True, text=True, timeout=1800, check=False, env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def _cli_build_in_fresh_dir(tmp_path_factory: pytest.TempPathFactory, recipe_name: str) -> tuple[Path, Path]:
    """``(work dir, build dir)``: ``trtpipe build recipes/<recipe_name>.yaml`` run once in a fresh work dir (its
    ``artifacts/``, whose ``.last_build`` then points at it). Its users share one ``xdist_group`` (one worker)."""
    recipe = REPO / "recipes" / f"{recipe_name}.yaml"
    work = tmp_path_factory.mktemp(recipe_name)
    _cli_build(recipe, work)
    return work, work / "artifacts" / recipe.stem


@pytest.fixture(scope="session")
def qwen2vl_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(work dir, build dir)`` of one ``trtpipe build recipes/tiny_qwen2_vl_cpu_llmapi.yaml`` run in a fresh work dir
    (slow tier): the trtllm-serve build the served VLM tests start from. A variant built in the same work dir (e.g.
    ``--set serving.frontend=triton``) reuses its quantize and engine stages (``pipeline.assemble.seed``)."""
    return _cli_build_in_fresh_dir(tmp_path_factory, "tiny_qwen2_vl_cpu_llmapi")


@pytest.fixture(scope="session")
def mllama_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(work dir, build dir)`` of one ``trtpipe build recipes/tiny_mllama_cpu.yaml`` run in a fresh work dir (slow
    tier, ~1.5 min): quantize with images → ONNX vision encoder → CPU engine → multimodal repository. Shared by the
    vision stage's recipe test (its manifests) and the served VLM tests (``trtpipe serve`` from the work dir)."""
    return _cli_build_in_fresh_dir(tmp_path_factory, "tiny_mllama_cpu")
