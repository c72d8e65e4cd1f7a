"""``pipeline.serve`` / ``trtpipe serve`` against the real Triton 2.51 (nvidia-pytriton) on CPU.

Server tests start real ``tritonserver`` processes on ``tests/data/echo_repo`` (one decoupled
python-backend model) and, when it has been built, on the CPU deployment
``artifacts/smollm2_135m_cpu_fp8/triton_repo``. Every test checks that nothing is left behind:
no server or stub process, no ``/dev/shm`` region of the server's prefix. The mpirun command of a
multi-GPU launch is checked as a pure contract test.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import psutil
import pytest
from support import free_port, free_ports

from pipeline.core.errors import IncompatibleArtifactError, StageError, UserError
from pipeline.core.layout import BuildLayout
from pipeline.serve import compat, registry
from pipeline.serve import stage as srv
from pipeline.triton.process import shm_regions
from pipeline.triton.server import (
    TritonInstall,
    TritonServer,
    cpu_triton,
    triton_command,
)

REPO = Path(__file__).resolve().parents[1]
ECHO_REPO = REPO / "tests" / "data" / "echo_repo"
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")


def _ports() -> dict[str, int]:
    http, grpc, metrics = free_ports(3)
    return {"http_port": http, "grpc_port": grpc, "metrics_port": metrics}


def _assert_gone(pids: list[int], shm_prefix: str, within_s: float = 10) -> None:
    deadline = time.monotonic() + within_s
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"processes left behind: {[p for p in pids if psutil.pid_exists(p)]}"
        time.sleep(0.1)
    assert shm_regions(shm_prefix) == [], f"/dev/shm regions left behind: {shm_regions(shm_prefix)}"


def _stream(client, model: str, inputs, timeout: float = 60.0) -> list:
    """Send one request on a gRPC stream; the list of non-final responses."""
    q: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        out = []
        while True:
            result, error = q.get(timeout=timeout)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                return out
            out.append(result)
    finally:
        client.stop_stream()


# ---------------------------------------------------------------------- contract tests (no server)
def test_mpirun_command_matches_launch_triton_server_contract():
    cmd = triton_command("/opt/tritonserver/bin/tritonserver", "/models/repo", world_size=2, shm_prefix="prefix",
                         http_port=8000, grpc_port=8001, metrics_port=8002, exit_timeout_s=5)
    assert cmd[:2] == ["mpirun", "--allow-run-as-root"]
    contexts, cur = [], []
    for tok in cmd[2:]:
        if tok == ":":
            contexts.append(cur)
            cur = []
        else:
            cur.append(tok)
    contexts.append(cur)
    assert len(contexts) == 2
    for rank, ctx in enumerate(contexts):
        assert ctx[:3] == ["-n", "1", "/opt/tritonserver/bin/tritonserver"]
        for flag in ("--model-repository=/models/repo", "--grpc-port=8001", "--http-port=8000", "--metrics-port=8002",
                     "--disable-auto-complete-config", f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
                     "--exit-timeout-secs=5"):
            assert flag in ctx, (rank, flag)
        explicit = "--model-control-mode=explicit" in ctx and "--load-model=tensorrt_llm" in ctx
        assert explicit == (rank != 0), rank  # only ranks != 0 load just the tensorrt_llm model


def test_single_rank_command_has_no_mpirun_and_binds_host():
    cmd = triton_command("tritonserver", "/r", host="0.0.0.0", backend_dir=Path("/b"), cache_dir=Path("/c"))
    assert cmd[0] == "tritonserver" and ":" not in cmd and "--model-control-mode=explicit" not in cmd
    assert {"--grpc-address=0.0.0.0", "--http-address=0.0.0.0", "--backend-directory=/b", "--cache-directory=/c"} <= set(cmd)


def test_cpu_triton_prepares_backend_dir_once(tmp_path):
    a = cpu_triton(cache_root=tmp_path)
    pydir = a.backend_dir / "python"
    assert {"libtriton_python.so", "triton_python_backend_stub", "triton_python_backend_utils.py"} <= {p.name for p in pydir.iterdir()}
    mtime = (pydir / "triton_python_backend_stub").stat().st_mtime_ns
    b = cpu_triton(cache_root=tmp_path)
    assert (b.backend_dir / "python" / "triton_python_backend_stub").stat().st_mtime_ns == mtime
    assert a.env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert "nvidia_pytriton.libs" in a.env["LD_LIBRARY_PATH"]


def test_resolve_target(tmp_path):
    with pytest.raises(UserError, match="run `trtpipe build RECIPE` first"):
        compat.ServeTarget.resolve(None, root=tmp_path / "artifacts")
    build = tmp_path / "artifacts" / "b"
    (build / "engine").mkdir(parents=True)
    with pytest.raises(UserError, match="no model repository at .*triton_repo: run `trtpipe build"):
        compat.ServeTarget.resolve(build)
    shutil.copytree(ECHO_REPO, build / "triton_repo")
    assert compat.ServeTarget.resolve(build) == compat.ServeTarget(build / "triton_repo", BuildLayout(build))
    assert compat.ServeTarget.resolve(ECHO_REPO) == compat.ServeTarget(ECHO_REPO, None)
    with pytest.raises(UserError, match="neither a build directory nor a Triton model repository"):
        compat.ServeTarget.resolve(tmp_path)
    recipe = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
    with pytest.raises(UserError, match="artifacts/smollm2_135m_cpu_fp8/triton_repo"):
        compat.ServeTarget.resolve(recipe, root=tmp_path / "artifacts")


def _trtllm_build(tmp_path: Path) -> Path:
    build = tmp_path / "b"
    (build / "triton_repo" / "tensorrt_llm").mkdir(parents=True)
    (build / "triton_repo" / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "tensorrtllm"\n')
    (build / "engine").mkdir()
    (build / "engine" / "manifest.json").write_text(json.dumps({"stage": "engine", "cache_key": "k", "engine_kind": "tensorrt", "status": "built", "world_size": 2}))
    return build


def test_check_runtime_refuses_gpu_repo_on_cpu_triton(tmp_path):
    build = _trtllm_build(tmp_path)
    with pytest.raises(IncompatibleArtifactError, match="tensorrtllm backend"):
        compat.check_runtime(compat.ServeTarget.resolve(build), TritonInstall(kind="cpu", binary=Path("tritonserver")))
    assert compat.ServeTarget.resolve(build).world_size == 2


def test_check_runtime_refuses_engine_mismatch_on_gpu(tmp_path, monkeypatch):
    build = _trtllm_build(tmp_path)
    seen = {}

    def check(manifest, runtime, *, stage_dir=None):
        seen.update(manifest=manifest, stage_dir=stage_dir)
        return ["engine built with TensorRT-LLM 1.2.1, this runtime has 1.1.0"] if runtime["tensorrt_llm"] != "1.2.1" else []

    fake = types.SimpleNamespace(check_engine_compatible=check, runtime_facts=lambda: {"tensorrt_llm": "1.1.0"})
    monkeypatch.setitem(sys.modules, "pipeline.trtllm.runtime", fake)
    gpu = TritonInstall(kind="gpu", binary=Path("/opt/tritonserver/bin/tritonserver"))
    with pytest.raises(IncompatibleArtifactError, match="does not match this runtime: engine built with TensorRT-LLM 1.2.1"):
        compat.check_runtime(compat.ServeTarget.resolve(build), gpu)
    # the engine files' hashes are checked once, for every engine kind, by compat.check_files (before this)
    assert seen["stage_dir"] is None and seen["manifest"]["world_size"] == 2
    fake.runtime_facts = lambda: {"tensorrt_llm": "1.2.1"}
    assert compat.check_runtime(compat.ServeTarget.resolve(build), gpu) == []
    # a container whose TensorRT-LLM is not the release matrix's target is named, with the image to use
    fake.runtime_facts = lambda: {"tensorrt_llm": "1.1.0"}
    (build / "engine" / "manifest.json").unlink()
    (warning,) = compat.check_runtime(compat.ServeTarget.resolve(build), gpu)
    from pipeline.trtllm.release import default_release
    assert "TensorRT-LLM 1.1.0" in warning and default_release().image in warning


def test_non_loopback_host_needs_an_admin_key():
    with pytest.raises(UserError, match="--host 0.0.0.0 exposes Triton's administrative APIs .* set --admin-key"):
        srv.ServeOptions(host="0.0.0.0").restricted_api_args()
    assert srv.ServeOptions(host="127.0.0.1").restricted_api_args() == []
    args = srv.ServeOptions(host="0.0.0.0", admin_key="s3cret").restricted_api_args()
    assert args == [f"--http-restricted-api=model-repository,shared-memory,logging,trace:{srv.ADMIN_HEADER}=s3cret",
                    f"--grpc-restricted-protocol=model-repository,shared-memory,logging,trace:{srv.ADMIN_HEADER}=s3cret"]


# ---------------------------------------------------------------------- real Triton
@pytest.mark.triton
def test_exposed_server_refuses_admin_apis_without_the_key(tmp_path):
    """Bound to all interfaces: a shared-memory registration without the key is refused, with it accepted;
    inference needs no key."""
    import tritonclient.grpc as grpcclient
    import tritonclient.utils.shared_memory as shm
    from tritonclient.utils import InferenceServerException

    options = srv.ServeOptions(host="0.0.0.0", admin_key="s3cret", http_port=None, grpc_port=None, metrics_port=None,
                               log_file=tmp_path / "triton.log", ready_timeout_s=60)
    region = shm.create_shared_memory_region("trtpipe_test_region", f"/trtpipe_test_{os.getpid()}", 64)
    try:
        with srv.run(ECHO_REPO, options) as handle:
            client = grpcclient.InferenceServerClient(handle.grpc_url)
            with pytest.raises(InferenceServerException, match="protocol is restricted"):
                client.register_system_shared_memory("r", f"/trtpipe_test_{os.getpid()}", 64)
            with pytest.raises(InferenceServerException, match="protocol is restricted"):  # a wrong key
                client.register_system_shared_memory("r", f"/trtpipe_test_{os.getpid()}", 64,
                                                     headers={srv.GRPC_ADMIN_HEADER: "guess"})
            key = {srv.GRPC_ADMIN_HEADER: "s3cret"}
            client.register_system_shared_memory("r", f"/trtpipe_test_{os.getpid()}", 64, headers=key)
            assert client.get_system_shared_memory_status(headers=key, as_json=True)["regions"]["r"]["byte_size"] == "64"
            client.unregister_system_shared_memory("r", headers=key)
            x = grpcclient.InferInput("IN", [2], "INT32")
            x.set_data_from_numpy(np.array([5, 6], dtype=np.int32))
            assert [int(r.as_numpy("OUT")[0]) for r in _stream(client, "echo", [x])] == [5, 6]
            client.close()
    finally:
        shm.destroy_shared_memory_region(region)


@pytest.mark.triton
def test_echo_stream_metadata_and_clean_stop(tmp_path):
    import tritonclient.grpc as grpcclient

    server = TritonServer(ECHO_REPO, log_file=tmp_path / "triton.log", **_ports())
    with server:
        assert server.ready_s is not None
        pids = [server.pid, *(c.pid for c in psutil.Process(server.pid).children(recursive=True))]
        assert len(pids) >= 2, "expected a python stub process"
        assert len(shm_regions(server.shm_prefix)) >= 1
        rss_mib = server.rss_bytes() / 2**20
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("echo")
        meta = client.get_model_metadata("echo", as_json=True)
        assert [i["name"] for i in meta["inputs"]] == ["IN"] and [o["name"] for o in meta["outputs"]] == ["OUT"]
        x = grpcclient.InferInput("IN", [4], "INT32")
        x.set_data_from_numpy(np.array([5, 6, 7, 8], dtype=np.int32))
        got = [int(r.as_numpy("OUT")[0]) for r in _stream(client, "echo", [x])]
        assert got == [5, 6, 7, 8]
        client.close()
        t_stop = time.monotonic()
    stop_s = time.monotonic() - t_stop
    assert server.proc.returncode == 0, server.log_excerpt()
    _assert_gone(pids, server.shm_prefix)
    print(f"\necho repo: ready {server.ready_s:.2f} s, RSS {rss_mib:.0f} MiB, stop {stop_s:.2f} s")


@pytest.mark.triton
def test_malformed_config_fails_fast_with_log_tail(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ECHO_REPO, repo)
    cfg = repo / "echo" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("TYPE_INT32", "TYPE_INT33", 1))
    server = TritonServer(repo, log_file=tmp_path / "triton.log", **_ports())
    with pytest.raises(StageError) as exc:
        with server:
            pass
    msg = str(exc.value)
    # fails fast: the server's own exit is reported, not the readiness bound running out
    assert "exited with status" in msg and "not ready after" not in msg
    assert "TYPE_INT33" in msg and "last lines of" in msg
    assert "Failed to initialize NVML" not in msg  # harmless CPU lines are filtered
    _assert_gone([server.pid], server.shm_prefix)


@pytest.mark.triton
def test_model_stuck_loading_is_bounded_and_killed(tmp_path):
    """A model that never finishes loading (like a stub that cannot start) hits the readiness bound."""
    repo = tmp_path / "repo"
    shutil.copytree(ECHO_REPO, repo)
    model = repo / "echo" / "1" / "model.py"
    model.write_text(model.read_text().replace(
        "    def execute(self, requests):", "    def initialize(self, args):\n        import time\n        time.sleep(3600)\n\n    def execute(self, requests):"))
    server = TritonServer(repo, log_file=tmp_path / "triton.log", **_ports())
    server.start()
    children: list[int] = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not children:
        children = [c.pid for c in psutil.Process(server.pid).children(recursive=True)]
        time.sleep(0.2)
    assert children, "the stub should be running"
    with pytest.raises(StageError, match=r"not ready after 4 s; not ready: echo \(LOADING\)"):
        server.wait_ready(4)
    _assert_gone([server.pid, *children], server.shm_prefix)


@pytest.mark.triton
def test_server_dies_with_a_killed_parent(tmp_path):
    """A process that started a server and is SIGKILLed leaves no orphaned server or stub behind."""
    p = _ports()
    code = (
        "import sys, time; from pathlib import Path; from pipeline.triton.server import TritonServer\n"
        f"s = TritonServer(Path({str(ECHO_REPO)!r}), log_file=Path({str(tmp_path / 't.log')!r}), "
        f"http_port={p['http_port']}, grpc_port={p['grpc_port']}, metrics_port={p['metrics_port']})\n"
        "s.start(); s.wait_ready(60); print(s.pid, s.shm_prefix, flush=True); time.sleep(120)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid_s, prefix = parent.stdout.readline().split()  # type: ignore[union-attr]
        pids = [int(pid_s), *(c.pid for c in psutil.Process(int(pid_s)).children(recursive=True))]
    finally:
        parent.kill()
        parent.wait()
    _assert_gone(pids, prefix)


@pytest.mark.triton
def test_port_in_use_is_one_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        ports = {**_ports(), "grpc_port": port}
        with pytest.raises(UserError, match=f"port {port} \\(grpc\\) is already in use"):
            TritonServer(ECHO_REPO, log_file=tmp_path / "t.log", **ports).start()
        r = subprocess.run([TRTPIPE, "serve", str(ECHO_REPO), "--grpc-port", str(port), "--http-port", str(free_port()),
                            "--metrics-port", str(free_port())], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert f"port {port} (grpc) is already in use" in r.stderr and "Traceback" not in r.stderr


def test_cli_without_build_says_build_first(tmp_path):
    r = subprocess.run([TRTPIPE, "serve"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "run `trtpipe build RECIPE` first" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_cli_status_handles_stale_state_file(tmp_path):
    state = tmp_path / "artifacts" / "serve.json"
    state.parent.mkdir()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    state.write_text(json.dumps({"pid": dead.pid, "create_time": 0, "grpc_url": "127.0.0.1:1", "shm_prefix": "trtpipe_none_"}))
    r = subprocess.run([TRTPIPE, "serve", "--status"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "stale" in r.stdout and not state.exists()


@pytest.mark.triton
def test_cli_detach_status_stop_round_trip(tmp_path):
    p = _ports()
    args = ["--http-port", str(p["http_port"]), "--grpc-port", str(p["grpc_port"]), "--metrics-port", str(p["metrics_port"]),
            "--log-file", str(tmp_path / "serve.log")]  # not next to the shared test repository
    r = subprocess.run([TRTPIPE, "serve", str(ECHO_REPO), "--detach", "--timeout", "60", *args],
                       cwd=tmp_path, capture_output=True, text=True, timeout=90)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "ready in" in r.stdout and f"127.0.0.1:{p['grpc_port']}" in r.stdout
    state = json.loads((tmp_path / "artifacts" / "serve.json").read_text())
    assert state["grpc_port"] == p["grpc_port"] and psutil.pid_exists(state["pid"])
    pids = [state["pid"], *(c.pid for c in psutil.Process(state["pid"]).children(recursive=True))]
    try:
        r = subprocess.run([TRTPIPE, "serve", "--status"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and "ready" in r.stdout and f"127.0.0.1:{p['grpc_port']}" in r.stdout, r.stdout
        r = subprocess.run([TRTPIPE, "serve", str(ECHO_REPO), "--detach", *args], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "already running" in r.stderr
    finally:
        r = subprocess.run([TRTPIPE, "serve", "--stop"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"stopped pid {state['pid']}" in r.stdout
    _assert_gone(pids, state["shm_prefix"])
    assert not (tmp_path / "artifacts" / "serve.json").exists()
    r = subprocess.run([TRTPIPE, "serve", "--status"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "not running" in r.stdout


@pytest.mark.triton
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_cli_foreground_stops_cleanly_on_signal(tmp_path, sig):
    p = _ports()
    cmd = [TRTPIPE, "serve", str(ECHO_REPO), "--http-port", str(p["http_port"]), "--grpc-port", str(p["grpc_port"]),
           "--metrics-port", str(p["metrics_port"]), "--log-file", str(tmp_path / "serve.log")]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        lines = []
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if line.startswith("ready in"):
                break
        assert any(ln.startswith("ready in") for ln in lines), "".join(lines)
        server = [c for c in psutil.Process(proc.pid).children(recursive=True)]
        assert server, "no tritonserver child"
        proc.send_signal(sig)
        try:
            out = proc.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:  # say where it hangs: faulthandler prints every thread on SIGABRT
            proc.send_signal(signal.SIGABRT)
            pytest.fail(f"serve did not stop within 30 s of signal {sig}; its threads:\n{proc.communicate(timeout=20)[0]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out
    assert "stopped (exit status 0)" in out
    _assert_gone([s.pid for s in server], "trtpipe_never_")


# ---------------------------------------------------------------------- the real CPU deployment
@pytest.mark.triton
def test_cpu_deployment_health_metadata_and_streams(tmp_path, cpu_build):
    """The built SmolLM2 CPU repository: health, metadata, one stream via ensemble, one via tensorrt_llm."""
    import tritonclient.grpc as grpcclient

    repo = compat.ServeTarget.resolve(cpu_build).repo
    with TritonServer(repo, log_file=tmp_path / "triton.log", ready_timeout_s=240, **_ports()) as server:
        rss_mib = server.rss_bytes() / 2**20
        pids = [server.pid, *(c.pid for c in psutil.Process(server.pid).children(recursive=True))]
        client = grpcclient.InferenceServerClient(server.grpc_url)
        assert client.is_server_ready()
        for model in ("ensemble", "preprocessing", "tensorrt_llm", "postprocessing"):
            assert client.is_model_ready(model), model
        meta = client.get_model_metadata("ensemble", as_json=True)
        assert {"text_input", "max_tokens"} <= {i["name"] for i in meta["inputs"]}
        assert "text_output" in {o["name"] for o in meta["outputs"]}

        def tensor(name, value, dtype):
            t = grpcclient.InferInput(name, list(value.shape), dtype)
            t.set_data_from_numpy(value)
            return t

        text = _stream(client, "ensemble", [
            tensor("text_input", np.array([["The capital of France is"]], dtype=object), "BYTES"),
            tensor("max_tokens", np.array([[8]], dtype=np.int32), "INT32"),
            tensor("stream", np.array([[True]]), "BOOL"),
        ])
        assert len(text) >= 2, "expected several streamed responses"
        assert "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for r in text).strip()

        ids = np.array([[1, 504, 3458, 282, 4649, 314]], dtype=np.int32)
        toks = _stream(client, "tensorrt_llm", [
            tensor("input_ids", ids, "INT32"),
            tensor("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32), "INT32"),
            tensor("request_output_len", np.array([[6]], dtype=np.int32), "INT32"),
            tensor("streaming", np.array([[True]]), "BOOL"),
        ])
        assert len(toks) >= 2 and all(r.as_numpy("output_ids").size >= 1 for r in toks)
        client.close()
    _assert_gone(pids, server.shm_prefix)
    print(f"\nCPU repo: ready {server.ready_s:.1f} s, RSS {rss_mib:.0f} MiB")


def test_bench_takes_the_detached_servers_build_not_the_last_one_built(tmp_path: Path) -> None:
    """`trtpipe serve A --detach` after building B: the server at A's URL serves A, so bench's tokenizer and provenance
    come from A (registry.detached_build), for its gRPC or HTTP URL spelled either way; another URL or a dead server: None."""
    build = tmp_path / "served-build"
    build.mkdir()
    me = psutil.Process()
    state = {"pid": me.pid, "create_time": me.create_time(), "grpc_url": "localhost:18001", "http_url": "localhost:18000",
             "build_dir": str(build)}
    registry.state_path(tmp_path).write_text(json.dumps(state))
    for url in ("localhost:18001", "127.0.0.1:18001", "http://localhost:18000", "http://127.0.0.1:18000/"):
        assert registry.detached_build(url, tmp_path) == build, url
    for url in ("localhost:8001", "otherhost:18001", "http://localhost:8000", "not a url"):
        assert registry.detached_build(url, tmp_path) is None, url
    registry.state_path(tmp_path).write_text(json.dumps({**state, "create_time": me.create_time() - 100}))  # PID reused
    assert registry.detached_build("localhost:18001", tmp_path) is None
    registry.state_path(tmp_path).write_text(json.dumps({**state, "build_dir": str(tmp_path / "gone")}))
    assert registry.detached_build("localhost:18001", tmp_path) is None
    registry.state_path(tmp_path).unlink()
    assert registry.detached_build("localhost:18001", tmp_path) is None


def test_old_server_logs_are_pruned_but_not_one_a_running_server_writes(tmp_path):
    """Free-port servers (tune, eval, bench_cpu.py) leave one log per port: a server start keeps the newest
    SERVER_LOGS_KEPT, and never removes a log that a live process named tritonserver holds open."""
    layout = BuildLayout(tmp_path)
    logs = [layout.server_log(40000 + i) for i in range(12)]
    for i, p in enumerate(logs):  # logs[0] oldest
        p.write_text(f"log {i}\n")
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
    other = tmp_path / "triton_server-notes.log"  # not a server log name: never touched
    other.write_text("mine\n")
    fake_server = tmp_path / "bin" / "tritonserver"  # a long-running server: its log is the oldest
    fake_server.parent.mkdir()
    shutil.copy(shutil.which("sleep"), fake_server)
    with open(logs[0], "ab") as out:
        proc = subprocess.Popen([str(fake_server), "60"], stdout=out)
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(proc.pid).name() != "tritonserver" and time.monotonic() < deadline:
            time.sleep(0.01)  # until the exec
        removed = srv.prune_server_logs(layout)
    finally:
        proc.kill()
        proc.wait()
    kept = sorted(p for p in logs if p.exists())
    assert kept == sorted([logs[0], *logs[-srv.SERVER_LOGS_KEPT:]])
    assert sorted(removed) == sorted(logs[1:12 - srv.SERVER_LOGS_KEPT])
    assert other.exists()
    assert srv.prune_server_logs(layout) == [logs[0]]  # no longer held: now the oldest beyond the newest 8 goes
