"""The dry-run scripts are a chain (#44 item 3): run top to bottom in the container (quantize → engine or LLM-API
config → repository → serve), each step reads only what the previous ones wrote. This test follows every file
reference of the chain for each GPU recipe and both engine paths (and the trtllm-serve frontend), without running
anything. And ``serve --print-command`` prints the in-image command of a GPU build (#44 item 4)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.triton.model_config import load_model_config
from pipeline.triton.server import CONTAINER_TRITONSERVER

REPO = Path(__file__).resolve().parents[1]
# vision recipes (issue #46) do not build yet (tests/test_recipe_vision.py checks the refusal)
GPU_RECIPES = sorted(p for p in (REPO / "recipes").glob("*.yaml")
                     if yaml.safe_load(p.read_text())["target"]["gpu"] != "cpu" and (yaml.safe_load(p.read_text()).get("vision") or {}).get("family") != "mllama")
CASES = [(p, []) for p in GPU_RECIPES] + [  # both engine paths: tensorrt and pytorch recipes are shipped
    (REPO / "recipes/llama31_8b_h200_fp8_pytorch.yaml", ["serving.frontend=trtllm-serve"]),
]
IDS = [p.stem + ("+" + "+".join(s) if s else "") for p, s in CASES]
WIDE = {"COLUMNS": "400"}


def _dry_build(tmp_path: Path, recipe: Path, sets: list[str]) -> Path:
    out = tmp_path / "build"
    args = ["build", str(recipe), "--dry-run", "--out", str(out)] + [a for s in sets for a in ("--set", s)]
    res = CliRunner().invoke(app, args, env=WIDE)
    assert res.exit_code == 0, res.output
    return out


class Chain:
    """The paths the chain's steps have written so far (a path counts when it or a parent was written)."""

    def __init__(self) -> None:
        self.written: list[Path] = []

    def write(self, path: Path) -> None:
        self.written.append(path.resolve())

    def has(self, path: str | Path) -> bool:
        p = Path(path).resolve()
        return any(p == w or w in p.parents for w in self.written)


def _quantize_step(build: Path, chain: Chain) -> str:
    """quantize/quantize_command.sh: what it writes (``--output_dir ${OUT_DIR}/X`` and the tokenizer's target);
    returns the ``--model_dir`` it reads (the chain's input)."""
    text = (build / "quantize/quantize_command.sh").read_text()
    assert 'OUT_DIR=${OUT_DIR:-"$(cd "$(dirname "$0")" && pwd)"}' in text  # OUT_DIR defaults to the script's dir
    flat = text.replace("\\\n", " ")
    # quantize.py --output_dir, or ModelOpt hf_ptq.py --export_path for a VLM (pipeline/quantize/vlm_command.py)
    outputs = re.findall(r"(?:--output_dir|--export_path)\s+\$\{OUT_DIR\}/(\S+)", flat)
    assert len(outputs) == 1, flat
    chain.write(build / "quantize" / outputs[0])
    for target in re.findall(r'save_pretrained\(sys\.argv\[2\]\)\'\s+\S+\s+"\$\{OUT_DIR\}/([^"]+)"', flat):
        assert chain.has(build / "quantize" / target)
    return re.search(r"(?:--model_dir|--pyt_ckpt_path)\s+(\S+)", flat).group(1)


def _engine_step(build: Path, chain: Chain) -> None:
    script = build / "engine/trtllm_build.sh"
    if script.is_file():  # build.engine tensorrt: trtllm-build reads the checkpoint, writes the engine dir
        argv = shlex.split(script.read_text().strip().splitlines()[-1])
        assert argv[0] == "trtllm-build" and "--model_config" not in argv, argv  # a config has no weights
        ckpt = argv[argv.index("--checkpoint_dir") + 1]
        assert chain.has(ckpt), f"trtllm-build reads {ckpt}, which no earlier step writes"
        out = argv[argv.index("--output_dir") + 1]
        chain.write(build / "engine" / out)  # the script cds to its own directory
        return
    cfg = yaml.safe_load((build / "engine/llm_api_config.yaml").read_text())  # build.engine pytorch
    for key in ("model", "tokenizer"):
        assert chain.has(cfg[key]), f"llm_api_config.yaml {key}: {cfg[key]} is written by no earlier step"
    chain.write(build / "engine")  # trtpipe wrote the LLM-API config files themselves


def _repo_step(build: Path, chain: Chain) -> None:
    repo = build / "triton_repo"
    script = repo / "tokenizer_command.sh"
    if script.is_file():
        dest = re.search(r'"([^"]+)"\s*$', script.read_text().strip()).group(1)
        chain.write(repo / dest)  # the script cds to the repository
    for cfg_file in sorted(repo.glob("*/config.pbtxt")):
        cfg = load_model_config(cfg_file.parent)
        for name, p in cfg.parameters.items():
            value = p.string_value
            if name.endswith(("_dir", "_path")) and value and not value.startswith("${"):
                path = Path(value) if Path(value).is_absolute() else cfg_file.parent / value
                if name == "xgrammar_tokenizer_info_path" or value.startswith("/opt/tritonserver/"):
                    continue  # guided decoding off in the GPU recipes; the image's own files (executor worker)
                assert chain.has(path), f"{cfg_file.parent.name}: {name} {value} is written by no earlier step"
    model_yaml = repo / "tensorrt_llm/1/model.yaml"
    if model_yaml.is_file():  # the llmapi model reads the LLM-API kwargs
        cfg = yaml.safe_load(model_yaml.read_text())
        for key in ("model", "tokenizer"):
            assert chain.has(cfg[key]), f"model.yaml {key}: {cfg[key]}"


def _serve_step(build: Path, chain: Chain | None, recipe_sets: list[str]) -> list[str]:
    res = CliRunner().invoke(app, ["serve", str(build), "--print-command"], env=WIDE)
    assert res.exit_code == 0, res.output
    argv = shlex.split(res.output.strip())
    if argv[0] == "trtllm-serve" and chain is not None:
        assert chain.has(argv[1]) and chain.has(argv[argv.index("--tokenizer") + 1]), argv
        assert chain.has(argv[argv.index("--extra_llm_api_options") + 1]), argv
    elif argv[0] != "trtllm-serve":
        repo = next(a.split("=", 1)[1] for a in argv if a.startswith("--model-repository="))
        assert Path(repo) == (build / "triton_repo").resolve()
    return argv


@pytest.mark.parametrize("recipe,sets", CASES, ids=IDS)
def test_the_dry_run_scripts_chain(tmp_path, recipe, sets):
    build = _dry_build(tmp_path, recipe, sets)
    chain = Chain()
    _quantize_step(build, chain)
    _engine_step(build, chain)
    _repo_step(build, chain)
    _serve_step(build, chain, sets)


def test_the_quantize_script_exports_what_each_engine_path_reads(tmp_path):
    trt = _dry_build(tmp_path / "t", REPO / "recipes/llama31_8b_h200_fp8.yaml", [])
    pyt = _dry_build(tmp_path / "p", REPO / "recipes/llama31_8b_h200_fp8_pytorch.yaml", [])
    t = (trt / "quantize/quantize_command.sh").read_text().replace(" \\\n    ", " ")
    p = (pyt / "quantize/quantize_command.sh").read_text().replace(" \\\n    ", " ")
    # quantize.py --export_format: tensorrt_llm (default) or hf (docs/reference/quantization.md §2.1)
    assert "--export_format" not in t and "--output_dir ${OUT_DIR}/trtllm_ckpt" in t
    assert "--export_format hf --output_dir ${OUT_DIR}/hf_ckpt" in p


# ------------------------------------------------------------------ serve --print-command on a GPU build (#44 item 4)
@pytest.mark.parametrize("recipe,ranks", [("llama31_8b_h200_fp8", 1), ("llama33_70b_h100_fp8_tp2", 2),
                                          ("llama31_8b_h200_fp8_pytorch", 1)])
def test_print_command_of_a_gpu_build_is_the_in_image_tritonserver(tmp_path, recipe, ranks):
    build = _dry_build(tmp_path, REPO / "recipes" / f"{recipe}.yaml", [])
    argv = _serve_step(build, None, [])
    binaries = [a for a in argv if a.endswith("tritonserver")]
    assert binaries == [str(CONTAINER_TRITONSERVER)] * ranks, argv  # never this machine's (CPU) Triton
    assert not any(a.startswith(("--backend-directory", "--cache-directory")) for a in argv), argv
    if ranks > 1:  # launch_triton_server.py's layout: mpirun, one app context per rank, ranks ≠ 0 load tensorrt_llm
        assert argv[:2] == ["mpirun", "--allow-run-as-root"] and argv.count(":") == ranks - 1
        assert argv.count("--load-model=tensorrt_llm") == ranks - 1
    else:
        assert argv[0] == str(CONTAINER_TRITONSERVER)


def test_print_command_of_a_gpu_trtllm_serve_build_is_trtllm_serve(tmp_path):
    build = _dry_build(tmp_path, REPO / "recipes/llama31_8b_h200_fp8_pytorch.yaml", ["serving.frontend=trtllm-serve"])
    argv = _serve_step(build, None, [])
    stored = json.loads((build / "engine/trtllm_serve.json").read_text())["argv"]
    assert argv == stored
