"""Issue #47 item 5 (engine core): the CPU engine decodes a Qwen2-VL-shaped model with an image exactly as
transformers does — the vision tower's embeddings spliced into the prompt's placeholder rows, M-RoPE positions in the
prefill, and generated tokens shifted by the prompt's ``delta``.

The model is a tiny random ``Qwen2VLForConditionalGeneration`` built from a config here (seeded; no download); the
engine directory holds its language model as a Qwen2 decoder with the config's ``mrope_section``."""

from __future__ import annotations

import json
import threading

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pipeline.cpu_runtime import CpuEngine  # noqa: E402
from pipeline.cpu_runtime.mrope import PromptMultimodal, mrope_rows, qwen2_vl_rope_index  # noqa: E402

IMG, START, END = 120, 122, 123


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, engine_dir, processor) of a seeded tiny Qwen2-VL: text hidden 32, 2 layers, 4 heads / 2 KV heads,
    mrope_section [2, 1, 1] (head_dim 8); vision tower 2 blocks of 32, 14 px patches merged 2×2."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    try:  # transformers 5.x: the torch-free processor; 4.57 (TensorRT-LLM 1.2.1's pin): numpy/PIL already
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as Proc,
        )
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Proc

    torch.manual_seed(0)
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_scaling={"type": "mrope", "mrope_section": [2, 1, 1]}, bos_token_id=1, eos_token_id=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4,
                                                             mlp_ratio=2, patch_size=14, spatial_merge_size=2,
                                                             temporal_patch_size=2, in_channels=3),
                        image_token_id=IMG, video_token_id=121, vision_start_token_id=START, vision_end_token_id=END,
                        bos_token_id=1, eos_token_id=2)
    model = Qwen2VLForConditionalGeneration(cfg).eval()
    d = tmp_path_factory.mktemp("qwen2vl_engine")
    tc = cfg.text_config.to_dict()
    tc.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2")
    (d / "config.json").write_text(json.dumps(tc))
    sd = {k.replace("model.language_model.", "model."): v.contiguous() for k, v in model.state_dict().items()
          if k.startswith("model.language_model.") or k == "lm_head.weight"}
    save_file(sd, str(d / "model.safetensors"))
    (d / "engine_config.json").write_text(json.dumps({
        "kind": "cpu", "runtime": "trtpipe-torch", "compute_dtype": "float32", "max_batch_size": 4, "max_seq_len": 128,
        "max_input_len": 96, "max_num_tokens": 256, "kv_cache": {"dtype": "float32", "max_tokens": 512},
        "vocab_size": 128, "enable_chunked_prefill": False}))
    proc = Proc(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=56 * 56,
                                 max_pixels=28 * 28 * 64)
    return model, d, proc


def _image_inputs(model, proc, size=(84, 56), seed=3):
    import numpy as np
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    px = proc(images=[Image.fromarray(rgb)], return_tensors="pt")
    grid = px["image_grid_thw"]
    n = int(grid.prod()) // 4
    ids = [1, 5, 9, START] + [IMG] * n + [END, 17, 33, 44]
    with torch.no_grad():
        feats = model.model.get_image_features(px["pixel_values"], grid)
    feats = torch.cat(list(feats.pooler_output if hasattr(feats, "pooler_output") else feats)).float()
    return ids, px, grid, feats


def _types(ids):
    return torch.tensor([[1 if t == IMG else 0 for t in ids]], dtype=torch.int32)


def _hf_rope_index(model, ids, grid):
    """transformers' own rule: 5.x takes the processor's mm_token_type_ids; 4.57 the image token id from the config."""
    import inspect

    f = model.model.get_rope_index
    if "mm_token_type_ids" in inspect.signature(f).parameters:
        return f(torch.tensor([ids]), _types(ids), image_grid_thw=grid)
    return f(torch.tensor([ids]), grid, None, torch.ones(1, len(ids)))


def _hf_extra(model, ids):
    import inspect

    return ({"mm_token_type_ids": _types(ids)} if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters
            else {})


def _engine_tokens(engine, ids, n, mm=None):
    done, out = threading.Event(), []

    def on_tokens(toks, fin):
        out.extend(toks)
        if fin:
            done.set()

    engine.add_request(ids, max_new_tokens=n, min_tokens=n, on_tokens=on_tokens, multimodal=mm)
    assert done.wait(60)
    return out


def test_rope_index_equals_transformers(tiny):
    model, _, proc = tiny
    ids, px, grid, _ = _image_inputs(model, proc)
    pos, delta = qwen2_vl_rope_index(ids, grid.tolist(), image_token_id=IMG, vision_start_token_id=START,
                                     spatial_merge_size=2)
    hf_pos, hf_delta = _hf_rope_index(model, ids, grid)
    assert torch.equal(pos, hf_pos[:, 0]) and delta == int(hf_delta)
    assert delta < 0  # the image's 2-D grid uses fewer positions than tokens


def test_mrope_rows_on_text_positions_are_the_1d_rows():
    cos, sin = torch.randn(16, 8), torch.randn(16, 8)
    p = torch.tensor([0, 3, 7])
    c, s = mrope_rows(cos, sin, p.expand(3, -1), [2, 1, 1])
    assert torch.equal(c, cos[p]) and torch.equal(s, sin[p])
    with pytest.raises(ValueError, match="mrope_section"):
        mrope_rows(cos, sin, p.expand(3, -1), [2, 2, 2])


def test_engine_with_an_image_decodes_as_transformers(tiny):
    model, d, proc = tiny
    ids, px, grid, feats = _image_inputs(model, proc)
    n = 10
    with torch.no_grad():
        hf = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                            pixel_values=px["pixel_values"], image_grid_thw=grid, max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, **_hf_extra(model, ids))[0, len(ids):].tolist()
        hf_text = model.generate(input_ids=torch.tensor([[1, 5, 9, 17, 33]]), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False)[0, 5:].tolist()
    pos, delta = qwen2_vl_rope_index(ids, grid.tolist(), image_token_id=IMG, vision_start_token_id=START,
                                     spatial_merge_size=2)
    rows = torch.tensor([i for i, t in enumerate(ids) if t == IMG])
    mm = PromptMultimodal(rows=rows, embeds=feats, positions=pos, delta=delta)
    with CpuEngine(d, num_threads=1) as eng:
        assert _engine_tokens(eng, ids, n, mm) == hf
        assert _engine_tokens(eng, [1, 5, 9, 17, 33], n) == hf_text  # text-only: the 1-D (native) path
        with pytest.raises(ValueError, match="image embeddings"):
            eng.add_request(ids, max_new_tokens=2, on_tokens=lambda t, f: None,
                            multimodal=PromptMultimodal(rows=rows, embeds=feats[:, :16], positions=pos, delta=delta))
