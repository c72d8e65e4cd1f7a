"""The OpenAI protocol of trtpipe's CPU stand-in for trtllm-serve: request models, their validation and their mapping
onto the CPU LLM facade (:mod:`pipeline.cpu_runtime.llm`), and the response bodies — no HTTP (the routes are
:mod:`pipeline.cpu_runtime.openai.routes`).

Upstream code read (line numbers counted on the index's copies; no 1.2.1-tagged copy is readable):
``PROTO`` = tensorrt_llm/serve/openai_protocol.py@54cf7be08a35, ``POST`` = tensorrt_llm/serve/postprocess_handlers.py
@01bf19231d29, ``OS`` = tensorrt_llm/serve/openai_server.py@e7f7345e31e5 (1.2-era).

Decoding is the facade's (greedy): ``temperature``, ``top_p``, ``top_k``, ``seed`` and the penalties are accepted and
have no effect; ``n``/``best_of`` > 1, beam search, ``logprobs``, ``suffix`` and several prompts per request are
refused (ValueError, which the routes answer with HTTP 400). ``max_tokens`` absent: the facade's ``SamplingParams``
default (32 tokens).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator


# ---------------------------------------------------------------------------------------------- requests (PROTO)
class _Strict(BaseModel):
    # unknown fields are refused, as PROTO:61-63 OpenAIBaseModel (extra="forbid")
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class StreamOptions(_Strict):
    # PROTO:66-68: both default to true once stream_options is given
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = True


class ResponseFormat(_Strict):
    """PROTO ResponseFormat (guided decoding; the CPU engine has no structural tags)."""

    type: Literal["text", "json", "json_object", "regex", "ebnf", "structural_tag"]
    schema_: dict | None = Field(default=None, alias="schema")
    regex: str | None = None
    ebnf: str | None = None


def guided(fmt: ResponseFormat | None) -> Any:
    """PROTO _response_format_to_guided_decoding_params: the facade's GuidedDecodingParams (None: unguided).
    Raises ValueError as upstream does (``json`` without ``schema``), and for a structural tag."""
    from pipeline.cpu_runtime.guided import GuidedDecodingParams

    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json":
        if fmt.schema_ is None:
            raise ValueError("The 'schema' field is required when response_format.type is 'json'.")
        return GuidedDecodingParams(json=fmt.schema_)
    if fmt.type == "structural_tag":
        raise ValueError("response_format.type 'structural_tag' is not supported by trtpipe's CPU stand-in")
    return GuidedDecodingParams(json_object=fmt.type == "json_object", regex=fmt.regex, grammar=fmt.ebnf)


class CommonRequest(_Strict):
    """The fields CompletionRequest (PROTO:210-249) and ChatCompletionRequest (PROTO:498-550) share."""

    model: str  # PROTO:213 / 505 (required; upstream does not check it against the served name)
    n: int = 1
    best_of: int | None = None
    seed: int | None = None  # PROTO:223 / 515 (no effect: greedy)
    stop: str | list[str] | None = Field(default_factory=list)  # PROTO:224 / 516
    stream: bool | None = False  # PROTO:225 / 517
    stream_options: StreamOptions | None = None  # PROTO:226 / 518
    temperature: float | None = None  # PROTO:228 / 519 (no effect: greedy)
    top_p: float | None = None  # PROTO:229 / 520 (no effect: greedy)
    top_k: int = 0
    user: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    stop_token_ids: list[int] | None = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False  # PROTO:243 / 545
    min_tokens: int = 0  # PROTO:244 / 546
    lora_request: dict[str, Any] | None = None  # PROTO:231 / 550: LoRARequest's fields (lora_name, lora_int_id, lora_path)
    skip_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # PROTO CompletionRequest / ChatCompletionRequest

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data: Any) -> Any:
        # PROTO:328-332 (CompletionRequest.validate_stream_options)
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("Stream options can only be defined when stream is true.")
        return data


class CompletionRequest(CommonRequest):
    prompt: str | list[int] | list[str] | list[list[int]]  # PROTO:214
    max_tokens: int | None = None  # PROTO:220
    echo: bool | None = False
    logprobs: int | None = None  # refused when set, as PROTO:321-324
    suffix: str | None = None  # refused when set, as PROTO:336-339
    add_special_tokens: bool = True
    detokenize: bool = True


class ChatCompletionRequest(CommonRequest):
    messages: list[dict[str, Any]]  # PROTO:501
    # PROTO:510-511: max_completion_tokens, read from max_tokens
    max_completion_tokens: int | None = Field(default=None, validation_alias=AliasChoices("max_tokens", "max_completion_tokens"))
    logprobs: bool | None = False
    add_generation_prompt: bool = True  # PROTO:560
    add_special_tokens: bool = False  # PROTO:567: the chat template adds them


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion request (OS:737-741: a string or token ids is one prompt, a list of them
    several).

    Raises:
        ValueError: ``logprobs`` or ``suffix`` set (as PROTO:321-324 / PROTO:336-339), or more than one prompt.
    """
    if req.logprobs:
        raise ValueError("logprobs is not supported")
    if req.suffix:
        raise ValueError("suffix is not supported")
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise ValueError(f"{len(prompt)} prompts in one request: trtpipe's CPU stand-in serves one prompt per request")
        prompt = prompt[0]
    return prompt


def sampling(req: CommonRequest, max_tokens: int | None, *, add_special_tokens: bool, detokenize: bool = True) -> Any:
    """The facade's SamplingParams for ``req`` (PROTO:274-317 to_sampling_params, the fields the facade has).

    Raises:
        ValueError: a ``response_format`` the facade cannot guide by (:func:`guided`), or sampling values the facade
            refuses (``n``/``best_of`` > 1, beam search).
    """
    from pipeline.cpu_runtime.llm import SamplingParams

    extra = {} if max_tokens is None else {"max_tokens": max_tokens}
    return SamplingParams(
        **extra, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, stop=req.stop or None,
        stop_token_ids=req.stop_token_ids or None, include_stop_str_in_output=req.include_stop_str_in_output,
        n=req.n, best_of=req.best_of, use_beam_search=req.use_beam_search, seed=req.seed, top_k=req.top_k or None,
        temperature=1.0 if req.temperature is None else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
        frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
        repetition_penalty=req.repetition_penalty, skip_special_tokens=req.skip_special_tokens,
        add_special_tokens=add_special_tokens, detokenize=detokenize, guided_decoding=guided(req.response_format))


def lora(req: CommonRequest) -> Any:
    """The request's ``lora_request`` as a :class:`pipeline.cpu_runtime.llm.LoRARequest` (ValueError when malformed)."""
    from pipeline.cpu_runtime.llm import LoRARequest

    try:
        return None if req.lora_request is None else LoRARequest(**req.lora_request)
    except TypeError as e:
        raise ValueError(f"lora_request: {e}") from None


# ---------------------------------------------------------------------------------------------- responses
def error_body(message: str, status: int = 400, kind: str = "BadRequestError") -> dict[str, Any]:
    """An ErrorResponse (PROTO:112-117) as OS:220-228 create_error_response fills it (``code``: the HTTP status)."""
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def usage(prompt: int, completion: int, cached: int = 0) -> dict[str, Any]:
    """UsageInfo (PROTO:75-79); ``cached``: prompt tokens served from reused KV blocks (block reuse on, else 0)."""
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def final_body(res: Any, rid: str, model_name: str, *, chat: bool, echo: str | None) -> dict[str, Any]:
    """The whole answer to a request that did not stream: ChatCompletionResponse (PROTO:439-448) or
    CompletionResponse (PROTO:146-155) of the finished :class:`~pipeline.cpu_runtime.llm.RequestOutput` ``res``,
    usage as POST:650 / POST:462-470; ``echo``: the prompt text put before a completion's text."""
    o = res.outputs[0]
    use = usage(len(res.prompt_token_ids), o.length, res.cached_tokens)
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": o.text}, "logprobs": None}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": (echo or "") + o.text, "token_ids": None, "logprobs": None}
        obj = "text_completion"
    choice |= {"finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name, "choices": [choice], "usage": use}


def chunk_body(rid: str, model_name: str, created: int, choices: list[dict[str, Any]], use: dict[str, Any] | None, *,
               chat: bool) -> dict[str, Any]:
    """One streamed chunk (PROTO:469-475 chat.completion.chunk / PROTO:174-180 text_completion), with ``usage`` only
    when ``use`` is given."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    body = {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices}
    return body | ({"usage": use} if use is not None else {})
