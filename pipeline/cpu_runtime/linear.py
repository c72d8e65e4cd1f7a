"""The CPU engine's Linear layer: a weight packed once into oneDNN's blocked layout, run by oneDNN or, for few rows,
by the native kernel on the same packed weight (``F.linear`` where oneDNN cannot pack it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.cpu_runtime import native

#: Batch-size hint for the oneDNN weight reorder. Measured on 2 AVX-512 cores, one SmolLM2 step's
#: GEMMs with hint 64 vs 1/4/16/128: within noise from 1 to 100 rows, best at 4–16 rows.
PACK_BATCH_HINT = 64
#: Most rows (tokens) a GEMM hands to the native kernel (``linear_packed_*`` in ``kernels/decoder.c``) instead of
#: oneDNN, on the same packed weights. Measured on 2 AVX-512 cores (Zen 4), the 121 GEMMs of one SmolLM2 step,
#: native vs oneDNN: float32 16.7 vs 23.2 ms at 1 row, 27.8 vs 30.9 at 16, 165 vs 166 at 128, 341 vs 330 at
#: 256; bfloat16 8.7 vs 12.8 at 1, 13.5 vs 17.1 at 16, 82 vs 85 at 128.
NATIVE_GEMM_MAX_ROWS = 128


def mkldnn_linear_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether torch has the oneDNN packed-linear ops (x86 builds with mkldnn) for weights of ``dtype``.

    bfloat16 packing also needs the CPU's bfloat16 support as oneDNN reads it (AVX-512 BW/VL/DQ or
    AVX-NE-CONVERT; ``torch.ops.mkldnn._is_mkldnn_bf16_supported``): on an AVX2-only host
    ``_reorder_linear_weight`` raises for a bfloat16 weight, so such a host runs ``F.linear`` instead.
    """
    ops = torch.ops.mkldnn
    available = bool(torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                     and hasattr(ops, "_linear_pointwise"))
    if available and dtype == torch.bfloat16:
        available = bool(getattr(ops, "_is_mkldnn_bf16_supported", lambda: False)())
    return available


class Linear:
    """``y = x @ weight.T (+ bias)`` for ``x`` of shape ``[tokens, in]``, weight ``[out, in]``, both in the
    weight's dtype (float32 or bfloat16; oneDNN accumulates bfloat16 products in float32).

    With ``packed`` the weight is reordered into oneDNN's blocked layout (the dense copy is dropped);
    otherwise ``F.linear`` runs on the dense weight. After :meth:`use_native` accepted the kernels, inputs of
    at most :data:`NATIVE_GEMM_MAX_ROWS` rows run the native kernel on the same packed weight.
    """

    __slots__ = ("weight", "bias", "packed", "out_features", "in_features", "_native", "_weight_ptr")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, *, packed: bool):
        self.out_features, self.in_features = weight.shape
        self.packed = packed
        w = weight.contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w, PACK_BATCH_HINT) if packed else w
        self.bias = None if bias is None else bias.contiguous()
        self._native: native.Kernels | None = None
        self._weight_ptr = 0

    def use_native(self, kernels: native.Kernels | None) -> bool:
        """Run inputs of up to :data:`NATIVE_GEMM_MAX_ROWS` rows with ``kernels`` when they read this packed
        weight as oneDNN does (:meth:`~pipeline.cpu_runtime.native.Kernels.packed_layout_ok`); returns whether.
        ``None``: oneDNN (or ``F.linear``) for every size again."""
        self._native, self._weight_ptr = None, 0
        if kernels is not None and self.packed and kernels.packed_layout_ok(
                self.weight, self.out_features, self.in_features, self.weight.dtype, self.bias):
            self._native, self._weight_ptr = kernels, torch.ops.mkldnn.data_ptr(self.weight)
        return self._native is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._native is not None and x.shape[0] <= NATIVE_GEMM_MAX_ROWS and x.dtype == self.weight.dtype:
            return self._native.linear(x, self._weight_ptr, self.out_features, self.in_features, self.bias,
                                       torch.get_num_threads())
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
