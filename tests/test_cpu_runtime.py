"""``CpuEngine``: in-flight batching on a slot KV cache (trtpipe's decoder on oneDNN GEMMs), on a real
FP8-quantized SmolLM2-135M engine directory built by the ``build.engine: cpu`` stage."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from support import cpu_fp8_build

from pipeline.cpu_runtime import native
from pipeline.cpu_runtime.engine import CpuEngine

REPO = Path(__file__).resolve().parents[1]
WAIT_S = 120  # bound on every wait: the machine is shared
END_ID = 2  # SmolLM2 <|im_end|> (= its eos and pad token)


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
    if shutil.which("cc") or shutil.which("gcc"):  # the native kernels are what ran
        assert engine.runtime["kernels"].startswith("native"), engine.runtime
        if engine.runtime["kernels"] == "native-avx512" and torch.backends.mkldnn.is_available():
            # the few-row GEMM kernel runs exactly when it reads every packed weight as oneDNN laid it out on this
            # CPU (with AMX oneDNN packs bfloat16 otherwise); else oneDNN runs every GEMM
            model = engine.model
            linears = [L[n] for L in model.layers for n in ("qkv", "o", "gate_up", "down")] + [model.lm_head]
            kn = native.kernels("native")
            readable = all(kn.packed_layout_ok(lin.weight, lin.out_features, lin.in_features, lin.weight.dtype, lin.bias)
                           for lin in linears)
            assert engine.runtime["gemm"] == ("native+onednn-packed" if readable else "onednn-packed"), engine.runtime


def test_native_and_torch_kernels_give_the_same_tokens(engine: CpuEngine, engine_dir: Path, tok,
                                                        monkeypatch) -> None:
    """Four sequences of different lengths decoding together (one finishes early, so the batch changes; the
    later prompts join while others decode, so steps mix prefill and decode) through the native kernels (the
    ``engine`` fixture) and through the torch path: token-identical."""
    monkeypatch.setenv("TRTPIPE_CPU_KERNELS", "torch")
    prompts = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at", "Once upon a time, in a land far"]
    lengths = [40, 12, 40, 40]

    def run(eng: CpuEngine) -> list[list[int]]:
        cols = [_submit(eng, _prompt(tok, p), n, min_tokens=n) for p, n in zip(prompts[:2], lengths[:2])]
        deadline = time.monotonic() + WAIT_S
        while len(cols[0].tokens) < 4 and time.monotonic() < deadline:  # the first two are decoding
            time.sleep(0.005)
        cols += [_submit(eng, _prompt(tok, p), n, min_tokens=n) for p, n in zip(prompts[2:], lengths[2:])]
        return [c.wait() for c in cols]

    with CpuEngine(engine_dir, num_threads=1) as ref_engine:
        assert ref_engine.runtime["kernels"] == "torch"
        want = run(ref_engine)
    assert run(engine) == want
    assert [len(t) for t in want] == lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_step_equals_the_layer_by_layer_kernels(engine_dir: Path, dtype: torch.dtype) -> None:
    """A decode-only step through Kernels.decode_layers (every layer in one native call) gives bit-identical logits
    and K/V to the same kernels called layer by layer from Python; sequences in scattered slots, different lengths."""
    from pipeline.cpu_runtime.model import Decoder, StepBatch

    dec = Decoder(engine_dir, slots=6, slot_len=64, dtype=dtype)
    if not dec.fused_decode:
        pytest.skip(f"no fused decode here (gemm {dec.gemm}, kernels {dec.kernels})")
    g = torch.Generator().manual_seed(9)
    for t in dec.cache.k + dec.cache.v:
        t.copy_(torch.randn(t.shape, generator=g))
    slots, ctx = [4, 0, 2], [17, 64, 1]
    b = StepBatch(tokens=torch.tensor([5, 900, 31]), positions=torch.tensor(ctx) - 1, slots=torch.tensor(slots),
                  n_decode=3, decode_slots=slots, decode_ctx=torch.tensor(ctx), chunks=[], logit_rows=torch.arange(3))
    dec.fused_decode = False
    want = dec.forward(b)
    want_k = [t.clone() for t in dec.cache.k]
    for t in dec.cache.k + dec.cache.v:  # the fused step must write the step's K/V itself
        t[b.slots, :, b.positions] = 0
    dec.fused_decode = True
    got = dec.forward(b)
    assert torch.equal(got, want)
    assert all(torch.equal(a, w) for a, w in zip(dec.cache.k, want_k))


def test_bfloat16_engine_runs_bf16_gemms_and_kv_cache_around_float32_attention(engine_dir: Path, tok) -> None:
    """``build.cpu.dtype: bfloat16``: bfloat16 weights on disk and in the GEMMs, a bfloat16 KV cache (half the bytes
    per token), float32 attention arithmetic and logits. Its logits differ from transformers' float32 model of the
    same (bfloat16-stored) weights by bfloat16 rounding — far more than the float32 engine's ~1e-5, far less than
    the logits' spread — and pick the same next token."""
    from transformers import AutoModelForCausalLM

    from pipeline.cpu_runtime.model import Decoder, StepBatch

    bf_dir = cpu_fp8_build("build-fp8-bs8-bf16", ["build.max_batch_size=8", "build.cpu.dtype=bfloat16"])
    ec = json.loads((bf_dir / "engine_config.json").read_text())
    f32_ec = json.loads((engine_dir / "engine_config.json").read_text())
    assert ec["compute_dtype"] == "bfloat16" and ec["kv_cache"]["dtype"] == "bfloat16"
    assert f32_ec["kv_cache"]["dtype"] == "float32"
    # SmolLM2: 30 layers × K and V × 3 KV heads × 64 × 2 bytes
    assert ec["kv_cache"]["bytes_per_token"] == 30 * 2 * 3 * 64 * 2 == f32_ec["kv_cache"]["bytes_per_token"] // 2
    assert ec["precision"] == {"weights": "fp8 dequantized to bfloat16", "activations": "bfloat16", "kv_cache": "bfloat16"}
    # bfloat16 on disk: half the float32 engine's weight bytes
    assert (bf_dir / "model.safetensors").stat().st_size < 0.51 * (engine_dir / "model.safetensors").stat().st_size

    ref = AutoModelForCausalLM.from_pretrained(bf_dir, local_files_only=True, dtype=torch.float32).eval()
    dec = Decoder(bf_dir, slots=1, slot_len=64, dtype=torch.bfloat16)
    assert dec.layers[0]["qkv"].weight.dtype == torch.bfloat16 and dec.cache.k[0].dtype == torch.bfloat16
    for prompt in ("The three primary colors are", "def fibonacci(n):\n    ", "Once upon a time"):
        ids = _prompt(tok, prompt)
        T = len(ids)
        step = StepBatch(tokens=torch.tensor(ids), positions=torch.arange(T), slots=torch.zeros(T, dtype=torch.int64),
                         n_decode=0, decode_slots=[], decode_ctx=torch.zeros(0, dtype=torch.int64), chunks=[(0, T, 0, 0)],
                         logit_rows=torch.arange(T))
        got = dec.forward(step)
        with torch.no_grad():
            want = ref(torch.tensor([ids])).logits[0]
        assert got.dtype == torch.float32 and got.shape == want.shape
        diff = (got - want).abs().mean().item()
        assert 1e-3 < diff < 0.1 * want.std().item(), f"{prompt!r}: mean |logit diff| {diff:.5f} (logit std {want.std():.2f})"
        assert torch.equal(got.argmax(-1), want.argmax(-1)), prompt

    # the torch fallback path reads and writes the same bfloat16 cache: a prefill, then greedy decode steps, on both
    ids = _prompt(tok, "The three primary colors are")
    paths = {k: Decoder(bf_dir, slots=1, slot_len=64, dtype=torch.bfloat16, kernels=k) for k in ("torch", "native")}
    if paths["native"].kernels == "torch":
        pytest.skip("no native kernels here")
    # greedy on the torch path; the native path is fed the same tokens (teacher forcing), so each step compares the
    # two paths' logits on the same input
    T, steps = len(ids), {}
    for name, d in paths.items():
        assert d.cache.k[0].dtype == d.cache.v[0].dtype == torch.bfloat16
        logits = d.forward(StepBatch(tokens=torch.tensor(ids), positions=torch.arange(T),
                                     slots=torch.zeros(T, dtype=torch.int64), n_decode=0, decode_slots=[], decode_ctx=torch.zeros(0, dtype=torch.int64),
                                     chunks=[(0, T, 0, 0)], logit_rows=torch.tensor([T - 1])))
        steps[name] = [logits[-1]]
        for i, pos in enumerate(range(T, T + 8)):
            token = int(steps["torch"][i].argmax())
            logits = d.forward(StepBatch(tokens=torch.tensor([token]), positions=torch.tensor([pos]),
                                         slots=torch.zeros(1, dtype=torch.int64), n_decode=1, decode_slots=[0],
                                         decode_ctx=torch.tensor([pos + 1]), chunks=[], logit_rows=torch.tensor([0])))
            steps[name].append(logits[0])
    for i, (a, b) in enumerate(zip(steps["torch"], steps["native"])):
        # a few bfloat16 ulps of a logit (ulp 0.0625 at 8-16): the same numerics, rounded in another order
        diff = (a - b).abs().max()
        assert diff < 0.1 * a.std(), f"step {i}: the two paths' logits differ beyond bfloat16 rounding ({diff:.4f})"
        if int(a.argmax()) != int(b.argmax()):  # another greedy token only where the top two are closer than that
            top2 = a.topk(2).values
            assert top2[0] - top2[1] <= 2 * diff, f"step {i}: greedy tokens differ without a near-tie"
    k_torch, k_native = (paths[n].cache.k[5][0, :, :len(ids) + 8].float() for n in ("torch", "native"))
    assert torch.allclose(k_torch, k_native, rtol=2e-2, atol=2e-2)  # the same K up to bfloat16 rounding

    with CpuEngine(bf_dir, num_threads=1) as eng:
        assert eng.runtime["dtype"] == eng.runtime["kv_dtype"] == "bfloat16"
        assert "Paris" in tok.decode(_submit(eng, _prompt(tok, "The capital of France is"), 8).wait())


def test_context_logits_are_the_models_logits_at_every_prompt_position(engine: CpuEngine, engine_dir: Path, tok) -> None:
    """``on_context_logits`` (TensorRT-LLM's return_context_logits): one float32 row per prompt position, equal to
    transformers' logits of the same weights (float32), delivered before the request's tokens; a concurrent
    request without it gets none and the same greedy tokens as alone."""
    from transformers import AutoModelForCausalLM

    ids = _prompt(tok, "The quick brown fox jumps over the lazy dog because")
    got: list[torch.Tensor] = []
    order: list[str] = []
    c = Collector()

    def on_tokens(toks: list[int], fin: bool) -> None:
        order.append("tokens")
        c(toks, fin)

    def on_logits(t: torch.Tensor) -> None:
        order.append("logits")
        got.append(t)

    plain = _submit(engine, _prompt(tok, "def fibonacci(n):"), 4)
    engine.add_request(ids, max_new_tokens=2, on_tokens=on_tokens, on_error=c.on_error, on_context_logits=on_logits)
    toks = c.wait()
    logits = torch.cat(got)
    assert logits.dtype == torch.float32 and logits.shape == (len(ids), engine.vocab_size)
    assert order[0] == "logits" and "logits" not in order[order.index("tokens"):]
    model = AutoModelForCausalLM.from_pretrained(engine_dir, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0]
    assert torch.allclose(logits, ref, atol=2e-3, rtol=1e-3), (logits - ref).abs().max()
    assert int(logits[-1].argmax()) == toks[0]
    alone = _submit(engine, _prompt(tok, "def fibonacci(n):"), 4).wait()
    assert plain.wait() == alone


def test_concurrent_requests_share_forward_passes(engine: CpuEngine, tok) -> None:
    ids = _prompt(tok, "Once upon a time")
    solo = _submit(engine, ids, 16).wait()
    before = engine.stats()["forward_passes"]
    cols = [_submit(engine, ids[: 2 + i % 3] + ids, 16) for i in range(8)]
    outs = [c.wait() for c in cols]
    passes = engine.stats()["forward_passes"] - before
    assert all(len(o) == 16 for o in outs)
    assert passes <= 16 + 4, f"8 × 16 tokens took {passes} forward passes: requests are not batched"
    assert max(engine.stats()["batch_sizes"]) >= 8
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
    with pytest.raises(ValueError, match="min_tokens"):
        engine.add_request([1], max_new_tokens=1, min_tokens=-1, end_id=2, on_tokens=ok)
    assert engine.num_active == 0


def test_requests_beyond_the_kv_slots_wait_and_join(engine: CpuEngine, tok) -> None:
    """More requests than KV slots: the extra ones wait (FIFO) and join when a slot frees."""
    slots = engine.runtime["kv_slots"]
    assert slots == 8  # max_batch_size 8 (the recipe's 16384 KV tokens hold 16 sequences of 1024)
    ids = _prompt(tok, "Once upon a time")
    long = [_submit(engine, ids, 120) for _ in range(slots)]
    late = _submit(engine, ids, 8)
    assert engine.num_active == slots + 1
    time.sleep(0.5)
    assert late.calls == 0, "a request beyond the free slots must wait"
    outs = [c.wait() for c in long]
    assert late.wait() == outs[0][:8]  # same greedy path once it got a slot
    assert engine.num_active == 0


def test_stop_words_end_the_request_with_the_word(engine: CpuEngine, tok) -> None:
    ids = _prompt(tok, "The capital of France is")
    free = _submit(engine, ids, 24).wait()
    word = free[5:7]
    end = next(i for i in range(2, 8) if free[i - 2:i] == word)  # first place the word is generated
    got = _submit(engine, ids, 24, stop_words=[[10**6 - 1], word]).wait()
    assert got == free[:end]
    assert _submit(engine, ids, 24, stop_words=[free[:1]]).wait() == free[:1]


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


def test_mass_cancel_frees_every_slot_and_the_queue_limit_refuses_fast(engine: CpuEngine, tok) -> None:
    """200 requests (8 in KV slots, the rest queued) cancelled at once: the iteration stats are back to every block
    free, nothing active or queued, and the engine still answers. With ``max_queue_size`` 4, the 5th request beyond
    the slots is refused at once with upstream's message (docs/robustness.md)."""
    from pipeline.cpu_runtime.requests import QueueFullError

    ids = _prompt(tok, "Count to one hundred:")
    slots = engine.runtime["kv_slots"]
    cols = [Collector() for _ in range(200)]
    rids = [engine.add_request(ids, max_new_tokens=400, on_tokens=c, on_error=c.on_error) for c in cols]
    deadline = time.monotonic() + WAIT_S
    while engine.iteration_stats()["numActiveRequests"] < slots and time.monotonic() < deadline:
        time.sleep(0.01)
    st = engine.iteration_stats()
    assert st["numActiveRequests"] == slots and st["numQueuedRequests"] == 200 - slots, st
    assert st["kvCacheStats"]["freeNumBlocks"] == 0 and st["kvCacheStats"]["maxNumBlocks"] == slots, st
    for rid in rids:
        engine.cancel(rid)
    deadline = time.monotonic() + 10
    while engine.iteration_stats()["kvCacheStats"]["usedNumBlocks"] and time.monotonic() < deadline:
        time.sleep(0.01)
    st = {k: v for k, v in engine.iteration_stats().items() if k != "stepStats"}  # the step timeline: test_profile
    assert st == {
        "numActiveRequests": 0, "numQueuedRequests": 0, "maxNumActiveRequests": slots,
        "kvCacheStats": {"maxNumBlocks": slots, "freeNumBlocks": slots, "usedNumBlocks": 0, "tokensPerBlock": 1024}}
    assert not any(c.done.is_set() for c in cols)  # no callback for a cancelled request
    engine.max_queue_size = 4
    try:
        rids = [engine.add_request(ids, max_new_tokens=400, on_tokens=Collector()) for _ in range(slots)]
        deadline = time.monotonic() + WAIT_S
        while engine.iteration_stats()["numActiveRequests"] < slots and time.monotonic() < deadline:
            time.sleep(0.01)
        rids += [engine.add_request(ids, max_new_tokens=400, on_tokens=Collector()) for _ in range(4)]
        t0 = time.perf_counter()
        with pytest.raises(QueueFullError, match=r"^Maximum queue size of 4 has been reached, please try again later"):
            engine.add_request(ids, max_new_tokens=4, on_tokens=Collector())
        assert time.perf_counter() - t0 < 0.1
        for rid in rids:
            engine.cancel(rid)
    finally:
        engine.max_queue_size = 0
    assert len(_submit(engine, ids, 4).wait()) == 4  # the engine keeps serving
    assert engine.iteration_stats()["kvCacheStats"]["usedNumBlocks"] == 0


def test_shutdown_stops_threads_and_fails_inflight(engine_dir: Path) -> None:
    before = set(threading.enumerate())
    eng = CpuEngine(engine_dir, num_threads=1)
    assert eng.config["kind"] == "cpu" and eng.load_time_s > 0
    assert eng.runtime["runtime"] == "trtpipe-torch" and eng.runtime["dtype"] == "float32"
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


_OMP_PROBE = """
import json, os, sys, threading
import torch
from pipeline.cpu_runtime import engine as E

def sleeps_per_step(release):
    n = len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    torch.ones(1 << 22).sum()  # a parallel region on this thread: it now keeps a pool of n - 1 workers
    real = E.release_openmp_pool
    if not release:
        E.release_openmp_pool = lambda: False
    try:
        eng = E.CpuEngine(sys.argv[1], num_threads=n)
    finally:
        E.release_openmp_pool = real
    with eng:
        tid = next(t.native_id for t in threading.enumerate() if t.name == "cpu-engine")
        def switches():
            with open(f"/proc/self/task/{tid}/status") as f:
                return next(int(l.split()[1]) for l in f if l.startswith("voluntary_ctxt_switches"))
        def run(osl):
            done = threading.Event()
            eng.add_request(list(range(1000, 1032)), max_new_tokens=osl, min_tokens=osl, end_id=2,
                            on_tokens=lambda toks, fin: fin and done.set())
            assert done.wait(120)
        run(4)
        v, steps = switches(), eng.stats()["forward_passes"]
        run(24)
        return (switches() - v) / (eng.stats()["forward_passes"] - steps)

print(json.dumps({"kept": sleeps_per_step(False), "released": sleeps_per_step(True)}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not Path("/proc/self/task").is_dir(),
                    reason="needs 2+ cores and Linux /proc")
def test_engine_threads_spin_after_the_creating_thread_ran_openmp(engine_dir: Path) -> None:
    """A multi-threaded torch op on the thread that creates the engine leaves it an OpenMP pool; with that pool
    alive libgomp manages more threads than cores and the engine's scheduler sleeps at every barrier of a step. The
    engine releases the creating thread's pool (``release_openmp_pool``). Run in a fresh process (no other thread
    of this test session may hold a pool); the scheduler thread's voluntary context switches per step tell."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _OMP_PROBE, str(engine_dir)], capture_output=True, text=True,
                       timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    # kept: ~130 sleeps per SmolLM2 step on 2 cores (about one per parallel region); released: none
    assert got["kept"] > 20, got
    assert got["released"] < 3, got


@pytest.mark.slow
def test_throughput_1_vs_16_concurrent(tok) -> None:
    """ISL ~100, OSL 16: 1 and 16 concurrent requests each return exactly OSL tokens; prints the tokens/s of both
    (a figure, not a check: the speed-up is measured by benchmarks/bench_cpu.py, with OSL 200)."""
    eng = CpuEngine(cpu_fp8_build("build-fp8"), num_threads=2)  # the shipped recipe: max_batch_size 32
    try:
        ids = _prompt(tok, "The history of the city " * 20)[:100]

        def run(n: int, osl: int) -> float:
            t = time.perf_counter()
            cols = [_submit(eng, ids, osl, min_tokens=osl, end_id=END_ID) for _ in range(n)]
            lengths = [len(c.wait()) for c in cols]
            assert lengths == [osl] * n, lengths
            return sum(lengths) / (time.perf_counter() - t)

        run(1, 8)  # warm-up
        one, sixteen = run(1, 16), run(16, 16)
        print(f"\ncpu engine tokens/s: 1 concurrent {one:.1f}, 16 concurrent {sixteen:.1f}; load {eng.load_time_s:.1f}s")
    finally:
        eng.shutdown()


def test_kv_capacity_follows_the_recipe(engine_dir: Path) -> None:
    """max_tokens caps the slots; the RAM fraction bounds them; too little KV is refused in one line."""
    from pipeline.cpu_runtime.kv import kv_slots

    per_tok = 2 * 30 * 3 * 64 * 4  # SmolLM2 fp32 K+V bytes per token
    assert kv_slots(max_batch_size=32, max_seq_len=1024, bytes_per_token=per_tok, available_bytes=10 * 2**30,
                    max_tokens=16384, free_memory_fraction=0.9) == (16, 16384)
    assert kv_slots(max_batch_size=4, max_seq_len=1024, bytes_per_token=per_tok, available_bytes=10 * 2**30,
                    max_tokens=None, free_memory_fraction=0.9) == (4, 4096)
    budget = 3 * 1024 * per_tok  # RAM for exactly 3 sequences at fraction 1.0
    assert kv_slots(max_batch_size=32, max_seq_len=1024, bytes_per_token=per_tok, available_bytes=budget,
                    max_tokens=None, free_memory_fraction=1.0) == (3, 3072)
    with pytest.raises(ValueError, match="less than one max_seq_len 1024 sequence"):
        kv_slots(max_batch_size=32, max_seq_len=1024, bytes_per_token=per_tok, available_bytes=budget,
                 max_tokens=None, free_memory_fraction=0.3)
    with CpuEngine(engine_dir, num_threads=1, kv_max_tokens=2048) as eng:
        assert eng.runtime["kv_slots"] == 2 and eng.runtime["kv_tokens"] == 2048


def test_embedding_stays_file_backed_and_unread(engine_dir: Path) -> None:
    """The (tied) embedding is not copied into the engine's memory and its pages are not all faulted in: only the
    rows of looked-up tokens become resident. Measured in a fresh process (this one maps the file for other
    engines) from /proc/self/smaps: the Rss of the mappings of model.safetensors, before and after 1 lookup."""
    import subprocess
    import sys

    script = f"""
import re, sys, torch
from pathlib import Path
sys.path.insert(0, {str(REPO)!r})
from pipeline.cpu_runtime.model import Decoder, StepBatch
path = {str(engine_dir / "model.safetensors")!r}
def mapped_rss_kib():
    total, on = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            on = line.rstrip().endswith(path)
        elif on and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total
dec = Decoder(Path(path).parent, slots=1, slot_len=16, kernels="torch")
before = mapped_rss_kib()
ids = torch.tensor([1, 2, 3])
dec.forward(StepBatch(tokens=ids, positions=torch.arange(3), slots=torch.zeros(3, dtype=torch.int64), n_decode=0,
                      decode_slots=[], decode_ctx=torch.zeros(0, dtype=torch.int64), chunks=[(0, 3, 0, 0)],
                      logit_rows=torch.arange(3)))
print(before, mapped_rss_kib(), dec.embed.numel() * dec.embed.element_size() // 1024)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stderr[-2000:]
    before, after, embed_kib = map(int, r.stdout.split()[-3:])
    assert embed_kib > 100_000  # SmolLM2: 49,152 × 576 float32
    assert before < 0.02 * embed_kib, (before, embed_kib)
    # 3 rows of 2.25 KiB: a page or two, each fault mapping up to 64 KiB around it (the kernel's fault-around)
    assert after < before + 512, (before, after)
