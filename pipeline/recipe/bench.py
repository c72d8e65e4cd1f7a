"""``bench`` section: ISL/OSL scenarios and load points for ``trtpipe bench``.

Every field that ``trtpipe bench`` can override declares its flag here, on the field (a :class:`Flag` in its
``Annotated`` metadata: name, help, how the option's text becomes the field's value); the command's options, the
overrides and the error messages are generated from it (:mod:`pipeline.bench.options`). A new knob is one field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from pipeline.recipe.base import StrictModel
from pipeline.recipe.bounds import (
    INT32_MAX,
    MAX_CONCURRENCY,
    MAX_DURATION_S,
    MAX_REQUESTS,
    MAX_TIMEOUT_S,
    SEED_MAX,
)

#: largest synthetic image side in pixels (trtpipe's sanity bound: 16384² RGB is 768 MiB per image)
MAX_IMAGE_PX = 16384
#: most images one bench request may carry (trtpipe's sanity bound; the build's vision.max_images_per_request rules)
MAX_IMAGES_PER_REQUEST = 64

#: goodput SLO keys (ms): ``ttft`` (TTFT), ``itl`` (the request's ITL), ``tpot`` (its TPOT), ``e2e`` (request latency)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")
#: most shared prompt prefixes (a bench sends at most 512 distinct synthetic prompts, pipeline/bench/prompts.py)
MAX_UNIQUE_PREFIXES = 512


@dataclasses.dataclass(frozen=True)
class Flag:
    """The command-line option that sets a field, declared on the field (``Annotated[T, Flag(...)]``).

    ``name`` is the option (``--concurrency``); ``help`` its help text; ``kind`` the type the option's text is parsed
    as (``str``, ``int``, ``float``, ``Path``, ``bool`` for an on/off flag, ``list[str]`` for a repeatable one);
    ``parse(value, name)`` turns that into the field's value (raising ``UserError`` naming the option); ``min`` is the
    option's range check; ``shows_default`` shows (and passes) the field's default rather than "not given";
    ``clears`` sets other fields when this one is given (``{"request_rate": []}``); ``excludes`` names fields whose
    options cannot be given together with this one.
    """

    name: str
    help: str
    kind: Any = str
    parse: Callable[[Any, str], Any] | None = None
    min: float | None = None
    shows_default: bool = False
    clears: dict[str, Any] = dataclasses.field(default_factory=dict)
    excludes: tuple[str, ...] = ()


def _user_error(message: str) -> Exception:
    from pipeline.core.errors import UserError

    return UserError(message)


def parse_ints(text: str, flag: str) -> list[int]:
    """``"1,8,64"`` → ``[1, 8, 64]``.

    Raises:
        UserError: not comma-separated integers, or a value < 1 (names ``flag``).
    """
    try:
        values = [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise _user_error(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,8,64") from None
    if not values or min(values) < 1:
        raise _user_error(f"{flag} {text!r}: values must be >= 1")
    return values


def parse_floats(text: str, flag: str) -> list[float]:
    """``"0.5,2"`` → ``[0.5, 2.0]``.

    Raises:
        UserError: not comma-separated numbers, or a value <= 0 (names ``flag``).
    """
    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError:
        raise _user_error(f"{flag} {text!r}: expected comma-separated numbers, e.g. 0.5,2") from None
    if not values or min(values) <= 0:
        raise _user_error(f"{flag} {text!r}: values must be > 0")
    return values


def parse_scenario(text: str, flag: str = "--scenario") -> tuple[int, int]:
    """``"100:2000"`` → ``(100, 2000)`` (ISL, OSL in tokens).

    Raises:
        UserError: not ``ISL:OSL``, or a value < 1.
    """
    try:
        isl, osl = (int(v) for v in text.split(":"))
    except ValueError:
        raise _user_error(f"{flag} {text!r}: expected ISL:OSL, e.g. 100:2000") from None
    if isl < 1 or osl < 1:
        raise _user_error(f"{flag} {text!r}: ISL and OSL must be >= 1")
    return isl, osl


def parse_scenarios(items: list[str], flag: str = "--scenario") -> list[dict[str, int]]:
    """``["100:2000", "100:100"]`` → ``[{"isl": 100, "osl": 2000}, {"isl": 100, "osl": 100}]`` (tokens)."""
    return [{"isl": i, "osl": o} for i, o in (parse_scenario(t, flag) for t in items)]


def parse_goodput(items: list[str], flag: str = "--goodput") -> dict[str, float]:
    """``["ttft:200,itl:20"]`` or ``["ttft:200", "itl:20"]`` → ``{"ttft": 200.0, "itl": 20.0}`` (ms).

    Raises:
        UserError: not ``KEY:MS``, or a key not in :data:`SLO_KEYS`.
    """
    out: dict[str, float] = {}
    for item in items:
        for part in item.replace(" ", ",").split(","):
            if not part:
                continue
            key, _, value = part.partition(":")
            try:
                out[key] = float(value)
            except ValueError:
                raise _user_error(f"{flag} {part!r}: expected KEY:MS, e.g. ttft:200") from None
            if key not in SLO_KEYS:
                raise _user_error(f"{flag} {part!r}: unknown SLO {key!r} (use {', '.join(SLO_KEYS)})")
    return out


class ScenarioSpec(StrictModel):
    """One input/output sequence-length pair, in tokens."""

    isl: int = Field(ge=1, le=INT32_MAX, description="Input sequence length: prompt tokens per request (exact; at most build.max_input_len).")
    osl: int = Field(
        ge=1,
        le=INT32_MAX,
        description=(
            "Output sequence length: generated tokens per request (exact via min_tokens = OSL on the TensorRT-LLM and "
            "CPU interfaces; the LLM-API model has no min_tokens input, so short requests are reported there)."
        ),
    )


class BenchSpec(StrictModel):
    """Default benchmark of the deployment; every field can be overridden by a ``trtpipe bench`` flag."""

    model: Annotated[str, Flag("--model", (
        "ensemble | tensorrt_llm | tensorrt_llm_bls (default: recipe/last build, else ensemble); the LLM-API "
        "(build.engine: pytorch) repository has only tensorrt_llm. With --api openai: the served model name (default: "
        "the only one GET /v1/models lists)."))] = Field(
        default="ensemble", min_length=1, description=(
            "Triton model to load: `ensemble`/`tensorrt_llm_bls` (text) or `tensorrt_llm` (token ids; with build.engine "
            "pytorch it is the LLM-API text model, and the default); any other decoupled model with one of these "
            "interfaces works too."
        )
    )
    scenarios: Annotated[list[ScenarioSpec], Flag(
        "--scenario", "ISL:OSL, repeatable (e.g. --scenario 100:2000 --scenario 100:100).", list[str], parse_scenarios,
    )] = Field(
        default_factory=lambda: [ScenarioSpec(isl=100, osl=2000)], min_length=1, description="ISL/OSL pairs."
    )
    concurrency: Annotated[list[Annotated[int, Field(ge=1, le=MAX_CONCURRENCY)]], Flag(
        "--concurrency", "Closed-loop load points, e.g. 1,8,64,256.", parse=parse_ints,
        clears={"request_rate": []},  # explicit concurrency wins over a recipe's request_rate
    )] = Field(
        default_factory=lambda: [1, 8, 64, 256], min_length=1, description="Closed-loop load points: requests always in flight."
    )
    request_rate: Annotated[list[Annotated[float, Field(gt=0, le=1e6, allow_inf_nan=False)]] | None, Flag(
        "--request-rate", "Open-loop load points in requests/s, e.g. 0.5,2.", parse=parse_floats, excludes=("concurrency",),
    )] = Field(
        default=None, description="Open-loop load points in requests/s (instead of concurrency)."
    )
    arrival: Annotated[Literal["poisson", "constant"], Flag(
        "--arrival", "poisson | constant (with --request-rate).")] = Field(default="poisson", description="Inter-arrival distribution for request_rate.")
    num_requests: Annotated[int | None, Flag("--num-requests", (
        "Measured requests per load point (default: the recipe's max(requests_per_load × load, min_requests), 4 and 16 "
        "unless set)."), int, min=1)] = Field(
        default=None,
        ge=1,
        le=MAX_REQUESTS,
        description="Measured requests per load point (default: max(requests_per_load × load, min_requests)).",
    )
    requests_per_load: float = Field(
        default=4.0, gt=0, le=1e4, allow_inf_nan=False, description="Default measured requests per unit of load (concurrency, or requests/s)."
    )
    min_requests: int = Field(default=16, ge=1, le=MAX_REQUESTS, description="Fewest measured requests of a load point by default.")
    warmup_requests: Annotated[int, Flag(
        "--warmup", "Warmup requests per load point (excluded).", int, min=0)] = Field(default=2, ge=0, le=MAX_REQUESTS, description="Requests sent first and excluded from statistics.")
    request_timeout_s: Annotated[float, Flag(
        "--timeout", "Per-request timeout in seconds.", float, min=0.001)] = Field(default=600.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description="Per-request timeout in seconds (at most a day).")
    stall_timeout_s: Annotated[float, Flag(
        "--stall-timeout", ("Stop the run when a stream gets no response for this many seconds (before its first "
                            "response: when no stream gets one); gRPC."), float, min=0.001)] = Field(
        default=60.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False, description=(
            "A gRPC stream with no response for this many seconds after its last one (before its first: while no "
            "stream of the run gets one) ends as `stalled` and stops the run, writing partial results: a model whose "
            "engine process died leaves its streams open forever."))
    goodput: Annotated[dict[Literal[SLO_KEYS], Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S * 1000, allow_inf_nan=False)]], Flag(
        "--goodput", "SLOs in ms: ttft:200,itl:20 (keys ttft, itl, tpot, e2e; repeatable).", list[str], parse_goodput,
    )] = Field(
        default_factory=dict, description="SLOs in ms for goodput, e.g. {ttft: 200, itl: 20}."
    )
    seed: Annotated[int, Flag("--seed", "Seed of the synthetic prompts and Poisson arrivals.", int)] = Field(default=0, ge=0, le=SEED_MAX, description="Seed in [0, 2^32) of the synthetic prompts and of Poisson arrivals.")
    duration_s: Annotated[float | None, Flag(
        "--duration", "Measure each load point for this many seconds instead.", float, min=0.1)] = Field(
        default=None, gt=0, le=MAX_DURATION_S, allow_inf_nan=False,
        description="Measure each load point for this many seconds instead of a request count (at most a week)."
    )
    dataset: Annotated[Path | None, Flag("--dataset", (
        "JSONL prompts (text/prompt/input_ids) instead of synthetic ones; the ISL of --isl/--scenario is then only a "
        "label (each request records its own input tokens)."), Path)] = Field(
        default=None, description=(
            "JSONL prompts (text/prompt/input_ids) instead of synthetic ones; the scenario ISL is then only a label "
            "(each request records its own input tokens)."
        ),
    )
    allow_short: Annotated[bool, Flag(
        "--allow-short", "Do not fail when requests return fewer than OSL tokens although min_tokens forced it.", bool,
    )] = Field(
        default=False, description=(
            "Accept requests that return fewer than OSL tokens although exact OSL was forced (min_tokens): by default "
            "such a run fails, naming the requests and how short they were."
        ),
    )
    server_timestamps: Annotated[bool, Flag(
        "--server-timestamps", "Also request the server's perf timestamps (return_perf_metrics).", bool,
    )] = Field(
        default=False, description="Also ask the server for its per-request perf timestamps (return_perf_metrics)."
    )

    # --------------------------------------------- shared prompt prefixes (AIPerf's / GenAI-Perf's flags:
    # ai-dynamo/aiperf@db4f6397d11ee2d4cfbb41f70b2327315163dcf0 aiperf/common/config/prompt_config.py:119-165,
    # ``--num-prefix-prompts`` :140 = the prefix pool size, ``--prefix-prompt-length`` :160 = tokens per prefix)
    num_prefix_prompts: Annotated[int, Flag("--num-prefix-prompts", (
        "Shared prefixes to draw from (with --prefix-prompt-length): every synthetic prompt starts with one."), int, min=0)] = Field(
        default=0, ge=0, le=MAX_UNIQUE_PREFIXES, description=(
            "Pool of shared prompt prefixes (AIPerf --num-prefix-prompts): synthetic prompt i starts with prefix "
            "i mod N, so prompts share their first prefix_prompt_length tokens (KV-cache block reuse); 0 = none."))
    prefix_prompt_length: Annotated[int, Flag("--prefix-prompt-length", (
        "Tokens of each shared prefix, counted in the ISL (which still holds exactly)."), int, min=0)] = Field(
        default=0, ge=0, le=INT32_MAX, description=(
            "Tokens of each shared prefix (AIPerf --prefix-prompt-length); unlike AIPerf, part of the scenario's ISL "
            "(the rest of the prompt is random), so the ISL stays exact; must be below every scenario's ISL."))

    # --------------------------------------------- synthetic images (AIPerf's flags: ai-dynamo/aiperf@db4f6397
    # aiperf/common/config/image_config.py:22-123; defaults config_defaults.py:69-76: size 0 = no images, batch 1,
    # png; images only when both means are > 0, dataset/composer/synthetic.py:161-166)
    image_width_mean: Annotated[float, Flag("--image-width-mean", (
        "Mean image width in pixels of synthetic images (with --image-height-mean; 0 = no images)."), float)] = Field(
        default=0.0, ge=0, le=MAX_IMAGE_PX, allow_inf_nan=False, description=(
            "Mean width in pixels of the synthetic images sent with every request (AIPerf --image-width-mean); "
            "images are sent only when both means are > 0."))
    image_width_stddev: Annotated[float, Flag("--image-width-stddev", "Standard deviation of the image width, pixels.", float)] = Field(
        default=0.0, ge=0, le=MAX_IMAGE_PX, allow_inf_nan=False, description="Standard deviation of the image width in pixels (AIPerf --image-width-stddev).")
    image_height_mean: Annotated[float, Flag("--image-height-mean", (
        "Mean image height in pixels of synthetic images (with --image-width-mean; 0 = no images)."), float)] = Field(
        default=0.0, ge=0, le=MAX_IMAGE_PX, allow_inf_nan=False, description=(
            "Mean height in pixels of the synthetic images (AIPerf --image-height-mean)."))
    image_height_stddev: Annotated[float, Flag("--image-height-stddev", "Standard deviation of the image height, pixels.", float)] = Field(
        default=0.0, ge=0, le=MAX_IMAGE_PX, allow_inf_nan=False, description="Standard deviation of the image height in pixels (AIPerf --image-height-stddev).")
    image_format: Annotated[Literal["png", "jpeg"], Flag("--image-format", "png | jpeg: how the images are encoded.")] = Field(
        default="png", description="Image file format sent (AIPerf --image-format; png is its default).")
    image_batch_size: Annotated[int, Flag("--image-batch-size", "Images per request (AIPerf's name).", int)] = Field(
        default=1, ge=1, le=MAX_IMAGES_PER_REQUEST, description=(
            "Images per request (AIPerf --image-batch-size); at most the build's vision.max_images_per_request."))

    @field_validator("prefix_prompt_length")
    @classmethod
    def _prefix_fits(cls, length: int, info: ValidationInfo) -> int:
        """Both prefix options or neither; the prefix leaves at least one token of every scenario's ISL (one line,
        named by the flag)."""
        d = info.data
        if bool(d.get("num_prefix_prompts")) != bool(length):
            raise PydanticCustomError("prefix", "goes with --num-prefix-prompts / num_prefix_prompts: both > 0, or both 0")
        if length and d.get("dataset") is not None:
            raise PydanticCustomError("prefix", "shared prefixes are for synthetic prompts, not with a dataset")
        short = [s.isl for s in d.get("scenarios") or [] if s.isl <= length]
        if length and short:
            raise PydanticCustomError("prefix", "{length} must be below every scenario's ISL (ISL {isl} holds no token "
                                      "after it)", {"length": length, "isl": short[0]})
        return length

    # ------------------------------------------------------------------ derived values
    def load_points(self) -> list[tuple[str, float]]:
        """``[(mode, value)]``: ``("concurrency", c)`` per concurrency, or ``(arrival, rate)`` per request
        rate when ``request_rate`` is set (rates in requests/s)."""
        if self.request_rate:
            return [(self.arrival, float(r)) for r in self.request_rate]
        return [("concurrency", float(c)) for c in self.concurrency]

    def requests_for(self, value: float) -> int:
        """Measured requests of one load point (concurrency or rate ``value``):
        ``num_requests``, else ``max(requests_per_load × value, min_requests)``."""
        if self.num_requests is not None:
            return self.num_requests
        return max(int(self.requests_per_load * value), self.min_requests)
