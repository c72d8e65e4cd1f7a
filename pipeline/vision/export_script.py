"""The vision encoder's ONNX export as a self-contained script, for the GPU host (``trtpipe build --dry-run``).

A dry run loads no model, so the export that :mod:`pipeline.vision.onnx_export` does in a real build is written as a
script the user runs in the TensorRT-LLM container (which has torch, transformers and onnx), followed by
``build_vision_engine.py`` (:mod:`pipeline.vision.trt_build`). The script restates what ``build_mllama_engine`` of
tensorrt_llm/tools/multimodal_builder.py@b35ac1b64368 (1.2.0rc2; cited by function) does: load
``MllamaForConditionalGeneration`` in the encoder dtype, wrap ``vision_model`` + ``multi_modal_projector``
(``model.model.*`` on transformers ≥ 4.52), run upstream's dummy image (``Image.new('RGB', [2048, 2688])``) through the
checkpoint's ``AutoProcessor``, and ``torch.onnx.export`` with opset 17, the processor's three keys as inputs, output
``encoder_output`` and axis 0 of every input dynamic (``batch``); then ``onnx.checker``. The names and opset come from
:mod:`pipeline.vision.onnx_export`, the one place trtpipe spells them.
"""

from __future__ import annotations

import shlex
from pathlib import Path

SCRIPT_NAME = "export_vision_onnx.py"
#: the one line the chain runs per step (``vision_command.sh``)
COMMAND_SCRIPT = "vision_command.sh"

_SCRIPT = '''#!/usr/bin/env python3
"""Export the mllama vision encoder (vision model + projector) to ONNX (written by trtpipe; run in the TensorRT-LLM
container). Mirrors build_mllama_engine / export_onnx of tensorrt_llm/tools/multimodal_builder.py@b35ac1b64368:
opset {opset}, inputs {inputs}, output {output!r}, axis 0 of every input dynamic ({batch!r}), dtype from --dtype.

usage: python3 {script} --model_dir MODEL --dtype {{bfloat16,float16,float32}} --output onnx/model.onnx
"""
import argparse
import os

import onnx
import torch
from PIL import Image
from transformers import AutoProcessor, MllamaForConditionalGeneration

INPUT_NAMES = {inputs!r}
OUTPUT_NAME = {output!r}
OPSET = {opset}


class MLLaMAVisionWrapper(torch.nn.Module):
    def __init__(self, vision_model, output_proj):
        super().__init__()
        self.vision_model = vision_model
        self.output_proj = output_proj

    def forward(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
        out = self.vision_model(pixel_values, aspect_ratio_ids, aspect_ratio_mask).last_hidden_state
        return self.output_proj(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model_dir", required=True, help="HF checkpoint directory or hub id")
    ap.add_argument("--dtype", default={dtype!r}, choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--output", default="onnx/model.onnx")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = MllamaForConditionalGeneration.from_pretrained(args.model_dir, dtype=dtype).to(device).eval()
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "vision_model") else model
    wrapper = MLLaMAVisionWrapper(inner.vision_model, inner.multi_modal_projector).eval()
    processor = AutoProcessor.from_pretrained(args.model_dir)
    image = Image.new("RGB", [2048, 2688])
    inputs = processor(images=image, text="<|image|>", return_tensors="pt")
    example = tuple(inputs[k].to(device) for k in INPUT_NAMES)
    example = (example[0].to(dtype),) + example[1:]
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(wrapper, example, args.output, opset_version=OPSET, input_names=list(INPUT_NAMES),
                          output_names=[OUTPUT_NAME], dynamic_axes={{k: {{0: {batch!r}}} for k in INPUT_NAMES}},
                          dynamo=False)
    onnx.checker.check_model(args.output)
    print(args.output)


if __name__ == "__main__":
    main()
'''


def render_export_script(dtype: str) -> str:
    """The export script's text (deterministic), with ``dtype`` as its default ``--dtype``."""
    from pipeline.vision import onnx_export as ox

    return _SCRIPT.format(opset=ox.OPSET, inputs=tuple(ox.INPUT_NAMES), output=ox.OUTPUT_NAME, batch=ox.BATCH_AXIS,
                          dtype=dtype, script=SCRIPT_NAME)


def write_chain(out_dir: Path, *, model_dir: str, dtype: str, build_argv: list[str]) -> tuple[Path, list[list[str]]]:
    """Write ``export_vision_onnx.py`` and ``vision_command.sh`` (export, then the TensorRT build ``build_argv``) into
    ``out_dir``; the shell script cds to its own directory, so the paths in it are relative to the stage directory.

    Returns:
        (the shell script, its two argvs).
    """
    (out_dir / SCRIPT_NAME).write_text(render_export_script(dtype))
    (out_dir / SCRIPT_NAME).chmod(0o755)
    export = ["python3", SCRIPT_NAME, "--model_dir", model_dir, "--dtype", dtype, "--output", "onnx/model.onnx"]
    lines = ["#!/usr/bin/env bash",
             "# Generated by trtpipe (dry run): the vision encoder of this build, run in the TensorRT-LLM container.",
             "# 1. ONNX export of vision model + projector (opset 17, batch-dynamic), 2. TensorRT engine with one",
             "# optimisation profile + config.json as the Triton multimodal_encoders model reads it. Upstream's one-step",
             "# equivalent: examples/models/core/multimodal/build_multimodal_engine.py --model_type mllama (README@89fd9b74).",
             "set -euo pipefail", 'cd "$(dirname "$0")"', shlex.join(export), shlex.join(build_argv)]
    path = out_dir / COMMAND_SCRIPT
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o755)
    return path, [export, build_argv]
