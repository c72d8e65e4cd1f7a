"""The one tokenizer wrapper and the one end-id rule (issue #45 item 2): the Triton python models and the CPU LLM-API
facade load their tokenizer with pipeline/core/tokenizer.py and take the same default end/pad ids from it."""

from __future__ import annotations

import ast
import json
import shutil
from pathlib import Path

import pytest

from pipeline.core.tokenizer import (
    Tokenizer,
    end_pad_ids,
    load_tokenizer,
    tokenizer_json_or_none,
)
from pipeline.cpu_runtime.llm import _load_tokenizer
from pipeline.quantize.sources import embedded_smollm2_dir

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def tok_dir(tmp_path: Path) -> Path:
    """The embedded SmolLM2's tokenizer files (eos_token ``<|im_end|>`` = 2, generation_config eos 2, pad 2)."""
    d = tmp_path / "tok"
    d.mkdir()
    for f in embedded_smollm2_dir().iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json")):
            shutil.copy(f, d / f.name)
    return d


def _gen(d: Path, **fields) -> None:
    doc = json.loads((d / "generation_config.json").read_text())
    doc.update(fields)
    for k in [k for k, v in doc.items() if v is None]:
        del doc[k]
    (d / "generation_config.json").write_text(json.dumps(doc))


def _triton_defaults(tok: Tokenizer) -> tuple[int, int]:
    """What the ensemble's preprocessing and the BLS model put in a request that names no end/pad id."""
    import sys

    sys.path.insert(0, str(ROOT / "pipeline" / "triton_repo" / "models"))
    try:
        from _common import default_end_pad_ids
    finally:
        sys.path.pop(0)
    return default_end_pad_ids(tok)


def test_generation_config_comes_first_and_a_list_gives_its_first_entry(tok_dir):
    im_start = load_tokenizer(str(tok_dir)).backend.token_to_id("<|im_start|>")
    _gen(tok_dir, eos_token_id=[im_start, 2], pad_token_id=None)
    tok = load_tokenizer(str(tok_dir))
    assert (tok.eos_token_id, tok.pad_token_id) == (im_start, 2)  # pad: the tokenizer files' pad_token
    # the CPU facade and the Triton models take the same ids from the same wrapper
    facade = _load_tokenizer(tok_dir)
    assert type(facade) is Tokenizer and facade.eos_token_id == im_start
    assert _triton_defaults(tok) == (im_start, 2)
    # no pad anywhere: the pad id is the end id
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if not (tok_dir / name).is_file():
            continue
        doc = json.loads((tok_dir / name).read_text())
        doc.pop("pad_token", None)
        (tok_dir / name).write_text(json.dumps(doc))
    assert _triton_defaults(load_tokenizer(str(tok_dir))) == (im_start, im_start)


def test_without_generation_config_the_tokenizer_files_name_the_end(tok_dir):
    (tok_dir / "generation_config.json").unlink()
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    tok = load_tokenizer(str(tok_dir))
    assert tok.eos_token_id == tok.backend.token_to_id(cfg["eos_token"]) == 2
    # tokenizer_config.json without eos_token: special_tokens_map.json names it (transformers' precedence)
    cfg.pop("eos_token")
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert _load_tokenizer(tok_dir).eos_token_id is None
    (tok_dir / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    assert _load_tokenizer(tok_dir).eos_token_id == 2


def test_nothing_names_an_end_token(tok_dir):
    assert end_pad_ids(str(tok_dir / "missing"), None, None) == (None, None)
    assert _triton_defaults(Tokenizer(backend=None)) == (-1, -1)  # never ends on a token
    assert tokenizer_json_or_none(str(tok_dir / "missing")) is None


def test_the_wrapper_is_one_module_that_imports_no_pipeline_code():
    """core/tokenizer.py is copied as tokenizer.py into every generated repository (it runs without trtpipe there),
    and no other module defines a tokenizer wrapper or reads generation_config.json's eos_token_id."""
    tree = ast.parse((ROOT / "pipeline" / "core" / "tokenizer.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not any(m and m.startswith("pipeline") for m in imported), imported
    readers = [p.relative_to(ROOT).as_posix() for p in (ROOT / "pipeline").rglob("*.py")
               if 'get("eos_token_id")' in p.read_text() or "class _Tokenizer" in p.read_text()]
    assert readers == ["pipeline/core/tokenizer.py"], readers
