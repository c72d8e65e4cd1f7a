"""``serving.frontend: trtllm-serve`` on the cpu target: trtpipe's CPU stand-in for trtllm-serve
(pipeline/cpu_runtime/openai/, an OpenAI-compatible server over the CPU engine's LLM facade) run for real by
``trtpipe serve`` with Triton's lifecycle: ``--print-command`` shows the line that runs, ``--detach`` waits for
``/health``, ``trtpipe bench --api openai`` finds the served build and gets exact OSL, a client that goes away frees
its engine slot, ``--status`` / ``--stop``. On a GPU target the real ``trtllm-serve`` line is unchanged.

One build is shared by the module (the llmapi recipe with ``--set serving.frontend=trtllm-serve`` and one engine slot,
``build.max_batch_size=1``, so that a request that is not aborted would block the next one), its engine and repository
stages run on the cached FP8 fixture checkpoint as in tests/test_llmapi_cpu.py.
"""

from __future__ import annotations

import http.client
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest
from support import free_port, quantized_stage

from pipeline.core import artifacts
from pipeline.core.layout import BuildLayout
from pipeline.engine import stage as engine_stage
from pipeline.recipe import load_recipe
from pipeline.recipe.load import dump_recipe
from pipeline.triton_repo import stage as triton_repo
from pipeline.trtllm import trtllm_serve

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(os.environ.get("TRTPIPE_CACHE_DIR", REPO / ".trtpipe-cache")) / "cpu-engine-fixtures"
RECIPE = REPO / "recipes" / "smollm2_135m_cpu_llmapi.yaml"
GPU_RECIPE = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
OSL = 24


def trtpipe(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([TRTPIPE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


@pytest.fixture(scope="module")
def build() -> Path:
    q = quantized_stage(FIXTURES, "fp8", kv_cache_dtype="fp8")
    recipe = load_recipe(RECIPE, ["serving.frontend=trtllm-serve", "build.max_batch_size=1"])
    layout = BuildLayout(FIXTURES / "build-fp8-trtllm-serve")
    e = engine_stage.run(recipe, layout, quantized=q)
    triton_repo.run(recipe, layout, quantized=q, engine=e)
    artifacts.write_atomic(layout.recipe_file, dump_recipe(recipe))  # as `trtpipe build` does
    return layout.root


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _post(port: int, path: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _sse(port: int, path: str, body: dict) -> list[dict | str]:
    """The events of a streamed request (``"[DONE]"`` as the string)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        lines = [ln.decode().strip() for ln in r if ln.startswith(b"data:")]
    return [ln[5:].strip() if ln.endswith("[DONE]") else json.loads(ln[5:]) for ln in lines]


def test_print_command_is_the_cpu_stand_in_with_trtllm_serves_flags(build, tmp_path):
    res = trtpipe("serve", str(build), "--print-command", "--http-port", "9123", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    argv = shlex.split(res.stdout.strip())
    assert argv[:3] == [sys.executable, "-m", "pipeline.cpu_runtime.openai"]
    engine = (build / "engine").resolve()
    assert argv[3] == str(engine) and argv[argv.index("--port") + 1] == "9123"
    assert argv[argv.index("--extra_llm_api_options") + 1] == str(engine / "llm_api_config.yaml")
    assert trtllm_serve.argv_problems(trtllm_serve.serve_flags(argv)) == []  # the contract's trtllm-serve flags only
    helptext = subprocess.run([*argv[:3], "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "NOT TensorRT-LLM" in helptext and "--extra_llm_api_options" in helptext


def test_detach_health_bench_exact_osl_cancel_status_stop(build, tmp_path):
    port = free_port()
    printed = trtpipe("serve", str(build), "--print-command", "--http-port", str(port), cwd=tmp_path).stdout
    up = trtpipe("serve", str(build), "--detach", "--http-port", str(port), "--timeout", "300", cwd=tmp_path)
    assert up.returncode == 0, up.stdout + up.stderr
    state = json.loads((tmp_path / "artifacts" / "serve.json").read_text())
    pids = [p.pid for p in [psutil.Process(state["pid"]), *psutil.Process(state["pid"]).children(recursive=True)]]
    try:
        assert "ready in" in up.stdout and f"http://127.0.0.1:{port}/v1" in up.stdout
        assert state["frontend"] == "trtllm-serve" and state["command"] == shlex.split(printed)  # what ran = what printed
        assert _get(f"http://127.0.0.1:{port}/health")[0] == 200
        assert [m["id"] for m in json.loads(_get(f"http://127.0.0.1:{port}/v1/models")[1])["data"]] == ["engine"]
        one = _post(port, "/v1/completions", {"model": "engine", "prompt": "Hello", "max_tokens": 5, "min_tokens": 5,
                                              "ignore_eos": True, "temperature": 0, "seed": 1})
        assert one["usage"]["completion_tokens"] == 5 and one["choices"][0]["finish_reason"] == "length"
        events = _sse(port, "/v1/chat/completions", {
            "model": "engine", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "min_tokens": 6,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
        assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"] == {"role": "assistant"}
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6

        out = tmp_path / "bench"
        bench = trtpipe("bench", "--api", "openai", "--url", f"http://127.0.0.1:{port}/v1", "--isl", "32", "--osl", str(OSL),
                        "--concurrency", "4", "--num-requests", "8", "--warmup", "1", "--out", str(out), cwd=tmp_path)
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        doc = json.loads((out / "bench.json").read_text())
        assert doc["config"]["build_dir"] == str(build.resolve())  # found through the detached server's record
        measured = [r for r in doc["requests"] if not r["warmup"]]
        assert len(measured) == 8 and all(r["error"] is None for r in measured)
        assert {r["output_tokens"] for r in measured} == {OSL} and {r["server_tokens"] for r in measured} == {OSL}

        # a streaming client that goes away: its request is aborted and the single engine slot is free again
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"model": "engine", "prompt": "Count: 1, 2, 3,", "max_tokens": 900,
                                                           "min_tokens": 900, "ignore_eos": True, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        got = 0
        while got < 3:
            got += resp.readline().startswith(b"data:")
        conn.sock.close()
        conn.close()
        follower = _post(port, "/v1/completions", {"model": "engine", "prompt": "Hi", "max_tokens": 4, "min_tokens": 4,
                                                   "ignore_eos": True}, timeout=60)
        assert follower["usage"]["completion_tokens"] == 4
        # no clock: the one slot was given back because the abandoned request was aborted (a finished one is not)
        assert "aborted" in Path(state["log_file"]).read_text()

        status = trtpipe("serve", "--status", cwd=tmp_path)
        assert status.returncode == 0 and "ready" in status.stdout and f"http://127.0.0.1:{port}/health" in status.stdout
    finally:
        down = trtpipe("serve", "--stop", cwd=tmp_path, timeout=120)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    for p in alive:  # what --stop left running: stopped here, and the test fails
        psutil.Process(p).kill()
    assert down.returncode == 0 and f"stopped pid {state['pid']}" in down.stdout, down.stdout + down.stderr
    assert not alive
    assert not (tmp_path / "artifacts" / "serve.json").exists()
    gone = trtpipe("serve", "--status", cwd=tmp_path)
    assert gone.returncode == 1 and "not running" in gone.stdout


def test_readiness_timeout_is_one_line_and_stops_the_server(build, tmp_path):
    port = free_port()
    res = trtpipe("serve", str(build), "--detach", "--http-port", str(port), "--timeout", "0.5", cwd=tmp_path)
    err = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(err) == 1, res.stdout + res.stderr
    assert f"http://127.0.0.1:{port}/health" in err[0] and f"trtllm_serve-{port}.log" in err[0]
    assert not (tmp_path / "artifacts" / "serve.json").exists()
    time.sleep(0.5)
    left = [p for p in psutil.process_iter(["cmdline"]) if "pipeline.cpu_runtime.openai" in (p.info["cmdline"] or [])
            and str(port) in (p.info["cmdline"] or [])]
    for p in left:  # a server the command failed to stop: stopped here, and the test fails
        p.kill()
    assert not left


def test_bench_finds_a_detached_trtllm_serve_build_at_the_openai_url(tmp_path, monkeypatch):
    from pipeline.bench.target import detached_trtllm_serve_build
    from pipeline.serve import registry

    monkeypatch.chdir(tmp_path)
    served = tmp_path / "served"
    served.mkdir()
    me = psutil.Process()
    state = {"frontend": "trtllm-serve", "pid": me.pid, "create_time": me.create_time(), "grpc_url": None,
             "http_url": "127.0.0.1:8000", "openai_url": "http://127.0.0.1:8000/v1", "build_dir": str(served)}
    registry.state_path().parent.mkdir()
    registry.state_path().write_text(json.dumps(state))
    assert detached_trtllm_serve_build("openai", None).root == served  # no --url: the OpenAI default, :8000/v1
    assert detached_trtllm_serve_build("openai", "http://localhost:8000").root == served
    assert detached_trtllm_serve_build("openai", "http://localhost:9000/v1") is None
    assert detached_trtllm_serve_build("grpc", None) is None
    registry.state_path().write_text(json.dumps({**state, "frontend": "triton"}))
    assert detached_trtllm_serve_build("openai", None) is None


def test_gpu_recipe_still_prints_the_real_trtllm_serve_line(tmp_path):
    out = tmp_path / "b"
    res = trtpipe("build", str(GPU_RECIPE), "--dry-run", "--out", str(out), "--set", "serving.frontend=trtllm-serve", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    line = trtpipe("serve", str(out), "--print-command", cwd=tmp_path).stdout.strip()
    options = (out / "engine" / "trtllm_serve_options.yaml").resolve()
    assert line.startswith(f"trtllm-serve {(out / 'quantize' / 'hf_ckpt').resolve()} ") and "--backend pytorch" in line
    assert line.endswith(f"--extra_llm_api_options {options}") and "cpu_runtime.openai" not in line
    res = trtpipe("serve", str(out), "--detach", cwd=tmp_path)  # detaching is supported; the binary is not here
    assert res.returncode == 3 and "trtllm-serve is not installed here" in res.stderr


def test_health_is_the_facades_public_call_and_goes_503_after_shutdown(engine_dir):
    """``LLM.health()`` on a real CPU engine: ok with no reason while it serves, then not ok with a one-line reason
    once shut down; the stand-in's ``/health`` answers from it (200, then 503 with upstream's message)."""
    from fastapi.testclient import TestClient

    from pipeline.cpu_runtime.llm import LLM
    from pipeline.cpu_runtime.openai.routes import create_app

    llm = LLM(str(engine_dir))
    try:
        with TestClient(create_app(llm, "m", str(engine_dir))) as client:
            assert tuple(llm.health()) == (True, "")
            assert client.get("/health").status_code == 200
            llm.shutdown()
            ok, reason = llm.health()
            assert not ok and "shut down" in reason and "\n" not in reason
            r = client.get("/health")
            assert r.status_code == 503 and "LLM is unavailable" in r.text
    finally:
        llm.shutdown()
