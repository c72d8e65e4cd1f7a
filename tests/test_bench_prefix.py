"""Shared-prefix bench workloads (``--num-prefix-prompts`` / ``--prefix-prompt-length``, AIPerf's names): prompts
that start with one of N shared prefixes while the ISL stays exact, with the real SmolLM2 tokenizer; and the
cached-token share the server reports, in the load point's summary and CSV."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pipeline.bench.prompts import load_tokenizer, make_prompts
from pipeline.core.errors import UserError
from pipeline.recipe.bench import BenchSpec


@pytest.fixture(scope="module")
def tokenizer():
    from pipeline.quantize.sources import embedded_smollm2_dir

    return load_tokenizer(embedded_smollm2_dir())


def _info(interface: str):
    from pipeline.bench.client import ModelInfo

    return ModelInfo("m", interface, {}, (), 0, {}, {}, {})


def _spec(**kw) -> BenchSpec:
    return BenchSpec(scenarios=[{"isl": 120, "osl": 4}], **kw)


@pytest.mark.parametrize("interface", ["tokens", "openai"])
def test_prompts_share_their_prefix_and_keep_the_isl(tokenizer, interface):
    spec = _spec(num_prefix_prompts=3, prefix_prompt_length=64)
    prompts = make_prompts(spec, _info(interface), 120, 9, tokenizer)
    assert [p.num_tokens for p in prompts] == [120] * 9
    ids = [p.ids.tolist() if p.ids is not None else tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]
    assert [len(i) for i in ids] == [120] * 9  # exact ISL, what the server tokenizes
    heads = [tuple(i[:64]) for i in ids]
    assert len(set(heads)) == 3  # three shared prefixes…
    assert all(heads[k] == heads[k % 3] for k in range(9))  # …prompt i takes prefix i mod 3
    assert len({tuple(i[64:]) for i in ids}) == 9  # the rest differs
    assert len({tuple(i[:65]) for i in ids}) == 9  # nothing shared beyond the prefix


def test_without_prefix_options_the_prompts_are_unchanged(tokenizer):
    a = make_prompts(_spec(), _info("openai"), 50, 4, tokenizer)
    from pipeline.bench.prompts import text_prompts

    assert [p.text for p in a] == [p.text for p in text_prompts(4, 50, seed=50, tokenizer=tokenizer)]


def test_bad_prefix_options_are_one_line(tmp_path):
    with pytest.raises(ValidationError, match="goes with --num-prefix-prompts"):
        _spec(num_prefix_prompts=2)
    with pytest.raises(ValidationError, match="must be below every scenario's ISL"):
        _spec(num_prefix_prompts=2, prefix_prompt_length=120)
    import subprocess
    import sys
    from pathlib import Path

    trtpipe = str(Path(sys.executable).parent / "trtpipe")
    r = subprocess.run([trtpipe, "bench", "--isl", "10", "--osl", "2", "--num-prefix-prompts", "2",
                        "--prefix-prompt-length", "10", "--url", "localhost:1", "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=tmp_path, check=False)
    assert r.returncode == 2 and r.stderr.strip() == (
        "error: --prefix-prompt-length: 10 must be below every scenario's ISL (ISL 10 holds no token after it)")
    assert not (tmp_path / "o").exists()


def test_prefix_that_leaves_no_room_for_added_special_tokens(tokenizer):
    from tests.test_bench_prompts import _BosTokenizer

    spec = BenchSpec(scenarios=[{"isl": 20, "osl": 4}], num_prefix_prompts=1, prefix_prompt_length=19)
    with pytest.raises(UserError, match="--prefix-prompt-length 19: ISL 20 leaves no token"):
        make_prompts(spec, _info("openai"), 20, 2, _BosTokenizer(tokenizer))


def test_cached_token_share_in_summary_and_csv():
    from pipeline.bench.metrics import summarize
    from pipeline.bench.records import RequestRecord
    from pipeline.bench.summary_csv import PREFIX_COLUMNS, csv_columns

    def rec(i: int, cached: int | None) -> RequestRecord:
        return RequestRecord("100:2", "c1", i, False, 100, 2, start_ns=0, response_ns=[10, 20],
                             response_tokens=[1, 1], end_ns=20, cached_tokens=cached)

    s = summarize([rec(0, 0), rec(1, 64), rec(2, 96)])
    assert s.prefix_cache == {"requests": 3, "cached_tokens": 160, "input_tokens": 300, "cached_token_share": 160 / 300}
    assert s.to_json()["prefix_cache"]["cached_tokens"] == 160
    assert summarize([rec(0, None)]).prefix_cache is None and "prefix_cache" not in summarize([rec(0, None)]).to_json()
    assert set(PREFIX_COLUMNS) <= set(csv_columns(prefix=True)) and not set(PREFIX_COLUMNS) & set(csv_columns())


def test_openai_usage_cached_tokens_land_on_the_record():
    from pipeline.bench.client import ModelInfo
    from pipeline.bench.http_client import SSEClient
    from pipeline.bench.records import RequestRecord

    client = SSEClient("http://x/v1", ModelInfo("m", "openai", {}, (), 0, {}, {}, {}), api="openai", timeout_s=1.0)
    rec = RequestRecord("320:1", "c1", 0, False, 320, 1)
    final = {"choices": [], "usage": {"prompt_tokens": 320, "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": 256}}}  # trtllm-serve / vLLM usage
    client._openai_event(final, 5, rec, [0])
    assert rec.cached_tokens == 256 and rec.server_tokens == 1
    plain = RequestRecord("320:1", "c1", 1, False, 320, 1)
    client._openai_event({"choices": [], "usage": {"prompt_tokens": 320, "completion_tokens": 1}}, 5, plain, [0])
    assert plain.cached_tokens is None  # no count reported: no share claimed
