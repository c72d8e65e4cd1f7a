"""``CpuEngine``: in-flight batching on a paged KV cache (transformers continuous batching), on a real
FP8-quantized SmolLM2-135M engine directory built by the ``build.engine: cpu`` stage."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from pipeline.layout import BuildLayout
from pipeline.cpu_runtime.engine import CpuEngine
from support import quantized_stage
from pipeline.engine import cpu as cpu_stage
from pipeline.recipe import load_recipe

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("TRTPIPE_CACHE_DIR", REPO / ".trtpipe-cache")) / "cpu-engine-fixtures"
WAIT_S = 120  # bound on every wait: the machine is shared
END_ID = 2  # SmolLM2 <|im_end|> (= its eos and pad token)


@pytest.fixture(scope="module")
def engine_dir() -> Path:
    q = quantized_stage(FIXTURES, "fp8", kv_cache_dtype="fp8")
    recipe = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml", ["build.max_batch_size=8"])
    return cpu_stage.run(recipe, BuildLayout(FIXTURES / "build-fp8-bs8"), quantized=q).path


@pytest.fixture(scope="module")
def engine(engine_dir: Path):
    eng = CpuEngine(engine_dir, num_threads=1)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tok(engine_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine_dir, local_files_only=True)


class Collector:
    """Records one request's streamed callbacks; ``wait()`` blocks until the finished call."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.calls = 0
        self.finished = 0
        self.error: str | None = None
        self.done = threading.Event()

    def __call__(self, toks: list[int], finished: bool) -> None:
        self.tokens.extend(toks)
        self.calls += 1
        if finished:
            self.finished += 1
            self.done.set()

    def on_error(self, msg: str) -> None:
        self.error = msg
        self.done.set()

    def wait(self) -> list[int]:
        assert self.done.wait(WAIT_S), "request did not finish in time"
        assert self.error is None, self.error
        return self.tokens


def _submit(engine: CpuEngine, ids: list[int], n: int, **kw) -> Collector:
    c = Collector()
    engine.add_request(ids, max_new_tokens=n, on_tokens=c, on_error=c.on_error, **kw)
    return c


def _prompt(tok, text: str) -> list[int]:
    return tok(text).input_ids


def test_greedy_matches_generate(engine: CpuEngine, engine_dir: Path, tok) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(engine_dir, local_files_only=True, dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def fibonacci(n):\n    "]
    cols = [_submit(engine, _prompt(tok, p), 24) for p in prompts]
    for p, c in zip(prompts, cols):
        enc = tok(p, return_tensors="pt")
        with torch.no_grad():
            ref = model.generate(**enc, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=END_ID)
        assert c.wait() == ref[0, enc.input_ids.shape[1] :].tolist(), p
        assert c.finished == 1 and c.calls >= 2  # streamed, one finished call
    assert "Paris" in tok.decode(cols[0].tokens)


def test_concurrent_requests_share_forward_passes(engine: CpuEngine, tok) -> None:
    ids = _prompt(tok, "Once upon a time")
    solo = _submit(engine, ids, 16).wait()
    before = engine.stats()["forward_passes"]
    cols = [_submit(engine, ids[: 2 + i % 3] + ids, 16) for i in range(8)]
    outs = [c.wait() for c in cols]
    passes = engine.stats()["forward_passes"] - before
    assert all(len(o) == 16 for o in outs)
    assert passes <= 16 + 4, f"8 × 16 tokens took {passes} forward passes: requests are not batched"
    assert outs[3] == _submit(engine, ids[:2] + ids, 16).wait()  # batching does not change greedy output
    assert solo


def test_request_added_mid_run_joins_the_batch(engine: CpuEngine, tok) -> None:
    long_ids = _prompt(tok, "Write a long story about a dragon.")
    short_ids = _prompt(tok, "The capital of France is")
    alone = _submit(engine, short_ids, 12).wait()
    before = engine.stats()["forward_passes"]
    a = _submit(engine, long_ids, 64)
    deadline = time.monotonic() + WAIT_S
    while len(a.tokens) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 8 <= len(a.tokens) < 64
    b = _submit(engine, short_ids, 12)
    assert b.wait() == alone
    assert not a.done.is_set(), "the short request should finish while the long one still decodes"
    assert len(a.wait()) == 64
    passes = engine.stats()["forward_passes"] - before
    assert passes <= 64 + 3, f"{passes} forward passes for 64 + 12 tokens: the joined request did not share them"


def test_exact_output_length_with_min_tokens(engine: CpuEngine, tok) -> None:
    chat = tok.apply_chat_template([{"role": "user", "content": "Say hi."}], add_generation_prompt=True)
    ids = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    runs = {
        "free": _submit(engine, ids, 48, end_id=END_ID),
        "exact": _submit(engine, ids, 48, end_id=END_ID, min_tokens=48),
        "never": _submit(engine, ids, 48, end_id=None),
        "one": _submit(engine, ids, 1, end_id=END_ID, min_tokens=1),
    }
    free, exact, never, one = (runs[k].wait() for k in ("free", "exact", "never", "one"))
    assert len(one) == 1 and runs["one"].finished == 1
    assert len(free) < 48, "the prompt should make the model stop early"
    assert END_ID not in free  # the end token is not returned
    assert len(exact) == 48 and END_ID not in exact
    assert exact[: len(free)] == free  # same greedy path until EOS was masked
    some = _submit(engine, ids, 48, end_id=END_ID, min_tokens=len(free) + 3).wait()
    assert len(free) + 3 <= len(some) <= 48 and END_ID not in some[: len(free) + 3]
    assert len(never) == 48  # no end_id: never stops early (may contain token 2)
    assert never[: len(free) + 1] == free + [END_ID]


def test_invalid_requests_raise_value_error(engine: CpuEngine) -> None:
    cfg = engine.config
    ok = lambda toks, fin: None  # noqa: E731
    with pytest.raises(ValueError, match="max_input_len 512"):
        engine.add_request([1] * 513, max_new_tokens=1, on_tokens=ok)
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len 1024"):
        engine.add_request([1] * 500, max_new_tokens=600, on_tokens=ok)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], max_new_tokens=1, on_tokens=ok)
    with pytest.raises(ValueError, match="outside"):
        engine.add_request([10**6], max_new_tokens=1, on_tokens=ok)
    with pytest.raises(ValueError, match="at least 1"):
        engine.add_request([1], max_new_tokens=0, on_tokens=ok)
    # max_batch_size (8) requests in flight: the 9th is refused with a clear message
    ids = [engine.add_request([1, 2, 3], max_new_tokens=500, on_tokens=ok) for _ in range(cfg["max_batch_size"])]
    with pytest.raises(ValueError, match="max_batch_size is 8"):
        engine.add_request([1], max_new_tokens=1, on_tokens=ok)
    for rid in ids:
        engine.cancel(rid)
    assert engine.num_active == 0


def test_cancel_stops_callbacks_and_frees_the_slot(engine: CpuEngine, tok) -> None:
    ids = _prompt(tok, "Count to one hundred:")
    c = Collector()
    rid = engine.add_request(ids, max_new_tokens=400, on_tokens=c, on_error=c.on_error)
    deadline = time.monotonic() + WAIT_S
    while len(c.tokens) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    engine.cancel(rid)
    calls = c.calls
    time.sleep(0.5)
    assert c.calls == calls and not c.done.is_set() and engine.num_active == 0
    engine.cancel(rid)  # unknown/finished ids are ignored
    assert len(_submit(engine, ids, 4).wait()) == 4  # the engine keeps serving


def test_shutdown_stops_threads_and_fails_inflight(engine_dir: Path) -> None:
    before = set(threading.enumerate())
    eng = CpuEngine(engine_dir, num_threads=1)
    assert eng.config["kind"] == "cpu" and eng.load_time_s > 0
    c = Collector()
    eng.add_request([1, 2, 3, 4], max_new_tokens=900, on_tokens=c, on_error=c.on_error)
    eng.shutdown()
    eng.shutdown()  # idempotent
    assert c.done.wait(5) and c.error is not None
    with pytest.raises(RuntimeError, match="shut down"):
        eng.add_request([1], max_new_tokens=1, on_tokens=lambda t, f: None)
    left = [t for t in set(threading.enumerate()) - before if t.is_alive() and not t.name.startswith("tqdm")]
    left = [t for t in left if type(t).__name__ != "TMonitor"]  # tqdm's progress-bar monitor (weight loading)
    assert not left, left


@pytest.mark.slow
def test_throughput_1_vs_16_concurrent(tok) -> None:
    """ISL ~100, OSL 64: 16 concurrent requests must give far more tokens/s than one (prints figures)."""
    q = quantized_stage(FIXTURES, "fp8", kv_cache_dtype="fp8")
    recipe = load_recipe(REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml")  # max_batch_size 32
    eng = CpuEngine(cpu_stage.run(recipe, BuildLayout(FIXTURES / "build-fp8"), quantized=q).path, num_threads=2)
    try:
        ids = _prompt(tok, "The history of the city " * 20)[:100]

        def run(n: int, osl: int) -> float:
            t = time.perf_counter()
            cols = [_submit(eng, ids, osl, min_tokens=osl, end_id=END_ID) for _ in range(n)]
            total = sum(len(c.wait()) for c in cols)
            return total / (time.perf_counter() - t)

        run(1, 8)  # warm-up
        one, sixteen = run(1, 64), run(16, 64)
        print(f"\ncpu engine tokens/s: 1 concurrent {one:.1f}, 16 concurrent {sixteen:.1f}; load {eng.load_time_s:.1f}s")
        assert sixteen > 3 * one
    finally:
        eng.shutdown()
