"""The CPU engine's one native kernel, decode attention over the slot KV cache, built on first use.

Why native: at 16 decoding sequences SmolLM2's decode attention as two batched GEMMs and a softmax
(:meth:`~pipeline.cpu_runtime.model.Decoder._decode_attention_torch`) took ~10 ms of a ~28 ms step
(bfloat16 GEMMs; 166 µs per ``bmm`` call), a third of what the memory allows: ``bmm`` over the strided
slot cache, and every slot read up to the longest one. ``kernels/decode_attention.c`` reads each
sequence's keys and values once, up to its own length, with AVX-512 when the CPU has it.

How it is built: the machine's C compiler (``$CC``, else ``cc``, else ``gcc``) with
``-O3 -march=native -fopenmp``, into ``$TRTPIPE_KERNEL_CACHE`` (default
``$XDG_CACHE_HOME/trtpipe/kernels``, else ``~/.cache/trtpipe/kernels``) under a key that hashes the
source, the flags, the compiler's version and the CPU's flags — so nothing is rebuilt that did not
change, and a cache shared between machines never serves a library built for another CPU. Written to
a temporary name and renamed into place, so concurrent first loads (a test run and a server) are safe.
~1.5 s once per machine; the engine stage builds it, so ``serve`` finds it ready.

The library is loaded after torch, so its OpenMP calls resolve to torch's ``libgomp.so.1`` (same
soname): one thread pool for the GEMMs and the attention, no second pool spinning against it.

Without a compiler, or when the build fails, or with ``TRTPIPE_CPU_ATTENTION=torch``, the engine
uses the torch path and says so (``CpuEngine.runtime["attention"]``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "decode_attention.c"
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
#: ``TRTPIPE_CPU_ATTENTION``: ``torch`` forces the torch path; ``native`` makes a missing kernel an error;
#: unset (``auto``): native when it builds, else torch.
ATTENTION_ENV = "TRTPIPE_CPU_ATTENTION"
ATTENTION_CHOICES = ("auto", "native", "torch")
#: Query heads per KV head the kernel handles (``MAX_GROUP`` in the source).
MAX_GROUP = 8
_COMPILE_TIMEOUT_S = 120


class KernelUnavailable(RuntimeError):
    """The native kernel cannot be built or loaded here (one line: why)."""


def cache_dir() -> Path:
    """Where built kernels are kept (see the module docstring)."""
    if os.environ.get("TRTPIPE_KERNEL_CACHE"):
        return Path(os.environ["TRTPIPE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "trtpipe" / "kernels"


def _compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise KernelUnavailable("no C compiler (set CC, or install gcc)")
    return cc


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(source: Path = SOURCE) -> Path:
    """Compile ``source`` (once per key) and return the shared library's path.

    Raises :class:`KernelUnavailable` with the compiler's last error line when it cannot.
    """
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from None
    key = hashlib.sha256("\0".join([source.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{source.stem}-{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, "-o", tmp, str(source)], capture_output=True, text=True,
                           timeout=_COMPILE_TIMEOUT_S)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
            raise KernelUnavailable(f"{cc} could not build {source.name}: {last}")
        os.replace(tmp, out)
    except (OSError, subprocess.SubprocessError) as e:
        raise KernelUnavailable(f"{cc} could not build {source.name}: {e}") from None
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.info("built %s (%s)", out, " ".join(FLAGS))
    return out


@dataclass(frozen=True)
class DecodeAttention:
    """The loaded kernel: ``name`` is ``native-avx512`` or ``native`` (portable loops); ``path`` the library."""

    name: str
    path: Path
    _lib: ctypes.CDLL

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, lens: torch.Tensor,
                 scale: float, threads: int) -> torch.Tensor:
        """``softmax(scale · q kᵀ) v`` per sequence over its own cache slot and length.

        ``q``: float32 ``[n, kv_heads, group, head_dim]`` contiguous; ``k``/``v``: one layer's cache, float32 or
        bfloat16 ``[num_slots, kv_heads, slot_len, head_dim]`` contiguous; ``slots``/``lens``: int64 ``[n]`` (the
        slot of each query row and its context length in tokens, this step's token included, all ≤ slot_len).
        Returns float32 ``[n, kv_heads, group, head_dim]``. Raises ``RuntimeError`` when the kernel fails.
        """
        n, kvh, group, d = q.shape
        fn = self._lib.decode_attention_bf16 if k.dtype == torch.bfloat16 else self._lib.decode_attention_f32
        out = torch.empty_like(q)
        rc = fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), lens.data_ptr(), n, kvh, group, d,
                k.shape[2], scale, out.data_ptr(), threads)
        if rc != 0:
            raise RuntimeError(f"decode attention kernel failed (rc {rc}) for q {tuple(q.shape)}")
        return out


def load(source: Path = SOURCE) -> DecodeAttention:
    """Build (if needed) and load the kernel. Raises :class:`KernelUnavailable`."""
    path = build(source)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr] * 5 + [i64] * 5 + [ctypes.c_float, ptr, ctypes.c_int]
    lib.decode_attention_simd.restype = ctypes.c_int
    return DecodeAttention("native-avx512" if lib.decode_attention_simd() else "native", path, lib)


@functools.cache
def _load_cached() -> DecodeAttention | str:
    try:
        return load()
    except KernelUnavailable as e:
        return str(e)


def decode_attention(choice: str | None = None) -> DecodeAttention | None:
    """The kernel to use for ``choice`` (default: ``$TRTPIPE_CPU_ATTENTION``, else ``auto``; see
    :data:`ATTENTION_CHOICES`), or ``None`` for the torch path. ``auto`` logs one warning with the reason
    when the kernel is unavailable; ``native`` raises :class:`KernelUnavailable` instead; an unknown choice
    raises ``ValueError``."""
    choice = choice or os.environ.get(ATTENTION_ENV) or "auto"
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"{ATTENTION_ENV}={choice!r} is not one of {', '.join(ATTENTION_CHOICES)}")
    if choice == "torch":
        return None
    got = _load_cached()
    if isinstance(got, str):
        if choice == "native":
            raise KernelUnavailable(got)
        log.warning("decode attention: torch path (%s)", got)
        return None
    return got
