"""Issue #47 item 5: ``embedded:tiny-qwen2-vl`` — a Qwen2-VL checkpoint built locally (SmolLM2's decoder grafted into
the Qwen2 layout, a seeded random vision tower). Checked against independent references: SmolLM2 itself for text
(the graft must not change a single greedy token) and the image-token rule of pipeline/vision/geometry.py for images."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeline.core.errors import UserError
from pipeline.quantize.sources import EMBEDDED_TINY_QWEN2_VL, resolve_source
from pipeline.recipe import ModelSpec
from pipeline.vision.geometry import qwen2_vl_image_tokens
from pipeline.vision.tiny_qwen2_vl import (
    MAX_PIXELS,
    MIN_PIXELS,
    expand_image_pads,
    load_image_processor,
)


@pytest.fixture(scope="module")
def tiny(smollm2_dir):
    from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration

    d = resolve_source(ModelSpec(source=EMBEDDED_TINY_QWEN2_VL), smollm2_dir).hf_dir
    return d, Qwen2VLForConditionalGeneration.from_pretrained(d).eval(), AutoTokenizer.from_pretrained(d)


def _ids(tok, content):
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=True,
                                  return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def test_text_answers_are_smollm2s(tiny, smollm2_dir, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    _, model, tok = tiny
    q = "What is the capital of France?"
    ids = _ids(tok, q)
    assert ids == _ids(smollm2_tokenizer, q)  # same ChatML prompt as SmolLM2's own template
    x = torch.tensor([ids])
    ours = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
    ref = AutoModelForCausalLM.from_pretrained(smollm2_dir).eval()
    theirs = ref.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=12, do_sample=False)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("size", [(448, 448), (1000, 700), (30, 40)])
def test_image_tokens_follow_the_rule(tiny, size):
    import numpy as np
    from PIL import Image

    d, model, tok = tiny
    proc = load_image_processor(d)
    w, h = size
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (h, w, 3), dtype=np.uint8))
    px = proc(images=[img], return_tensors="pt")
    ids = expand_image_pads(_ids(tok, [{"type": "image"}, {"type": "text", "text": "Describe."}]),
                            px["image_grid_thw"].tolist(), model.config.image_token_id)
    n = sum(t == model.config.image_token_id for t in ids)
    assert n == qwen2_vl_image_tokens(h, w, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS)
    assert n <= MAX_PIXELS // (28 * 28)
    x = torch.tensor([ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), pixel_values=px["pixel_values"],
                         image_grid_thw=px["image_grid_thw"], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape[1] == len(ids) + 3


def test_placeholder_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        expand_image_pads([5, 9, 5], [[1, 2, 2], [1, 2, 2]], image_token_id=9)


def test_unknown_embedded_names_both(tmp_path):
    with pytest.raises(UserError, match="tiny-qwen2-vl"):
        resolve_source(ModelSpec(source="embedded:nope"), tmp_path)
