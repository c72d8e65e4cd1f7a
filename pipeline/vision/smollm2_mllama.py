"""``embedded:smollm2-135m-mllama``: SmolLM2-135M-Instruct grafted into Llama 3.2 Vision's shape, built locally.

An ``MllamaForConditionalGeneration`` whose self-attention decoder layers ARE SmolLM2-135M-Instruct's 30 Llama layers
(the embedded checkpoint, ``pipeline.quantize.sources.embedded_smollm2_dir()``; no download), with
:data:`CROSS_LAYERS` gated cross-attention layers inserted between them (mllama's ``cross_attention_layers``), a tiny
seeded vision tower (:data:`~pipeline.vision.tiny_mllama.TINY_VISION`: 56 px tiles of 14 px patches, 17 vectors a
tile, 4 tiles → 68 encoder vectors per image) and a seeded projector to the text hidden size 576.

Why the graft holds (transformers v4.57.3 models/mllama/modeling_mllama.py, the release TensorRT-LLM 1.2.1
pins; the installed 5.14.1 has the same code at :587, :656, :1034, :1139-1145): ``MllamaSelfAttentionDecoderLayer``
(:599-670) is Llama's block — RMSNorm, RoPE self-attention with GQA, RMSNorm, SiLU-gated MLP — with the same
parameter names, so SmolLM2's tensors drop in; ``MllamaTextModel`` *skips* a cross-attention layer when there are
no cross-attention states and none cached (:1248-1257), so a text-only request is SmolLM2 exactly; its
``embed_tokens`` has ``vocab_size + 8`` rows (:1148) — SmolLM2's 49152 rows, then the new ``<|image|>`` token at id 49152 (= ``vocab_size``, as Llama 3.2 Vision's 128256) and 7 spare rows, seeded; the
``lm_head`` is separate (SmolLM2 ties it to the embedding, so it is a copy of the first 49152 rows).
tests/test_smollm2_mllama.py checks that greedy output equals SmolLM2's own (text only, and with an image at gates 0).

Gates: each cross layer adds ``tanh(attn_gate) · cross_attn(...)`` and ``tanh(mlp_gate) · mlp(...)`` to the residual
(``MllamaCrossAttentionDecoderLayer``, :673-723). At 0 (transformers' initial value) an image changes nothing,
so nothing could tell a CPU engine that ignores the image from one that attends to it. :data:`GATE` is small but non-zero: the cross layers are random
(seeded, unit gain), so a large gate would turn answers into noise, while a small one changes a greedy answer
after a few tokens, and differently for different images (measured on "Describe this image." with the bundled
photographs: at 0.1 astronaut/coffee/chelsea barely differ, at 0.25 they give different fluent answers, at 0.5 they
converge on one) — an engine's cross-attention is then testable token-for-token against transformers, and text
answers stay SmolLM2's (text-only requests skip the layers whatever the gate).

Same seed → same bytes: the random tensors come from ``torch.manual_seed(seed)`` in a fixed order; the tokenizer,
chat template and image processor are built from parameters.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.vision.tiny_mllama import TINY_VISION, image_processor

#: where the cross-attention layers sit in the 32-layer mllama decoder (30 SmolLM2 layers + 2): after SmolLM2's
#: layers 0-9 and 10-19, like Llama 3.2 Vision's every-fifth pattern (3, 8, …) spread over a shallower stack
CROSS_LAYERS: tuple[int, ...] = (10, 21)
#: the cross layers' tanh gate pre-activation (both gates): see the module docstring
GATE = 0.25
IMAGE_TOKEN = "<|image|>"
#: bump when the built checkpoint changes (a new cache entry for :func:`embedded_smollm2_mllama_dir`)
BUILDER_VERSION = 2
PROVENANCE = "trtpipe_source.json"
#: SmolLM2's ChatML template, with ``{"type": "image"}`` content parts rendered as ``<|image|>`` before the text
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<|image|>' }}{% endif %}{% endfor %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def embedded_smollm2_mllama_dir(smollm2_dir: Path, seed: int = 0) -> Path:
    """``embedded:smollm2-135m-mllama``: :func:`build_smollm2_mllama` once into
    ``artifacts.cache_dir()/models/smollm2-135m-mllama-<key12>/`` (atomic, under a lock; ~10 s, 0.68 GB) and reused.
    The key covers the SmolLM2 conversion it grafts (its directory name holds the GGUF's hash),
    :data:`BUILDER_VERSION`, ``seed`` and the transformers version.

    Args:
        smollm2_dir: SmolLM2's HF checkpoint — ``pipeline.quantize.sources.embedded_smollm2_dir()``; passed in, not
            looked up, because the quantize stage imports this folder (a vision → quantize arrow would be a cycle).
        seed: see :func:`build_smollm2_mllama`.
    """
    import fcntl
    import hashlib

    import transformers

    from pipeline.core import artifacts

    key = hashlib.sha256(json.dumps([smollm2_dir.name, BUILDER_VERSION, seed, transformers.__version__]).encode())
    final = artifacts.cache_dir() / "models" / f"smollm2-135m-mllama-{key.hexdigest()[:12]}"
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent processes build it once
        if not (final / PROVENANCE).is_file():
            with artifacts.atomic_dir(final, need_bytes=800 << 20) as tmp:
                build_smollm2_mllama(tmp, seed, smollm2_dir=smollm2_dir)
                (tmp / PROVENANCE).write_text(json.dumps({
                    "built_from": str(smollm2_dir), "builder_version": BUILDER_VERSION, "seed": seed,
                    "transformers": transformers.__version__}, indent=2, sort_keys=True) + "\n")
    return final


def smollm2_mllama_config(smollm2_cfg: dict[str, Any], *, gate_layers: tuple[int, ...] = CROSS_LAYERS) -> Any:
    """The ``MllamaConfig`` of the graft: SmolLM2's text geometry (hidden 576, 9 heads / 3 KV heads, head 64,
    intermediate 1536, RoPE θ 1e5, RMSNorm eps) with ``len(gate_layers)`` more layers, the cross layers at
    ``gate_layers``; :data:`TINY_VISION` with ``vision_output_dim`` projected to 576; ``image_token_index`` =
    SmolLM2's ``vocab_size``.

    Args:
        smollm2_cfg: SmolLM2's ``config.json`` as a dict.
        gate_layers: cross-attention layer indices in the mllama decoder (sorted, distinct, < total layers).
    """
    from transformers import MllamaConfig

    c = smollm2_cfg
    n = c["num_hidden_layers"] + len(gate_layers)
    if list(gate_layers) != sorted(set(gate_layers)) or not all(0 <= i < n for i in gate_layers):
        raise ValueError(f"cross-attention layers {list(gate_layers)}: need distinct sorted indices below {n}")
    rope = c.get("rope_parameters") or {"rope_type": "default", "rope_theta": c["rope_theta"]}
    text = {
        "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": n, "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"], "rms_norm_eps": c["rms_norm_eps"],
        "max_position_embeddings": c["max_position_embeddings"], "rope_theta": rope["rope_theta"],
        "rope_scaling": {"rope_type": "default"}, "rope_parameters": dict(rope),
        "cross_attention_layers": list(gate_layers), "tie_word_embeddings": False,
        "bos_token_id": c["bos_token_id"], "eos_token_id": c["eos_token_id"], "pad_token_id": c["pad_token_id"],
        "hidden_act": c.get("hidden_act", "silu"),
    }
    return MllamaConfig(vision_config=dict(TINY_VISION), text_config=text, image_token_index=c["vocab_size"])


def self_layer_map(num_smollm2_layers: int, gate_layers: tuple[int, ...] = CROSS_LAYERS) -> dict[int, int]:
    """SmolLM2 layer index → mllama decoder layer index (the cross layers pushed in between).

    >>> self_layer_map(4, (1, 3))
    {0: 0, 1: 2, 2: 4, 3: 5}
    """
    total = num_smollm2_layers + len(gate_layers)
    selfs = [i for i in range(total) if i not in gate_layers]
    return dict(enumerate(selfs))


def _tokenizer(smollm2_dir: Path) -> Any:
    from transformers import AddedToken, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    tok.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_smollm2_mllama(out_dir: Path, seed: int = 0, *, smollm2_dir: Path, gate: float = GATE,
                         cross_layers: tuple[int, ...] = CROSS_LAYERS) -> Path:
    """Write the ``embedded:smollm2-135m-mllama`` checkpoint directory (see the module docstring).

    Files: ``config.json`` (``MllamaConfig``), ``model.safetensors`` (float32, ~0.66 GB), ``generation_config.json``
    (SmolLM2's: eos 2), ``preprocessor_config.json`` (mllama image processor, 56 px tiles, 4 tiles), tokenizer files
    with ``<|image|>`` added (its id = ``config.image_token_index`` = 49152) and :data:`CHAT_TEMPLATE`.

    Args:
        out_dir: the directory to write (created; files in it are overwritten).
        seed: ``torch.manual_seed`` for the vision tower, projector, cross-attention layers and the new embedding
            rows: the same seed gives the same bytes.
        gate: the cross layers' tanh-gate pre-activations (0 makes an image a no-op; tests use it for the graft).
        cross_layers: the cross layers' indices in the mllama decoder (each < SmolLM2's layers + their count).
        smollm2_dir: SmolLM2-135M-Instruct's HF checkpoint, ``pipeline.quantize.sources.embedded_smollm2_dir()``
            (a required argument: see :func:`embedded_smollm2_mllama_dir`).

    Returns:
        ``out_dir``.
    """
    import torch
    from safetensors.torch import load_file
    from transformers import GenerationConfig, MllamaForConditionalGeneration

    src_cfg = json.loads((smollm2_dir / "config.json").read_text())
    cfg = smollm2_mllama_config(src_cfg, gate_layers=cross_layers)
    src = load_file(str(smollm2_dir / "model.safetensors"))
    torch.manual_seed(seed)
    model = MllamaForConditionalGeneration(cfg)
    _fill(model, src, src_cfg, cfg, gate)
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    GenerationConfig.from_pretrained(smollm2_dir, local_files_only=True).save_pretrained(out_dir)
    _tokenizer(smollm2_dir).save_pretrained(out_dir)
    _compat_config(out_dir / "config.json", cfg)
    vc = cfg.vision_config
    image_processor(vc.image_size, vc.max_num_tiles).save_pretrained(out_dir)
    return out_dir


def _compat_config(path: Path, cfg: Any) -> None:
    """Add the 4.x spellings of the RoPE settings to the saved ``text_config`` (transformers 5.x writes only
    ``rope_parameters``; v4.57.3's ``MllamaTextConfig`` reads ``rope_theta`` / ``rope_scaling`` and would fall back
    to its default θ 500000, configuration_mllama.py:254 of that release), so both releases load the same model."""
    data = json.loads(path.read_text())
    rope = cfg.text_config.rope_parameters
    data["text_config"]["rope_theta"] = rope["rope_theta"]
    data["text_config"]["rope_scaling"] = {"rope_type": rope["rope_type"]}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    tc_path = path.parent / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"  # 4.57 has no TokenizersBackend (as quantize/sources.py does)
    tc["model_input_names"] = ["input_ids", "attention_mask"]  # 4.57's fast tokenizer adds token_type_ids otherwise
    for k in ("is_local", "local_files_only"):
        tc.pop(k, None)
    tc_path.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")


def _fill(model: Any, src: dict[str, Any], src_cfg: dict[str, Any], cfg: Any, gate: float) -> None:
    """Overwrite the freshly initialised (seeded) ``model`` with SmolLM2's tensors where they exist: self-attention
    layers (moved past the cross layers), final norm, the first ``vocab_size`` embedding rows, ``lm_head`` (SmolLM2's
    tied embedding); set both gates of every cross layer to ``gate`` and redraw the cross layers' and the
    projector's matrices at unit gain (transformers' N(0, 0.02²) makes them ~50× too small for the image to matter
    at a small gate). The rest keeps transformers' own seeded init."""
    import torch

    mapping = self_layer_map(src_cfg["num_hidden_layers"], tuple(cfg.text_config.cross_attention_layers))
    lm = model.model.language_model
    embed = src["model.embed_tokens.weight"]
    with torch.no_grad():
        for i, j in mapping.items():
            layer = lm.layers[j].state_dict()
            prefix = f"model.layers.{i}."
            theirs = {k[len(prefix):]: v for k, v in src.items() if k.startswith(prefix)}
            if set(theirs) != set(layer):
                raise RuntimeError(f"SmolLM2 layer {i} {sorted(theirs)} != mllama layer {j} {sorted(layer)}")
            lm.layers[j].load_state_dict(theirs, strict=True)
        lm.norm.weight.copy_(src["model.norm.weight"])
        lm.embed_tokens.weight[: embed.shape[0]].copy_(embed)
        model.lm_head.weight.copy_(src.get("lm_head.weight", embed))
        linears = [model.model.multi_modal_projector]
        for j in cfg.text_config.cross_attention_layers:
            layer = lm.layers[j]
            layer.cross_attn_attn_gate.fill_(gate)
            layer.cross_attn_mlp_gate.fill_(gate)
            attn, mlp = layer.cross_attn, layer.mlp
            linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        for lin in linears:  # unit-gain: N(0, 1/fan_in), so a cross layer's output is on the residual's scale
            lin.weight.normal_(0.0, lin.weight.shape[1] ** -0.5)
