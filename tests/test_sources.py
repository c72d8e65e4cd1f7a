"""pipeline.quantize.sources: embedded GGUF conversion, .gguf paths, local dirs, hub ids (real files, no mocks)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from pipeline.core import artifacts
from pipeline.core.errors import UserError
from pipeline.quantize.sources import (
    SMOLLM2_GGUF,
    SMOLLM2_GGUF_SHA256,
    _smollm2_gguf,
    resolve_source,
)
from pipeline.recipe import EMBEDDED_SMOLLM2, ModelSpec

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def test_embedded_resolves_to_converted_checkpoint(smollm2_dir: Path, tmp_path: Path) -> None:
    src = resolve_source(ModelSpec(source=EMBEDDED_SMOLLM2), tmp_path)
    assert src.kind == "embedded" and src.hf_dir == smollm2_dir
    assert src.content_hash == SMOLLM2_GGUF_SHA256
    assert src.hf_dir.parent == artifacts.cache_dir() / "models"
    assert src.hf_dir.name == f"smollm2-135m-instruct-{SMOLLM2_GGUF_SHA256[:12]}"
    cfg = json.loads((src.hf_dir / "config.json").read_text())
    # traps of docs/reference/cpu-stack.md §4: explicit rope_theta / tokenizer_class for transformers 4.57
    assert cfg["rope_theta"] == 100000.0
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
    assert "quantization_config" not in cfg  # remove_quantization_config was applied
    tok_cfg = json.loads((src.hf_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (src.hf_dir / "chat_template.jinja").read_text().count("<|im_start|>") >= 2


def test_embedded_reload_has_identical_logits_to_gguf(smollm2_dir: Path, smollm2_tokenizer, quant_one_thread) -> None:
    """The saved checkpoint reproduces the GGUF model loaded directly by transformers, bit for bit."""
    from transformers import AutoModelForCausalLM

    gguf = _smollm2_gguf()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    saved = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, local_files_only=True).eval()
    text = smollm2_tokenizer.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    enc = smollm2_tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        assert torch.equal(direct(**enc).logits, saved(**enc).logits)
        out = saved.generate(**enc, max_new_tokens=8, do_sample=False)
    answer = smollm2_tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer


def test_tokenizer_special_tokens_follow_gguf_metadata(smollm2_tokenizer) -> None:
    # GGUF: eos = pad = 2 (<|im_end|>), bos = 1; transformers 5.14's converter alone says eos = 1
    assert smollm2_tokenizer.eos_token == "<|im_end|>" and smollm2_tokenizer.eos_token_id == 2
    assert smollm2_tokenizer.pad_token_id == 2 and smollm2_tokenizer.bos_token_id == 1


def test_embedded_conversion_is_reused(smollm2_dir: Path, tmp_path: Path) -> None:
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    again = resolve_source(ModelSpec(source=EMBEDDED_SMOLLM2), tmp_path)
    assert again.hf_dir == smollm2_dir
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    prov = json.loads((smollm2_dir / "trtpipe_source.json").read_text())
    assert prov["gguf_sha256"] == SMOLLM2_GGUF_SHA256


def test_gguf_path_relative_to_recipe_dir(smollm2_dir: Path, tmp_path: Path) -> None:
    """A local .gguf is content-addressed: the same bytes under the same stem reuse one conversion."""
    (tmp_path / "models").mkdir()
    os.symlink(_smollm2_gguf(), tmp_path / "models" / "smollm2-135m-instruct.gguf")
    src = resolve_source(ModelSpec(source="models/smollm2-135m-instruct.gguf"), tmp_path)
    assert src.kind == "gguf"
    assert src.content_hash == SMOLLM2_GGUF_SHA256
    assert src.hf_dir == smollm2_dir


def test_local_dir(smollm2_dir: Path, tmp_path: Path) -> None:
    local = tmp_path / "ckpt"
    local.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / f, local / f)
    src = resolve_source(ModelSpec(source="ckpt"), tmp_path)
    assert src.kind == "local_dir" and src.hf_dir == local.resolve() and src.revision is None
    assert resolve_source(ModelSpec(source=str(local)), Path("/")).content_hash == src.content_hash
    (local / "config.json").write_text((local / "config.json").read_text() + " ")
    assert resolve_source(ModelSpec(source=str(local)), tmp_path).content_hash != src.content_hash


def test_dir_without_config_is_a_user_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="has no config.json"):
        resolve_source(ModelSpec(source="empty"), tmp_path)


def test_hub_id_not_cached_says_how_to_download(tmp_path: Path) -> None:
    with pytest.raises(UserError) as e:  # HF_HUB_OFFLINE=1 (conftest): no download is tried
        resolve_source(ModelSpec(source="trtpipe-tests/no-such-model", revision="v1"), tmp_path)
    msg = str(e.value)
    assert "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in msg
    assert "hf download trtpipe-tests/no-such-model --revision v1" in msg and "HF_HOME" in msg
    assert "\n" not in msg


def test_hub_id_download_failure_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the download is tried; no hub is reachable here
    with pytest.raises(UserError) as e:
        resolve_source(ModelSpec(source="trtpipe-tests/no-such-model"), tmp_path)
    msg = str(e.value)
    assert "the download failed (" in msg and "hf download trtpipe-tests/no-such-model" in msg
    assert "\n" not in msg


def test_missing_path_and_unknown_embedded(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no such file or directory"):
        resolve_source(ModelSpec(source="./nowhere/model.gguf"), tmp_path)
    with pytest.raises(UserError, match="unknown embedded model"):
        resolve_source(ModelSpec(source="embedded:gpt-5"), tmp_path)


def test_packaged_gguf_is_the_pinned_file() -> None:
    gguf = _smollm2_gguf()
    assert gguf.name == SMOLLM2_GGUF and gguf.stat().st_size == 98_362_432
