"""``trtpipe bench --api openai`` against a fake OpenAI-compatible server whose wire rules are vLLM's
(:mod:`fakes.openai_server`): exact ISL prompts, exact OSL fields, token counts from the stream's usage,
the OSL two-way check, timing (lower bounds only: no assert here can fail on a slow moment), a strict server
without vLLM's extras, chat, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.openai_server import FakeOpenAIServer
from support import free_port

from pipeline.bench import stage as bench
from pipeline.bench.results import check_outcome
from pipeline.bench.stage import BenchTarget
from pipeline.core.errors import StageError, UserError
from pipeline.recipe.bench import BenchSpec

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    from pipeline.quantize.sources import embedded_smollm2_dir

    return embedded_smollm2_dir()


def _spec(c: int = 4, n: int = 8, isl: int = 24, osl: int = 12) -> BenchSpec:
    return BenchSpec(scenarios=[{"isl": isl, "osl": osl}], concurrency=[c], num_requests=n, warmup_requests=1, request_timeout_s=30)


def test_vllm_like_server_exact_isl_osl_usage_counts_and_timing(tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    with FakeOpenAIServer(free_port(), ttft_ms=40, itl_ms=8) as srv:
        run = bench.run(_spec(), BenchTarget(url=srv.url, api="openai", tokenizer=tokenizer_dir, out=tmp_path / "run"))
        sent = list(srv.requests)
    check_outcome(run)
    assert run.info.name == "smollm2" and run.spec.model == "smollm2" and run.osl_forced
    probe, *load = sent
    assert probe["max_tokens"] == 2 and len(load) == 9  # preflight probe, 1 warmup + 8 measured
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    for body in load:
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        assert body["max_tokens"] == body["min_tokens"] == 12 and body["ignore_eos"] is True and body["temperature"] == 0
        assert len(tok.encode(body["prompt"])) == 24  # exact ISL as the server tokenizes it
    s = run.load_points[0].summary
    assert s.counts.completed == 8 and s.counts.short == 0 and s.counts.output_tokens == 96
    # OSL two ways: the running usage (client), the final usage chunk (server), re-tokenized text
    assert s.osl_check.methods == ["client", "retokenized", "server"] and s.osl_check.mismatch == 0
    m = s.metrics  # lower bounds only (a slow moment lengthens times): the server's 40 ms, then 11 tokens 8 ms apart
    assert m["time_to_first_token"]["min"] >= 40 - 0.01, m["time_to_first_token"]
    assert m["request_latency"]["min"] >= 40 + 11 * 8 - 0.01, m["request_latency"]
    doc = json.loads((run.run_dir / "bench.json").read_text())
    assert doc["config"]["api"] == "openai" and doc["config"]["url"] == srv.url
    assert run.load_points[0].server_metrics is None  # no Prometheus scrape for a non-Triton target
    assert (run.run_dir / "profile_export_aiperf.json").is_file()


def test_strict_server_without_vllm_extras_counts_by_retokenizing(tokenizer_dir, tmp_path):
    notes: list[str] = []
    with FakeOpenAIServer(free_port(), strict=True, eos_after=5) as srv:
        run = bench.run(_spec(c=2, n=4), BenchTarget(url=srv.url, api="openai", tokenizer=tokenizer_dir, out=tmp_path / "run"),
                        on_status=notes.append)
        load = srv.requests[1:]
    assert not run.osl_forced and any("rejected min_tokens" in n for n in notes)
    assert all("min_tokens" not in b and "ignore_eos" not in b and "continuous_usage_stats" not in b["stream_options"] for b in load)
    check_outcome(run)  # not forced: short requests are reported, not failed
    s = run.load_points[0].summary
    assert s.counts.short == 4 and s.counts.output_tokens == 20  # stopped at "EOS" after 5 tokens
    assert s.osl_check.methods == ["client", "retokenized", "server"] and s.osl_check.mismatch == 0


def test_chat_endpoint_records_the_servers_prompt_tokens(tokenizer_dir, tmp_path):
    with FakeOpenAIServer(free_port()) as srv:
        run = bench.run(_spec(c=1, n=2, osl=4), BenchTarget(url=srv.url.removesuffix("/v1"), api="openai",
                        openai_endpoint="chat", tokenizer=tokenizer_dir, out=tmp_path / "run"))
        body = srv.requests[-1]
    check_outcome(run)
    assert body["messages"][0]["role"] == "user" and "prompt" not in body
    rec = next(r for r in run.records if not r.warmup)
    assert rec.input_tokens == len(body["messages"][0]["content"].split()) + 5 and rec.output_tokens == 4


def test_model_choice_and_unreachable_server(tokenizer_dir, tmp_path):
    with FakeOpenAIServer(free_port(), models=("a", "b")) as srv:
        with pytest.raises(UserError, match=r"serves 2 models \(a, b\): pick one with --model"):
            bench.run(_spec(), BenchTarget(url=srv.url, api="openai", tokenizer=tokenizer_dir, out=tmp_path / "x"))
        with pytest.raises(UserError, match="model 'c' is not served"):
            bench.run(_spec(), BenchTarget(url=srv.url, api="openai", served_model="c", tokenizer=tokenizer_dir, out=tmp_path / "y"))
        run = bench.run(_spec(c=1, n=1, osl=2), BenchTarget(url=srv.url, api="openai", served_model="b", tokenizer=tokenizer_dir,
                                                          out=tmp_path / "z"))
        assert srv.requests[-1]["model"] == "b" and run.load_points[0].summary.counts.completed == 1
    with pytest.raises(UserError, match="no server at http://127.0.0.1:"):
        bench.run(_spec(), BenchTarget(url=f"127.0.0.1:{free_port()}", api="openai", tokenizer=tokenizer_dir, out=tmp_path / "w"))


def test_server_going_away_mid_run_stops_with_partial_results(tokenizer_dir, tmp_path):
    srv = FakeOpenAIServer(free_port(), itl_ms=5).__enter__()
    import threading

    def stop_after_some_load() -> None:  # after the probe and four load requests, whenever that is
        while len(srv.requests) < 5:
            threading.Event().wait(0.01)
        srv.__exit__()

    threading.Thread(target=stop_after_some_load, daemon=True).start()
    run = bench.run(BenchSpec(scenarios=[{"isl": 8, "osl": 20}], concurrency=[2], num_requests=200, warmup_requests=0,
                              request_timeout_s=10),
                    BenchTarget(url=srv.url, api="openai", tokenizer=tokenizer_dir, out=tmp_path / "run"))
    with pytest.raises(StageError, match="server became unreachable"):
        check_outcome(run)
    assert (run.run_dir / "bench.json").is_file() and run.load_points[0].summary.counts.requests < 200


def test_cli_bad_api_and_endpoint_are_one_line_exit_2(tmp_path):
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(REPO), "COLUMNS": "200"}
    for flags, needle in ((["--api", "soap"], "--api 'soap'"), (["--api", "openai", "--openai-endpoint", "x"], "--openai-endpoint 'x'"),
                          (["--api", "openai", "--url", f"http://127.0.0.1:{free_port()}/v1", "--isl", "8", "--osl", "4"], "no server at")):
        p = subprocess.run([TRTPIPE, "bench", *flags], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env, check=False)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
