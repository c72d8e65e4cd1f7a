"""mllama's gated cross-attention layers in the CPU engine (Llama 3.2 Vision: ``MllamaForConditionalGeneration``).

The decoder's self-attention layers run as for a Llama (:class:`~pipeline.cpu_runtime.model.Decoder`, native kernels
included); the cross-attention layers sit between them and run here, in torch, over each request's encoder features
(the vision model + projector output, ``[encoder_len, hidden]``). Semantics are transformers'
``MllamaCrossAttentionDecoderLayer`` — v4.57.3 (the release TensorRT-LLM 1.2.1 pins) models/mllama/modeling_mllama.py
and the installed 5.14.1, same code:

- attention block (v4.57.3 :673-723, 5.14.1 :656-703): ``h = RMSNorm(x, input_layernorm)``; ``q = q_proj(h)`` per
  head, then ``q_norm`` (RMSNorm over head_dim, :427 / :425); ``k = k_proj(features)``, ``v = v_proj(features)``
  per KV head, ``k_norm`` on k only (:435 / :433); softmax(q kᵀ / √head_dim + mask) v with GQA, ``o_proj``;
  ``x = x + tanh(cross_attn_attn_gate) · out`` (:714 / :694);
- MLP block: ``x = x + tanh(cross_attn_mlp_gate) · full_row · mlp(RMSNorm(x, post_attention_layernorm))``
  (:716-721 / :696-701), where ``full_row`` is 0 for a "full text row masked out" — a token whose mask row has no
  True — and 1 otherwise;
- the mask (``_prepare_cross_attention_mask``, v4.57.3 :48-73, 5.14.1 :48-73): transformers' per-tile mask
  ``[B, S, images, tiles]`` is ``repeat_interleave``d by the vectors per tile (:55) into ``[B, S, encoder_len]``
  (:func:`expand_tile_mask` here), inverted to an additive mask (finfo.min where False) and multiplied by
  ``full_row`` — so a fully masked row's *attention* runs unmasked over every encoder vector and is still added
  through the attention gate; only its MLP is zeroed. Reproduced as is (greedy output must equal ``generate``);
- rows: token at position p uses mask row min(p, rows − 1): the prompt's rows, then ``generate`` appends the last row
  for each new token (``_update_model_kwargs_for_generation``, v4.57.3 :1732-1746, 5.14.1 :1576-1590);
- the self-attention layers keep their kernels (native or torch); the cross layers run in torch between them;
- no features → the layers are skipped (text-only; v4.57.3 :1252-1257, 5.14.1 :1139-1145). ``cross_attention_mask``
  None with features → no mask (every row attends to every vector, transformers with ``cross_attention_mask=None``).

K/V are computed once per request (:meth:`CrossLayers.prepare`, at admission) and kept with the request
(:class:`CrossState`); each step attends with the rows of the tokens it runs.

Engine directory layout (written by :mod:`pipeline.engine.cpu`): ``config.json`` is the full ``MllamaConfig``;
``model.safetensors`` holds the language model only (the vision tower + projector run in the vision encoder, the
ONNX model) with the self-attention layers renumbered ``model.layers.{0..n_self-1}.*`` in order, the cross layers as
``model.cross_layers.{i}.*`` with ``i`` their index in the mllama decoder, ``model.embed_tokens.weight``
(``vocab_size + 8`` rows: ``<|image|>`` is an input id), ``model.norm.weight``, ``lm_head.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

ARCHITECTURE = "MllamaForConditionalGeneration"
CROSS_PREFIX = "model.cross_layers."


def is_mllama(cfg: dict[str, Any]) -> bool:
    """Whether a config.json dict is an mllama checkpoint (``architectures[0]``)."""
    return (cfg.get("architectures") or ["?"])[0] == ARCHITECTURE


def text_view(cfg: dict[str, Any]) -> dict[str, Any]:
    """The Llama config of an mllama config's self-attention stack: ``text_config`` with ``num_hidden_layers`` = the
    self-attention layers only, ``architectures`` ``LlamaForCausalLM`` (what :class:`~pipeline.cpu_runtime.model.Decoder`
    builds its layers and KV cache from)."""
    tc = dict(cfg["text_config"])
    tc["num_hidden_layers"] = int(tc["num_hidden_layers"]) - len(tc.get("cross_attention_layers") or [])
    tc["architectures"] = ["LlamaForCausalLM"]
    tc.setdefault("hidden_act", "silu")
    return tc


def unsupported_reason(cfg: dict[str, Any]) -> str | None:
    """Why an mllama config is beyond this module (one line), or None: the text stack must be Llama-shaped
    (checked by the caller on :func:`text_view`), cross layers must be distinct, in range, and not first/last."""
    tc = cfg.get("text_config") or {}
    cross = list(tc.get("cross_attention_layers") or [])
    n = int(tc.get("num_hidden_layers", 0))
    if not cross:
        return "an mllama text_config without cross_attention_layers"
    if cross != sorted(set(cross)) or cross[0] < 1 or cross[-1] >= n - 1:
        return (f"cross_attention_layers {cross}: the CPU engine needs distinct sorted indices in [1, {n - 2}] "
                f"(a cross layer between two self-attention layers)")
    if tc.get("hidden_size", 0) % tc.get("num_attention_heads", 1):
        return "hidden_size not a multiple of num_attention_heads (mllama's cross-attention head_dim)"
    return None


def checked_view(cfg: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
    """``cfg`` itself, or for mllama its :func:`text_view` (raising ``error`` with :func:`unsupported_reason`)."""
    if not is_mllama(cfg):
        return cfg
    if (why := unsupported_reason(cfg)) is not None:
        raise error(f"{ARCHITECTURE}: {why} is not supported by the CPU engine")
    return text_view(cfg)


def active(layers: CrossLayers | None, states: list | None) -> CrossLayers | None:
    """``layers`` when a sequence of the step has a :class:`CrossState` (``states`` per slot), else None."""
    return layers if layers is not None and states and any(s is not None for s in states) else None


def after_layer(layers: CrossLayers | None, n_before: int, x: torch.Tensor, b: Any,
                add: torch.Tensor | None = None) -> torch.Tensor | None:
    """The decoder's hook after each self-attention layer: run the cross layer that follows ``n_before`` of them
    (if there is one and a sequence of step ``b`` has encoder features) on ``x`` in place.

    ``add``: the layer's MLP output not yet added to ``x`` (the native path fuses that add into the next RMSNorm):
    returned as is when no cross layer runs; else added to ``x`` first and None returned (nothing left to add).
    """
    if (cross := active(layers, b.cross)) is None or n_before not in cross.after:
        return add
    if add is not None:
        x += add
    cross.apply(n_before, x, b.slots, b.positions, b.cross)
    return None


def engine_tensor_name(name: str, cfg: dict[str, Any]) -> str | None:
    """A checkpoint tensor's name in the engine's ``model.safetensors`` (module docstring), or None for a tensor
    the engine does not hold (mllama's vision tower and projector). Non-mllama names pass through. Both spellings
    of mllama's language model are read: ``language_model.model.*`` / ``language_model.lm_head`` (what
    ``save_pretrained`` writes, v4.57.3 and 5.14.1) and ``model.language_model.*`` / ``lm_head`` (the modules'
    own names since v4.52)."""
    if not is_mllama(cfg):
        return name
    if name in ("lm_head.weight", "language_model.lm_head.weight"):
        return "lm_head.weight"
    for pre in ("model.language_model.", "language_model.model."):
        if name.startswith(pre):
            rest = name[len(pre):]
            break
    else:
        return None
    if not rest.startswith("layers."):
        return "model." + rest  # embed_tokens, norm
    i_str, _, leaf = rest[len("layers."):].partition(".")
    i, cross = int(i_str), cfg["text_config"]["cross_attention_layers"]
    if i in cross:
        return f"{CROSS_PREFIX}{i}.{leaf}"
    return f"model.layers.{i - sum(c < i for c in cross)}.{leaf}"


def expand_tile_mask(tile_mask: Any, vectors_per_tile: int) -> torch.Tensor:
    """transformers' per-tile ``cross_attention_mask`` ``[rows, images, tiles]`` (0/1, the processor's output for one
    sample) → the engine's bool ``[rows, images × tiles × vectors_per_tile]`` (``repeat_interleave`` as
    ``_prepare_cross_attention_mask`` does, v4.57.3 modeling_mllama.py:55)."""
    t = torch.as_tensor(tile_mask)
    rows = t.shape[0]
    return t.reshape(rows, -1).repeat_interleave(vectors_per_tile, dim=1).bool()


def check_cross_inputs(features: Any, mask: Any, n_prompt: int, hidden: int, max_len: int
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Validate one request's ``encoder_input_features`` ``[encoder_len, hidden]`` and ``cross_attention_mask``
    ``[rows ≥ n_prompt, encoder_len]``; returns them as float32 / bool tensors.

    Raises ``ValueError`` (one line, meant for the client) naming the input and both shapes at fault.
    """
    f = torch.as_tensor(features)
    if f.dim() == 3 and f.shape[0] == 1:
        f = f[0]
    if f.dim() != 2 or f.shape[1] != hidden or not 0 < f.shape[0] <= max_len:
        raise ValueError(f"encoder_input_features has shape {list(f.shape)}; this engine takes [encoder_len ≤ "
                         f"{max_len}, {hidden}] (max_encoder_input_len, hidden size)")
    if not f.is_floating_point():
        raise ValueError(f"encoder_input_features has dtype {f.dtype}; it must be floating point")
    f = f.float()
    if not torch.isfinite(f).all():
        raise ValueError("encoder_input_features holds NaN or infinite values")
    if mask is None:
        return f, None
    m = torch.as_tensor(mask)
    if m.dim() == 3 and m.shape[0] == 1:
        m = m[0]
    if m.dim() != 2 or m.shape[1] != f.shape[0] or m.shape[0] < n_prompt:
        raise ValueError(f"cross_attention_mask has shape {list(m.shape)}; this request needs [rows ≥ {n_prompt} "
                         f"(prompt tokens), {f.shape[0]}] (encoder_len of encoder_input_features)")
    return f, m.bool()


def request_cross(layers: CrossLayers | None, engine_cfg: dict[str, Any], n_prompt: int, features: Any, mask: Any,
                  skip: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One request's checked cross inputs for :meth:`CrossLayers.prepare`, or None (text-only: no features, or
    ``skip`` — upstream's ``skip_cross_attn_blocks``). Limits from engine_config.json ``max_encoder_input_len``.

    Raises ``ValueError`` (one line): features for an engine without cross-attention layers, a mask without
    features, or a shape :func:`check_cross_inputs` refuses.
    """
    if skip or features is None:
        if mask is not None and not skip:
            raise ValueError("cross_attention_mask given without encoder_input_features")
        return None
    if layers is None:
        raise ValueError("encoder_input_features given, but this engine's model has no cross-attention layers")
    return check_cross_inputs(features, mask, n_prompt, layers.hidden, int(engine_cfg["max_encoder_input_len"]))


@dataclass
class CrossState:
    """One request's cross-attention state: per cross layer K (``k_norm`` applied) and V ``[kv_heads, E, D]``; the
    additive mask ``[rows, E]`` (0 / finfo.min, zeros on full-masked rows) and ``full_row`` ``[rows]`` (0/1) — or
    ``None`` for no mask."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    add_mask: torch.Tensor | None
    full_row: torch.Tensor | None

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The additive mask rows ``[n, E]`` and ``full_row`` ``[n, 1]`` for tokens at ``positions``."""
        if self.add_mask is None:
            return None, None
        r = positions.clamp(max=self.add_mask.shape[0] - 1)
        return self.add_mask[r], self.full_row[r].unsqueeze(1)


class CrossLayers:
    """The cross-attention layers of an mllama engine directory (float32), keyed by the number of self-attention
    layers that run before each.

    Args:
        weights: the engine's :class:`~pipeline.cpu_runtime.weights.Weights`.
        cfg: the full mllama config.json dict.
        eps: RMSNorm epsilon.
    """

    def __init__(self, weights: Any, cfg: dict[str, Any], eps: float):
        tc = cfg["text_config"]
        self.cross = list(tc["cross_attention_layers"])
        self.hidden = int(tc["hidden_size"])
        self.heads, self.kv_heads = int(tc["num_attention_heads"]), int(tc["num_key_value_heads"])
        self.head_dim = self.hidden // self.heads  # MllamaTextCrossAttention: hidden_size // num_heads
        self.scale = self.head_dim ** -0.5
        self.eps = eps
        f32 = torch.float32
        #: self-attention layers before it → the cross layer's tensors
        self.after: dict[int, dict[str, torch.Tensor]] = {}
        for n_before, i in enumerate(self.cross):
            p = f"{CROSS_PREFIX}{i}."
            t = {k: weights.get(p + k, f32) for k in (
                "input_layernorm.weight", "post_attention_layernorm.weight", "cross_attn.q_proj.weight",
                "cross_attn.k_proj.weight", "cross_attn.v_proj.weight", "cross_attn.o_proj.weight",
                "cross_attn.q_norm.weight", "cross_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                "mlp.down_proj.weight")}
            t["attn_gate"] = weights.get(p + "cross_attn_attn_gate", f32).reshape(()).tanh()
            t["mlp_gate"] = weights.get(p + "cross_attn_mlp_gate", f32).reshape(()).tanh()
            self.after[i - n_before] = t

    def prepare(self, features: torch.Tensor, mask: torch.Tensor | None) -> CrossState:
        """K/V of every cross layer for one request's ``features`` ``[E, hidden]`` float32 and its bool ``mask``
        ``[rows, E]`` (or None), computed once (at admission)."""
        E, D = features.shape[0], self.head_dim
        ks, vs = [], []
        for t in self.after.values():
            k = F.linear(features, t["cross_attn.k_proj.weight"]).view(E, self.kv_heads, D).transpose(0, 1)
            ks.append(F.rms_norm(k, (D,), t["cross_attn.k_norm.weight"], self.eps).contiguous())
            vs.append(F.linear(features, t["cross_attn.v_proj.weight"]).view(E, self.kv_heads, D).transpose(0, 1)
                      .contiguous())
        if mask is None:
            return CrossState(ks, vs, None, None)
        full_row = mask.any(dim=1).float()
        add = torch.zeros(mask.shape, dtype=torch.float32).masked_fill_(~mask, torch.finfo(torch.float32).min)
        add *= full_row.unsqueeze(1)  # a full-masked row attends unmasked (transformers, module docstring)
        return CrossState(ks, vs, add, full_row)

    def apply(self, n_before: int, x: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
              states: list[CrossState | None]) -> None:
        """Run the cross layer that follows ``n_before`` self-attention layers on the step's residual stream ``x``
        float32 ``[T, hidden]`` in place, for the tokens whose slot has a :class:`CrossState` (``states[slot]``);
        other tokens pass through (text-only requests)."""
        t = self.after[n_before]
        H, KVH, D = self.heads, self.kv_heads, self.head_dim
        group = H // KVH
        for slot, st in enumerate(states):
            if st is None:
                continue
            rows = (slots == slot).nonzero().flatten()
            if rows.numel() == 0:
                continue
            xs = x[rows]
            n = xs.shape[0]
            h = F.rms_norm(xs, (self.hidden,), t["input_layernorm.weight"], self.eps)
            q = F.linear(h, t["cross_attn.q_proj.weight"]).view(n, H, D)
            q = F.rms_norm(q, (D,), t["cross_attn.q_norm.weight"], self.eps)
            q = q.view(n, KVH, group, D).permute(1, 0, 2, 3).reshape(KVH, n * group, D)
            j = list(self.after).index(n_before)
            k, v = st.k[j], st.v[j]
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(self.scale)  # [KVH, n·group, E]
            add, full_row = st.rows(positions[rows])
            if add is not None:
                scores = scores.view(KVH, n, group, -1).add_(add.view(1, n, 1, -1)).view(KVH, n * group, -1)
            o = torch.bmm(torch.softmax(scores, dim=-1), v)  # [KVH, n·group, D]
            o = o.view(KVH, n, group, D).permute(1, 0, 2, 3).reshape(n, H * D)
            xs = xs + t["attn_gate"] * F.linear(o, t["cross_attn.o_proj.weight"])
            h = F.rms_norm(xs, (self.hidden,), t["post_attention_layernorm.weight"], self.eps)
            m = F.linear(F.silu(F.linear(h, t["mlp.gate_proj.weight"])) * F.linear(h, t["mlp.up_proj.weight"]),
                         t["mlp.down_proj.weight"])
            if full_row is not None:
                m = full_row * m
            x[rows] = xs + t["mlp_gate"] * m
