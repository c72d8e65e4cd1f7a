"""Faults after and during a build (issue #39, docs/robustness.md), on real artifacts of the CPU default:

- a corrupted artifact (bit flip, truncation): ``trtpipe serve`` refuses the build, one line naming the file
  (:func:`pipeline.serve.compat.check_files`);
- two builds of one build directory at once: the second waits on the directory's lock, naming the holder, then
  reuses the first's stages (:mod:`pipeline.core.lock`);
- a full disk: the build fails with one line naming the stage directory and the space it needs, and leaves no
  temporary or manifest-less stage directory (:func:`pipeline.core.artifacts.atomic_dir`). A real tmpfs, mounted
  in a user + mount namespace (``unshare -rm``); skipped where that is not allowed.

The corruption and lock tests reuse the session's CPU build (``cpu_build``) through a hard-linked copy: a file to
corrupt is rewritten as a new inode first, so the session build is never touched.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.core import artifacts, lock
from pipeline.core.errors import IncompatibleArtifactError
from pipeline.core.layout import STAGES, BuildLayout
from pipeline.serve import compat

REPO = Path(__file__).resolve().parents[1]
TRTPIPE = str(Path(sys.executable).parent / "trtpipe")
RECIPE = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
#: a short calibration for the builds made here from scratch (the stages' outputs keep their size)
SMALL = ["quantization.calibration.size=8", "quantization.calibration.max_seq_length=64",
         "quantization.calibration.batch_size=8", "quantization.calibration.eval_samples=2"]
#: one progress line per stage (rich wraps at 80 columns off a terminal)
WIDE = {**os.environ, "COLUMNS": "400"}


def _linked_copy(build: Path, dest: Path) -> Path:
    """``build`` copied to ``dest`` as hard links (no data copied)."""
    shutil.copytree(build, dest, copy_function=os.link)
    return dest


def _own(path: Path) -> bytes:
    """Give ``path`` its own inode (so changing it leaves the hard-linked original alone); its bytes."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return data


def _flip(path: Path, n: int = 64) -> None:
    """Invert ``n`` bytes in the middle of ``path`` (what a bad disk or a shared volume does)."""
    data = bytearray(_own(path))
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))


def _error_lines(stderr: str) -> list[str]:
    """The CLI's error lines (stderr also carries the stages' warnings); a traceback is never one of them."""
    assert "Traceback" not in stderr, stderr
    return [ln for ln in stderr.splitlines() if ln.startswith("error:")]


# ------------------------------------------------------------------ a corrupted artifact
def test_serve_refuses_flipped_cpu_engine_weights(cpu_build: Path, tmp_path: Path):
    """64 bytes flipped in the middle of the CPU engine's model.safetensors: `trtpipe serve` exits 4 with one line
    naming the file, before any server starts."""
    copy = _linked_copy(cpu_build, tmp_path / "build")
    logs = set(copy.glob("triton_server-*.log"))  # other tests may have served the session build already
    target = compat.ServeTarget.resolve(copy)
    compat.check_files(target)  # the intact copy passes
    weights = copy / "engine" / "model.safetensors"
    _flip(weights)
    res = subprocess.run([TRTPIPE, "serve", str(copy), "--timeout", "5"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 4, res.stdout + res.stderr
    (line,) = _error_lines(res.stderr)
    assert str(weights) in line and "sha256 differs" in line and "--force" in line, line
    assert "Traceback" not in res.stdout + res.stderr
    assert set(copy.glob("triton_server-*.log")) == logs, "a server was started"


def test_truncated_or_missing_engine_files_are_refused(cpu_build: Path, tmp_path: Path):
    """A truncated copy of a file (here the tokenizer) and a deleted one are both named."""
    copy = _linked_copy(cpu_build, tmp_path / "build")
    tok = copy / "engine" / "tokenizer.json"
    tok.write_bytes(_own(tok)[:100])
    with pytest.raises(IncompatibleArtifactError, match=r"engine/tokenizer\.json changed on disk"):
        compat.check_files(compat.ServeTarget.resolve(copy))
    (copy / "engine" / "tokenizer.json").unlink()
    with pytest.raises(IncompatibleArtifactError, match=r"engine/tokenizer\.json is missing"):
        compat.check_files(compat.ServeTarget.resolve(copy))


def test_serve_refuses_a_changed_llmapi_checkpoint(cpu_build: Path, tmp_path: Path):
    """`build.engine: pytorch` on a GPU target: the LLM API loads the quantize stage's hf_ckpt at start, so that
    checkpoint's recorded hashes are checked (the real engine stage writes the manifest; the checkpoint is the
    session build's real ModelOpt export)."""
    from pipeline.engine import pytorch
    from pipeline.quantize.result import QuantizeResult
    from pipeline.recipe import load_recipe

    gpu = tmp_path / "gpu"
    _linked_copy(cpu_build / "quantize", gpu / "quantize")
    layout = BuildLayout(gpu)
    recipe = load_recipe(RECIPE, ["target.gpu=h200", "build.engine=pytorch", "bench.model=tensorrt_llm"])
    pytorch.run(recipe, layout, quantized=QuantizeResult.load(layout.quantize))
    target = compat.ServeTarget(gpu / "triton_repo", layout)
    [(root, recorded)] = compat.served_files(layout)
    assert root == layout.hf_ckpt.resolve() and "model.safetensors" in recorded
    compat.check_files(target)
    _flip(layout.hf_ckpt / "model.safetensors")
    with pytest.raises(IncompatibleArtifactError, match=r"hf_ckpt/model\.safetensors changed on disk"):
        compat.check_files(target)


def test_tensorrt_engine_files_go_through_the_same_check(tmp_path: Path):
    """A TensorRT engine's recorded ``engine_files`` are checked by the same function, on any Triton."""
    engine = tmp_path / "b" / "engine"
    engine.mkdir(parents=True)
    (engine / "rank0.engine").write_bytes(bytes(range(256)) * 64)
    artifacts.write_manifest(engine, {"stage": "engine", "cache_key": "k", "engine_kind": "tensorrt", "status": "built",
                                      "engine_dir": ".", "engine_files": artifacts.file_hashes(engine)})
    target = compat.ServeTarget(tmp_path / "b" / "triton_repo", BuildLayout(tmp_path / "b"))
    compat.check_files(target)
    _flip(engine / "rank0.engine")
    with pytest.raises(IncompatibleArtifactError, match=r"engine/rank0\.engine changed on disk"):
        compat.check_files(target)


# ------------------------------------------------------------------ two builds at once
def _holder(path: Path) -> subprocess.Popen:
    """A process that holds ``lock.exclusive(path)`` until its stdin closes (it prints ``held`` once it does)."""
    code = ("import sys; from pathlib import Path; from pipeline.core import lock\n"
            f"with lock.exclusive(Path({str(path)!r})):\n    print('held', flush=True); sys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_names_the_holder_and_waits(tmp_path: Path):
    path = tmp_path / "b" / ".build.lock"
    holder = _holder(path)
    said: list[str] = []
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; from pathlib import Path; from pipeline.core import lock\n"
             f"with lock.exclusive(Path({str(path)!r}), on_wait=lambda m: print(m, flush=True)):\n    print('got it')\n"],
            stdout=subprocess.PIPE, text=True)
        said.append(child.stdout.readline().strip())
        assert child.poll() is None, "the second process did not wait"
    finally:
        holder.stdin.close()
        holder.wait(30)
    said.append(child.communicate(timeout=30)[0].strip())
    assert said[0].startswith(f"waiting for another build of {path.parent} (pid {holder.pid}, since "), said
    assert said[0].endswith(f"; lock {path})") and said[1] == "got it", said


def test_lock_removed_while_waiting_is_taken_again(tmp_path: Path):
    """A failed first build removes its new build directory, lock file included: a waiter must not trust the lock
    on the removed file (a third build would lock a new one)."""
    path = tmp_path / "b" / ".build.lock"
    holder = _holder(path)
    shutil.rmtree(path.parent)
    with lock.exclusive(path):  # no wait: the file at `path` is a new one
        assert path.is_file()
    holder.stdin.close()
    holder.wait(30)


def test_a_second_build_waits_then_reuses_the_first(cpu_build: Path, tmp_path: Path):
    """`trtpipe build` of a build directory another build holds says it waits (holder pid, lock path), does
    nothing until the holder is done, then reuses the stages it finds by their cache keys."""
    copy = _linked_copy(cpu_build, tmp_path / "build")
    layout = BuildLayout(copy)
    before = {s: (layout.stage_dir(s) / artifacts.MANIFEST).stat().st_ino for s in STAGES}
    holder = _holder(layout.lock_file)
    try:
        proc = subprocess.Popen([TRTPIPE, "build", str(RECIPE), "--out", str(copy)], cwd=tmp_path, env=WIDE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "waiting for another build" in line:
                break
        assert proc.poll() is None, "".join(lines) + proc.stderr.read()
        assert f"pid {holder.pid}" in lines[-1] and str(layout.lock_file) in lines[-1], lines[-1]
        assert {s: (layout.stage_dir(s) / artifacts.MANIFEST).stat().st_ino for s in STAGES} == before
    finally:
        holder.stdin.close()
        holder.wait(30)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out + err
    for stage in ("quantize", "engine"):
        assert any(stage in ln and "reused" in ln for ln in out.splitlines()), out
    assert (tmp_path / "artifacts" / artifacts.LAST_BUILD_FILE).read_text().strip() == str(copy.resolve())


@pytest.mark.slow
def test_two_builds_of_one_recipe_at_once(cpu_build: Path, tmp_path: Path):
    """Two `trtpipe build`s of the default recipe into artifacts/<name> at once (the second started while the first
    holds the lock): both exit 0, one waited and then reused every stage; one valid build, no temp directory, the
    last-build marker names it. The session build's finished quantize stage (same recipe: same content key) is
    hard-linked in first, as `trtpipe build` seeds one (pipeline/assemble/seed.py): the first build holds the lock while
    it builds the engine and the repository."""
    def build() -> subprocess.Popen:
        argv = [TRTPIPE, "build", str(RECIPE)]
        return subprocess.Popen(argv, cwd=tmp_path, env=WIDE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    out_dir = tmp_path / "artifacts" / "smollm2_135m_cpu_fp8"
    shutil.copytree(cpu_build / "quantize", BuildLayout(out_dir).stage_dir("quantize"), copy_function=os.link)
    lock_file = BuildLayout(out_dir).lock_file
    first = build()
    while not (lock_file.is_file() and lock_file.stat().st_size > 0) and first.poll() is None:
        time.sleep(0.05)  # until the first build holds the lock (it writes its pid into the file)
    second = build()
    outs = [p.communicate(timeout=1800)[0] for p in (first, second)]
    assert [first.returncode, second.returncode] == [0, 0], outs
    assert "waiting for another build" in outs[1] and f"pid {first.pid}" in outs[1], outs[1]
    assert sum("reused" in ln for ln in outs[1].splitlines()) == len(STAGES), outs[1]
    layout = BuildLayout(out_dir)
    for stage in STAGES:
        assert artifacts.read_manifest(layout.stage_dir(stage))["status"] == "built"
    assert not [p.name for p in out_dir.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert artifacts.last_build(tmp_path / "artifacts") == out_dir.resolve()
    compat.check_files(compat.ServeTarget.resolve(out_dir))


# ------------------------------------------------------------------ a full disk
def _in_tmpfs(tmp_path: Path, size: str, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) with ``$D`` a fresh tmpfs of ``size`` (a user + mount namespace: gone when it ends, so
    the script lists what it needs checked). Skips the test where such a mount is refused."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here: a tmpfs cannot be mounted without root")
    d = tmp_path / "tmpfs"
    d.mkdir()
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {d}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {probe.stderr.strip()}")
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs \"$D\" && {script}"],
                          capture_output=True, text=True, timeout=1800,
                          env={**os.environ, "D": str(d), "TRTPIPE": TRTPIPE, "PY": sys.executable})


def test_build_on_a_small_disk_is_refused_before_quantizing(tmp_path: Path):
    """150 MB free, the two FP8 exports need ~300 MB: refused before the model loads, one line naming the stage
    directory and the space needed, exit 1, nothing left on the disk."""
    res = _in_tmpfs(tmp_path, "150m", f'"$TRTPIPE" build {RECIPE} --out "$D/build"; echo "rc=$?"; find "$D"')
    assert "rc=1" in res.stdout, res.stdout + res.stderr
    (line,) = _error_lines(res.stderr)
    d = tmp_path / "tmpfs"
    assert f"{d}/build/quantize: not enough free space" in line and "needs about" in line and "MiB free" in line, line
    assert "Traceback" not in res.stderr
    assert res.stdout.split("rc=1")[1].split() == [str(d)], "something was left on the disk"


def test_disk_filling_while_writing_is_one_line(tmp_path: Path):
    """The disk fills inside a stage's writer (no estimate, or a wrong one): safetensors' error (the writer the
    quantize export and the CPU engine use) and a plain OSError both become the one line; the temp dir is gone."""
    code = textwrap.dedent("""
        import os, sys, torch
        from pathlib import Path
        from safetensors.torch import save_file
        from pipeline.core.artifacts import atomic_dir
        from pipeline.core.errors import StageError
        d = Path(os.environ["D"])
        for name, write in (("st", lambda t: save_file({"w": torch.zeros(4 << 20)}, str(t / "model.safetensors"))),
                            ("os", lambda t: (t / "blob").write_bytes(bytes(16 << 20)))):
            try:
                with atomic_dir(d / name, need_bytes=4 << 20) as tmp:  # an estimate below what it writes
                    write(tmp)
            except StageError as e:
                print("error:", e)
        print("left:", sorted(p.name for p in d.iterdir()))
    """)
    res = _in_tmpfs(tmp_path, "8m", f'"$PY" -c {_sh_quote(code)}')
    assert res.returncode == 0, res.stdout + res.stderr
    errors = [ln for ln in res.stdout.splitlines() if ln.startswith("error:")]
    d = tmp_path / "tmpfs"
    assert len(errors) == 2, res.stdout + res.stderr
    for name, line in zip(("st", "os"), errors):
        assert f"{d}/{name}: no space left on device while writing it: it needs about 4 MiB" in line, line
    assert "left: []" in res.stdout, res.stdout


def _sh_quote(s: str) -> str:
    return "'" + s.replace("'", "'\"'\"'") + "'"


@pytest.mark.slow
def test_disk_too_small_for_the_engine_keeps_the_finished_quantize_stage(tmp_path: Path):
    """600 MB: the FP8 exports (~300 MB) fit, the CPU engine's float32 weights (~540 MB) then do not: refused at
    the engine stage with one line; the quantize stage stays complete (manifest, recorded hashes), no engine or
    temp directory exists, so a rerun on a larger disk reuses quantize."""
    script = (f'"$TRTPIPE" build {RECIPE} --out "$D/build" ' + " ".join(f"--set {s}" for s in SMALL)
              + '; echo "rc=$?"; echo "left:" $(ls -A "$D/build"); '
              '"$PY" -c "import sys; from pipeline.core import artifacts; '
              "m = artifacts.read_manifest(sys.argv[1]); "
              "print('quantize', m['status'], sum(len(v) for v in m['outputs'].values()), "
              "sum(len(artifacts.changed_files(sys.argv[1] + '/' + k, v)) for k, v in m['outputs'].items()))\" "
              '"$D/build/quantize"')
    res = _in_tmpfs(tmp_path, "600m", script)
    assert "rc=1" in res.stdout, res.stdout + res.stderr
    (line,) = _error_lines(res.stderr)
    assert f"{tmp_path / 'tmpfs'}/build/engine: not enough free space" in line, line
    assert "left: .build.lock quantize\n" in res.stdout, res.stdout
    status = res.stdout.splitlines()[-1].split()
    assert status[:2] == ["quantize", "built"] and int(status[2]) > 0 and status[3] == "0", res.stdout
