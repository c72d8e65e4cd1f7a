"""Model geometry (layers, hidden size, heads, …) from a config.json or the known-model table.

Used by recipe validation (AWQ block size must divide the Linear input dims; heads must divide
by tp_size) and by the planner. ``pipeline/data/models.yaml`` holds the geometry of the shipped
recipes' models so that validation and planning work without the checkpoint on disk.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict


class ModelGeometry(BaseModel):
    """Shape of a decoder-only transformer, in the names of HF ``config.json``."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    torch_dtype: str | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float | None = None
    #: RoPE base θ and scaling as HF config.json (transformers 4.57 form) spells them; None when unknown
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    #: Mixture of experts (0 = dense MLP): routed experts per layer, experts each token is routed to, experts
    #: every token passes through (shared), and the width of one expert's MLP (None: ``intermediate_size``,
    #: Mixtral's spelling). HF spellings: ``num_local_experts`` (Mixtral) / ``num_experts`` (Qwen3-MoE),
    #: ``num_experts_per_tok``, ``n_shared_experts``, ``moe_intermediate_size``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    num_shared_experts: int = 0
    moe_intermediate_size: int | None = None
    #: multi-token-prediction layers shipped with the model (HF ``num_nextn_predict_layers``, DeepSeek-V3 style; 0 = none)
    num_nextn_predict_layers: int = 0
    source: str = ""

    def kv_bytes_per_token(self, kv_dtype_bytes: int, *, tp_size: int = 1, pp_size: int = 1) -> int:
        """KV-cache bytes per token on one rank — the one KV-size rule of trtpipe (the planner on a GPU or the
        host, the CPU engine's build stage and the CPU engine's KV cache all call it).

        2 (K and V) × ceil(layers / pp) × max(1, kv_heads / tp) × head_dim × ``kv_dtype_bytes`` (bytes per
        element: 1 for an fp8/int8 KV cache, 2 for float16/bfloat16, 4 for the CPU engine's float32 cache). KV
        heads are replicated when tp > kv_heads (TensorRT-LLM's attention plugin). With tp = pp = 1 it is the
        whole model's K+V bytes per token. Llama-3.1-8B with an fp8 KV cache: 2 × 32 × 8 × 128 × 1 = 65,536 B.
        """
        layers = -(-self.num_hidden_layers // pp_size)
        heads = max(1, self.num_key_value_heads // tp_size)
        return 2 * layers * heads * self.head_dim * kv_dtype_bytes

    @property
    def heads_per_kv_head(self) -> int:
        """Query heads that share one KV head (grouped-query attention; 1 for multi-head attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    def hf_config(self) -> dict:
        """The geometry as a HF ``config.json`` dict (transformers 4.57 spelling), for checks that take one."""
        moe = set() if self.is_moe else {"num_experts", "num_experts_per_tok", "num_shared_experts", "moe_intermediate_size"}
        moe |= set() if self.num_nextn_predict_layers else {"num_nextn_predict_layers"}
        cfg = {"architectures": [self.architecture], **self.model_dump(exclude={"architecture", "source"} | moe)}
        return {k: v for k, v in cfg.items() if v is not None}

    @property
    def is_moe(self) -> bool:
        """True for a mixture-of-experts MLP (``num_experts`` > 0)."""
        return self.num_experts > 0

    @property
    def expert_width(self) -> int:
        """Width of one MLP (elements): the dense ``intermediate_size``, or one expert's (``moe_intermediate_size``,
        else ``intermediate_size`` as Mixtral spells it)."""
        return (self.moe_intermediate_size or self.intermediate_size) if self.is_moe else self.intermediate_size

    @property
    def active_mlp_width(self) -> int:
        """MLP width one token passes through (elements): intermediate_size (dense) or (experts per token +
        shared experts) × expert_width (MoE). Qwen3-30B-A3B: 8 × 768 = 6,144; Mixtral-8x7B: 2 × 14,336."""
        if not self.is_moe:
            return self.intermediate_size
        return (self.num_experts_per_tok + self.num_shared_experts) * self.expert_width

    @property
    def linear_input_dims(self) -> tuple[int, ...]:
        """Input dims of the Linear layers ModelOpt quantizes: q/k/v/gate/up take hidden_size,
        o_proj takes heads×head_dim, down_proj takes the MLP (or one expert's) width."""
        return (self.hidden_size, self.num_attention_heads * self.head_dim, self.expert_width)

    @property
    def attention_linear_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """``(name, in_features, out_features)`` of q, k, v, o of one decoder layer."""
        h, q, kv = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return (("q_proj", h, q), ("k_proj", h, kv), ("v_proj", h, kv), ("o_proj", q, h))

    @property
    def expert_linear_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """``(name, in_features, out_features)`` of one gated MLP (gate, up, down): the dense MLP or one expert."""
        h, i = self.hidden_size, self.expert_width
        return (("gate_proj", h, i), ("up_proj", h, i), ("down_proj", i, h))

    @property
    def layer_linear_shapes(self) -> tuple[tuple[str, int, int], ...]:
        """``(name, in_features, out_features)`` of every Linear layer stored in one decoder layer: q, k, v, o and
        the gated MLP (gate, up, down) — for MoE the router (hidden → experts) and every expert's gate/up/down
        (routed and shared), each its own tensor."""
        if not self.is_moe:
            return self.attention_linear_shapes + self.expert_linear_shapes
        experts = tuple((f"experts.{e}.{n}", i, o) for e in range(self.num_experts + self.num_shared_experts)
                        for n, i, o in self.expert_linear_shapes)
        return self.attention_linear_shapes + (("router", self.hidden_size, self.num_experts),) + experts

    @property
    def layer_linear_params(self) -> int:
        """Parameters in the Linear layers stored in one decoder layer (all experts; no biases)."""
        return sum(i * o for _, i, o in self.layer_linear_shapes)

    @property
    def layer_expert_params(self) -> int:
        """Parameters of the routed experts of one decoder layer (0 for a dense model): what a decode step reads
        only in part, the experts its tokens were routed to."""
        return self.num_experts * sum(i * o for _, i, o in self.expert_linear_shapes)

    @property
    def layer_active_linear_params(self) -> int:
        """Linear parameters one token passes through in one decoder layer: attention + router + the experts it
        is routed to + shared experts (MoE), or all of them (dense). Sets the GEMM FLOPs per token."""
        if not self.is_moe:
            return self.layer_linear_params
        per_expert = sum(i * o for _, i, o in self.expert_linear_shapes)
        attn = sum(i * o for _, i, o in self.attention_linear_shapes)
        return attn + self.hidden_size * self.num_experts + (self.num_experts_per_tok + self.num_shared_experts) * per_expert

    @property
    def num_parameters(self) -> int:
        """All parameters, counting a tied lm_head once: embedding + layers × (Linear + 2 norms) +
        final norm (+ lm_head when untied). Llama-3.1-8B: 8,030,261,248."""
        h = self.hidden_size
        embed = self.vocab_size * h
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + lm_head + self.num_hidden_layers * (self.layer_linear_params + 2 * h) + h

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token uses (MoE: only its experts; dense: = num_parameters)."""
        return self.num_parameters - self.num_hidden_layers * (self.layer_linear_params - self.layer_active_linear_params)


@functools.cache
def _known() -> dict[str, dict]:
    return yaml.safe_load(resources.files("pipeline").joinpath("data/models.yaml").read_text())


def known_geometry(source: str) -> ModelGeometry | None:
    """Geometry from the known-model table for a recipe ``model.source`` spelling, or ``None``."""
    entry = _known().get(source.strip())
    return ModelGeometry(**entry) if entry else None


def geometry_from_config(config_json: Path) -> ModelGeometry:
    """Geometry from an HF ``config.json`` (``head_dim`` defaults to hidden/heads).

    Raises ``KeyError``/``ValueError`` when the file lacks a required field.
    """
    return geometry_from_dict(json.loads(Path(config_json).read_text()), source=str(config_json))


def geometry_from_dict(cfg: dict, source: str = "") -> ModelGeometry:
    """Geometry from a parsed HF ``config.json`` (its ``text_config`` for multimodal wrappers).

    Raises ``KeyError``/``ValueError`` when it lacks a required field.
    """
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    return ModelGeometry(
        architecture=(cfg.get("architectures") or ["unknown"])[0],
        num_hidden_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate_size=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings"),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        hidden_act=cfg.get("hidden_act") or "silu",
        rms_norm_eps=cfg.get("rms_norm_eps"),
        rope_theta=hf_rope(cfg)[0],
        rope_scaling=_hf_scaling(cfg),
        num_experts=cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0,
        num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
        num_shared_experts=cfg.get("n_shared_experts") or 0,
        moe_intermediate_size=cfg.get("moe_intermediate_size"),
        num_nextn_predict_layers=cfg.get("num_nextn_predict_layers") or 0,
        source=source,
    )


def _hf_scaling(cfg: dict) -> dict | None:
    """The HF RoPE scaling in the 4.57 spelling (``rope_type`` + numeric keys), or ``None``."""
    scaling = hf_rope(cfg)[1]
    if scaling is None:
        return None
    return {"rope_type": scaling["type"], **{k: v for k, v in scaling.items() if k != "type"}}


def geometry_for_source(source: str, base_dir: Path | None = None) -> ModelGeometry | None:
    """Best-effort geometry for a recipe source: known table first, then a local dir's config.json."""
    known = known_geometry(source)
    if known:
        return known
    from pipeline.core.recipe_paths import recipe_path

    path = recipe_path(source, base_dir)
    if path.is_dir() and (path / "config.json").is_file():
        try:
            return geometry_from_config(path / "config.json")
        except (KeyError, ValueError, TypeError):
            return None
    return None


#: rotary_scaling keys TensorRT-LLM reads (attention.py / RopeEmbeddingUtils.apply_llama3_scaling; see
#: pipeline/data/trtllm_geometry.yaml)
SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def hf_rope(hf: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None]:
    """``(rope_theta, scaling)`` from a HF config of either transformers major.

    transformers 4.57: top-level ``rope_theta`` and ``rope_scaling``. transformers 5: ``rope_parameters``
    holding ``rope_theta`` and ``rope_type`` (``default`` = no scaling) plus the scaling keys. The scaling
    comes back in TensorRT-LLM's form ``{"type": …, <numeric keys>}``, or ``None`` for plain RoPE.
    """
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta") or params.get("rope_theta")
    scaling = hf.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    kind = scaling.get("rope_type") or scaling.get("type") if scaling else None
    if not kind or kind == "default":
        return (float(theta) if theta else None), None
    out: dict[str, Any] = {"type": kind}
    out.update({k: scaling[k] for k in SCALING_KEYS if scaling.get(k) is not None})
    return (float(theta) if theta else None), out
