"""The vision encoder stage's typed result (no torch import: the build, serve and repository code read it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, ClassVar

from pipeline.core.results import StageResult

#: the ONNX graph inside the stage directory (upstream's ``<output_dir>/onnx`` folder, multimodal_builder.py@b35ac1b64368)
ONNX_FILE = Path("onnx") / "model.onnx"
#: the TensorRT engine a GPU host builds next to it, and the config ``multimodal_encoders`` reads
ENGINE_FILE = "model.engine"
CONFIG_FILE = "config.json"
PREPROCESSOR_FILE = "preprocessor_config.json"


@dataclasses.dataclass(frozen=True)
class VisionResult(StageResult):
    """The vision encoder stage: ``onnx/model.onnx``, ``config.json``, ``preprocessor_config.json`` and, on a GPU
    host, ``model.engine`` (dry run: ``vision_command.sh`` and the two scripts it runs)."""

    STAGE: ClassVar[str] = "vision"

    @property
    def onnx(self) -> Path:
        """The exported ONNX graph (vision model + projector; exists when built)."""
        return self.path / ONNX_FILE

    @property
    def engine_file(self) -> Path:
        """The TensorRT engine (exists only when built on a GPU host)."""
        return self.path / ENGINE_FILE

    @property
    def config(self) -> Path:
        """``config.json`` as the Triton ``multimodal_encoders`` model reads it (``builder_config``)."""
        return self.path / CONFIG_FILE

    @property
    def parity(self) -> dict[str, Any] | None:
        """onnxruntime vs PyTorch: ``max_abs_diff``, ``tolerance``, ``batch_sizes`` … (``None`` in a dry run)."""
        return self.manifest.get("parity")

    @property
    def encoder_len_per_image(self) -> int:
        """Encoder vectors one image yields (max tiles × ((tile / patch)² + 1)): 6404 at 560 px, 68 on the CPU model."""
        return int(self.manifest["encoder_len_per_image"])

    @property
    def dtype(self) -> str:
        """The graph's / engine's dtype (``float32`` on the CPU target, the recipe's ``encoder_dtype`` on a GPU)."""
        return str(self.manifest["dtype"])
