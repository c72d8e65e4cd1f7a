"""The quantize stage's checkpoint must load in the serving image, whose transformers is older than ours.

Audit 2026-11-26, finding 10: transformers 5 saves a generic fast tokenizer as ``"tokenizer_class":
"TokenizersBackend"``; TensorRT-LLM 1.2.1 pins transformers 4.57.3 (release matrix), whose ``AutoTokenizer``
refuses that name. The stage rewrites it to the 4.x class that loads the same ``tokenizer.json`` and refuses
(one line, StageError) a tokenizer the runtime cannot load. Finding 7: the dry run's ``TRTLLM_EXAMPLES`` default is
the image's ``/app/examples``.

``test_default_env_checkpoint_tokenizer_loads_in_this_transformers`` is the parity-tier check: scripts/parity.sh
runs this file in .venv-parity (transformers 4.57.3); the checkpoint is quantized by the default environment
(.venv, transformers 5.x) in a subprocess, and the tokenizer is loaded here with ``AutoTokenizer``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.core.errors import StageError
from pipeline.core.layout import BuildLayout
from pipeline.quantize import stage as quantize
from pipeline.recipe import load_recipe
from pipeline.trtllm import release

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
#: the development environment that quantizes (override for another layout)
DEFAULT_PYTHON = Path(os.environ.get("TRTPIPE_DEFAULT_PYTHON", REPO / ".venv" / "bin" / "python"))
SMALL = ["quantization.calibration.size=16", "quantization.calibration.max_seq_length=128",
         "quantization.calibration.batch_size=8", "quantization.calibration.eval_samples=4"]


def _tokenizer_dir(tmp_path: Path, cls: str, *, with_json: bool = True) -> Path:
    d = tmp_path / "hf_ckpt"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls, "eos_token": "<|im_end|>"}))
    if with_json:
        (d / "tokenizer.json").write_text("{}")
    return d


def test_runtime_transformers_is_the_release_matrix_pin():
    assert quantize._runtime_transformers() == release.default_release().transformers == "4.57.3"


def test_tokenizers_backend_is_rewritten_for_transformers_4(tmp_path):
    d = _tokenizer_dir(tmp_path, "TokenizersBackend")
    adj = quantize.portable_tokenizer(d, "4.57.3")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    assert cfg == {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    assert adj[0]["value"] == "PreTrainedTokenizerFast" and adj[0]["default"] == "TokenizersBackend"


@pytest.mark.parametrize("cls,runtime", [("PreTrainedTokenizerFast", "4.57.3"), ("GPT2Tokenizer", "4.57.3"),
                                         ("TokenizersBackend", "5.14.1"), ("TokenizersBackend", None)])
def test_loadable_tokenizers_are_left_alone(tmp_path, cls, runtime):
    d = _tokenizer_dir(tmp_path, cls)
    before = (d / "tokenizer_config.json").read_text()
    assert quantize.portable_tokenizer(d, runtime) == []
    assert (d / "tokenizer_config.json").read_text() == before


@pytest.mark.parametrize("cls,with_json", [("SentencePieceBackend", True), ("TokenizersBackend", False)])
def test_a_tokenizer_the_runtime_cannot_load_is_refused_in_one_line(tmp_path, cls, with_json):
    d = _tokenizer_dir(tmp_path, cls, with_json=with_json)
    with pytest.raises(StageError) as e:
        quantize.portable_tokenizer(d, "4.57.3")
    msg = str(e.value)
    assert "\n" not in msg and "tokenizer_class" in msg and cls in msg and "4.57.3" in msg


def test_dry_run_uses_the_images_examples_directory(tmp_path):
    """Finding 7: TensorRT-LLM's examples are at /app/examples in the Triton trtllm image
    (tensorrtllm_backend dockerfile/Dockerfile.triton.trt_llm_backend@ce68ff5fd0a7:170,175)."""
    recipe = load_recipe(RECIPES / "llama31_8b_h200_fp8.yaml")
    res = quantize.run(recipe, BuildLayout(tmp_path), recipe_dir=RECIPES, dry_run=True)
    script = (res.path / "quantize_command.sh").read_text()
    assert "TRTLLM_EXAMPLES=${TRTLLM_EXAMPLES:-/app/examples}" in script
    assert "/app/tensorrt_llm/examples" not in script


_QUANTIZE = """
import json, sys
from pathlib import Path
from pipeline.core.layout import BuildLayout
from pipeline.quantize import stage
from pipeline.recipe import load_recipe
recipe = load_recipe(Path(sys.argv[1]), sys.argv[3:])
res = stage.run(recipe, BuildLayout(Path(sys.argv[2])), recipe_dir=Path(sys.argv[1]).parent)
import transformers
print(json.dumps({"hf_ckpt": str(res.path / "hf_ckpt"), "transformers": transformers.__version__}))
"""


@pytest.fixture(scope="module")
def default_env_checkpoint(request, tmp_path_factory):
    """The SmolLM2 FP8 recipe quantized by the default environment (.venv): when these tests run in it (the default
    tier), the quantize stage of the session's ``trtpipe build`` of that recipe (``cpu_build``, made by this very
    environment); otherwise (the parity tier's .venv-parity) quantized in a subprocess of the default environment."""
    if not DEFAULT_PYTHON.is_file():
        pytest.skip(f"no default environment at {DEFAULT_PYTHON}")
    if Path(sys.prefix).resolve() == DEFAULT_PYTHON.parent.parent.resolve():
        import transformers

        stage = BuildLayout(request.getfixturevalue("cpu_build")).stage_dir("quantize")
        return {"hf_ckpt": str(stage / "hf_ckpt"), "transformers": transformers.__version__}
    out = tmp_path_factory.mktemp("default-env-build")
    env = {k: v for k, v in os.environ.items() if k not in ("TRTPIPE_CACHE_DIR", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(TRTPIPE_NUM_THREADS="1", PYTHONPATH=str(REPO))
    p = subprocess.run([str(DEFAULT_PYTHON), "-c", _QUANTIZE, str(RECIPES / "smollm2_135m_cpu_fp8.yaml"), str(out),
                        *SMALL], capture_output=True, text=True, env=env, cwd=REPO, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_default_env_checkpoint_names_a_class_the_runtime_has(default_env_checkpoint):
    cfg = json.loads((Path(default_env_checkpoint["hf_ckpt"]) / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] not in quantize.TRANSFORMERS5_TOKENIZER_CLASSES
    manifest = json.loads((Path(default_env_checkpoint["hf_ckpt"]).parent / "manifest.json").read_text())
    if default_env_checkpoint["transformers"].startswith("5."):
        assert any(a["key"] == "tokenizer_config.json:tokenizer_class" for a in manifest["adjustments"])


def test_default_env_checkpoint_tokenizer_loads_in_this_transformers(default_env_checkpoint):
    """Parity tier (transformers 4.57.3 in .venv-parity): what the serving image's AutoTokenizer does."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_env_checkpoint["hf_ckpt"], local_files_only=True)
    ids = tok("The capital of France is")["input_ids"]
    assert len(ids) > 3 and tok.decode(ids).strip() == "The capital of France is"
    assert tok.eos_token == "<|im_end|>"
