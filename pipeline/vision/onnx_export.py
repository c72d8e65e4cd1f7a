"""The mllama vision encoder as ONNX: the vision model + projector wrapped as TensorRT-LLM's builder wraps it,
exported, checked with ``onnx.checker``, and run by onnxruntime against the PyTorch module on the same inputs.

Upstream (tensorrt_llm/tools/multimodal_builder.py@b35ac1b64368, 1.2.0rc2 — the newest stored 1.2.x copy; cited by
function, the stored copy has no line numbers):

- ``build_mllama_engine`` wraps ``MLLaMAVisionWrapper(vision_model, multi_modal_projector)``; ``forward(pixel_values,
  aspect_ratio_ids, aspect_ratio_mask)`` returns ``output_proj(vision_model(...).last_hidden_state)``, so the
  projector is inside the engine. It takes ``model.model.vision_model`` / ``model.model.multi_modal_projector``
  when transformers ≥ 4.52 (else ``model.vision_model`` / ``model.multi_modal_projector``).
- Its input names are the processor's keys in order (pixel_values, aspect_ratio_ids, aspect_ratio_mask), the output
  is ``encoder_output``, and every input's axis 0 is dynamic (``{key: {0: "batch"}}``).
- ``export_onnx`` calls ``torch.onnx.export(..., opset_version=17, input_names, output_names, dynamic_axes)``: the
  TorchScript exporter (``dynamo=False`` here, which torch ≥ 2.9 no longer defaults to).

Shapes (one image per sample, ``T`` = tile px, ``P`` = (T / patch)² + 1, ``H`` = text hidden size):
``pixel_values`` float [B, 1, tiles, 3, T, T], ``aspect_ratio_ids`` int64 [B, 1], ``aspect_ratio_mask`` int64
[B, 1, tiles] → ``encoder_output`` float [B, 1, tiles, P, H]; ``1 × tiles × P`` is the decoder's encoder length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.errors import StageError

#: upstream's names and opset (multimodal_builder.py@b35ac1b64368 ``build_mllama_engine`` / ``export_onnx``)
INPUT_NAMES = ("pixel_values", "aspect_ratio_ids", "aspect_ratio_mask")
OUTPUT_NAME = "encoder_output"
OPSET = 17
BATCH_AXIS = "batch"

#: Parity tolerance: |onnxruntime − PyTorch| ≤ ATOL + RTOL × max|PyTorch| over every element. Both sides compute
#: in float32 (≈1.2e-7 relative rounding). They differ only in operator order and fusion (onnxruntime fuses
#: LayerNorm / attention / GELU; reductions of length hidden × 4 accumulate in another order), which grows with
#: depth: ~2e-7 on the tiny model, ~1e-6..1e-5 expected for a 40-layer 1280-wide tower with outputs of order 1. An
#: export bug — a constant-folded batch, swapped inputs, a dropped mask, a wrong tile layout — moves outputs by
#: their own magnitude (≥ 1e-2 relative). 1e-4 relative to the output's scale sits two orders above the first and
#: two below the second. Not for a float16/bfloat16 export: that is compared on the GPU host against its own dtype.
ATOL = 1e-5
RTOL = 1e-4


class MllamaVisionWrapper(torch.nn.Module):
    """Vision model + projector in one module (upstream's ``MLLaMAVisionWrapper``).

    ``forward(pixel_values [B, 1, tiles, 3, T, T], aspect_ratio_ids [B, 1], aspect_ratio_mask [B, 1, tiles])``
    → projected encoder features [B, 1, tiles, P, text hidden].
    """

    def __init__(self, vision_model: torch.nn.Module, output_proj: torch.nn.Module):
        super().__init__()
        self.vision_model = vision_model
        self.output_proj = output_proj

    def forward(self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor,
                aspect_ratio_mask: torch.Tensor) -> torch.Tensor:
        out = self.vision_model(pixel_values, aspect_ratio_ids, aspect_ratio_mask).last_hidden_state
        return self.output_proj(out)


def vision_wrapper(model: Any) -> MllamaVisionWrapper:
    """Wrap an ``MllamaForConditionalGeneration``'s vision tower and projector (transformers ≥ 4.52 keeps them under
    ``model.model``, older releases on the model itself — upstream checks the same way). Eval mode."""
    inner = model.model if hasattr(model, "model") and hasattr(model.model, "vision_model") else model
    return MllamaVisionWrapper(inner.vision_model, inner.multi_modal_projector).eval()


def encoder_inputs(processed: Any, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The three encoder inputs, in :data:`INPUT_NAMES` order, from an mllama image processor's output
    (``return_tensors="pt"``); ``pixel_values`` cast to ``dtype``, the others int64. Extra keys (``num_tiles``)
    are dropped — the processor wrapper upstream uses pops it too."""
    out = {n: processed[n] for n in INPUT_NAMES}
    out["pixel_values"] = out["pixel_values"].to(dtype)
    return out


def export_vision_onnx(wrapper: MllamaVisionWrapper, example: dict[str, torch.Tensor], onnx_path: Path) -> Path:
    """Export ``wrapper`` to ``onnx_path`` as upstream does (opset 17, :data:`INPUT_NAMES` → :data:`OUTPUT_NAME`,
    axis 0 of every input named ``batch``), then ``onnx.checker.check_model`` the written file.

    Args:
        wrapper: the module to trace (its dtype is the graph's dtype).
        example: the tracing inputs (see :func:`encoder_inputs`); only their per-sample shapes are baked in.
        onnx_path: the file to write; its parent is created. Weights over 2 GiB go to external data beside it.

    Returns:
        ``onnx_path``.

    Raises:
        StageError: the exporter or the checker failed (the message carries their one-line reason).
    """
    import onnx

    onnx_path.parent.mkdir(parents=True, exist_ok=True)
    args = tuple(example[n] for n in INPUT_NAMES)
    try:
        with torch.no_grad():
            torch.onnx.export(wrapper, args, str(onnx_path), opset_version=OPSET, input_names=list(INPUT_NAMES),
                              output_names=[OUTPUT_NAME], dynamic_axes={n: {0: BATCH_AXIS} for n in INPUT_NAMES},
                              dynamo=False)
        onnx.checker.check_model(str(onnx_path), full_check=True)
    except Exception as exc:  # the exporter and checker raise many types; one line for the stage
        raise StageError(f"vision encoder ONNX export of {onnx_path.name} failed: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    return onnx_path


def onnx_signature(onnx_path: Path) -> dict[str, list[int | str]]:
    """Input and output shapes the ONNX graph declares: ``{name: [dim, …]}``, a dynamic dim as its name
    (``"batch"``), in graph order (inputs first)."""
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*graph.input, *graph.output)}


@dataclass(frozen=True)
class Parity:
    """onnxruntime vs PyTorch on the same inputs.

    Attributes:
        max_abs_diff: the largest |ort − torch| over every element of every batch compared (output units).
        ref_max_abs: the largest |torch| output, the scale the tolerance is relative to.
        tolerance: :data:`ATOL` + :data:`RTOL` × ``ref_max_abs``.
        batch_sizes: the batch sizes run (more than one shows the batch axis is really dynamic).
        output_shape: the PyTorch output shape of the last batch, [B, 1, tiles, P, H].
    """

    max_abs_diff: float
    ref_max_abs: float
    tolerance: float
    batch_sizes: tuple[int, ...]
    output_shape: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form for a stage manifest."""
        return {"max_abs_diff": self.max_abs_diff, "ref_max_abs": self.ref_max_abs, "tolerance": self.tolerance,
                "atol": ATOL, "rtol": RTOL, "batch_sizes": list(self.batch_sizes),
                "output_shape": list(self.output_shape)}


def ort_session(onnx_path: Path, threads: int = 1) -> Any:
    """An onnxruntime CPU session on ``onnx_path`` with ``threads`` intra-op threads (1: the machines are shared)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])


def check_parity(onnx_path: Path, wrapper: MllamaVisionWrapper, batches: list[dict[str, torch.Tensor]]) -> Parity:
    """Run every batch through onnxruntime and ``wrapper``; refuse a difference above the tolerance.

    Args:
        onnx_path: the exported graph.
        wrapper: the PyTorch module it was exported from (float32).
        batches: input dicts as :func:`encoder_inputs` returns, of any batch sizes.

    Returns:
        :class:`Parity` over all batches.

    Raises:
        StageError: onnxruntime failed on a batch, an output shape differs, or the max abs difference is above
            :data:`ATOL` + :data:`RTOL` × max|PyTorch output| (the message names both numbers).
    """
    if not batches:
        raise ValueError("check_parity needs at least one batch")
    sess = ort_session(onnx_path)
    worst, scale, sizes, shape = 0.0, 0.0, [], ()
    for feeds in batches:
        with torch.no_grad():
            ref = wrapper(*(feeds[n] for n in INPUT_NAMES)).float().numpy()
        try:
            got = sess.run([OUTPUT_NAME], {n: feeds[n].numpy() for n in INPUT_NAMES})[0]
        except Exception as exc:
            raise StageError(f"onnxruntime could not run {onnx_path.name} at batch "
                             f"{feeds['pixel_values'].shape[0]}: {str(exc).splitlines()[0]}") from exc
        if got.shape != ref.shape:
            raise StageError(f"{onnx_path.name}: onnxruntime output {list(got.shape)} ≠ PyTorch {list(ref.shape)}")
        worst = max(worst, float(np.max(np.abs(got.astype(np.float64) - ref))))
        scale = max(scale, float(np.max(np.abs(ref))))
        sizes.append(int(ref.shape[0]))
        shape = tuple(int(d) for d in ref.shape)
    tol = ATOL + RTOL * scale
    if not worst <= tol:  # also refuses NaN
        raise StageError(f"{onnx_path.name}: onnxruntime differs from PyTorch by {worst:.3g} (max abs), above the "
                         f"tolerance {tol:.3g} (= {ATOL:g} + {RTOL:g} × max|output| {scale:.3g})")
    return Parity(worst, scale, tol, tuple(sizes), shape)
