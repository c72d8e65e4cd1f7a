"""What ``trtpipe serve`` serves, and whether this runtime can serve it.

:class:`ServeTarget` resolves ``[ARTIFACT_DIR | RECIPE]`` (a build directory, a recipe's default build, a model
repository, or the last build) to a model repository and its build; :func:`check_runtime` refuses artifacts this
Triton cannot run (a TensorRT-LLM repository on the CPU Triton, an engine built for another runtime) before any
server starts. :func:`check_files` (run by :func:`check_runtime` and by the trtllm-serve frontend) refuses a build
whose served files no longer have the sha256 the build recorded (a truncated copy, a bit flip). The stage itself is
:func:`pipeline.serve.stage.run`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from pipeline.core import artifacts
from pipeline.core.errors import IncompatibleArtifactError, UserError
from pipeline.core.layout import BuildLayout
from pipeline.engine.result import EngineResult
from pipeline.recipe.serving_path import path_of_engine
from pipeline.triton.server import TritonInstall

_TRTLLM_BACKEND = re.compile(r'^\s*backend\s*:\s*"tensorrtllm"', re.M)


@dataclasses.dataclass(frozen=True)
class ServeTarget:
    """A model repository to serve and, when it belongs to one, its build."""

    repo: Path
    layout: BuildLayout | None = None

    @classmethod
    def resolve(cls, target: Path | BuildLayout | None, root: Path = artifacts.DEFAULT_ARTIFACTS_ROOT) -> ServeTarget:
        """``trtpipe serve [ARTIFACT_DIR | RECIPE]``: ``None`` → the last build; a ``.yaml`` recipe → its
        default build dir ``artifacts/<name>``; a build dir (holding stage dirs) or a model repository.

        Raises:
            UserError: nothing built yet / no model repository there (one line: run ``trtpipe build``).
        """
        if isinstance(target, BuildLayout):
            return cls(_repo_of(target, hint="RECIPE"), target)
        if target is None:
            build = artifacts.last_build(root)
            if build is None:
                raise UserError(f"no build found ({root / artifacts.LAST_BUILD_FILE}): run `trtpipe build RECIPE` first")
            layout = BuildLayout(build)
            return cls(_repo_of(layout, hint="RECIPE"), layout)
        target = Path(target)
        if target.is_file() and target.suffix in (".yaml", ".yml"):
            from pipeline.recipe import load_recipe

            recipe = load_recipe(target)
            layout = BuildLayout(artifacts.default_build_dir(recipe.name or target.stem, root))
            return cls(_repo_of(layout, hint=str(target)), layout)
        if not target.exists():
            raise UserError(f"{target} does not exist: give a build directory, a model repository or a recipe")
        if BuildLayout(target).is_build():
            layout = BuildLayout(target)
            return cls(_repo_of(layout, hint="RECIPE"), layout)
        if target.is_dir() and any(target.glob("*/config.pbtxt")):
            parent = BuildLayout(target.parent)
            return cls(target, parent if parent.is_build() and parent.triton_repo.resolve() == target.resolve() else None)
        raise UserError(f"{target} is neither a build directory nor a Triton model repository (no */config.pbtxt)")

    @property
    def world_size(self) -> int:
        """TP×PP of the build's engine (1 without a build or engine manifest)."""
        if self.layout is None:
            return 1
        engine = EngineResult.load(self.layout.engine)
        return engine.world_size if engine is not None else 1

    @property
    def launch_options(self) -> dict:
        """The tritonserver options the build's recipe needs beyond the repository (the multimodal repository's
        ``load_models`` / ``cuda_pool_gpu0_bytes``: :func:`pipeline.triton_repo.vision.tritonserver_options`);
        ``{}`` without a build recipe."""
        if self.layout is None or not self.layout.recipe_file.is_file():
            return {}
        from pipeline.recipe import load_recipe
        from pipeline.triton_repo.vision import tritonserver_options

        try:
            return tritonserver_options(load_recipe(self.layout.recipe_file))
        except Exception:  # a build recipe this trtpipe no longer validates: serve the repository as it is
            return {}

    def log_file(self, grpc_port: int) -> Path:
        """Where the server log goes: next to the build, else next to the repository."""
        return (self.layout or BuildLayout(self.repo.parent)).server_log(grpc_port)


def _repo_of(layout: BuildLayout, hint: str) -> Path:
    if not layout.has_repository():
        raise UserError(f"no model repository at {layout.triton_repo}: run `trtpipe build {hint}` first")
    return layout.triton_repo


def served_files(layout: BuildLayout) -> list[tuple[Path, dict[str, str]]]:
    """What a server of this build loads, with the sha256 the build recorded: ``[(directory, {relative path:
    sha256})]``. The engine stage's files (the CPU engine's weights, config and tokenizer: its manifest's
    ``files``; a TensorRT engine: ``engine_files``) and, for an engine that loads the quantize stage's checkpoint
    at start (``build.engine: pytorch`` on a GPU: the LLM API's ``model``), that checkpoint's files as the quantize
    manifest's ``outputs`` recorded them. Empty when nothing was built or nothing recorded."""
    engine = EngineResult.load(layout.engine)
    if engine is None or not engine.built:
        return []
    m = engine.manifest
    out = []
    if m.get("files"):
        out.append((engine.path, m["files"]))
    if m.get("engine_files"):
        out.append((engine.path / m.get("engine_dir", "."), m["engine_files"]))
    checkpoint = (m.get("checkpoint") or {}).get("path") if path_of_engine(m).loads_checkpoint_at_start else None
    if checkpoint:  # the LLM API loads it at start (a TensorRT engine's manifest names the checkpoint it was built from)
        ckpt = Path(checkpoint)
        recorded = ((artifacts.read_manifest(ckpt.parent) or {}).get("outputs") or {}).get(ckpt.name)
        if recorded:
            out.append((ckpt, recorded))
    return out


def check_files(target: ServeTarget) -> None:
    """Refuse a build whose served files (:func:`served_files`) are missing or no longer have their recorded
    sha256 (:func:`pipeline.core.artifacts.changed_files`); a bare model repository has nothing recorded.

    Raises:
        IncompatibleArtifactError: one line naming the first such file (and how many more).
    """
    if target.layout is None:
        return
    problems = [line for root, recorded in served_files(target.layout) for line in artifacts.changed_files(root, recorded)]
    if problems:
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise IncompatibleArtifactError(f"{problems[0]}{more}: the build's files no longer match the hashes recorded "
                                        "when it was built — rebuild it with `trtpipe build RECIPE --force`")


def check_runtime(target: ServeTarget, install: TritonInstall) -> list[str]:
    """Refuse artifacts this Triton cannot serve; returns warnings to show (may be empty).

    * Any build whose served files changed since the build (:func:`check_files`) → refused.
    * CPU Triton + a repository using the C++ ``tensorrtllm`` backend → refused (GPU image needed).
    * GPU Triton + a TensorRT engine → ``pipeline.trtllm.runtime.check_engine_compatible(
      manifest, runtime_facts())`` (versions and GPU; its files were checked above); any difference is refused.
    * GPU Triton whose TensorRT-LLM is not the release matrix's target → a warning naming the image.

    Raises:
        IncompatibleArtifactError: listing what differs.
    """
    check_files(target)
    repo = target.repo
    uses_trtllm = any(_TRTLLM_BACKEND.search(p.read_text(errors="replace")) for p in repo.glob("*/config.pbtxt"))
    if install.kind == "cpu" and uses_trtllm:
        raise IncompatibleArtifactError(
            f"{repo} uses the tensorrtllm backend (a TensorRT-LLM GPU engine) and this machine has only the CPU "
            "Triton: serve it in the GPU deploy image (docs/deploy-gpu.md) or build a cpu recipe"
        )
    if install.kind != "gpu":
        return []
    from pipeline.trtllm.release import default_release
    from pipeline.trtllm.runtime import check_engine_compatible, runtime_facts

    facts = runtime_facts()
    target_release = default_release()
    warnings = []
    if facts["tensorrt_llm"] and facts["tensorrt_llm"] != target_release.tensorrt_llm:
        warnings.append(f"this runtime has TensorRT-LLM {facts['tensorrt_llm']}; trtpipe targets "
                        f"{target_release.tensorrt_llm} ({target_release.image}, `trtpipe release`)")
    engine = EngineResult.load(target.layout.engine) if target.layout is not None else None
    if not uses_trtllm or engine is None:
        return warnings
    problems = check_engine_compatible(engine.manifest, facts)
    if problems:
        raise IncompatibleArtifactError(
            f"engine {engine.path} does not match this runtime: {'; '.join(problems)} "
            "— rebuild it here with `trtpipe build RECIPE --force`"
        )
    return warnings
