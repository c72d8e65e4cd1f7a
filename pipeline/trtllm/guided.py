"""Guided decoding as TensorRT-LLM 1.2.1 defines it: backends, per-request guide types, the xgrammar tokenizer-info file.

Upstream facts (code read at the commits named; the 1.2.1 tag itself is not readable here, docs/upstream.md):

* The C++ ``tensorrtllm`` backend turns guided decoding on only when both parameters ``guided_decoding_backend``
  and ``xgrammar_tokenizer_info_path`` are set; the backend must be exactly ``xgrammar`` and the file a JSON
  object with ``encoded_vocab`` (list of str), ``tokenizer_str`` (str) and ``stop_token_ids`` (list of int)
  (tensorrtllm_backend inflight_batcher_llm/src/model_instance_state.cc@c2e65b88d852:410-449).
* Per request it reads the optional STRING inputs ``guided_decoding_guide_type`` and ``guided_decoding_guide``
  (all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt@c2e65b88d852:448-461); the type maps
  ``json``/``json_schema``/``regex``/``ebnf_grammar`` (inflight_batcher_llm/src/utils.cc@c2e65b88d852:816-860; an
  unknown type is silently no guide there). The executor compiles them with xgrammar: ``json`` → the built-in
  JSON grammar, ``json_schema`` → ``CompileJSONSchema(guide)``, ``regex`` → ``Grammar::FromRegex``,
  ``ebnf_grammar`` → ``Grammar::FromEBNF``; the matcher accepts every generated token
  (NVIDIA/TensorRT-LLM cpp/tensorrt_llm/batch_manager/guidedDecoder.cpp@000a01de66f0:92-119), its tokenizer
  info is ``TokenizerInfo::FromHuggingFace(encoded_vocab, tokenizer_str, vocab_size_padded, stop_token_ids)``
  (same file :45-50).
* The ensemble and ``tensorrt_llm_bls`` pass both inputs through unchanged (ensemble/config.pbtxt@c2e65b88d852:
  245-258, 577-582; tensorrt_llm_bls/config.pbtxt@c2e65b88d852:293-304, its lib/triton_decoder.py:457-458).
* The tokenizer-info file is what ``examples/generate_xgrammar_tokenizer_info.py@7ed07f0691df`` writes
  (``xgrammar_tokenizer_info.json``, ``json.dump`` of ``tensorrt_llm.llmapi.tokenizer._xgrammar_tokenizer_info``):
  ``stop_token_ids = [eos_token_id]``, ``encoded_vocab`` = the vocabulary's tokens sorted by id, ``tokenizer_str`` =
  the fast tokenizer's backend JSON (``backend_tokenizer.to_str()``); other tokenizers have no ``tokenizer_str``
  (tensorrt_llm/llmapi/tokenizer.py@89fd9b74ab7a ``_xgrammar_tokenizer_info``), which the C++ backend cannot read.
* LLM API: ``guided_decoding_backend: Optional[Literal["xgrammar", "llguidance"]] = None``, "llguidance is supported
  in PyTorch backend only" (tensorrt_llm/llmapi/llm_args.py@c292b9f997d6:1931); per request
  ``SamplingParams.guided_decoding: GuidedDecodingParams`` with one of ``json`` (schema: str, dict or pydantic
  model), ``regex``, ``grammar`` (EBNF), ``json_object``, ``structural_tag`` (tensorrt_llm/sampling_params.py@
  a98a9061d72f:14-30, 263; ``_get_guided_decoding_params`` maps them to the executor's JSON_SCHEMA, REGEX,
  EBNF_GRAMMAR, JSON, STRUCTURAL_TAG).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: the recipe's ``build.guided_decoding_backend`` values trtpipe builds (xgrammar: the backend of both paths and the
#: CPU engine; llguidance is PyTorch-only upstream and not offered)
BACKENDS = ("xgrammar",)
#: ``guided_decoding_guide_type`` values the C++ backend maps (utils.cc@c2e65b88d852:818-822)
GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")
#: the Triton inputs carrying a request's guide (tensorrt_llm/config.pbtxt@c2e65b88d852:448-461)
GUIDE_INPUTS = ("guided_decoding_guide_type", "guided_decoding_guide")
#: the file name upstream's generator writes (examples/generate_xgrammar_tokenizer_info.py@7ed07f0691df)
TOKENIZER_INFO_FILE = "xgrammar_tokenizer_info.json"
#: keys the C++ backend reads from it (model_instance_state.cc@c2e65b88d852:433-436)
TOKENIZER_INFO_KEYS = ("encoded_vocab", "tokenizer_str", "stop_token_ids")


def tokenizer_info(tokenizer_dir: Path) -> dict[str, Any]:
    """The xgrammar tokenizer info of the tokenizer in ``tokenizer_dir``, in upstream's file format.

    Returns:
        ``{"encoded_vocab": [token, …] (index = token id), "tokenizer_str": backend JSON, "stop_token_ids": [eos]}``.

    Raises:
        ValueError: the tokenizer is not a fast (``tokenizer.json``) tokenizer (the C++ backend needs
            ``tokenizer_str``), or it has no EOS token.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ValueError(f"{tokenizer_dir}: {type(tok).__name__} is not a fast tokenizer (tokenizer.json): the "
                         "guided-decoding tokenizer info needs its backend JSON (tokenizer_str)")
    if tok.eos_token_id is None:
        raise ValueError(f"{tokenizer_dir}: the tokenizer has no EOS token (the grammar's stop token)")
    vocab = tok.get_vocab()
    return {
        "encoded_vocab": [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])],
        "tokenizer_str": tok.backend_tokenizer.to_str(),
        "stop_token_ids": [int(tok.eos_token_id)],
    }


def write_tokenizer_info(tokenizer_dir: Path, path: Path) -> None:
    """Write :func:`tokenizer_info` of ``tokenizer_dir`` to ``path`` as JSON (raises as it does)."""
    Path(path).write_text(json.dumps(tokenizer_info(tokenizer_dir)))


def read_tokenizer_info(path: Path) -> dict[str, Any]:
    """A tokenizer-info file as the C++ backend reads it. Raises ``ValueError`` naming the file when it is not a JSON
    object with :data:`TOKENIZER_INFO_KEYS` (``FileNotFoundError`` when missing)."""
    data = json.loads(Path(path).read_text())
    missing = [k for k in TOKENIZER_INFO_KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        raise ValueError(f"{path}: not an xgrammar tokenizer-info file (missing {', '.join(missing)})")
    return data
