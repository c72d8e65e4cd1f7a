"""``BuildLayout``: the one object that knows every path of a build directory.

A build (``trtpipe build RECIPE --out OUT``, default ``artifacts/<recipe name>``) is::

    OUT/quantize/               ModelOpt stage: manifest.json, trtllm_ckpt/, hf_ckpt/ (or quantize_command.sh)
    OUT/vision/                 vision encoder stage (vision-language recipes): onnx/model.onnx, config.json, manifest.json
    OUT/engine/                 engine stage: TensorRT engine / LLM-API config / CPU engine + manifest.json
    OUT/triton_repo/            the Triton model repository + manifest.json
    OUT/recipe.yaml             the resolved recipe of the last successful build
    OUT/.build.lock             held (flock) by the ``trtpipe build`` writing OUT (:mod:`pipeline.core.lock`)
    OUT/triton_server-<port>.log   server logs of ``trtpipe serve`` (one per gRPC port; the newest 8 are kept)
    OUT/eval_outputs/<key>.jsonl   outputs ``trtpipe eval`` generated on this build (cached by content key)

No other module spells these names; stages, ``serve``, ``bench``, ``eval`` and ``deploy`` ask the layout.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

#: the build stages in pipeline order; each owns the directory of the same name
STAGES = ("quantize", "engine", "triton_repo")
#: the vision encoder stage of a vision-language recipe (issue #46): runs between quantize and engine, only when the
#: recipe has a ``vision`` section (so not in :data:`STAGES`, which every build runs)
VISION_STAGE = "vision"
RECIPE_FILE = "recipe.yaml"
LOCK_FILE = ".build.lock"
#: the quantize stage's two exports (subdirectories of its stage directory)
TRTLLM_CKPT = "trtllm_ckpt"
HF_CKPT = "hf_ckpt"
#: the LLM-API model's configuration inside the model repository
LLMAPI_MODEL_YAML = Path("tensorrt_llm") / "1" / "model.yaml"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclasses.dataclass(frozen=True)
class BuildLayout:
    """Every path of one build directory ``root`` (nothing is created by asking)."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    # ----------------------------------------------------------------- stage directories
    def stage_dir(self, stage: str) -> Path:
        """``root/<stage>`` for one of :data:`STAGES`. Raises ``ValueError`` for another name."""
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r} (stages: {', '.join(STAGES)})")
        return self.root / stage

    @property
    def quantize(self) -> Path:
        """The quantize stage directory."""
        return self.root / "quantize"

    @property
    def trtllm_ckpt(self) -> Path:
        """ModelOpt's TensorRT-LLM checkpoint (``config.json`` + ``rank{N}.safetensors``)."""
        return self.quantize / TRTLLM_CKPT

    @property
    def hf_ckpt(self) -> Path:
        """ModelOpt's unified HF checkpoint with the tokenizer files."""
        return self.quantize / HF_CKPT

    @property
    def vision(self) -> Path:
        """The vision encoder stage directory (ONNX graph, TensorRT engine on a GPU host, ``config.json`` as the
        Triton ``multimodal_encoders`` model reads it)."""
        return self.root / VISION_STAGE

    @property
    def engine(self) -> Path:
        """The engine stage directory (``gpt_model_path`` of the TensorRT engine)."""
        return self.root / "engine"

    @property
    def triton_repo(self) -> Path:
        """The Triton model repository."""
        return self.root / "triton_repo"

    @property
    def recipe_file(self) -> Path:
        """The resolved recipe of the last successful build."""
        return self.root / RECIPE_FILE

    @property
    def lock_file(self) -> Path:
        """The lock a build holds while it writes this directory (:func:`pipeline.core.lock.exclusive`)."""
        return self.root / LOCK_FILE

    def server_log(self, grpc_port: int) -> Path:
        """Log of a ``trtpipe serve`` of this build on ``grpc_port``."""
        return self.root / f"triton_server-{int(grpc_port)}.log"

    def server_logs(self) -> list[Path]:
        """Every server log of this build (:meth:`server_log` of any port), in no particular order."""
        return [p for p in self.root.glob("triton_server-*.log") if p.stem.removeprefix("triton_server-").isdigit()]

    def eval_outputs(self, key: str) -> Path:
        """Generated outputs of ``trtpipe eval`` on this build for one content key (repo key, data, params)."""
        return self.root / "eval_outputs" / f"{key}.jsonl"

    # ----------------------------------------------------------------- questions about a build
    def is_build(self) -> bool:
        """True when ``root`` holds at least one stage directory."""
        return any((self.root / s).is_dir() for s in STAGES)

    def has_repository(self) -> bool:
        """True when the model repository holds at least one ``<model>/config.pbtxt``."""
        return any(self.triton_repo.glob("*/config.pbtxt"))
