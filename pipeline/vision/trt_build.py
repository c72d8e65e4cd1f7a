"""The vision encoder's TensorRT build step, for a GPU host: a self-contained script written next to the ONNX file.

Written here, run there (in the TensorRT-LLM container, which has ``tensorrt`` and ``tensorrt_llm``). The script
does what ``build_trt_engine`` in tensorrt_llm/tools/multimodal_builder.py@b35ac1b64368 (1.2.0rc2; cited by
function) does for mllama:

- the TensorRT Python builder, not trtexec: ``trt.Builder``, an explicit-batch network, ``trt.OnnxParser``,
  ``builder.build_serialized_network``;
- the builder config from TensorRT-LLM's ``Builder().create_builder_config(precision=<model dtype>,
  model_type="mllama", strongly_typed=False, max_batch_size=N, model_name="multiModal")`` — that object sets the
  precision flags and is what ``Builder.save_config`` writes as ``config.json`` (``builder_config.precision`` /
  ``model_type`` are what the Triton ``multimodal_encoders`` model reads);
- ONE optimisation profile: batch min 1, opt ``max(1, int(N / 2))``, max N on axis 0 of every input, the
  per-sample dims fixed (min = opt = max = the traced shape[1:]); ``build_mllama_engine`` passes the model dtype as
  precision (bfloat16 for the Llama 3.2 Vision checkpoints) and N = ``--max_batch_size`` (upstream default 4;
  tensorrtllm_backend docs/multimodal.md@efb8a497:171 uses max_batch_size × images per request);
- files: ``<output_dir>/model.engine`` and ``<output_dir>/config.json`` with ``output_shape`` recorded from the
  built engine. Unlike upstream it keeps the ONNX file and fails (exit 1) when the parser reports errors (upstream
  logs them and goes on to build).
"""

from __future__ import annotations

import shlex
from pathlib import Path

from pipeline.core.errors import UserError

SCRIPT_NAME = "build_vision_engine.py"
#: precisions upstream's ``torch_dtype_to_str`` produces for the dtypes a vision tower is built in
PRECISIONS = ("bfloat16", "float16", "float32")

Shape = tuple[int, ...]


def profile_shapes(per_sample: dict[str, Shape], max_batch_size: int) -> dict[str, tuple[Shape, Shape, Shape]]:
    """The one optimisation profile, as upstream's ``build_trt_engine`` sets it.

    Args:
        per_sample: input name → its shape without the batch axis (e.g. ``pixel_values`` → (1, 4, 3, 560, 560)).
        max_batch_size: the engine's batch limit N (requests × images).

    Returns:
        name → (min, opt, max) full shapes: batch 1, ``max(1, int(N / 2))``, N; other dims unchanged.

    Raises:
        UserError: N not a positive integer, or a per-sample dim that is not a positive integer (a dynamic dim
            other than batch has no place in the mllama graph).
    """
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise UserError(f"vision.max_batch_size: {max_batch_size!r} is not a positive integer")
    opt = max(1, int(max_batch_size / 2))
    out = {}
    for name, dims in per_sample.items():
        if not all(isinstance(d, int) and d > 0 for d in dims):
            raise UserError(f"vision encoder input {name}: per-sample shape {list(dims)} must be fixed positive dims")
        d = tuple(dims)
        out[name] = ((1, *d), (opt, *d), (max_batch_size, *d))
    return out


_SCRIPT = '''#!/usr/bin/env python3
"""Build the {model_type} vision encoder's TensorRT engine from its ONNX file (written by trtpipe; run on a GPU host in
the TensorRT-LLM container). Mirrors build_trt_engine of tensorrt_llm/tools/multimodal_builder.py@b35ac1b64368:
TensorRT Python builder, one optimisation profile (batch 1 / {opt} / {max_batch}), precision {precision},
model.engine + config.json (Builder.save_config) in --output-dir.

usage: python3 {script} --onnx ONNX_FILE --output-dir DIR
"""
import argparse
import json
import os
import sys

import tensorrt as trt
from tensorrt_llm.builder import Builder

MODEL_TYPE = {model_type!r}
PRECISION = {precision!r}
MAX_BATCH_SIZE = {max_batch}
OUTPUT_NAME = {output_name!r}
# input name -> (min, opt, max) shape: batch on axis 0, the traced per-sample dims fixed
PROFILE = {profile!r}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--onnx", required=True, help="the exported vision encoder (model.onnx)")
    ap.add_argument("--output-dir", required=True, help="where model.engine and config.json go")
    args = ap.parse_args(argv)
    onnx_path = os.path.abspath(args.onnx)
    if not os.path.isfile(onnx_path):
        sys.exit(f"--onnx: {{onnx_path}} does not exist")

    logger = trt.Logger(trt.Logger.INFO)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH"):  # implied (and deprecated) in TensorRT 10
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    config_wrapper = Builder().create_builder_config(precision=PRECISION, model_type=MODEL_TYPE, strongly_typed=False,
                                                     max_batch_size=MAX_BATCH_SIZE, model_name="multiModal")
    config = config_wrapper.trt_builder_config

    parser = trt.OnnxParser(network, logger)
    with open(onnx_path, "rb") as f:
        parsed = parser.parse(f.read(), onnx_path)
    if not parsed:
        for i in range(parser.num_errors):
            print(parser.get_error(i), file=sys.stderr)
        sys.exit(f"TensorRT could not parse {{onnx_path}}")

    names = [network.get_input(i).name for i in range(network.num_inputs)]
    if sorted(names) != sorted(PROFILE):
        sys.exit(f"{{onnx_path}}: inputs {{names}}, this script was written for {{sorted(PROFILE)}}")
    profile = builder.create_optimization_profile()
    for name in names:
        lo, opt, hi = PROFILE[name]
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)

    engine = builder.build_serialized_network(network, config)
    if engine is None:
        sys.exit(f"TensorRT could not build an engine from {{onnx_path}}")
    runtime = trt.Runtime(logger)
    config_wrapper.output_shape = list(runtime.deserialize_cuda_engine(engine).get_tensor_shape(OUTPUT_NAME))

    os.makedirs(args.output_dir, exist_ok=True)
    engine_file = os.path.join(args.output_dir, "model.engine")
    with open(engine_file, "wb") as f:
        f.write(engine)
    Builder.save_config(config_wrapper, os.path.join(args.output_dir, "config.json"))
    print(json.dumps({{"engine": engine_file, "bytes": len(engine), "output_shape": config_wrapper.output_shape}}))


if __name__ == "__main__":
    main()
'''


def render_build_script(per_sample: dict[str, Shape], max_batch_size: int, *, precision: str = "bfloat16",
                        model_type: str = "mllama", output_name: str = "encoder_output") -> str:
    """The GPU host's build script as Python source (see the module docstring for what it does).

    Args:
        per_sample: input name → traced shape without batch (from the ONNX export's example inputs).
        max_batch_size: the profile's max batch N (``vision.max_batch_size`` = requests × images).
        precision: ``bfloat16`` (mllama: the checkpoint's dtype), ``float16`` or ``float32``.
        model_type: upstream's ``--model_type`` (written into config.json).
        output_name: the graph output whose built shape goes into config.json.

    Returns:
        the script text; deterministic for the same arguments (content-keyed stages can hash it).

    Raises:
        UserError: an unknown precision, or as :func:`profile_shapes`.
    """
    if precision not in PRECISIONS:
        raise UserError(f"vision.encoder_dtype: {precision!r} is not one of {', '.join(PRECISIONS)}")
    profile = {n: [list(s) for s in shapes] for n, shapes in profile_shapes(per_sample, max_batch_size).items()}
    return _SCRIPT.format(model_type=model_type, precision=precision, max_batch=max_batch_size,
                          opt=max(1, int(max_batch_size / 2)), output_name=output_name, profile=profile,
                          script=SCRIPT_NAME)


def write_build_script(out_dir: Path, per_sample: dict[str, Shape], max_batch_size: int, *,
                       precision: str = "bfloat16", onnx_path: str = "onnx/model.onnx",
                       engine_dir: str = ".") -> tuple[Path, list[str]]:
    """Write :func:`render_build_script`'s text to ``out_dir/build_vision_engine.py`` and give the command that runs
    it on the GPU host (paths relative to ``out_dir``).

    Returns:
        (the script path, the argv: ``python3 build_vision_engine.py --onnx <onnx_path> --output-dir <engine_dir>``).

    Raises:
        UserError: as :func:`render_build_script`.
    """
    text = render_build_script(per_sample, max_batch_size, precision=precision)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / SCRIPT_NAME
    path.write_text(text)
    path.chmod(0o755)
    return path, ["python3", SCRIPT_NAME, "--onnx", onnx_path, "--output-dir", engine_dir]


def command_line(argv: list[str]) -> str:
    """``argv`` as one shell-quoted line, for a dry run's listing."""
    return shlex.join(argv)
