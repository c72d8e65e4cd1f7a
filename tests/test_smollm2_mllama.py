"""The SmolLM2 → mllama graft (pipeline/vision/smollm2_mllama.py): text answers are SmolLM2's own, gates at 0
make an image a no-op, the shipped gates make it count, and the same seed gives the same bytes."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.vision.images import bundled_sample
from pipeline.vision.smollm2_mllama import (
    CROSS_LAYERS,
    GATE,
    IMAGE_TOKEN,
    build_smollm2_mllama,
    self_layer_map,
)

NEW = 16


@pytest.fixture(scope="module")
def models(smollm2_dir: Path, smollm2_mllama_dir: Path):
    from transformers import AutoModelForCausalLM, MllamaForConditionalGeneration

    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    mm = MllamaForConditionalGeneration.from_pretrained(smollm2_mllama_dir, dtype=torch.float32).eval()
    return ref, mm


@pytest.fixture(scope="module")
def processor(smollm2_mllama_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(smollm2_mllama_dir)


def _greedy(model, **inputs) -> list[int]:
    n = inputs["input_ids"].shape[1]
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False)
    return out[0, n:].tolist()


def _chat_ids(tok, text: str):
    enc = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    return enc["input_ids"]


def test_checkpoint_files_and_image_token(smollm2_mllama_dir: Path, processor):
    cfg = json.loads((smollm2_mllama_dir / "config.json").read_text())
    assert cfg["architectures"] == ["MllamaForConditionalGeneration"]
    tc = cfg["text_config"]
    assert tc["cross_attention_layers"] == list(CROSS_LAYERS) and tc["num_hidden_layers"] == 32
    assert tc["rope_theta"] == 100000.0  # the 4.x spelling is there too (4.57 defaults to 500000)
    tok = processor.tokenizer
    assert tok.convert_tokens_to_ids(IMAGE_TOKEN) == cfg["image_token_index"] == tc["vocab_size"]
    # the chat template puts <|image|> before the user's text when an image is given
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": "image"}]}],
        add_generation_prompt=True)
    assert "<|im_start|>user\n<|image|>What is this?<|im_end|>" in text
    ip = processor.image_processor
    assert ip.size == {"height": 56, "width": 56} and ip.max_image_tiles == 4


def test_text_only_greedy_equals_smollm2(models, processor):
    """No image: mllama skips its cross layers, so the grafted model IS SmolLM2 (whatever the gates)."""
    ref, mm = models
    ids = _chat_ids(processor.tokenizer, "What is the capital of France?")
    want = _greedy(ref, input_ids=ids)
    assert _greedy(mm, input_ids=ids) == want
    assert "Paris" in processor.tokenizer.decode(want)


def test_gates_zero_make_an_image_a_no_op_and_the_shipped_gates_do_not(models, processor):
    """With the cross layers RUN on a real image (every row attends), gates 0 give SmolLM2's answer token for
    token; the shipped gate (tanh(0.25)) changes it."""
    ref, mm = models
    ids = _chat_ids(processor.tokenizer, "Describe a sunny day in one sentence.")
    pix = processor.image_processor(images=[[bundled_sample("astronaut")]], return_tensors="pt")
    img = {"pixel_values": pix["pixel_values"], "aspect_ratio_ids": pix["aspect_ratio_ids"],
           "aspect_ratio_mask": pix["aspect_ratio_mask"],
           "cross_attention_mask": torch.ones(1, ids.shape[1], 1, 4, dtype=torch.long)}
    want = _greedy(ref, input_ids=ids)
    gates = [p for n, p in mm.named_parameters() if n.endswith(("cross_attn_attn_gate", "cross_attn_mlp_gate"))]
    assert len(gates) == 2 * len(CROSS_LAYERS) and all(float(g.detach()) == GATE for g in gates)
    try:
        with torch.no_grad():
            for g in gates:
                g.zero_()
        assert _greedy(mm, input_ids=ids, **img) == want
    finally:
        with torch.no_grad():
            for g in gates:
                g.fill_(GATE)
    assert _greedy(mm, input_ids=ids, **img) != want


def _tiny_llama(src: Path, dst: Path) -> Path:
    """A 3-layer Llama with SmolLM2's tokenizer (a stand-in decoder, so the byte test builds in a second)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(123)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, rope_theta=100000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2, max_position_embeddings=256)
    LlamaForCausalLM(cfg).save_pretrained(dst)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_same_seed_same_bytes(tmp_path: Path, smollm2_dir: Path):
    base = _tiny_llama(smollm2_dir, tmp_path / "llama")

    def digest(d: Path) -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}

    a = digest(build_smollm2_mllama(tmp_path / "a", 0, smollm2_dir=base, cross_layers=(1, 3)))
    b = digest(build_smollm2_mllama(tmp_path / "b", 0, smollm2_dir=base, cross_layers=(1, 3)))
    c = digest(build_smollm2_mllama(tmp_path / "c", 1, smollm2_dir=base, cross_layers=(1, 3)))
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"] and a["tokenizer.json"] == c["tokenizer.json"]


def test_self_layer_map_skips_the_cross_layers():
    m = self_layer_map(30)
    assert len(m) == 30 and set(m.values()).isdisjoint(CROSS_LAYERS) and max(m.values()) == 31
