"""Dequantize a ModelOpt unified HF checkpoint into plain weights that carry the quantization error.

The CPU has no FP8/INT4 GEMM kernels, so the CPU engine computes in fp32 (or bf16) with the
*effective* weights of the quantized model: the exported integer/FP8 codes times their scales.
The result is what ModelOpt's fake-quant forward uses (``weight_quantizer(weight)``), so the
engine shows the weight-quantization error of the deployed format. Activation and KV-cache
quantization (``input_scale``, ``k_scale``/``v_scale``) are NOT emulated: activations and the
KV cache stay in the compute dtype.

Exported tensors per Linear ``<m>`` (ModelOpt 0.47 ``export_hf_checkpoint``; see
``modelopt/torch/export/quant_utils.py::to_quantized_weight`` / ``pack_int4_in_uint8``):

======================  =====================================  ======================================
format                  stored                                 effective weight [out, in]
======================  =====================================  ======================================
FP8 (per tensor/chan.)  ``weight`` float8_e4m3fn [out, in],    ``weight.float() * weight_scale``
                        ``weight_scale`` f32 [] / [out] /
                        [out, 1]
INT8 SQ / INT8 WO       ``weight`` int8 [out, in],             ``weight * weight_scale[:, None]``
                        ``weight_scale`` f32 [out]
INT4 AWQ / INT4 WO      ``weight`` uint8 [out/2, in]: row 2j   ``int4 * weight_scale`` repeated
                        in the low nibble, row 2j+1 in the     over each group of ``in/groups``
                        high nibble (signed, -8..7);           input columns
                        ``weight_scale`` [out, in/group]
W4A8 AWQ                as INT4 + ``weight_scale_2`` f32 []    ``e4m3(W4 / weight_scale_2) *
                        (FP8 second stage, amax/448)           weight_scale_2``
any of the above        ``pre_quant_scale`` [in] (AWQ, SQ:     ``W * pre_quant_scale[None, :]``
                        multiplies the layer's INPUT)
======================  =====================================  ======================================

Scales that ModelOpt already fused into a preceding layernorm are in that layernorm's weight and
need nothing here. NVFP4/MXFP4 (FP8 block scales) are not supported on CPU (the recipe forbids
them for the cpu target).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

#: Per-module tensors that describe quantization and are consumed (not kept) by dequantization.
QUANT_SUFFIXES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "output_scale", "k_scale", "v_scale")
#: Largest finite float8_e4m3fn value (OCP FP8 spec; ModelOpt's FP8 ``maxbound``).
E4M3_MAX = 448.0


class DequantError(ValueError):
    """The checkpoint holds a tensor layout this module cannot turn into a plain weight."""


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Signed int4 codes from ModelOpt's packing: uint8 [out/2, in] → int8 [out, in] in -8..7.

    Byte ``packed[j, c]`` holds row ``2j`` in bits 0–3 and row ``2j+1`` in bits 4–7, two's
    complement (``pack_int4_in_uint8`` in ModelOpt 0.47).
    """
    p = packed.view(torch.uint8).to(torch.int16)
    lo = p & 0x0F
    hi = (p >> 4) & 0x0F
    both = torch.stack((lo, hi), dim=1)  # [out/2, 2, in]
    both = torch.where(both >= 8, both - 16, both)
    return both.reshape(packed.shape[0] * 2, packed.shape[1]).to(torch.int8)


def _per_out_channel(scale: torch.Tensor, out: int) -> torch.Tensor:
    """A scale as a tensor broadcastable to [out, in]: scalar → [], [out]/[out,1] → [out, 1]."""
    s = scale.float()
    if s.numel() == 1:
        return s.reshape(())
    if s.numel() == out:
        return s.reshape(out, 1)
    raise DequantError(f"scale of shape {tuple(scale.shape)} is neither per-tensor nor per-channel for {out} rows")


def dequantize_weight(
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None,
    *,
    weight_scale_2: torch.Tensor | None = None,
    pre_quant_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fp32 effective weight [out, in] of one exported Linear (formats: module docstring).

    ``weight_scale=None`` means the weight is not quantized (returned as fp32, with
    ``pre_quant_scale`` still folded in). Raises :class:`DequantError` for an unknown layout.
    """
    if weight_scale is None:
        w = weight.float()
    elif weight.dtype == torch.float8_e4m3fn:
        w = weight.float() * _per_out_channel(weight_scale, weight.shape[0])
    elif weight.dtype == torch.int8:
        w = weight.float() * _per_out_channel(weight_scale, weight.shape[0])
    elif weight.dtype == torch.uint8 and weight_scale.dtype != torch.float8_e4m3fn and weight_scale.dim() == 2:
        codes = unpack_int4(weight)
        out, inp = codes.shape
        if weight_scale.shape[0] != out or inp % weight_scale.shape[1]:
            raise DequantError(
                f"INT4 weight {tuple(weight.shape)} (→ [{out}, {inp}]) does not match weight_scale {tuple(weight_scale.shape)}"
            )
        group = inp // weight_scale.shape[1]
        w = codes.float() * weight_scale.float().repeat_interleave(group, dim=1)
        if weight_scale_2 is not None:  # W4A8: the INT4 result is FP8-quantized per tensor (SequentialQuantizer)
            s2 = weight_scale_2.float().reshape(())
            w = (w / s2).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s2
    else:
        raise DequantError(
            f"unsupported quantized weight: dtype {weight.dtype} {tuple(weight.shape)} with weight_scale "
            f"{weight_scale.dtype} {tuple(weight_scale.shape)} (NVFP4/MXFP4 cannot run on the CPU engine)"
        )
    if pre_quant_scale is not None:
        if pre_quant_scale.numel() != w.shape[1]:
            raise DequantError(f"pre_quant_scale has {pre_quant_scale.numel()} values for {w.shape[1]} input columns")
        w = w * pre_quant_scale.float().reshape(1, -1)
    return w


def _tensor_files(ckpt_dir: Path) -> list[Path]:
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{ckpt_dir}: no *.safetensors files")
    return files


def read_quant_info(ckpt_dir: Path) -> dict:
    """``quantization`` section of ``hf_quant_config.json`` (quant_algo, kv_cache_quant_algo,
    group_size, exclude_modules…), else ``config.json``'s ``quantization_config``, else ``{}``."""
    ckpt_dir = Path(ckpt_dir)
    hq = ckpt_dir / "hf_quant_config.json"
    if hq.exists():
        return dict(json.loads(hq.read_text()).get("quantization") or {})
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    return dict(cfg.get("quantization_config") or {})


def iter_dequantized(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every plain tensor of the checkpoint, in ``dtype``.

    Quantized Linear weights are dequantized (:func:`dequantize_weight`); scale tensors
    (:data:`QUANT_SUFFIXES`) are consumed; everything else passes through cast to ``dtype``
    (integer tensors keep their dtype). Raises ``FileNotFoundError`` with no safetensors and
    :class:`DequantError` for an unsupported layout.
    """
    from safetensors import safe_open

    handles = [safe_open(str(f), framework="pt") for f in _tensor_files(Path(ckpt_dir))]
    where = {k: h for h in handles for k in h.keys()}

    def get(name: str) -> torch.Tensor | None:
        h = where.get(name)
        return h.get_tensor(name) if h is not None else None

    for name in sorted(where):
        prefix, _, leaf = name.rpartition(".")
        if leaf in QUANT_SUFFIXES:
            continue
        t = where[name].get_tensor(name)
        if leaf == "weight" and (f"{prefix}.weight_scale" in where or f"{prefix}.pre_quant_scale" in where):
            t = dequantize_weight(
                t,
                get(f"{prefix}.weight_scale"),
                weight_scale_2=get(f"{prefix}.weight_scale_2"),
                pre_quant_scale=get(f"{prefix}.pre_quant_scale"),
            )
        elif t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8) and leaf == "weight":
            raise DequantError(f"{name}: quantized dtype {t.dtype} without a weight_scale")
        if t.is_floating_point():
            t = t.to(dtype)
        yield name, t.contiguous()


def dequantize_checkpoint(ckpt_dir: Path, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """All tensors of :func:`iter_dequantized` as a state dict (loads the whole model in memory)."""
    return dict(iter_dequantized(ckpt_dir, dtype))


def plain_config(ckpt_dir: Path, dtype: str) -> dict:
    """``config.json`` of the checkpoint without ``quantization_config``, with ``dtype``/``torch_dtype``
    set to ``dtype`` (``"float32"``/``"bfloat16"``), so plain transformers loads the dequantized weights."""
    cfg = json.loads((Path(ckpt_dir) / "config.json").read_text())
    cfg.pop("quantization_config", None)
    for key in ("dtype", "torch_dtype"):
        cfg[key] = dtype
    return cfg
