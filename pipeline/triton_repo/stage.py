"""Triton model-repository stage: the recipe's engine behind the TensorRT-LLM Triton interface.

``run(recipe, out_dir, quantized=..., engine=...)`` writes ``out_dir`` (atomically, with a manifest)
as a complete Triton model repository for ``build.engine``:

- ``tensorrt``: ``ensemble``, ``preprocessing``, ``tensorrt_llm`` (C++ ``tensorrtllm`` backend, empty
  ``1/``), ``postprocessing``, ``tensorrt_llm_bls`` — the TensorRT-LLM ≤1.2 ``inflight_batcher_llm`` layout.
- ``cpu``: the same layout and tensors; ``tensorrt_llm`` is a decoupled python model that runs
  :class:`pipeline.cpu_runtime.engine.CpuEngine` on ``engine.path``. With ``build.cpu.detokenize: engine``
  (default) it also outputs ``text_output`` and the ``ensemble`` maps it straight to its own
  ``text_output``: preprocessing → tensorrt_llm, the same ensemble inputs and outputs, one
  python-backend round trip less per streamed token; ``postprocessing`` stays in the repository (the
  three-step ensemble of the GPU path with ``detokenize: postprocessing``).
- ``pytorch``: the LLM-API layout: one python ``tensorrt_llm`` model configured by ``1/model.yaml``
  (``LLM()`` kwargs from the engine stage's ``llm_api_config.yaml``) with upstream's ``llmapi`` interface plus
  ``sampling_param_{min_tokens,ignore_eos,skip_special_tokens}``. Its ``model.py`` is trtpipe's
  (``models/llmapi``, copied like the other python models): ``tensorrt_llm.LLM`` on a GPU, and on the cpu
  target (parameter ``llm_runtime: trtpipe_cpu``) :class:`pipeline.cpu_runtime.llm.LLM` over the CPU engine.

Every ``config.pbtxt`` is rendered from a jinja2 template in the ``triton_repo`` package
(``StrictUndefined``), parsed into ``ModelConfig`` (unknown fields fail here, not in Triton) and written
back with ``text_format``. The recipe → Triton parameter-name translation lives only in
:func:`tensorrt_llm_parameters`. The tokenizer files are copied into ``preprocessing/tokenizer/`` and
every python model's ``tokenizer_dir`` is ``../preprocessing/tokenizer`` (relative to its model dir).

Streaming text: ``tensorrt_llm_bls`` detokenizes incrementally per request in its own process, and so
does the CPU ``tensorrt_llm`` model when it writes ``text_output``. The three-step ``ensemble``'s
``postprocessing`` sees every streamed step as a separate request, so it keeps one incremental
detokenizer per stream keyed by the request id (copied by the ensemble scheduler onto each composing
request; clients must set a unique ``request_id``) and runs as ONE instance when
``serving.decoupled_mode`` (state must live in one process; its dynamic batching keeps throughput).
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from pipeline.core import artifacts
from pipeline.core.errors import StageError
from pipeline.core.layout import BuildLayout
from pipeline.engine.result import EngineResult
from pipeline.quantize.result import QuantizeResult
from pipeline.recipe import Recipe
from pipeline.recipe.consumers import consumed
from pipeline.recipe.serving_path import serving_path
from pipeline.recipe.vision import cross_attention
from pipeline.triton.model_config import write_model_config
from pipeline.triton_repo import PACKAGE_DIR, layouts, vision
from pipeline.triton_repo.render import render_model_config
from pipeline.triton_repo.result import RepoResult
from pipeline.trtllm.guided import TOKENIZER_INFO_FILE, write_tokenizer_info
from pipeline.trtllm.triton_contract import repository_problems

STAGE = RepoResult.STAGE


TOKENIZER_SCRIPT = "tokenizer_command.sh"  # dry run: writes preprocessing/tokenizer (the chain's repository step)


def _bool(value: bool) -> str:
    return "true" if value else "false"


def _engine_writes_text(recipe: Recipe) -> bool:
    """The CPU ``tensorrt_llm`` model writes ``text_output`` and the ensemble skips postprocessing."""
    return serving_path(recipe).tensorrt_llm_model == "cpu" and recipe.build.cpu.detokenize == "engine"


def tokenizer_info_path(repo_dir: Path | None) -> str:
    """Where the repository keeps the xgrammar tokenizer-info file (``tensorrt_llm/xgrammar_tokenizer_info.json``):
    absolute under ``repo_dir`` (the C++ backend opens the path as given, model_instance_state.cc@c2e65b88d852:430),
    relative to the repository root without one."""
    rel = Path("tensorrt_llm") / TOKENIZER_INFO_FILE
    return str((Path(repo_dir) / rel).resolve()) if repo_dir is not None else str(rel)


def tensorrt_llm_parameters(recipe: Recipe, engine_dir: Path, *, paged_context_fmha: bool = True,
                            repo_dir: Path | None = None) -> dict[str, str]:
    """The ``parameters`` of the ``tensorrt_llm`` model: the ONE recipe → Triton name translation.

    ``build.kv_cache_config.free_gpu_memory_fraction`` → ``kv_cache_free_gpu_mem_fraction``,
    ``max_tokens`` → ``max_tokens_in_paged_kv_cache``, ``enable_block_reuse`` → ``enable_kv_cache_reuse``,
    ``max_attention_window`` → ``max_attention_window_size``, ``host_cache_size`` → ``kv_cache_host_memory_bytes``,
    ``scheduler_config.capacity_scheduler_policy`` → ``batch_scheduler_policy`` (lower case),
    ``build.enable_chunked_prefill`` → ``enable_chunked_context``, ``build.lora.cache_*`` → ``lora_cache_*``; names and meanings from
    tensorrtllm_backend docs/model_config.md (docs/reference/triton-model-repository.md §3.2). Optional knobs left unset in the recipe
    are omitted (never left as ``${…}``). For the CPU engine the parameters are exactly those its python
    model reads (engine path, beam width, exclude-input, cancellation period, ``cpu_num_threads``): its KV pool
    and scheduler limits are in the engine directory's ``engine_config.json``.

    ``build.guided_decoding_backend`` → ``guided_decoding_backend`` + ``xgrammar_tokenizer_info_path``
    (:func:`tokenizer_info_path` of ``repo_dir``, the repository's final directory; both empty when off, for the C++
    backend reads them unguarded; the CPU model reads them the same way).

    KV-cache reuse and chunked context need paged context FMHA in the engine; when the engine
    manifest says trtllm-build turned it off (``effective_plugins``), both are set to false here
    so the runtime does not refuse the engine.

    Args:
        recipe: the validated recipe.
        engine_dir: the engine directory (``gpt_model_path``), made absolute.
        paged_context_fmha: whether the built engine has paged context FMHA.

    Returns:
        ``{parameter key: string value}`` in template order.
    """
    b, s, kv = recipe.build, recipe.serving, recipe.build.kv_cache_config
    guided = {"guided_decoding_backend": b.guided_decoding_backend or "",
              "xgrammar_tokenizer_info_path": tokenizer_info_path(repo_dir) if b.guided_decoding_backend else ""}
    if serving_path(recipe).tensorrt_llm_model == "cpu":  # exactly what triton_repo/models/tensorrt_llm_cpu/model.py reads
        params = {
            "gpt_model_path": str(Path(engine_dir).resolve()),
            "max_beam_width": str(b.max_beam_width),
            "exclude_input_in_output": _bool(s.exclude_input_in_output),
            "cancellation_check_period_ms": str(s.cancellation_check_period_ms),
            "stats_check_period_ms": str(s.stats_check_period_ms),
        }
        if b.cpu.num_threads is not None:
            params["cpu_num_threads"] = str(b.cpu.num_threads)
        if _engine_writes_text(recipe):  # the model also writes text_output (the ensemble skips postprocessing)
            params["tokenizer_dir"] = layouts()["tokenizer"]["param_value"]
            params["skip_special_tokens"] = _bool(s.skip_special_tokens)
        if b.guided_decoding_backend:
            params.update(guided)
        return params
    params: dict[str, str] = {
        "max_beam_width": str(b.max_beam_width),
        "gpt_model_type": s.batching_strategy,
        "gpt_model_path": str(Path(engine_dir).resolve()),
        "batch_scheduler_policy": b.scheduler_config.capacity_scheduler_policy.lower(),
        "kv_cache_free_gpu_mem_fraction": repr(float(kv.free_gpu_memory_fraction)),
        "enable_kv_cache_reuse": _bool(kv.enable_block_reuse and paged_context_fmha),
        "enable_chunked_context": _bool(b.enable_chunked_prefill and paged_context_fmha),
        "exclude_input_in_output": _bool(s.exclude_input_in_output),
        "cancellation_check_period_ms": str(s.cancellation_check_period_ms),
        "stats_check_period_ms": str(s.stats_check_period_ms),
    }
    optional = {
        "max_tokens_in_paged_kv_cache": kv.max_tokens,
        "max_attention_window_size": kv.max_attention_window,
        "kv_cache_host_memory_bytes": kv.host_cache_size,
    }
    lora = b.lora
    if lora is not None:  # the C++ backend's PEFT cache (model_instance_state.cc@c2e65b88d852:289-351)
        optional.update({"lora_cache_gpu_memory_fraction": lora.cache_gpu_memory_fraction,
                         "lora_cache_host_memory_bytes": lora.cache_host_memory_bytes,
                         "lora_cache_optimal_adapter_size": lora.cache_optimal_adapter_size,
                         "lora_cache_max_adapter_size": lora.cache_max_adapter_size})
    params.update({k: str(v) for k, v in optional.items() if v is not None})
    # the C++ tensorrtllm backend
    cpp = layouts()["cpp"]
    params["FORCE_CPU_ONLY_INPUT_TENSORS"] = cpp["force_cpu_only_input_tensors"]
    params["executor_worker_path"] = cpp["executor_worker_path"]
    # read unguarded by the backend's guided-decoding setup: a missing key fails the model load
    # (model_instance_state.cc@c2e65b88d852:413-415, pipeline/data/triton_backend_contract.yaml);
    # empty = guided decoding off
    params["tokenizer_dir"] = layouts()["tokenizer"]["param_value"]
    params["xgrammar_tokenizer_info_path"] = guided["xgrammar_tokenizer_info_path"]
    params["guided_decoding_backend"] = guided["guided_decoding_backend"]
    return params


# ---------------------------------------------------------------------------------------- configs
def model_configs(recipe: Recipe, engine_dir: Path, *, paged_context_fmha: bool = True,
                  repo_dir: Path | None = None, vision_dir: Path | None = None) -> dict[str, Any]:
    """``{model name: ModelConfig}`` of every model the repository for ``recipe`` contains
    (``paged_context_fmha``, ``repo_dir``: see :func:`tensorrt_llm_parameters`; ``vision_dir``: the build's vision
    stage directory, default beside ``engine_dir``; a vision recipe adds ``multimodal_encoders``, :mod:`.vision`)."""
    s, lay, path = recipe.serving, layouts(), serving_path(recipe)
    common = dict(
        max_batch_size=recipe.triton_max_batch_size,
        decoupled=s.decoupled_mode,
        max_queue_delay_microseconds=s.max_queue_delay_microseconds,
        max_queue_size=s.max_queue_size,
        logits_datatype=lay["logits_datatype"],
    )
    if path.llm_api:
        runtime = lay["llmapi"]["llm_runtime"][path.target]
        ctx = dict(common, max_batch_size=lay["llmapi"]["triton_max_batch_size"], llm_runtime=runtime,
                   multimodal=recipe.vision is not None, max_num_images=str(getattr(recipe.vision, "max_images_per_request", 1)))
        return {"tensorrt_llm": render_model_config("llmapi_tensorrt_llm", **ctx)}
    tok = lay["tokenizer"]["param_value"]
    post_count = lay["streaming_postprocessing_instance_count"] if s.decoupled_mode else s.postprocessing_instance_count
    backend = lay["cpp"]["triton_backend"] if path.tensorrt_llm_model == "cpp" else "python"
    engine_text = _engine_writes_text(recipe)
    mm = vision.template_context(recipe, vision_dir or vision.vision_dir_of(engine_dir))
    common["vision"], common["features_data_type"] = mm["vision"], mm["features_data_type"]
    encoders = {"multimodal_encoders": render_model_config(
        "multimodal_encoders", **common, parameters=mm["multimodal_encoders"])} if mm["vision"] else {}
    return {
        "ensemble": render_model_config("ensemble", **common, engine_text=engine_text),
        "preprocessing": render_model_config(
            "preprocessing", **common, instance_count=s.preprocessing_instance_count,
            parameters={"tokenizer_dir": tok, "add_special_tokens": _bool(s.add_special_tokens), **mm.get("preprocessing", {})},
        ),
        **encoders,
        "tensorrt_llm": render_model_config(
            "tensorrt_llm", **common, backend=backend, engine_text=engine_text,
            parameters={**tensorrt_llm_parameters(recipe, engine_dir, paged_context_fmha=paged_context_fmha,
                                                  repo_dir=repo_dir), **mm.get("tensorrt_llm", {})},
        ),
        "postprocessing": render_model_config(
            "postprocessing", **common, instance_count=post_count,
            parameters={"tokenizer_dir": tok, "skip_special_tokens": _bool(s.skip_special_tokens)},
        ),
        "tensorrt_llm_bls": render_model_config(
            "tensorrt_llm_bls", **common, instance_count=s.bls_instance_count,
            parameters={
                "tokenizer_dir": tok,
                "add_special_tokens": _bool(s.add_special_tokens),
                "skip_special_tokens": _bool(s.skip_special_tokens),
                "accumulate_tokens": _bool(s.accumulate_tokens),
                "tensorrt_llm_model_name": "tensorrt_llm",
                **mm.get("tensorrt_llm_bls", {}),
            },
        ),
    }


def runtime_conflicts(recipe: Recipe, engine: EngineResult) -> list[str]:
    """Runtime knobs the engine cannot honour, so the repository turns them off (:func:`tensorrt_llm_parameters`):
    chunked context and KV-cache reuse need paged context FMHA (docs/reference/trtllm-1.2.1-contract.md §2)."""
    if engine.paged_context_fmha:
        return []
    b = recipe.build
    return [f"{knob}: true needs paged context FMHA, which this engine does not have; the repository turns it off"
            for knob, on in (("build.enable_chunked_prefill", b.enable_chunked_prefill),
                             ("build.kv_cache_config.enable_block_reuse", b.kv_cache_config.enable_block_reuse)) if on]


# ---------------------------------------------------------------------------------------- files
def template_hashes() -> dict[str, str]:
    """sha256 of every template/model file of the ``triton_repo`` package and of the shared python files copied from
    outside it (``../core/tokenizer.py``) (part of the cache key)."""
    hashes = {
        k: v for k, v in artifacts.file_hashes(PACKAGE_DIR).items()
        if "__pycache__" not in k and not k.endswith(".pyc")
    }
    return hashes | {rel: artifacts.sha256_file(PACKAGE_DIR / rel) for rel in layouts()["shared_python"] if rel.startswith("../")}


def _install_python_model(model_dir: Path, source: str) -> None:
    """Copy ``models/<source>/model.py`` and the shared modules into ``model_dir/1/``."""
    version = model_dir / "1"
    version.mkdir(parents=True, exist_ok=True)
    shutil.copy2(PACKAGE_DIR / "models" / source / "model.py", version / "model.py")
    for rel in layouts()["shared_python"]:
        shutil.copy2(PACKAGE_DIR / rel, version / Path(rel).name)


def _copy_tokenizer(hf_ckpt: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files found in ``hf_ckpt`` into ``dest``; returns their names.

    Raises:
        StageError: ``hf_ckpt`` holds no tokenizer file.
    """
    dest.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in layouts()["tokenizer"]["files"]:
        if (hf_ckpt / name).is_file():
            shutil.copy2(hf_ckpt / name, dest / name)
            copied.append(name)
    if not any(n.startswith("tokenizer") or n in ("vocab.json",) for n in copied):
        raise StageError(f"{hf_ckpt}: no tokenizer files (tokenizer.json / tokenizer.model) to put in the Triton repository")
    return copied


def _write_tokenizer_script(repo: Path, quantized: QuantizeResult, recipe: Recipe, subdir: str) -> None:
    """Dry run: ``tokenizer_command.sh``, the chain's repository step: writes ``<repo>/<subdir>`` (every python
    model's ``tokenizer_dir``) from the model the quantize script read (its ``--model_dir``)."""
    from pipeline.core.scripts import save_tokenizer

    cmd = quantized.manifest.get("command") or []
    model = cmd[cmd.index("--model_dir") + 1] if "--model_dir" in cmd else recipe.model.source
    text = ("#!/usr/bin/env bash\n# Generated by trtpipe (dry run). The chain: after ../quantize/quantize_command.sh and "
            "../engine/trtllm_build.sh,\n# this writes the tokenizer the pre/postprocessing models read "
            f"(tokenizer_dir ../{subdir}); then serve this repository\n# (`trtpipe serve BUILD --print-command`).\n"
            'set -euo pipefail\ncd "$(dirname "$0")"\n'
            + save_tokenizer(model, subdir, trust_remote_code=recipe.model.trust_remote_code) + "\n")
    (repo / TOKENIZER_SCRIPT).write_text(text)
    (repo / TOKENIZER_SCRIPT).chmod(0o755)


def _write_tokenizer_info(tokenizer_dir: Path, dest: Path) -> None:
    """The xgrammar tokenizer-info file of the guided-decoding parameters (:mod:`pipeline.trtllm.guided`, upstream's
    ``generate_xgrammar_tokenizer_info.py`` format). Raises StageError when the tokenizer cannot give one."""
    try:
        write_tokenizer_info(tokenizer_dir, dest)
    except Exception as e:  # ValueError (not a fast tokenizer) or whatever transformers raises for broken files
        raise StageError(f"build.guided_decoding_backend: no xgrammar tokenizer info from {tokenizer_dir}: {e}") from None


def _llmapi_kwargs(recipe: Recipe, quantized: QuantizeResult, engine: EngineResult) -> dict[str, Any]:
    """``LLM()`` kwargs for model.yaml: the engine stage's ``llm_api_config.yaml`` or, if absent,
    ``pipeline.trtllm.llmapi.llm_api_kwargs``. Raises StageError when neither is available."""
    path = Path(engine.path) / layouts()["llmapi"]["engine_config_file"]
    if path.is_file():
        data = yaml.safe_load(path.read_text())
        if not isinstance(data, dict):
            raise StageError(f"{path}: expected a mapping of LLM() arguments")
        return data
    from pipeline.trtllm.llmapi import llm_api_kwargs

    return dict(llm_api_kwargs(recipe, quantized.hf_ckpt))


def _write_llmapi_files(recipe: Recipe, model_dir: Path, quantized: QuantizeResult, engine: EngineResult) -> None:
    """Write ``1/model.yaml`` (``LLM()`` kwargs + ``triton_config``) and copy trtpipe's llmapi ``model.py`` next to it."""
    lay = layouts()["llmapi"]
    _install_python_model(model_dir, layouts()["python_models"]["tensorrt_llm@llmapi"])
    version = model_dir / "1"
    kwargs = _llmapi_kwargs(recipe, quantized, engine)
    kwargs["triton_config"] = {
        "max_batch_size": lay["triton_max_batch_size"],
        "decoupled": recipe.serving.decoupled_mode,
        "cancellation_check_period_ms": recipe.serving.cancellation_check_period_ms,
        **({"multimodal": True} if recipe.vision is not None else {}),  # upstream's switch for image_url (PR #18381)
    }
    (version / "model.yaml").write_text(yaml.safe_dump(kwargs, sort_keys=False))


# ---------------------------------------------------------------------------------------- stage
def cache_key(recipe: Recipe, *, quantized: QuantizeResult, engine: EngineResult, vision_dir: Path | None = None) -> str:
    """Hash of the runtime fields (serving + KV/scheduler knobs, :mod:`pipeline.recipe.consumers`), both upstream
    cache keys (which cover the build-time fields), the engine path and the templates; for a vision recipe also the
    vision stage's key and directory (``multimodal_model_path``)."""
    mm = {}
    if cross_attention(recipe.vision) and vision_dir is not None:
        mm = {"vision": (artifacts.read_manifest(vision_dir) or {}).get("cache_key"), "vision_dir": str(Path(vision_dir).resolve())}
    return artifacts.stable_hash({
        **mm,
        "recipe": consumed(recipe, "runtime"),
        "triton_max_batch_size": recipe.triton_max_batch_size,
        "quantize": quantized.cache_key,
        "engine": engine.cache_key,
        "engine_dir": str(Path(engine.path).resolve()),
        "templates": template_hashes(),
    })


def run(
    recipe: Recipe, layout: BuildLayout, *, quantized: QuantizeResult, engine: EngineResult, force: bool = False,
    dry_run: bool = False,
) -> RepoResult:
    """Write the Triton model repository for ``recipe`` into ``layout.triton_repo`` (reused when unchanged).

    Args:
        recipe: the validated recipe (``build.engine`` selects the layout).
        layout: the build directory; ``layout.triton_repo`` is replaced atomically.
        quantized: the quantize stage result (tokenizer files come from ``<path>/hf_ckpt``).
        engine: the engine stage result (``gpt_model_path`` / CPU engine dir / ``llm_api_config.yaml``).
        force: rebuild even when the cache key matches.
        dry_run: the quantize stage only wrote commands (GPU recipe on a machine without the model):
            the tokenizer files are not there yet, so the repository is written without them
            (``status: dry_run``); every config.pbtxt is still generated and validated.

    Returns:
        The :class:`RepoResult` (``models`` lists the models written).

    Raises:
        StageError: missing tokenizer/engine config, or a template that renders an invalid config.
    """
    out_dir = layout.triton_repo
    key = cache_key(recipe, quantized=quantized, engine=engine, vision_dir=layout.vision)
    if dry_run:
        key = artifacts.stable_hash([key, "dry_run"])
    if not force and (hit := RepoResult.load(out_dir, key)):
        return hit
    t0 = time.perf_counter()
    kind = recipe.build.engine
    lay = layouts()
    configs = model_configs(recipe, engine.path, paged_context_fmha=engine.paged_context_fmha, repo_dir=out_dir,
                            vision_dir=layout.vision)
    impl = serving_path(recipe).tensorrt_llm_model
    problems = repository_problems(configs, impl)
    if problems:  # would not load (or would answer wrong) under the upstream backend / model
        raise StageError("generated model repository breaks the upstream contract "
                         "(pipeline/data/triton_backend_contract.yaml): " + "; ".join(problems))
    extra: dict[str, Any] = {}
    conflicts = runtime_conflicts(recipe, engine)
    if conflicts:
        extra["notes"] = conflicts
        for c in conflicts:
            sys.stderr.write(f"trtpipe: warning: {c}\n")
    with artifacts.atomic_dir(out_dir) as tmp:
        for name, cfg in configs.items():
            (tmp / name).mkdir()
            write_model_config(tmp / name / "config.pbtxt", cfg)
        if impl == "llmapi":
            _write_llmapi_files(recipe, tmp / "tensorrt_llm", quantized, engine)
        else:
            hf_ckpt = quantized.hf_ckpt
            if dry_run and not hf_ckpt.is_dir():
                extra["notes"] = [(f"tokenizer files are copied from {hf_ckpt} by the real build; dry run: "
                                   f"{TOKENIZER_SCRIPT} writes them")]
                _write_tokenizer_script(tmp, quantized, recipe, lay["tokenizer"]["repo_subdir"])
            else:
                extra["tokenizer_files"] = _copy_tokenizer(hf_ckpt, tmp / lay["tokenizer"]["repo_subdir"])
                if recipe.build.guided_decoding_backend:
                    _write_tokenizer_info(tmp / lay["tokenizer"]["repo_subdir"], tmp / tokenizer_info_path(None))
            (tmp / "ensemble" / "1").mkdir()
            (tmp / "tensorrt_llm" / "1").mkdir()
            sources = lay["python_models"]
            for name in configs:
                src = sources.get(f"{name}@{impl}", sources.get(name))
                if src:
                    _install_python_model(tmp / name, src)
            if recipe.serving.decoupled_mode and recipe.serving.postprocessing_instance_count != 1:
                extra.setdefault("notes", []).extend([
                    "postprocessing runs 1 instance (not serving.postprocessing_instance_count="
                    f"{recipe.serving.postprocessing_instance_count}): streamed-text state must live in one process"
                ])
        manifest = artifacts.base_manifest(
            STAGE, key,
            status="dry_run" if dry_run else "built",
            consumed=consumed(recipe, "runtime"),
            engine_kind=kind,
            models=sorted(configs),
            inputs={"quantize": quantized.cache_key, "engine": engine.cache_key,
                    "engine_dir": str(Path(engine.path).resolve())},
            templates=template_hashes(),
            versions=artifacts.library_versions("tritonclient", "jinja2", "protobuf", "transformers"),
            files=artifacts.file_hashes(tmp),
            timings_s={"total": round(time.perf_counter() - t0, 3)},
            peak_rss_bytes=artifacts.peak_rss_bytes(),
            **extra,
        )
        artifacts.write_manifest(tmp, manifest)
    return RepoResult.from_manifest(out_dir, json.loads(json.dumps(manifest, default=str)))
