"""One server-process base (issue #45 item 2): tritonserver and trtllm-serve share start / readiness / stop / logs
(pipeline/triton/server_process.py); here the trtllm-serve side runs real child processes (a few lines of Python
that serve ``/health``), no model."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from pipeline.core.errors import StageError
from pipeline.serve.trtllm_process import TrtllmServeProcess
from pipeline.triton.process import pick_free_port
from pipeline.triton.server import TritonServer
from pipeline.triton.server_process import ServerProcess

#: a server that answers GET /health with 200 once it listens
HEALTH = ("import http.server, sys\n"
          "class H(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
          "    def log_message(self, *a): pass\n"
          "print('listening', flush=True)\n"
          "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def test_both_servers_share_the_one_lifecycle():
    for cls in (TritonServer, TrtllmServeProcess):
        assert issubclass(cls, ServerProcess)
        for name in ("start", "wait_ready", "stop", "detach", "wait", "rss_bytes", "__enter__", "__exit__"):
            assert getattr(cls, name) is getattr(ServerProcess, name), (cls.__name__, name)


def test_start_ready_stop_of_a_real_child(tmp_path: Path):
    port = pick_free_port()
    proc = TrtllmServeProcess([sys.executable, "-c", HEALTH, str(port)], host="127.0.0.1", port=port,
                              log_file=tmp_path / "serve.log")
    with proc:
        assert proc.ready_s is not None and proc.ready_s >= 0 and proc.is_ready()
        assert proc.rss_bytes() > 0
        pid = proc.pid
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert proc.stop() is not None  # idempotent: the status again


def test_an_exit_before_ready_is_one_line_with_the_last_log_line(tmp_path: Path):
    port = pick_free_port()
    proc = TrtllmServeProcess([sys.executable, "-c", "print('model not found: /nowhere'); raise SystemExit(3)"],
                              host="127.0.0.1", port=port, log_file=tmp_path / "serve.log").start()
    with pytest.raises(StageError, match=r"exited with status 3 before .*/health answered 200 .*last log line: model not found"):
        proc.wait_ready(30)


def test_not_ready_in_time_stops_the_group(tmp_path: Path):
    port = pick_free_port()
    proc = TrtllmServeProcess([sys.executable, "-c", "import time; time.sleep(60)"], host="127.0.0.1", port=port,
                              log_file=tmp_path / "serve.log").start()
    pid = proc.pid
    with pytest.raises(StageError, match=r"did not answer 200 within 0.5 s; stopped it"):
        proc.wait_ready(0.5)
    assert proc.proc is not None and proc.proc.poll() is not None and pid == proc.pid
