"""Weight bytes of a model geometry in a quantization format: the one formula the planner (GPU memory,
:mod:`pipeline.plan.memory`) and the build stages (the disk a stage needs, :mod:`pipeline.core.disk`) share.

Pure functions (geometry + numbers in, bytes out). Layout assumed (Llama/Mistral decoder, what the shipped recipes
use): per layer 7 bias-free Linear layers (q, k, v, o, gate, up, down) + 2 RMSNorm weight vectors; an embedding
table; a final norm; an lm_head. ModelOpt quantizes the Linear layers of the decoder only: the embedding, the norms
and the lm_head stay in the model dtype (quantize.py ``--quantize_lm_head`` default False).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from pipeline.core.geometry import ModelGeometry

#: bytes per element of the unquantized dtypes.
DTYPE_BYTES: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

#: bytes per Linear weight element per qformat (scales come on top, see linear_storage_bytes).
QFORMAT_WEIGHT_BYTES: dict[str, float] = {
    "fp8": 1.0, "int8_sq": 1.0, "int8_wo": 1.0,
    "int4_awq": 0.5, "w4a8_awq": 0.5, "int4_wo": 0.5, "nvfp4": 0.5,
}


class WeightBytes(BaseModel):
    """Weight memory of one model in one qformat. All sizes in bytes; ``*_params`` in parameters."""

    model_config = ConfigDict(frozen=True)

    qformat: str
    model_dtype_bytes: int
    linear_params: int
    embedding_params: int
    lm_head_params: int
    norm_params: int
    linear_bytes: int
    scale_bytes: int
    embedding_bytes: int
    lm_head_bytes: int
    norm_bytes: int
    #: of linear_bytes + scale_bytes: the routed experts' (MoE; 0 for a dense model), all experts counted
    expert_bytes: int = 0
    total_bytes: int
    per_gpu_bytes: int

    @property
    def total_params(self) -> int:
        """Parameters stored (a tied lm_head that is stored as a copy counts twice)."""
        return self.linear_params + self.embedding_params + self.lm_head_params + self.norm_params


def linear_storage_bytes(qformat: str, in_f: int, out_f: int, dtype_bytes: int, awq_block_size: int = 128) -> tuple[int, int]:
    """Bytes of one Linear layer ``[out_f, in_f]`` in ``qformat``: ``(weight_bytes, scale_bytes)``.

    Formulas (n = in_f × out_f weights; scale dtypes as ModelOpt exports them for TensorRT-LLM):

    - ``full_prec``: n × dtype_bytes, no scales.
    - ``fp8`` (FP8 per-tensor): n × 1 B + weight scale + activation scale, fp32 each = 8 B.
    - ``int8_sq`` (W8A8 SmoothQuant per-channel): n × 1 B + out_f × 4 B per-channel weight scales +
      4 B activation scale + in_f × dtype_bytes smoothing scales (upper bound: TensorRT-LLM folds them
      into the preceding norm for q/k/v and gate/up).
    - ``int8_wo`` (W8A16): n × 1 B + out_f × dtype_bytes per-channel scales.
    - ``int4_wo`` (W4A16 per-channel): n × 0.5 B + out_f × dtype_bytes.
    - ``int4_awq`` (W4A16 AWQ): n × 0.5 B + (in_f / awq_block_size) × out_f × 2 B fp16 group scales +
      in_f × dtype_bytes pre_quant_scale.
    - ``w4a8_awq``: as int4_awq + 8 B (fp32 per-tensor weight and activation scales).
    - ``nvfp4``: n × 0.5 B + n / 16 × 1 B fp8 block scales + 8 B (fp32 global weight and input scales).

    Raises ``ValueError`` for an unknown qformat.
    """
    n = in_f * out_f
    if qformat == "full_prec":
        return n * dtype_bytes, 0
    if qformat not in QFORMAT_WEIGHT_BYTES:
        raise ValueError(f"unknown qformat {qformat!r}")
    w = math.ceil(n * QFORMAT_WEIGHT_BYTES[qformat])
    if qformat == "fp8":
        s = 8
    elif qformat == "int8_sq":
        s = out_f * 4 + 4 + in_f * dtype_bytes
    elif qformat in ("int8_wo", "int4_wo"):
        s = out_f * dtype_bytes
    elif qformat in ("int4_awq", "w4a8_awq"):
        s = math.ceil(in_f / awq_block_size) * out_f * 2 + in_f * dtype_bytes + (8 if qformat == "w4a8_awq" else 0)
    else:  # nvfp4
        s = math.ceil(n / 16) + 8
    return w, s


def pad_vocab(vocab_size: int, tp_size: int) -> int:
    """Vocab rounded up to a multiple of tp_size (TensorRT-LLM pads the vocab-parallel lm_head)."""
    return math.ceil(vocab_size / tp_size) * tp_size


def weight_bytes(
    geo: ModelGeometry,
    qformat: str,
    dtype_bytes: int = 2,
    *,
    awq_block_size: int = 128,
    tp_size: int = 1,
    pp_size: int = 1,
    lm_head_copy: bool = True,
) -> WeightBytes:
    """Weight memory of ``geo`` in ``qformat`` (bytes), in total and on the most loaded GPU. A mixture of experts
    stores every expert (``expert_bytes`` are the routed experts' share, the part a decode step reads only in part).

    total = layers × Σ_linear linear_storage_bytes + vocab × hidden × dtype_bytes (embedding)
            + vocab × hidden × dtype_bytes (lm_head, unless tied and not copied)
            + (2 × layers + 1) × hidden × dtype_bytes (RMSNorm weights).

    ``lm_head_copy``: a TensorRT engine holds lm_head as its own tensor even when the HF model ties it to
    the embedding (assumed; the PyTorch backend shares it: pass False).

    Per GPU (tensor parallel splits every Linear and the vocab-parallel lm_head by tp_size; the embedding
    is replicated, TensorRT-LLM's default ``use_parallel_embedding=False``; pipeline parallel gives
    ceil(layers / pp) layers to a stage, the embedding to the first and lm_head + final norm to the last):
    per_gpu = max over stages of (stage layers × layer bytes / tp + that stage's embedding / lm_head / tp).
    """
    h = geo.hidden_size
    L = geo.num_hidden_layers
    lin_w = lin_s = 0
    for _, i, o in geo.layer_linear_shapes:
        w, s = linear_storage_bytes(qformat, i, o, dtype_bytes, awq_block_size)
        lin_w += w
        lin_s += s
    expert_b = geo.num_experts * sum(sum(linear_storage_bytes(qformat, i, o, dtype_bytes, awq_block_size))
                                     for _, i, o in geo.expert_linear_shapes)
    layer_norm_bytes = 2 * h * dtype_bytes
    layer_bytes = lin_w + lin_s
    embed_params = geo.vocab_size * h
    head_params = 0 if (geo.tie_word_embeddings and not lm_head_copy) else pad_vocab(geo.vocab_size, tp_size) * h
    embed_b = embed_params * dtype_bytes
    head_b = head_params * dtype_bytes
    norm_params = (2 * L + 1) * h
    total = L * layer_bytes + embed_b + head_b + norm_params * dtype_bytes

    stage_layers = math.ceil(L / pp_size)
    per_layer_gpu = layer_bytes / tp_size + layer_norm_bytes
    if pp_size == 1:
        per_gpu = stage_layers * per_layer_gpu + embed_b + head_b / tp_size + h * dtype_bytes
    else:
        first = stage_layers * per_layer_gpu + embed_b
        last = stage_layers * per_layer_gpu + head_b / tp_size + h * dtype_bytes
        per_gpu = max(first, last)
    return WeightBytes(
        qformat=qformat, model_dtype_bytes=dtype_bytes,
        linear_params=L * geo.layer_linear_params, embedding_params=embed_params, lm_head_params=head_params,
        norm_params=norm_params, linear_bytes=L * lin_w, scale_bytes=L * lin_s, embedding_bytes=embed_b,
        lm_head_bytes=head_b, norm_bytes=norm_params * dtype_bytes, expert_bytes=L * expert_b, total_bytes=total, per_gpu_bytes=math.ceil(per_gpu),
    )
