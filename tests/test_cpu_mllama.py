"""The CPU engine on an mllama (SmolLM2-grafted Llama 3.2 Vision shape) engine directory: greedy tokens equal
transformers' ``MllamaForConditionalGeneration.generate`` with an image (features from the model's own vision
tower + projector on a processed bundled photograph) and without, the processor's cross-attention mask handled as
transformers does, bad encoder inputs refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_cpu_runtime import END_ID, _submit

from pipeline.cpu_runtime.cross_attention import expand_tile_mask
from pipeline.cpu_runtime.engine import CpuEngine
from pipeline.engine import cpu as cpu_stage
from pipeline.recipe import load_recipe
from pipeline.vision.images import bundled_sample

REPO = Path(__file__).resolve().parents[1]
NEW = 24
#: vectors per tile of the tiny vision tower: (56 / 14)² patches + the class token
PER_TILE = (56 // 14) ** 2 + 1


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_mllama_dir: Path) -> Path:
    """The engine directory the cpu stage writes for the float32 grafted checkpoint (weights + engine_config). Overrides
    tests/conftest.py's FP8 ``engine_dir`` in this module, so conftest's ``engine`` opens this one."""
    d = tmp_path_factory.mktemp("mllama-engine")
    cpu_stage.write_weights(smollm2_mllama_dir, d, "float32")
    for f in smollm2_mllama_dir.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, d / f.name)
    recipe = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml",
                         ["build.max_batch_size=4", "build.max_seq_len=512", "build.kv_cache_config.max_tokens=2048"])
    ecfg = cpu_stage.engine_config(recipe, json.loads((d / "config.json").read_text()))
    (d / "engine_config.json").write_text(json.dumps(ecfg))
    return d


@pytest.fixture(scope="module")
def hf(smollm2_mllama_dir: Path):
    from transformers import AutoProcessor, MllamaForConditionalGeneration

    model = MllamaForConditionalGeneration.from_pretrained(smollm2_mllama_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(smollm2_mllama_dir)


def _inputs(processor, text: str, image: str | None):
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=prompt, images=[[bundled_sample(image)]] if image else None, return_tensors="pt")


def _generate(model, inputs) -> list[int]:
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=END_ID)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _features(model, inputs) -> torch.Tensor:
    """The vision tower + projector output for one image: ``[images × tiles × vectors, hidden]`` (what the
    ``multimodal_encoders`` model hands the decoder as ``encoder_input_features``)."""
    with torch.no_grad():
        v = model.model.vision_model(pixel_values=inputs["pixel_values"], aspect_ratio_ids=inputs["aspect_ratio_ids"],
                                     aspect_ratio_mask=inputs["aspect_ratio_mask"]).last_hidden_state
        return model.model.multi_modal_projector(v).reshape(-1, model.config.text_config.hidden_size)


def test_engine_config_advertises_the_encoder_length(engine_dir: Path, smollm2_mllama_dir: Path, hf):
    ecfg = json.loads((engine_dir / "engine_config.json").read_text())
    model, processor = hf
    feats = _features(model, _inputs(processor, "Hi", "coffee"))
    assert ecfg["encoder_len_per_image"] == feats.shape[0] == 4 * PER_TILE == 68
    assert ecfg["max_encoder_input_len"] == 68  # one image per request (no vision section)
    assert ecfg["architecture"] == "MllamaForConditionalGeneration"


def test_greedy_with_an_image_equals_transformers_generate(engine: CpuEngine, hf):
    model, processor = hf
    cols, refs = [], []
    for image, text in (("astronaut", "Describe this image."), ("coffee", "What is in the picture?")):
        inputs = _inputs(processor, text, image)
        mask = expand_tile_mask(inputs["cross_attention_mask"][0], PER_TILE)
        ids = inputs["input_ids"][0].tolist()
        cols.append(_submit(engine, ids, NEW, encoder_input_features=_features(model, inputs),
                            cross_attention_mask=mask))
        refs.append(_generate(model, inputs))
    text_inputs = _inputs(processor, "What is the capital of France?", None)
    text_col = _submit(engine, text_inputs["input_ids"][0].tolist(), NEW)  # batched beside the image requests
    for c, ref in zip(cols, refs):
        assert c.wait() == ref
    assert refs[0] != refs[1]  # the image counts (different photographs, different answers)
    assert text_col.wait() == _generate(model, text_inputs)
    assert "Paris" in processor.tokenizer.decode(text_col.tokens)


def test_cross_attention_mask_rows_before_the_image_token_are_masked(engine: CpuEngine, hf):
    """The processor's mask: rows before ``<|image|>`` attend to nothing (transformers' "full text row masked out":
    the engine zeroes their cross MLP and leaves their attention unmasked), rows from it on attend to all 4 tiles."""
    model, processor = hf
    inputs = _inputs(processor, "Describe this image.", "chelsea")
    ids = inputs["input_ids"][0].tolist()
    at = ids.index(model.config.image_token_index)
    mask = expand_tile_mask(inputs["cross_attention_mask"][0], PER_TILE)
    assert at > 0 and not mask[:at].any() and mask[at:].all()
    st = engine.model.cross.prepare(_features(model, inputs), mask)
    assert st.full_row[:at].sum() == 0 and st.full_row[at:].min() == 1
    assert (st.add_mask[:at] == 0).all()  # multiplied by full_row, as _prepare_cross_attention_mask does


def test_text_only_and_skip_cross_attn_blocks_equal_generate_without_an_image(engine: CpuEngine, hf):
    model, processor = hf
    inputs = _inputs(processor, "Describe this image.", "astronaut")
    ids = inputs["input_ids"][0].tolist()  # <|image|> in the prompt, but the cross layers skipped
    skipped = _submit(engine, ids, NEW, encoder_input_features=_features(model, inputs), skip_cross_attn_blocks=True)
    ref = _generate(model, {"input_ids": inputs["input_ids"], "attention_mask": inputs["attention_mask"]})
    assert skipped.wait() == ref


@pytest.mark.parametrize(("kw", "field"), [
    ({"encoder_input_features": torch.zeros(68, 100)}, "encoder_input_features has shape [68, 100]"),
    ({"encoder_input_features": torch.zeros(69, 576)}, "encoder_input_features has shape [69, 576]"),
    ({"encoder_input_features": torch.zeros(68, 576), "cross_attention_mask": torch.ones(3, 68, dtype=torch.bool)},
     "cross_attention_mask has shape [3, 68]"),
    ({"cross_attention_mask": torch.ones(8, 68, dtype=torch.bool)}, "cross_attention_mask given without"),
])
def test_bad_encoder_inputs_are_refused_in_one_line(engine: CpuEngine, kw, field):
    with pytest.raises(ValueError) as e:
        engine.add_request(list(range(1, 9)), max_new_tokens=2, on_tokens=lambda t, f: None, **kw)
    msg = str(e.value)
    assert field in msg and "\n" not in msg
    assert engine.num_active == 0  # nothing queued


def test_torch_layer_path_gives_the_same_tokens_with_an_image(engine: CpuEngine, engine_dir: Path, hf, monkeypatch):
    """Image steps run the self-attention layers on the native kernels (when they build here) with the cross layers
    in torch between them; the all-torch path gives the same greedy tokens."""
    model, processor = hf
    inputs = _inputs(processor, "What is in the picture?", "rocket")
    kw = {"encoder_input_features": _features(model, inputs),
          "cross_attention_mask": expand_tile_mask(inputs["cross_attention_mask"][0], PER_TILE)}
    ids = inputs["input_ids"][0].tolist()
    first = _submit(engine, ids, NEW, **kw).wait()
    monkeypatch.setenv("TRTPIPE_CPU_KERNELS", "torch")
    with CpuEngine(engine_dir, num_threads=1) as eng:
        assert eng.runtime["kernels"] == "torch"
        assert _submit(eng, ids, NEW, **kw).wait() == first
    assert first == _generate(model, inputs)
