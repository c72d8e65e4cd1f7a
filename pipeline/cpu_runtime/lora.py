"""LoRA on the CPU engine: adapters held beside the base weights, applied per sequence inside a step.

An adapter is a ``peft`` LoRA directory (:mod:`pipeline.core.lora`: ``adapter_config.json`` +
``adapter_model.safetensors``), read here with ``safetensors`` alone (no ``peft`` at serve time). For a target module
with weights ``A`` ``[r, in]`` and ``B`` ``[out, r]``, the rows ``x`` ``[n, in]`` of the step that belong to a
sequence using the adapter get ``x · Aᵀ · Bᵀ · (lora_alpha / r)`` added to the module's output, in float32 and added
in the output's dtype: what peft's unmerged ``LoraLayer.forward`` computes, and, up to summation order, what its merged
model (``W + (lora_alpha / r) · B · A``) computes. Rows without an adapter are untouched, so one step mixes sequences
with different adapters and without one (TensorRT-LLM's per-request ``lora_task_id``).

The decoder fuses q/k/v and gate/up into one GEMM each; an adapter on ``q_proj`` adds to the q columns of the qkv
output, ``up_proj`` to the up half of gate/up (:func:`segments`). A step with any adapter runs the layer-by-layer path
(not the one-call decode step), where every Linear is a Python call (:meth:`LoraStep.wrap`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from pipeline.core.geometry import ModelGeometry
from pipeline.core.lora import (
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    read_adapter_config,
)

#: peft's tensor names: ``base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_{A|B}.weight``
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def segments(geo: ModelGeometry) -> dict[str, tuple[str, int, int]]:
    """transformers module → (the decoder's fused Linear, first output column, width)."""
    nq, nkv, inter = geo.num_attention_heads * geo.head_dim, geo.num_key_value_heads * geo.head_dim, geo.intermediate_size
    return {"q_proj": ("qkv", 0, nq), "k_proj": ("qkv", nq, nkv), "v_proj": ("qkv", nq + nkv, nkv),
            "o_proj": ("o", 0, geo.hidden_size), "gate_proj": ("gate_up", 0, inter), "up_proj": ("gate_up", inter, inter),
            "down_proj": ("down", 0, geo.hidden_size)}


@dataclass
class Adapter:
    """A loaded adapter: ``deltas[layer][fused Linear]`` = list of (first column, width, A ``[r, in]``, B·scale ``[w, r]``),
    float32."""

    name: str
    task_id: int
    config: AdapterConfig
    deltas: list[dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]]]


def load_adapter(adapter_dir: Path, geo: ModelGeometry, *, name: str, task_id: int, max_rank: int | None = None) -> Adapter:
    """Read one adapter for a model of geometry ``geo``.

    Raises:
        AdapterError: the adapter cannot be served (:func:`pipeline.core.lora.read_adapter_config`), its rank exceeds
            ``max_rank``, or a tensor is missing or has the wrong shape for this model.
    """
    from safetensors.torch import load_file

    cfg = read_adapter_config(adapter_dir)
    if max_rank is not None and cfg.rank > max_rank:
        raise AdapterError(f"{adapter_dir}: rank r={cfg.rank} exceeds max_lora_rank {max_rank}")
    tensors = load_file(str(Path(adapter_dir) / WEIGHTS_FILE))
    seg = segments(geo)
    in_dim = {"qkv": geo.hidden_size, "o": geo.num_attention_heads * geo.head_dim, "gate_up": geo.hidden_size,
              "down": geo.intermediate_size}
    deltas: list[dict[str, list]] = [{} for _ in range(geo.num_hidden_layers)]
    for i in range(geo.num_hidden_layers):
        for module in cfg.target_modules:
            prefix = f"base_model.model.model.layers.{i}.{_PARENT[module]}.{module}"
            a, b = tensors.get(f"{prefix}.lora_A.weight"), tensors.get(f"{prefix}.lora_B.weight")
            fused, col, width = seg[module]
            if a is None or b is None:
                raise AdapterError(f"{adapter_dir}: no lora_A/lora_B weights for layer {i} {module}")
            if tuple(a.shape) != (cfg.rank, in_dim[fused]) or tuple(b.shape) != (width, cfg.rank):
                raise AdapterError(f"{adapter_dir}: layer {i} {module} has A {tuple(a.shape)} / B {tuple(b.shape)}, expected "
                                   f"{(cfg.rank, in_dim[fused])} / {(width, cfg.rank)} for this model")
            deltas[i].setdefault(fused, []).append((col, width, a.float().contiguous(), (b.float() * cfg.scale).contiguous()))
    return Adapter(name=name, task_id=task_id, config=cfg, deltas=deltas)


class _LoraLinear:
    """A fused Linear plus the step's LoRA deltas on its output (called like the Linear)."""

    __slots__ = ("base", "layer", "fused", "groups")

    def __init__(self, base, layer: int, fused: str, groups: list[tuple[torch.Tensor, Adapter]]):
        self.base, self.layer, self.fused, self.groups = base, layer, fused, groups

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for rows, adapter in self.groups:
            parts = adapter.deltas[self.layer].get(self.fused)
            if not parts:
                continue
            xs = x[rows].float()
            for col, width, a, b in parts:
                y[rows, col:col + width] += ((xs @ a.t()) @ b.t()).to(y.dtype)
        return y


class LoraStep:
    """The adapters of one step: ``groups`` = (token rows as an int64 tensor, adapter) per adapter in use."""

    def __init__(self, groups: list[tuple[torch.Tensor, Adapter]]):
        self.groups = groups

    def wrap(self, layers: list[dict]) -> list[dict]:
        """``layers`` (the decoder's per-layer dicts) with every fused Linear an adapter touches wrapped."""
        out = []
        for i, L in enumerate(layers):
            w = dict(L)
            for fused in ("qkv", "o", "gate_up", "down"):
                groups = [(rows, a) for rows, a in self.groups if a.deltas[i].get(fused)]
                if groups:
                    w[fused] = _LoraLinear(L[fused], i, fused, groups)
            out.append(w)
        return out


class LoraSet:
    """The adapters an engine knows, by task id (thread-safe to add to while the engine runs)."""

    def __init__(self, geo: ModelGeometry, max_rank: int | None = None):
        self.geo, self.max_rank = geo, max_rank
        self._by_id: dict[int, Adapter] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_engine_config(cls, engine_dir: Path, cfg: dict, geo: ModelGeometry) -> "LoraSet | None":
        """The adapters of an engine directory's ``engine_config.json`` ``lora`` section (``None`` when it has none):
        ``{"max_lora_rank", "adapters": [{"name", "task_id", "dir"}]}``, ``dir`` relative to ``engine_dir``."""
        lora = cfg.get("lora")
        if not lora:
            return None
        out = cls(geo, lora.get("max_lora_rank"))
        for a in lora.get("adapters", ()):
            out.add(Path(engine_dir) / a["dir"], name=a["name"], task_id=int(a["task_id"]))
        return out

    def add(self, adapter_dir: Path, *, name: str, task_id: int) -> Adapter:
        """Load and register an adapter under ``task_id`` (raises :class:`AdapterError`)."""
        adapter = load_adapter(adapter_dir, self.geo, name=name, task_id=task_id, max_rank=self.max_rank)
        with self._lock:
            self._by_id[task_id] = adapter
        return adapter

    def get(self, task_id: int) -> Adapter | None:
        """The adapter registered under ``task_id``."""
        with self._lock:
            return self._by_id.get(task_id)

    def describe(self) -> str:
        """``1: name, 2: name`` (for messages)."""
        with self._lock:
            return ", ".join(f"{t}: {a.name}" for t, a in sorted(self._by_id.items())) or "none"


def step_for(token_slots: torch.Tensor, slot_adapters: list[Adapter | None]) -> LoraStep | None:
    """The :class:`LoraStep` of a batch whose token ``t`` belongs to KV slot ``token_slots[t]``, the sequence in slot ``s``
    using adapter ``slot_adapters[s]`` (``None``: the step uses no adapter)."""
    if not any(slot_adapters):
        return None
    per_token = [slot_adapters[s] for s in token_slots.tolist()]
    groups: dict[int, tuple[list[int], Adapter]] = {}
    for t, a in enumerate(per_token):
        if a is not None:
            groups.setdefault(id(a), ([], a))[0].append(t)
    return LoraStep([(torch.tensor(rows, dtype=torch.int64), a) for rows, a in groups.values()]) if groups else None


def selected(lora: LoraSet | None, task_id: int | None) -> Adapter | None:
    """The adapter a request's ``task_id`` selects (``None`` for no id).

    Raises ``ValueError`` (meant for the client) for an id no adapter has: TensorRT-LLM answers a task id it does not
    hold with "LoRA task N not found in cache" (PeftCacheManager::addRequestPeft, docs/lora.md)."""
    if task_id is None:
        return None
    adapter = lora.get(int(task_id)) if lora is not None else None
    if adapter is None:
        raise ValueError(f"LoRA task {task_id} not found: this engine serves {lora.describe() if lora else 'no LoRA adapters'}")
    return adapter


@dataclass(slots=True)
class LoRARequest:
    """A request's adapter, as ``tensorrt_llm.executor.request.LoRARequest`` (request.py@4ce835a571f8:23-53): a peft
    LoRA directory ``lora_path`` held under ``lora_int_id``; raises ValueError when the path does not exist."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if self.lora_path is not None and not Path(self.lora_path).exists():
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")


def llm_lora(engine, lora_config: dict | None) -> bool:
    """The LLM-API facade's ``lora_config``: adapters then come per request (:func:`request_task_id`), held under their
    ``lora_int_id`` with ranks up to ``max_lora_rank`` (LoraConfig's default 64); returns whether LoRA is on."""
    if lora_config is None:
        return False
    engine.lora = LoraSet(engine.model.geo, int(lora_config.get("max_lora_rank", 64)))
    return True


def request_task_id(engine, req: LoRARequest | None, enabled: bool) -> int | None:
    """The engine task id of ``req``'s adapter, loaded from ``lora_path`` the first time its ``lora_int_id`` is seen.
    Raises ValueError without ``lora_config`` (``enabled`` false), or for an adapter the engine cannot serve
    (:class:`AdapterError`, e.g. a rank above max_lora_rank)."""
    if req is None:
        return None
    if not enabled:
        raise ValueError("a LoRA request, but the LLM was built without lora_config")
    if engine.lora.get(req.lora_int_id) is None:
        engine.lora.add(Path(req.lora_path), name=req.lora_name, task_id=req.lora_int_id)
    return req.lora_int_id
