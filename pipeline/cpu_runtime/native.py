"""The CPU engine's native kernels (``kernels/decoder.c``), built on first use with the machine's C compiler.

What they replace, per layer of every step (measured on 2 AVX-512 cores, SmolLM2-135M):

- **decode attention** over the slot KV cache: torch's two batched ``bmm`` + softmax read every slot up to
  the longest one through strided views, ~10 ms of a ~28 ms step at 16 sequences (bfloat16 GEMMs). The
  kernel reads each sequence's keys and values once, up to its own length (AVX-512 when the CPU has it):
  122 µs per layer vs 368 µs at 16 sequences of ~200 tokens, K/V not in cache.
- **the GEMMs of steps of up to 128 tokens** (every decode step): y = x·Wᵀ on the weight oneDNN packed, so the
  engine keeps one copy (``Kernels.linear``; ``Kernels.packed_layout_ok`` checks oneDNN's layout per weight
  before it is used). One SmolLM2 float32 step's GEMMs: 16.7 vs 23.2 ms for oneDNN at 1 row, 27.8 vs 30.9 at 16.
- **the glue around the GEMMs**: residual add + RMSNorm (+ the cast to the GEMM dtype), RoPE + the K/V
  scatter into the cache, and the MLP's silu(gate) · up — a dozen small torch ops per layer, each a dispatch
  of a few µs: at one decoding sequence the step's non-GEMM time was ~3 ms of ~9. Same arithmetic in the same
  order where it can be (RoPE and the K/V rows bitwise equal to the torch path; RMSNorm's sum of squares in
  another order, ~1 ulp; SiLU's exponential a polynomial, ~2 ulp).
- **the whole decode step**: ``decode_layers`` runs every layer of a decode-only step in one call, the kernels
  above in the order the engine's Python calls them (bit-identical results), so a step no longer returns to
  Python ~10 times per layer.

How they are built: ``$CC`` (else ``cc``, else ``gcc``) with :data:`FLAGS` (``-march=native``,
``-ffp-contract=off`` so no multiply-add is fused where torch rounds twice), into
``$TRTPIPE_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/trtpipe/kernels``, else ``~/.cache/trtpipe/kernels``)
under a key hashing the source, the flags, the compiler's version and the CPU's flags: nothing is rebuilt
that did not change, and a shared cache never serves a library built for another CPU. Written to a
temporary name and renamed into place, so concurrent first loads are safe. ~2 s once per machine; the
engine stage builds it, so ``serve`` finds it ready.

The library is loaded after torch, so its OpenMP calls resolve to torch's ``libgomp.so.1`` (same soname):
one thread pool for the GEMMs and the kernels, no second pool spinning against it.

Without a compiler, when the build fails, or with ``TRTPIPE_CPU_KERNELS=torch``, the engine runs the
torch path and says so (``CpuEngine.runtime["kernels"]``).
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

from pipeline.core.errors import UserError

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "kernels" / "decoder.c"
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
#: ``TRTPIPE_CPU_KERNELS``: ``torch`` forces the torch path; ``native`` makes missing kernels an error;
#: unset (``auto``): native when they build, else torch.
KERNELS_ENV = "TRTPIPE_CPU_KERNELS"
KERNEL_CHOICES = ("auto", "native", "torch")
#: Query heads per KV head the kernel handles (``MAX_GROUP`` in the source).
MAX_GROUP = 8
_COMPILE_TIMEOUT_S = 120


class KernelUnavailable(UserError, RuntimeError):
    """The native kernels cannot be built or loaded here (one line: why). Reaches the user only where they were
    asked for (``TRTPIPE_CPU_KERNELS=native``): a :class:`~pipeline.core.errors.UserError`, one line and exit 2."""


class KernelChoiceError(UserError, ValueError):
    """``TRTPIPE_CPU_KERNELS`` (or a ``kernels`` argument) names none of :data:`KERNEL_CHOICES`: one line, exit 2."""


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
    key = hashlib.sha256(source.read_bytes() + "\0".join(["", " ".join(FLAGS), version, _cpu_flags()]).encode()).hexdigest()[:16]
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


_ERRORS = {-1: "out of memory", -2: "unsupported shape", -3: "slot, position or length outside the KV cache"}


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"native {what} failed: {_ERRORS.get(rc, f'rc {rc}')}")


@dataclass(frozen=True)
class Kernels:
    """The loaded library: ``name`` is ``native-avx512`` or ``native`` (portable loops); ``path`` the file.

    Every tensor argument must be contiguous (they are read through ``data_ptr``); ``threads``: OpenMP threads
    (the engine passes ``torch.get_num_threads()``). Each method raises ``RuntimeError`` when the kernel fails.
    """

    name: str
    path: Path
    _lib: ctypes.CDLL

    def decode_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                         lens: torch.Tensor, scale: float, threads: int) -> torch.Tensor:
        """``softmax(scale · q kᵀ) v`` per sequence over its own cache slot and length.

        ``q``: float32 ``[n, kv_heads, group, head_dim]`` (group ≤ :data:`MAX_GROUP`); ``k``/``v``: one layer's
        cache, float32 or bfloat16 ``[num_slots, kv_heads, slot_len, head_dim]``; ``slots``/``lens``: int64 ``[n]``
        (the slot of each query row and its context length in tokens, this step's token included, 1 ≤ len ≤
        slot_len). Returns float32 ``[n, kv_heads, group, head_dim]``.
        """
        n, kvh, group, d = q.shape
        fn = self._lib.decode_attention_bf16 if k.dtype == torch.bfloat16 else self._lib.decode_attention_f32
        out = torch.empty_like(q)
        _check(fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), slots.data_ptr(), lens.data_ptr(), n, kvh, group, d,
                  k.shape[0], k.shape[2], scale, out.data_ptr(), threads), "decode attention")
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor, threads: int) -> None:
        """``x += delta`` (in place; ``delta`` float32 or bfloat16 ``[T, hidden]``, or ``None``), then
        ``out = RMSNorm(x) · weight`` in ``out``'s dtype (float32 or bfloat16, rounded to nearest even).
        ``x``: float32 ``[T, hidden]``; ``weight``: float32 ``[hidden]``."""
        rows, hidden = x.shape
        _check(self._lib.add_rms_norm(
            x.data_ptr(), None if delta is None else delta.data_ptr(), delta is not None and delta.dtype == torch.bfloat16,
            weight.data_ptr(), rows, hidden, eps, out.data_ptr(), out.dtype == torch.bfloat16, threads), "add_rms_norm")

    def rope_kv_write(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, heads: int, kc: torch.Tensor, vc: torch.Tensor, q_out: torch.Tensor,
                      threads: int) -> None:
        """RoPE on q and k of the fused projection's output and the K/V write into one layer's cache.

        ``qkv``: float32 or bfloat16 ``[T, (heads + 2·kv_heads)·head_dim]``; ``cos``/``sin``: float32
        ``[slot_len, head_dim]`` (by position); ``positions``/``slots``: int64 ``[T]``; ``kc``/``vc``: float32 or
        bfloat16 (both the same) ``[num_slots, kv_heads, slot_len, head_dim]``, written at ``(slots[t], :,
        positions[t])`` (bfloat16: rounded to nearest even, as ``Tensor.to(torch.bfloat16)``); ``q_out``: float32
        ``[T, heads, head_dim]``, the rotated queries. Raises ``ValueError`` for RoPE tables shorter than the cache
        or K and V caches of different dtypes.
        """
        num_slots, kvh, slot_len, d = kc.shape
        if cos.shape[0] < slot_len:
            raise ValueError(f"RoPE tables have {cos.shape[0]} positions, the cache {slot_len}")
        if kc.dtype != vc.dtype or kc.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"K/V caches must both be float32 or bfloat16, not {kc.dtype} / {vc.dtype}")
        _check(self._lib.rope_kv_write(
            qkv.data_ptr(), qkv.dtype == torch.bfloat16, cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), qkv.shape[0], heads, kvh, d, num_slots, slot_len, q_out.data_ptr(), kc.data_ptr(),
            vc.data_ptr(), kc.dtype == torch.bfloat16, threads), "rope_kv_write")

    def linear(self, x: torch.Tensor, weight: int, out_features: int, in_features: int, bias: torch.Tensor | None,
               threads: int) -> torch.Tensor:
        """``x @ Wᵀ (+ bias)`` with ``W`` in oneDNN's blocked layout (see ``linear_packed_*`` in the source).

        ``x``: float32 or bfloat16 ``[M, in_features]``; ``weight``: the address of the packed ``[out_features,
        in_features]`` weight in ``x``'s dtype (``torch.ops.mkldnn.data_ptr`` of a ``_reorder_linear_weight``
        result); ``bias``: ``None`` or ``[out_features]`` in ``x``'s dtype. Returns ``[M, out_features]`` in ``x``'s
        dtype (float32 accumulation). Use it only on a weight :meth:`packed_layout_ok` accepted. Raises
        ``ValueError`` when ``x`` has another number of columns (the kernel would read past the weight)."""
        if x.dim() != 2 or x.shape[1] != in_features:
            raise ValueError(f"linear: input {tuple(x.shape)} does not match a weight of {in_features} inputs")
        x = x.contiguous()
        y = torch.empty(x.shape[0], out_features, dtype=x.dtype)
        fn = self._lib.linear_packed_bf16 if x.dtype == torch.bfloat16 else self._lib.linear_packed_f32
        _check(fn(x.data_ptr(), weight, None if bias is None else bias.data_ptr(), x.shape[0], out_features,
                  x.shape[1], y.data_ptr(), threads), "linear")
        return y

    def silu_mul(self, gu: torch.Tensor) -> torch.Tensor:
        """``silu(gu[:, :inter]) * gu[:, inter:]`` for the fused gate/up output ``gu`` float32 or bfloat16 ``[T, 2·inter]``
        (contiguous) → ``[T, inter]`` in its dtype; bfloat16 rounds where torch does on bfloat16 tensors. Within ~2 ulp
        of ``F.silu(g) * u``."""
        rows, inter = gu.shape[0], gu.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gu.dtype)
        _check(self._lib.silu_mul(gu.data_ptr(), gu.dtype == torch.bfloat16, rows, inter, out.data_ptr()), "silu_mul")
        return out

    def decode_layers(self, table: torch.Tensor, bf16: bool, kv_bf16: bool, x: torch.Tensor, heads: int, kv_heads: int,
                      head_dim: int, inter: int, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, lens: torch.Tensor, num_slots: int, slot_len: int, eps: float, scale: float,
                      threads: int) -> None:
        """Every decoder layer of a decode-only step in one call (``decode_layers`` in the source): ``x`` float32
        ``[n, hidden]`` updated in place. ``table``: int64 ``[layers, 10]`` addresses (see the source) that the caller
        keeps valid; ``bf16``: bfloat16 GEMMs; ``kv_bf16``: the K/V caches the table points at are bfloat16 (else
        float32); ``positions``/``slots``/``lens``: int64 ``[n]``; ``cos``/``sin`` as for :meth:`rope_kv_write`."""
        n, hidden = x.shape
        _check(self._lib.decode_layers(
            table.data_ptr(), table.shape[0], bf16, kv_bf16, x.data_ptr(), n, hidden, heads, kv_heads, head_dim, inter,
            cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(), lens.data_ptr(), num_slots,
            slot_len, eps, scale, threads), "decode_layers")

    def packed_layout_ok(self, packed: torch.Tensor, out_features: int, in_features: int, dtype: torch.dtype,
                         bias: torch.Tensor | None) -> bool:
        """Whether :meth:`linear` reads ``packed`` (a ``_reorder_linear_weight`` result) as oneDNN does.

        oneDNN chooses its blocked layout per shape, dtype and CPU; the kernel knows one layout per dtype. The
        check: the buffer holds exactly ``out × in`` elements, and for one-hot inputs picking columns at both ends,
        in the middle and in both halves of a k pair (products by 1 and sums of zeros: exact in any order) the
        kernel's output equals oneDNN's bit for bit (8 rows, so both the full and a partial row block run)."""
        elem = 2 if dtype == torch.bfloat16 else 4
        if torch.ops.mkldnn._nbytes(packed) != out_features * in_features * elem:
            return False
        k = in_features
        cols = sorted({0, 1, 2, 3, k // 2, k // 2 + 1, k - 2, k - 1})
        x = torch.zeros(8, k, dtype=dtype)
        for row, col in enumerate(cols):
            x[row, col] = 1.0
        want = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        try:
            got = self.linear(x, torch.ops.mkldnn.data_ptr(packed), out_features, in_features, bias, 1)
        except RuntimeError:  # -2: a shape or CPU the kernel does not take
            return False
        return torch.equal(got, want)


def load(source: Path = SOURCE) -> Kernels:
    """Build (if needed) and load the kernels. Raises :class:`KernelUnavailable`."""
    path = build(source)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from None
    i64, ptr, flag, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    for name in ("decode_attention_f32", "decode_attention_bf16"):
        getattr(lib, name).argtypes = [ptr] * 5 + [i64] * 6 + [f32, ptr, flag]
    lib.add_rms_norm.argtypes = [ptr, ptr, flag, ptr, i64, i64, f32, ptr, flag, flag]
    lib.rope_kv_write.argtypes = [ptr, flag, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, flag, flag]
    for name in ("linear_packed_f32", "linear_packed_bf16"):
        getattr(lib, name).argtypes = [ptr] * 3 + [i64] * 3 + [ptr, flag]
    lib.silu_mul.argtypes = [ptr, flag, i64, i64, ptr]
    lib.decode_layers.argtypes = [ptr, i64, flag, flag, ptr] + [i64] * 6 + [ptr] * 5 + [i64, i64, f32, f32, flag]
    for name in ("decode_attention_f32", "decode_attention_bf16", "add_rms_norm", "rope_kv_write", "decoder_simd",
                 "linear_packed_f32", "linear_packed_bf16", "silu_mul", "decode_layers"):
        getattr(lib, name).restype = ctypes.c_int
    return Kernels("native-avx512" if lib.decoder_simd() else "native", path, lib)


@functools.cache
def _load_cached() -> Kernels | str:
    try:
        return load()
    except KernelUnavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - whatever breaks the native build, the engine still serves (torch path)
        return f"{type(e).__name__}: {e}"


def checked_choice(choice: str | None = None) -> str:
    """``choice`` (default: ``$TRTPIPE_CPU_KERNELS``, else ``auto``) if it is one of :data:`KERNEL_CHOICES`, else
    :class:`KernelChoiceError`; builds nothing (``trtpipe build`` checks it before its first stage)."""
    choice = choice or os.environ.get(KERNELS_ENV) or "auto"
    if choice not in KERNEL_CHOICES:
        raise KernelChoiceError(f"{KERNELS_ENV}={choice!r} is not one of {', '.join(KERNEL_CHOICES)}")
    return choice


def kernels(choice: str | None = None) -> Kernels | None:
    """The kernels to use for ``choice`` (default: ``$TRTPIPE_CPU_KERNELS``, else ``auto``; see
    :data:`KERNEL_CHOICES`), or ``None`` for the torch path. ``auto`` logs one warning with the reason when they
    are unavailable; ``native`` raises :class:`KernelUnavailable` instead; an unknown choice raises
    :class:`KernelChoiceError` (a ``ValueError``)."""
    choice = checked_choice(choice)
    if choice == "torch":
        return None
    got = _load_cached()
    if isinstance(got, str):
        if choice == "native":
            raise KernelUnavailable(f"the native CPU kernels were asked for ({KERNELS_ENV}=native) but cannot be used: "
                                    f"{got}")
        log.warning("CPU engine kernels: torch path (%s)", got)
        return None
    return got
