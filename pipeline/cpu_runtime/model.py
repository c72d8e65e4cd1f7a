"""The CPU engine's decoder: a Llama-family transformer in plain torch with a slot KV cache.

What makes it fast on a few CPU cores (measured on 2 AVX-512 cores, SmolLM2-135M fp32; see
``benchmarks/bench_cpu.py``):

- **Prepacked GEMMs, one copy of each weight.** Every Linear weight is reordered once into oneDNN's blocked
  layout (``torch.ops.mkldnn._reorder_linear_weight``). Steps of up to :data:`NATIVE_GEMM_MAX_ROWS` tokens (every
  decode step) run the native few-row kernel on that packed weight (``linear_packed_*`` in ``kernels/decoder.c``:
  each k's 64 outputs loaded once and multiply-added into every row): it streams the weights at the memory's
  speed where oneDNN's ``_linear_pointwise`` reaches ~2/3 of it at 1–4 rows (measured, the 540 MB of SmolLM2
  float32 weights: 16.7 vs 23.2 ms at 1 row). Larger steps (prefill) run oneDNN on the same weight.
  ``F.linear`` (MKL) takes 33–50 ms on this AMD CPU; it remains the fallback without mkldnn.
- **Fused projections**: q/k/v → one GEMM, gate/up → one GEMM; the lm_head runs only on the rows
  that need logits.
- **Slot KV cache** (:class:`SlotKvCache`): per layer ``[slots, kv_heads, slot_len, head_dim]`` in the
  compute dtype (float32, or bfloat16 with bfloat16 GEMMs), so every sequence's keys are one contiguous
  block. Grouped-query attention without repeating K/V: the ``group`` query heads that share a KV head
  become ``group`` query rows.
- **Native kernels** (:mod:`pipeline.cpu_runtime.native`, ``kernels/decoder.c``, built with the
  machine's C compiler): decode attention for the whole batch in one call per layer, each sequence's
  K/V read once up to its own length (16 sequences at ~200 tokens: 122 µs per layer vs 368 µs for two
  batched ``bmm`` + softmax); residual add + RMSNorm and RoPE + the K/V write in one call each instead
  of a dozen torch ops per layer. The torch path (:meth:`Decoder._layers_torch`) stays as the fallback.
- **One native call per decode step.** With the native GEMMs, a decode-only step runs every layer in
  ``Kernels.decode_layers`` (the same kernels in the same order as :meth:`Decoder._layers_native`, bit for bit,
  without ~10 Python dispatches per layer): 16 sequences at 200 tokens, 35.6 vs 38.4 ms per float32 step, 20.8 vs
  22.5–25.4 ms with bfloat16 GEMMs; 1 sequence 11.3 vs 12.9 ms (bfloat16).

Numerics follow ``transformers``' Llama in float32 (RMSNorm, rotate-half RoPE from the same
``inv_freq`` formula, SiLU-gated MLP, softmax attention with ``1/sqrt(head_dim)`` scaling): greedy
output matches ``generate()``; logits differ from it only by summation order (~1e-6 relative).

Supported ``config.json``: ``LlamaForCausalLM`` / ``MistralForCausalLM`` (no sliding window) /
``Qwen2ForCausalLM`` (q/k/v bias), rope ``default``/``llama3`` (:func:`check_supported`); mllama (cross_attention.py).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pipeline.core.geometry import ModelGeometry, geometry_from_dict
from pipeline.cpu_runtime import cross_attention, native
from pipeline.cpu_runtime.linear import (
    NATIVE_GEMM_MAX_ROWS,
    Linear,
    mkldnn_linear_available,
)
from pipeline.cpu_runtime.weights import Weights

#: Architectures whose HF implementation equals this module's decoder (config.json ``architectures[0]``).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
#: Rope types implemented by :func:`rope_inv_freq` (transformers ``ROPE_INIT_FUNCTIONS`` names).
SUPPORTED_ROPE_TYPES = ("default", "llama3")


class UnsupportedModelError(ValueError):
    """The checkpoint's config.json describes a model this decoder does not implement (one line)."""


def check_supported(cfg: dict[str, Any]) -> None:
    """Raise :class:`UnsupportedModelError` naming the first unsupported feature of ``cfg`` (a config.json dict)."""
    cfg = cross_attention.checked_view(cfg, UnsupportedModelError)
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {arch} is not supported by the CPU engine (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    rope = _rope_params(cfg)
    if rope.get("rope_type", "default") not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type {rope.get('rope_type')!r} is not supported by the CPU engine (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", arch == "MistralForCausalLM"):
        raise UnsupportedModelError("sliding-window attention is not supported by the CPU engine")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported by the CPU engine (silu only)")


def _rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 ``rope_parameters`` or transformers 4 ``rope_theta`` + ``rope_scaling``."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    return rope


def rope_inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float32, as transformers computes them
    (``_compute_default_rope_parameters`` / ``_compute_llama3_parameters``)."""
    rope = _rope_params(cfg)
    base = float(rope["rope_theta"])
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim))
    if rope.get("rope_type", "default") == "llama3":
        factor, lo, hi = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old = rope["original_max_position_embeddings"]
        low_wl, high_wl = old / lo, old / hi
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        inv = torch.where(medium, smoothed, inv_l)
    return inv


#: Compute dtypes of :class:`Decoder` by their recipe names (``build.cpu.dtype``).
COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

#: RMSNorm epsilon when config.json has no ``rms_norm_eps`` (transformers ``LlamaConfig``'s default).
DEFAULT_RMS_NORM_EPS = 1e-6


class SlotKvCache:
    """K and V for ``slots`` sequences of up to ``slot_len`` tokens: per layer ``[slots, kv_heads, slot_len, head_dim]``
    in ``dtype`` (float32 or bfloat16).

    Allocated with ``torch.empty``: pages become resident only when tokens are written, so the
    reserved size (``slots × slot_len`` tokens) is an upper bound on RAM, not a cost at start.
    """

    def __init__(self, geo: ModelGeometry, slots: int, slot_len: int, dtype: torch.dtype = torch.float32):
        self.slots, self.slot_len, self.dtype = slots, slot_len, dtype
        shape = (slots, geo.num_key_value_heads, slot_len, geo.head_dim)
        self.k = [torch.empty(shape, dtype=dtype) for _ in range(geo.num_hidden_layers)]
        self.v = [torch.empty(shape, dtype=dtype) for _ in range(geo.num_hidden_layers)]

    @property
    def reserved_bytes(self) -> int:
        """Bytes reserved (virtual) for all layers' K and V: slots × slot_len ×
        :meth:`~pipeline.core.geometry.ModelGeometry.kv_bytes_per_token` (element size of ``dtype``)."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of slot ``src`` into slot ``dst`` (all layers)."""
        for t in self.k + self.v:
            t[dst, :, :length].copy_(t[src, :, :length])


@dataclass
class StepBatch:
    """The tokens of one forward pass (built by the scheduler).

    ``tokens``/``positions``/``slots``: int64 ``[T]`` (decode tokens first, one per decoding
    sequence, then each prefill chunk's tokens in order). ``n_decode``: how many leading tokens are
    decode tokens. ``decode_ctx``: int64 ``[n_decode]`` context length (incl. this token) of each.
    ``chunks``: ``(offset in tokens, length, slot, start position)`` per prefill chunk.
    ``logit_rows``: int64 ``[R]`` indices into the T tokens whose next-token logits are needed.
    ``lora``: the step's LoRA deltas (:class:`pipeline.cpu_runtime.lora.LoraStep`), ``None`` without adapters.
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    n_decode: int
    decode_slots: list[int]
    decode_ctx: torch.Tensor
    chunks: list[tuple[int, int, int, int]]
    logit_rows: torch.Tensor
    lora: Any = None
    cross: Any = None  # per slot: the request's CrossState (mllama, cross_attention.py) or None


class Decoder:
    """Llama-family decoder over a :class:`SlotKvCache` (inference only).

    Args:
        engine_dir: directory with ``config.json`` and ``*.safetensors`` (plain HF layout).
        slots / slot_len: KV cache size (sequences × tokens each).
        pack: use prepacked oneDNN GEMMs (default: when available).
        dtype: GEMM dtype (:data:`COMPUTE_DTYPES`). ``torch.float32``: everything in float32 (greedy
            output equals ``generate()`` in float32). ``torch.bfloat16``: the weights of every Linear
            (lm_head included), their inputs and outputs in bfloat16 (oneDNN accumulates in float32), and
            so the SiLU-gated product between gate/up and down; the residual stream, RMSNorm, RoPE,
            attention's arithmetic and the logits (the bfloat16 lm_head output, upcast) stay float32.
            Half the weight bytes per step.
        kv_dtype: the KV cache's dtype (float32 or bfloat16; default ``dtype``, as TensorRT-LLM keeps an
            unquantized KV cache in the model's dtype: ``_create_kv_cache_manager`` in
            ``tensorrt_llm/_torch/pyexecutor/_util.py``@0004396). bfloat16: K and V rounded to bfloat16 when
            written (half the bytes attention reads per step and per cached token); attention computes in float32
            either way.
        kernels: decode attention and the layer glue (RMSNorm, RoPE, K/V write),
            :data:`~pipeline.cpu_runtime.native.KERNEL_CHOICES` (default ``$TRTPIPE_CPU_KERNELS``, else ``auto``:
            the native kernels when they build here, else torch ops). :attr:`kernels` names the ones in use.

    Raises ``UnsupportedModelError`` (see :func:`check_supported`), ``FileNotFoundError``,
    ``ValueError`` for a dtype not in :data:`COMPUTE_DTYPES` or an unknown ``kernels``, and
    :class:`~pipeline.cpu_runtime.native.KernelUnavailable` for ``kernels="native"`` where they cannot be used.
    """

    def __init__(self, engine_dir: Path, *, slots: int, slot_len: int, pack: bool | None = None,
                 dtype: torch.dtype = torch.float32, kv_dtype: torch.dtype | None = None, kernels: str | None = None):
        if dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"compute dtype {dtype} is not one of {', '.join(COMPUTE_DTYPES)}")
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if kv_dtype not in COMPUTE_DTYPES.values():
            raise ValueError(f"KV cache dtype {kv_dtype} is not one of {', '.join(COMPUTE_DTYPES)}")
        engine_dir = Path(engine_dir)
        cfg = json.loads((engine_dir / "config.json").read_text())
        check_supported(cfg)
        self.config, view = cfg, cross_attention.checked_view(cfg, UnsupportedModelError)  # mllama: its self-attn stack
        self.geo = geo = geometry_from_dict(view)  # ModelGeometry: the shape, and the one KV bytes-per-token rule
        self.eps = float(geo.rms_norm_eps if geo.rms_norm_eps is not None else DEFAULT_RMS_NORM_EPS)
        self.packed = mkldnn_linear_available(dtype) if pack is None else (pack and mkldnn_linear_available(dtype))
        self.dtype = cd = dtype
        w = Weights(engine_dir)
        f32 = torch.float32
        self.layers: list[dict[str, Any]] = []
        for i in range(geo.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv_w = torch.cat([w.mapped(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).to(cd)
            qkv_b = None
            if p + "self_attn.q_proj.bias" in w:
                qkv_b = torch.cat([w.mapped(p + f"self_attn.{n}_proj.bias") for n in "qkv"]).to(cd)
            gate_up = torch.cat([w.mapped(p + "mlp.gate_proj.weight"), w.mapped(p + "mlp.up_proj.weight")]).to(cd)
            o_b = w.get(p + "self_attn.o_proj.bias", cd) if p + "self_attn.o_proj.bias" in w else None
            self.layers.append({
                "ln1": w.get(p + "input_layernorm.weight", f32),
                "ln2": w.get(p + "post_attention_layernorm.weight", f32),
                "qkv": Linear(qkv_w, qkv_b, packed=self.packed),
                "o": Linear(w.get(p + "self_attn.o_proj.weight", cd), o_b, packed=self.packed),
                "gate_up": Linear(gate_up, None, packed=self.packed),
                "down": Linear(w.get(p + "mlp.down_proj.weight", cd), None, packed=self.packed),
            })
        self.norm = w.get("model.norm.weight", f32)
        # the embedding stays file-backed in its stored dtype (only the rows looked up become resident);
        # forward() upcasts the looked-up rows into the float32 residual stream
        self.embed = w.mapped("model.embed_tokens.weight")
        # the lm_head (tied to the embedding in SmolLM2) is packed from a private copy: packing it through the
        # mapping above would leave every page of the embedding resident in this process (113 MB for SmolLM2
        # in float32) when lookups need only the rows of the tokens seen
        head = "lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"
        self.lm_head = Linear(w.get(head, cd), None, packed=self.packed)
        self.cross = cross_attention.CrossLayers(w, cfg, self.eps) if view is not cfg else None
        inv = rope_inv_freq(view, geo.head_dim)
        pos = torch.arange(slot_len, dtype=torch.int64).float()
        freqs = torch.outer(pos, inv)  # == transformers' inv_freq @ position_ids (one-term products)
        emb2 = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb2.cos(), emb2.sin()
        self.cache = SlotKvCache(geo, slots, slot_len, kv_dtype)
        self.scale = 1.0 / math.sqrt(geo.head_dim)
        kn = native.kernels(kernels)
        if kn and geo.heads_per_kv_head > native.MAX_GROUP:
            if kernels == "native":
                raise native.KernelUnavailable(f"the native decode attention takes at most {native.MAX_GROUP} query "
                                               f"heads per KV head; this model has {geo.heads_per_kv_head}")
            kn = None
        self._kernels = kn
        #: kernels in use: ``native-avx512`` / ``native`` (:mod:`pipeline.cpu_runtime.native`) or ``torch``
        self.kernels = kn.name if kn else "torch"
        linears = [L[n] for L in self.layers for n in ("qkv", "o", "gate_up", "down")] + [self.lm_head]
        native_gemms = bool(kn) and self.packed and all(lin.use_native(kn) for lin in linears)
        if not native_gemms:
            for lin in linears:  # all or none: one GEMM path per step size
                lin.use_native(None)
        #: GEMMs in use: ``native+onednn-packed`` (the native kernel up to :data:`NATIVE_GEMM_MAX_ROWS` rows, oneDNN
        #: above, on one packed copy), ``onednn-packed`` or ``torch-linear``
        self.gemm = "native+onednn-packed" if native_gemms else "onednn-packed" if self.packed else "torch-linear"
        # decode-only steps run every layer in one native call (Kernels.decode_layers) when every GEMM is native: the
        # addresses it reads per layer (the tensors stay referenced by self.layers and self.cache)
        self._layer_table: torch.Tensor | None = None
        if native_gemms:
            def addr(t: torch.Tensor | None) -> int:
                return 0 if t is None else t.data_ptr()

            # the packed weights' addresses as use_native() took them
            self._layer_table = torch.tensor([
                [addr(L["ln1"]), addr(L["ln2"]), L["qkv"]._weight_ptr, addr(L["qkv"].bias), L["o"]._weight_ptr,
                 addr(L["o"].bias), L["gate_up"]._weight_ptr, L["down"]._weight_ptr, addr(self.cache.k[i]),
                 addr(self.cache.v[i])]
                for i, L in enumerate(self.layers)], dtype=torch.int64)
        #: whether decode-only steps go through :meth:`~pipeline.cpu_runtime.native.Kernels.decode_layers` (same
        #: kernels and order as :meth:`_layers_native`; tests switch it off to compare the two)
        self.fused_decode = self._layer_table is not None

    # ------------------------------------------------------------------ forward
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        """transformers' ``x * cos + rotate_half(x) * sin`` for ``x`` ``[T, heads, D]``, with the halves swapped
        by ``flip`` and the sign of ``-x2 * sin`` folded into ``sin_signed`` (bitwise the same products)."""
        T, n, D = x.shape
        swapped = x.view(T, n, 2, D // 2).flip(2).view(T, n, D)
        return x * cos + swapped * sin_signed

    def _decode_attention_torch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ · scale + mask) v for decode: ``q`` ``[slots, kv_heads, group, D]``, ``k``/``v`` the cache views
        ``[slots, kv_heads, ctx, D]``, ``mask`` ``[slots, 1, 1, ctx]`` (0 / -inf) → ``[slots, kv_heads, group, D]``.

        Two batched GEMMs and a softmax over the strided cache views (no copy): with a handful of query rows per
        KV head, SDPA's blocked flash kernel spends most of its time on setup (measured on 2 cores, SmolLM2, 16
        sequences at 150 tokens: 267 µs per layer vs 90 µs here)."""
        n, kvh, group, d = q.shape
        ctx = k.shape[2]
        # [slots, kv_heads] merge into one batch dim without a copy: the cache's slot stride is kv_heads × its head stride
        kk, vv = k.reshape(n * kvh, ctx, d), v.reshape(n * kvh, ctx, d)
        scores = torch.bmm(q.reshape(n * kvh, group, d), kk.transpose(1, 2)).view(n, kvh, group, ctx)
        probs = torch.softmax(scores.mul_(self.scale).add_(mask), dim=-1)
        return torch.bmm(probs.view(n * kvh, group, ctx), vv).view(n, kvh, group, d)

    def _prefill_attention(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: StepBatch,
                           masks: list[torch.Tensor | None], attn: torch.Tensor) -> None:
        """Causal SDPA of each prefill chunk over its slot's cache into ``attn`` ``[T, heads, D]`` (``q`` the same
        shape, rotated; ``masks`` one per chunk: ``None`` for a chunk starting at position 0, else its additive mask)."""
        for (off, n, slot, start), m in zip(b.chunks, masks):
            qc = q[off:off + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            kk = kc[slot:slot + 1, :, :start + n].float()  # a copy only when the cache is bfloat16
            vv = vc[slot:slot + 1, :, :start + n].float()
            o = F.scaled_dot_product_attention(qc, kk, vv, attn_mask=m, is_causal=m is None, scale=self.scale,
                                               enable_gqa=True)
            attn[off:off + n] = o[0].transpose(0, 1)

    @torch.inference_mode()
    def forward(self, b: StepBatch) -> torch.Tensor:
        """Run one step; returns float32 logits ``[len(b.logit_rows), vocab]`` (in bfloat16 compute: the
        bfloat16 lm_head output, upcast). Writes the step's K/V into the cache at (slot, position) of every token.

        Per layer: residual add + RMSNorm, fused qkv GEMM, RoPE on q and k, K/V write into the slot cache,
        attention (decode tokens: one call over their slots and lengths; prefill chunks: causal SDPA over the
        slot's cache), o-proj, residual add + RMSNorm, fused gate/up GEMM, SiLU·up, down. The native kernels
        (:mod:`pipeline.cpu_runtime.native`) do the add + RMSNorm, RoPE + K/V write, decode attention and SiLU·up in
        one call each (:meth:`_layers_native`), and a decode-only step of up to :data:`NATIVE_GEMM_MAX_ROWS` tokens
        runs all layers in one call (:attr:`fused_decode`); the torch path (:meth:`_layers_torch`) in torch ops.
        """
        x = F.embedding(b.tokens, self.embed)
        if self.dtype != torch.float32:
            x = x.float()  # the residual stream is float32 in every compute dtype
        chunk_masks = [
            None if start == 0 else
            torch.zeros(n, start + n).masked_fill_(
                torch.arange(start + n).unsqueeze(0) > torch.arange(start, start + n).unsqueeze(1), float("-inf"))
            for _, n, _, start in b.chunks
        ]
        T = x.shape[0]
        layers = self.layers if b.lora is None else b.lora.wrap(self.layers)  # LoRA: the layer-by-layer path
        if b.lora is None and self.fused_decode and b.n_decode == T <= NATIVE_GEMM_MAX_ROWS and not cross_attention.active(self.cross, b.cross):
            g = self.geo
            self._kernels.decode_layers(
                self._layer_table, self.dtype != torch.float32, self.cache.dtype != torch.float32, x, g.num_attention_heads,
                g.num_key_value_heads, g.head_dim,
                self.layers[0]["down"].in_features, self.cos, self.sin, b.positions.contiguous(), b.slots.contiguous(),
                b.decode_ctx.contiguous(), self.cache.slots, self.cache.slot_len, self.eps, self.scale, torch.get_num_threads())
        elif self._kernels:
            x = self._layers_native(b, x, chunk_masks, layers)
        else:
            x = self._layers_torch(b, x, chunk_masks, layers)
        last = x[b.logit_rows]
        h = F.rms_norm(last, (self.geo.hidden_size,), self.norm, self.eps)
        return self.lm_head(h.to(self.dtype)).float() if self.dtype != torch.float32 else self.lm_head(h)

    def _layers_native(self, b: StepBatch, x: torch.Tensor, chunk_masks: list[torch.Tensor | None], layers: list) -> torch.Tensor:
        """The decoder layers with the native kernels; ``x`` float32 ``[T, hidden]`` (updated in place, returned)."""
        g, kn = self.geo, self._kernels
        T = x.shape[0]
        D, H, KVH, eps, group = g.head_dim, g.num_attention_heads, g.num_key_value_heads, self.eps, g.heads_per_kv_head
        cd = self.dtype
        lowp = cd != torch.float32
        nd = b.n_decode
        threads = torch.get_num_threads()
        positions, slots = b.positions.contiguous(), b.slots.contiguous()
        dec_slots, dec_lens = slots[:nd], b.decode_ctx.contiguous()  # the decode tokens come first
        h = torch.empty(T, g.hidden_size, dtype=cd)  # each GEMM's normalised input, in the GEMM dtype
        kn.add_rms_norm(x, None, layers[0]["ln1"], eps, h, threads)
        for i, L in enumerate(layers):
            kc, vc = self.cache.k[i], self.cache.v[i]
            q = torch.empty(T, H, D)
            kn.rope_kv_write(L["qkv"](h), self.cos, self.sin, positions, slots, H, kc, vc, q, threads)
            if nd:
                dec = kn.decode_attention(q[:nd].view(nd, KVH, group, D), kc, vc, dec_slots, dec_lens, self.scale,
                                          threads).view(nd, H, D)
            if nd == T:
                attn = dec
            else:
                attn = torch.empty(T, H, D)
                if nd:
                    attn[:nd] = dec
                self._prefill_attention(q, kc, vc, b, chunk_masks, attn)
            attn = attn.view(T, H * D)
            kn.add_rms_norm(x, L["o"](attn.to(cd) if lowp else attn), L["ln2"], eps, h, threads)
            gu = L["gate_up"](h)
            down = L["down"](kn.silu_mul(gu))
            if i + 1 < len(layers):
                kn.add_rms_norm(x, cross_attention.after_layer(self.cross, i + 1, x, b, add=down), layers[i + 1]["ln1"], eps, h, threads)
            else:
                x += down
        return x

    def _layers_torch(self, b: StepBatch, x: torch.Tensor, chunk_masks: list[torch.Tensor | None], layers: list) -> torch.Tensor:
        """The decoder layers in torch ops (no native kernels); ``x`` float32 ``[T, hidden]``. RMSNorm is
        ``F.rms_norm`` (bitwise equal to transformers' formula in float32)."""
        g = self.geo
        T = x.shape[0]
        D, H, KVH, group, hidden = g.head_dim, g.num_attention_heads, g.num_key_value_heads, g.heads_per_kv_head, g.hidden_size
        cd = self.dtype
        lowp = cd != torch.float32  # float32 skips the casts below (each is a dispatch even when a no-op)
        cos = self.cos[b.positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[b.positions].unsqueeze(1)
        half = D // 2
        sin_signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        nq, nkv = H * D, KVH * D
        nd = b.n_decode
        decode_only = nd == T
        if nd:
            n_slots = max(b.decode_slots) + 1
            ctx = int(b.decode_ctx.max())
            contiguous = b.decode_slots == list(range(nd))
            lens = torch.zeros(n_slots, dtype=torch.int64)
            lens[b.decode_slots] = b.decode_ctx
            dec_mask = torch.zeros(n_slots, 1, 1, ctx).masked_fill_(
                (torch.arange(ctx).unsqueeze(0) >= lens.unsqueeze(1)).view(n_slots, 1, 1, ctx), float("-inf"))
            dec_slot_idx = torch.tensor(b.decode_slots, dtype=torch.int64)
        eps = self.eps
        for i, L in enumerate(layers):
            h = F.rms_norm(x, (hidden,), L["ln1"], eps)
            qkv = L["qkv"](h.to(cd)).float() if lowp else L["qkv"](h)  # RoPE and attention in float32
            qk = self._rope(qkv[:, :nq + nkv].view(T, H + KVH, D), cos, sin_signed)
            q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, nq + nkv:].view(T, KVH, D)
            kc, vc = self.cache.k[i], self.cache.v[i]
            kc[b.slots, :, b.positions] = k.to(kc.dtype)  # bfloat16 cache: rounded to nearest even
            vc[b.slots, :, b.positions] = v.to(vc.dtype)
            attn = None if decode_only else torch.empty(T, H, D)
            if nd:
                qd = q[:nd].reshape(nd, KVH, group, D)
                if not contiguous:
                    full = qd.new_zeros(n_slots, KVH, group, D)
                    full[dec_slot_idx] = qd
                    qd = full
                o = self._decode_attention_torch(qd, kc[:n_slots, :, :ctx].float(), vc[:n_slots, :, :ctx].float(), dec_mask)
                if not contiguous:
                    o = o[dec_slot_idx]
                if decode_only:
                    attn = o.reshape(T, nq)
                else:
                    attn[:nd] = o.reshape(nd, H, D)
            if b.chunks:
                self._prefill_attention(q, kc, vc, b, chunk_masks, attn)
            x = x + L["o"](attn.view(T, nq).to(cd) if lowp else attn.view(T, nq))
            h = F.rms_norm(x, (hidden,), L["ln2"], eps)
            gu = L["gate_up"](h.to(cd) if lowp else h)
            inter = gu.shape[1] // 2
            x = x + L["down"](F.silu(gu[:, :inter]) * gu[:, inter:])
            cross_attention.after_layer(self.cross, i + 1, x, b)  # mllama: the cross layer after this one, if any
        return x
