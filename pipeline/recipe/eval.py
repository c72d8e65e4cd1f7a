"""``eval`` section: the accuracy gate of ``trtpipe eval`` (candidate deployment vs a baseline)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bench import Flag

#: the gate's rules (see :mod:`pipeline.eval.stats`)
RULES = ("paired", "mlperf", "mlperf_high", "trtllm", "kld")
#: the built-in tasks; any other value is a path to a JSONL file with ``article``/``highlights``
BUILTIN_TASKS = ("embedded", "agreement", "cnn_dailymail")


class EvalSpec(StrictModel):
    """What ``trtpipe eval`` generates and how it decides PASS / FAIL / INCONCLUSIVE; a field with a
    :class:`~pipeline.recipe.bench.Flag` is a ``trtpipe eval`` option (:mod:`pipeline.eval.options`)."""

    task: Annotated[str, Flag("--task", "embedded | agreement | cnn_dailymail | path/to.jsonl (article, highlights).")] = Field(
        default="embedded", min_length=1, description=(
            "`embedded` (30 article/summary pairs shipped with trtpipe, offline), `agreement` (label-free: held-out "
            "passages of the embedded calibration text, candidate scored against the baseline's outputs), a path to a "
            "JSONL file with `article`/`highlights` fields, or `cnn_dailymail` (3.0.0 test split via HF datasets; "
            "needs network)."
        ),
    )
    n: Annotated[int, Flag("--n", "Samples (capped by the task's size).", int)] = Field(
        default=30, ge=1, le=20000, description=(
            "Samples to evaluate (capped by the task's size). Upper bound: MLPerf's llama3.1-8b CNN/DailyMail accuracy "
            "set has 13,368 samples (mlcommons/inference tools/submission/submission_checker/constants.py)."
        ),
    )
    seed: Annotated[int, Flag("--seed", "Sample selection and bootstrap seed.", int)] = Field(default=0, ge=0, description="Seed of the sample selection and of the bootstrap resampling.")
    rule: Annotated[Literal["paired", "mlperf", "mlperf_high", "trtllm", "kld"], Flag("--rule", (
        "paired | mlperf | mlperf_high | trtllm | kld (token-level KL divergence on the served context logits)."))] = Field(
        default="paired", description=(
            "`paired`: non-inferiority of the per-sample ROUGE deltas vs the baseline (bootstrap CI); `mlperf` / "
            "`mlperf_high`: each ROUGE >= 99 % / 99.9 % of the reference and generated length within 90-110 % "
            "(MLPerf Inference submission checker); `trtllm`: TensorRT-LLM's accuracy-suite one-sided hypothesis test "
            "(tests/integration/defs/accuracy/accuracy_core.py); `kld`: token-level KL divergence of the candidate's "
            "next-token distributions from the baseline's on the baseline's greedy outputs (teacher forcing through the "
            "served context_logits), non-inferior to `kld_max` and `same_top1_min` (docs/eval.md)."
        ),
    )
    kld_max: Annotated[float | None, Flag(
        "--kld-max", "kld rule: largest acceptable mean KLD (nats/token; eval.kld_max).", float)] = Field(
        default=None, gt=0.0, le=10.0, description=(
            "`kld` rule: largest acceptable mean KL divergence (nats per token). Default: per quantization format from "
            "llama.cpp's published LLaMA-3-8B table (pipeline/eval/kld.py THRESHOLDS)."
        ),
    )
    same_top1_min: Annotated[float | None, Flag(
        "--same-top1-min", "kld rule: smallest acceptable same-top-1 % (eval.same_top1_min).", float)] = Field(
        default=None, gt=0.0, le=100.0, description=(
            "`kld` rule: smallest acceptable share (%) of positions whose top-1 token equals the baseline's. Default: per "
            "quantization format (pipeline/eval/kld.py THRESHOLDS)."
        ),
    )
    ratio: float = Field(
        default=0.99, gt=0.5, le=1.0, description=(
            "Fraction of the baseline each ROUGE must keep (`paired`: margin = (1 - ratio) x baseline mean). Default "
            "0.99 = MLPerf's 99 % accuracy target (submission_checker constants.py)."
        ),
    )
    alpha: float = Field(
        default=0.002, gt=0.0, lt=0.5, description=(
            "One-sided type-I error: of the `trtllm` test, and of each bound of the `paired` bootstrap CI (a two-sided "
            "1 - 2 x alpha interval). Default 0.002 = TensorRT-LLM's CnnDailymail.ALPHA "
            "(accuracy_core.py)."
        ),
    )
    beta: float = Field(
        default=0.2, gt=0.0, lt=0.5, description=(
            "Type-II error for the minimum detectable effect (power 1 - beta). Default 0.2 = TensorRT-LLM's "
            "CnnDailymail.BETA (accuracy_core.py)."
        ),
    )
    sigma: float = Field(
        default=11.06, gt=0.0, le=100.0, description=(
            "Per-sample standard deviation of ROUGE-1 (x100) assumed by the `trtllm` test. Default 11.06 = TensorRT-LLM's "
            "CnnDailymail.SIGMA (accuracy_core.py); ROUGE x100 is bounded by 100."
        ),
    )
    max_input_tokens: int = Field(
        default=384, ge=16, le=131072, description=(
            "Article tokens kept per prompt (truncated before the instruction and chat template are added; capped so the "
            "whole prompt fits build.max_input_len). "
            "TensorRT-LLM's CnnDailymail uses 924 (accuracy_core.py MAX_INPUT_LEN); the CPU default uses less."
        ),
    )
    max_output_tokens: Annotated[int, Flag("--max-output-tokens", "max_tokens per request.", int)] = Field(
        default=64, ge=1, le=32768, description=(
            "max_tokens per request (greedy, stops at the model's EOS). TensorRT-LLM's CnnDailymail uses 100 "
            "(accuracy_core.py MAX_OUTPUT_LEN)."
        ),
    )
    concurrency: Annotated[int, Flag("--concurrency", "Requests in flight.", int)] = Field(
        default=16, ge=1, le=1024, description=(
            "Requests in flight at once. Default 16: the CPU engine's in-flight batching peaks near there (README)."
        ),
    )
    resamples: int = Field(
        default=2000, ge=100, le=100000, description="Bootstrap resamples for the paired confidence intervals."
    )


def needs_context_logits(spec: EvalSpec) -> bool:
    """The gate reads the deployment's context logits (``rule: kld``): the TensorRT engine must then be built with
    ``--gather_context_logits`` (trtllm_1.2.1_contract.yaml ``trtllm_build.flags``)."""
    return spec.rule == "kld"
