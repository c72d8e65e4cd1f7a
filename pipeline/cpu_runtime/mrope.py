"""The CPU decoder's rotary rules (1-D ``default``/``llama3`` inverse frequencies, :func:`rope_inv_freq`) and image
tokens in its prefill (issue #47 item 5): spliced embeddings and M-RoPE positions.

A Qwen2-VL-family request reaches the decoder as token ids whose image placeholders are replaced by the vision
tower's embeddings (what the PyTorch backend does with ``fuse_input_embeds``, modeling_qwen2vl.py@000a01de), and its
rotary positions are three-dimensional (M-RoPE: temporal, height, width). This module holds both rules:

- :func:`qwen2_vl_rope_index`: the 3-D positions of a prompt with images and the ``delta`` that shifts every later
  (generated) token, restated from transformers' ``Qwen2VLModel.get_rope_index`` (v5.14 modeling_qwen2_vl.py, and
  upstream's copy ``Qwen2VLInputProcessorBase.get_rope_index`` in modeling_qwen2vl.py@000a01de): text runs continue
  one position after the previous run's maximum; an image's ``t × (h/merge) × (w/merge)`` tokens get
  ``(t, row, column)`` offsets from the position after the text before it. For images (not video) ``t`` is 1.
- :func:`mrope_rows`: per-token cos/sin rows from the decoder's 1-D tables, picking for each channel section the
  position of its axis — transformers' ``apply_multimodal_rotary_pos_emb`` (``mrope_section * 2`` over the
  rotate-half layout, section ``i`` reads axis ``i % 3``).

A text token's three positions are equal, so its rows are the ordinary RoPE rows: only requests with images (and
their generated tokens, shifted by ``delta``) leave the 1-D path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PromptMultimodal:
    """One request's image inputs for the decoder.

    Attributes:
        rows: int64 ``[N]`` prompt indices whose token embedding is replaced (the image placeholders).
        embeds: float32 ``[N, hidden]`` their embeddings (the vision tower + merger output, in prompt order).
        positions: int64 ``[3, P]`` M-RoPE positions of the ``P`` prompt tokens, or ``None`` (1-D RoPE).
        delta: generated token ``i`` (cache position ``P + i``) has rotary position ``P + i + delta``.
    """

    rows: torch.Tensor
    embeds: torch.Tensor
    positions: torch.Tensor | None = None
    delta: int = 0

    def check(self, prompt_len: int, hidden: int) -> None:
        """Raise ``ValueError`` (one line, for the client) when the shapes do not fit a prompt of ``prompt_len``
        tokens and a decoder of ``hidden`` channels."""
        if self.embeds.ndim != 2 or self.embeds.shape[1] != hidden or self.embeds.shape[0] != self.rows.numel():
            raise ValueError(f"image embeddings {tuple(self.embeds.shape)}: expected [{self.rows.numel()}, {hidden}] "
                             "(one row per image token of the prompt)")
        if self.rows.numel() and (int(self.rows.min()) < 0 or int(self.rows.max()) >= prompt_len):
            raise ValueError(f"image token rows outside the prompt of {prompt_len} tokens")
        if self.positions is not None and tuple(self.positions.shape) != (3, prompt_len):
            raise ValueError(f"M-RoPE positions {tuple(self.positions.shape)}: expected (3, {prompt_len})")


def qwen2_vl_rope_index(input_ids: list[int], image_grid_thw: list[tuple[int, int, int]], *, image_token_id: int,
                        vision_start_token_id: int, spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """``(positions int64 [3, len(input_ids)], delta)`` of a prompt whose images follow ``vision_start_token_id``
    and span ``t·(h/merge)·(w/merge)`` ``image_token_id`` placeholders each (``image_grid_thw``: the processor's
    patch grid per image, in prompt order). ``delta = max(positions) + 1 - len(input_ids)``.

    Raises:
        ValueError: fewer grids than images in the prompt, or a grid whose tokens do not fit the placeholders.
    """
    ids = list(input_ids)
    starts = [i for i, t in enumerate(ids[:-1]) if t == vision_start_token_id and ids[i + 1] == image_token_id]
    if len(starts) != len(image_grid_thw):
        raise ValueError(f"{len(starts)} images in the prompt, {len(image_grid_thw)} image grids")
    parts: list[torch.Tensor] = []
    st = 0
    for grid in image_grid_thw:
        t, h, w = int(grid[0]), int(grid[1]) // spatial_merge_size, int(grid[2]) // spatial_merge_size
        ed = ids.index(image_token_id, st)
        n = t * h * w
        if ids[ed:ed + n] != [image_token_id] * n:
            raise ValueError(f"image grid {tuple(grid)} needs {n} image tokens at prompt index {ed}")
        base = int(parts[-1].max()) + 1 if parts else 0
        parts.append(torch.arange(ed - st).view(1, -1).expand(3, -1) + base)
        base += ed - st
        t_idx = torch.arange(t).view(-1, 1).expand(-1, h * w).flatten()
        h_idx = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
        w_idx = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
        parts.append(torch.stack([t_idx, h_idx, w_idx]) + base)
        st = ed + n
    if st < len(ids):
        base = int(parts[-1].max()) + 1 if parts else 0
        parts.append(torch.arange(len(ids) - st).view(1, -1).expand(3, -1) + base)
    pos = torch.cat(parts, dim=1).to(torch.int64)
    return pos, int(pos.max()) + 1 - len(ids)


def mrope_rows(cos: torch.Tensor, sin: torch.Tensor, pos3: torch.Tensor, section: list[int]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``(cos, sin)`` float32 ``[T, D]`` for 3-D positions ``pos3`` int64 ``[3, T]``, from the decoder's
    1-D tables ``cos``/``sin`` ``[L, D]`` (rotate-half layout) and ``section`` (``mrope_section``, summing to D/2)."""
    D = cos.shape[1]
    if 2 * sum(section) != D:
        raise ValueError(f"mrope_section {section} sums to {sum(section)}, not head_dim/2 = {D // 2}")
    axis = torch.cat([torch.full((n,), i % 3, dtype=torch.int64) for i, n in enumerate(list(section) * 2)])  # [D]
    idx = pos3[axis].T  # [T, D]: the position each channel of each token reads
    return torch.gather(cos, 0, idx), torch.gather(sin, 0, idx)


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 ``rope_parameters`` or transformers 4 ``rope_theta`` + ``rope_scaling``."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:
        rope["rope_type"] = rope["type"]
    return rope


def rope_inv_freq(cfg: dict[str, Any], head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim / 2]`` float32, as transformers computes them
    (``_compute_default_rope_parameters`` / ``_compute_llama3_parameters``)."""
    rope = rope_params(cfg)
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
