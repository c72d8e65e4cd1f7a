"""Issue #47 item 7, checked on the CPU model: the decoder-only ModelOpt path for Qwen2-VL (``pipeline/quantize/vlm_qwen.py``)
— FP8 on the tiny SmolLM2-grafted Qwen2-VL, calibrated with images (4 samples, ≈ 15 s) — leaves the vision tower and
merger unquantized, keeps the processor files in the export, and the CPU engine built from it answers an image
request through the LLM facade."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("modelopt")
torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
SMALL = ["--set", "quantization.qformat=fp8", "--set", "quantization.calibration.size=4",
         "--set", "quantization.calibration.max_seq_length=32", "--set", "quantization.calibration.eval_samples=2"]


def test_fp8_decoder_only_quantize_of_the_tiny_qwen2_vl(tmp_path):
    from safetensors import safe_open

    out = tmp_path / "b"
    res = subprocess.run([TRTPIPE, "build", str(REPO / "recipes/tiny_qwen2_vl_cpu_llmapi.yaml"), "--out", str(out),
                          "--stage", "engine", *SMALL], capture_output=True, text=True, timeout=600, check=False,
                         env={**os.environ, "COLUMNS": "200"})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    hf = out / "quantize" / "hf_ckpt"
    quant = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == "FP8" and "visual*" in quant["exclude_modules"] and "lm_head" in quant["exclude_modules"]
    for f in ("preprocessor_config.json", "tokenizer.json", "chat_template.jinja"):
        assert (hf / f).is_file(), f
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.endswith("down_proj.weight_scale") for n in names)  # the decoder is FP8
    assert not [n for n in names if "visual" in n and "scale" in n]  # the tower and merger are not
    manifest = json.loads((out / "quantize" / "manifest.json").read_text())
    assert manifest["image_calibration"]["images"] == 4 and manifest["image_calibration"]["excluded_from_quantization"]

    import numpy as np
    from PIL import Image
    from transformers import AutoTokenizer

    from pipeline.cpu_runtime.llm import LLM, SamplingParams

    engine = out / "engine"
    assert (engine / "vision" / "model.safetensors").is_file() and (engine / "preprocessor_config.json").is_file()
    tok = AutoTokenizer.from_pretrained(engine)
    prompt = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}],
                                     add_generation_prompt=True, tokenize=False)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (448, 448, 3), dtype=np.uint8))

    async def go(llm):
        r = llm.generate_async({"prompt": prompt, "multi_modal_data": {"image": [img]}},
                               SamplingParams(max_tokens=4, min_tokens=4, add_special_tokens=False))
        async for _ in r:
            pass
        return r

    with LLM(str(engine)) as llm:
        r = asyncio.run(go(llm))
    assert r.image_tokens == 256 and len(r.outputs[0].token_ids) == 4
