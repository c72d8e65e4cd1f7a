"""The CPU engine's native kernels (``pipeline/cpu_runtime/kernels/decoder.c``), built with this machine's C
compiler: decode attention against softmax attention computed here in float64, RoPE + K/V write and
add + RMSNorm against the torch ops they replace; the build cache; the torch fallback when they cannot be built."""

from __future__ import annotations

import ctypes
import math
import shutil

import pytest
import torch

from pipeline.core.errors import UserError
from pipeline.cpu_runtime import native

needs_cc = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler on this machine")


def _reference(q, k, v, slots, lens, scale):
    """softmax(scale · q·K) V per (sequence, KV head, query row), in float64, from the cache slices directly."""
    n, kvh, group, d = q.shape
    out = torch.empty(n, kvh, group, d, dtype=torch.float64)
    for i in range(n):
        s, L = int(slots[i]), int(lens[i])
        for h in range(kvh):
            K = k[s, h, :L].double()  # [L, d]
            V = v[s, h, :L].double()
            for g in range(group):
                w = torch.exp(scale * (K @ q[i, h, g].double()) - (scale * (K @ q[i, h, g].double())).max())
                out[i, h, g] = (w / w.sum()) @ V
    return out


@needs_cc
@pytest.mark.parametrize(
    ("group", "d", "kv_dtype"),
    [
        (3, 64, torch.float32),    # SmolLM2-135M: 9 query heads over 3 KV heads of 64
        (4, 128, torch.float32),   # Llama-3.1-8B: 32 over 8 of 128 (tiled: 4 × 8 accumulators > 24)
        (1, 64, torch.bfloat16),   # multi-head attention, bfloat16 K/V
        (8, 128, torch.bfloat16),  # the largest group the kernel takes
        (2, 80, torch.float32),    # head_dim 80: a multiple of 16 outside the specialised shapes
        (5, 48, torch.float32),    # head_dim 48 (also a multiple of 16), odd group
        (3, 40, torch.float32),    # head_dim 40: the portable loops
    ],
)
def test_kernel_matches_softmax_attention(group: int, d: int, kv_dtype: torch.dtype) -> None:
    kernel = native.kernels("native")
    g = torch.Generator().manual_seed(group * 1000 + d)
    num_slots, kvh, slot_len = 7, 2, 300
    k = (torch.randn(num_slots, kvh, slot_len, d, generator=g) * 2).to(kv_dtype)
    v = torch.randn(num_slots, kvh, slot_len, d, generator=g).to(kv_dtype)
    # slots out of order with gaps; lengths from 1 token to the whole slot, and lengths that are not multiples of 16
    slots = torch.tensor([5, 0, 3, 6], dtype=torch.int64)
    lens = torch.tensor([1, 17, 300, 129], dtype=torch.int64)
    q = torch.randn(len(slots), kvh, group, d, generator=g)
    scale = 1 / math.sqrt(d)
    got = kernel.decode_attention(q, k, v, slots, lens, scale, threads=2)
    want = _reference(q, k.float(), v.float(), slots, lens, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    err = (got.double() - want).abs().max().item()
    assert err < 2e-6 * want.abs().max().item() + 1e-7, err
    # one token of context: the output is that token's value row, whatever the scores
    assert torch.allclose(got[0], v[5, :, :1].float().expand(kvh, group, d), atol=1e-7)
    # the same result on one thread (the work split does not change any item's arithmetic)
    assert torch.equal(kernel.decode_attention(q, k, v, slots, lens, scale, threads=1), got)
    # a length past the slot, or a slot past the cache, is refused (nothing read out of bounds)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernel.decode_attention(q, k, v, slots, torch.tensor([1, 17, 301, 129]), scale, threads=1)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kernel.decode_attention(q, k, v, torch.tensor([5, 0, 7, 6]), lens, scale, threads=1)


def _rope_reference(x, cos, sin):
    """transformers' apply_rotary_pos_emb on one [T, heads, D] tensor: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


@needs_cc
@pytest.mark.parametrize(("qkv_dtype", "kv_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                                    (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_rope_kv_write_matches_transformers_rotation(qkv_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """q rotated bitwise as transformers does; K (rotated) and V written at (slot, position) only, a bfloat16 cache
    getting exactly ``Tensor.to(torch.bfloat16)`` of the float32 values (round to nearest even)."""
    kn = native.kernels("native")
    H, KVH, D, num_slots, slot_len = 9, 3, 64, 4, 40
    g = torch.Generator().manual_seed(7)
    inv = 1.0 / (100000.0 ** (torch.arange(0, D, 2).float() / D))
    freqs = torch.outer(torch.arange(slot_len).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    positions = torch.tensor([3, 7, 0, 39, 12])
    slots = torch.tensor([0, 2, 3, 1, 2])
    qkv = torch.randn(5, (H + 2 * KVH) * D, generator=g).to(qkv_dtype)
    kc = torch.zeros(num_slots, KVH, slot_len, D, dtype=kv_dtype)
    vc = torch.zeros(num_slots, KVH, slot_len, D, dtype=kv_dtype)
    q = torch.empty(5, H, D)
    kn.rope_kv_write(qkv, cos, sin, positions, slots, H, kc, vc, q, threads=2)
    x = qkv.float()
    qr = _rope_reference(x[:, :H * D].view(5, H, D), cos[positions], sin[positions])
    kr = _rope_reference(x[:, H * D:(H + KVH) * D].view(5, KVH, D), cos[positions], sin[positions])
    assert torch.equal(q, qr)  # the same products and sums, so bitwise
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    want_k[slots, :, positions] = kr.to(kv_dtype)
    want_v[slots, :, positions] = x[:, (H + KVH) * D:].view(5, KVH, D).to(kv_dtype)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)  # and nothing else in the cache touched
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kn.rope_kv_write(qkv, cos, sin, torch.tensor([3, 7, 0, 40, 12]), slots, H, kc, vc, q, threads=1)


@needs_cc
@pytest.mark.parametrize(("delta_dtype", "out_dtype"), [(None, torch.float32), (torch.float32, torch.float32),
                                                        (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_add_rms_norm_matches_transformers_rmsnorm(delta_dtype, out_dtype) -> None:
    kn = native.kernels("native")
    g = torch.Generator().manual_seed(3)
    rows, hidden, eps = 17, 576, 1e-5
    x = torch.randn(rows, hidden, generator=g) * 3
    w = torch.rand(hidden, generator=g) + 0.5
    delta = None if delta_dtype is None else torch.randn(rows, hidden, generator=g).to(delta_dtype)
    want_x = x if delta is None else x + delta.float()
    # transformers LlamaRMSNorm in float32, then the cast the GEMM input gets
    want = (w * (want_x * torch.rsqrt(want_x.pow(2).mean(-1, keepdim=True) + eps))).to(out_dtype)
    out = torch.empty(rows, hidden, dtype=out_dtype)
    kn.add_rms_norm(x, delta, w, eps, out, threads=2)
    assert torch.equal(x, want_x)  # the residual is updated in place, exactly
    if out_dtype == torch.float32:  # the sum of squares in another order: within a few ulp
        assert torch.allclose(out, want, rtol=4e-7, atol=1e-7), (out - want).abs().max()
    else:  # bfloat16: the same rounding almost everywhere
        assert (out != want).float().mean() < 0.01
        assert torch.allclose(out.float(), want.float(), rtol=8e-3, atol=0)


@needs_cc
def test_kernel_is_built_once_per_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRTPIPE_KERNEL_CACHE", str(tmp_path / "cache"))
    first = native.build()
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    changed = tmp_path / native.SOURCE.name
    changed.write_bytes(native.SOURCE.read_bytes() + b"\n/* changed */\n")
    other = native.build(changed)
    assert other != first and other.is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, other.name])  # no temp left


def test_without_a_compiler_the_engine_takes_the_torch_path(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("TRTPIPE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native._load_cached.cache_clear()
    try:
        with pytest.raises(native.KernelUnavailable, match="TRTPIPE_CPU_KERNELS=native.*no-such-cc") as asked:
            native.kernels("native")
        assert isinstance(asked.value, UserError)  # the CLI prints it as one line and exits 2
        with caplog.at_level("WARNING", logger=native.__name__):
            assert native.kernels("auto") is None
        assert "torch path" in caplog.text and "no-such-cc" in caplog.text
        monkeypatch.setenv(native.KERNELS_ENV, "auto")
        assert native.kernels() is None
    finally:
        native._load_cached.cache_clear()
    broken = tmp_path / "broken.c"
    broken.write_text("int f( {\n")
    monkeypatch.delenv("CC")
    if shutil.which("cc") or shutil.which("gcc"):
        with pytest.raises(native.KernelUnavailable, match="could not build broken.c"):
            native.build(broken)
        assert not any((tmp_path / "cache").glob("*"))  # nothing half-written
    assert native.kernels("torch") is None
    with pytest.raises(ValueError, match="TRTPIPE_CPU_KERNELS='fast' is not one of auto, native, torch") as bad:
        native.kernels("fast")
    assert isinstance(bad.value, UserError)


def _cpu_has(flag: str) -> bool:
    return flag in native._cpu_flags().split()


def _gemm_capable(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this CPU has the GEMM kernel's instructions in ``dtype`` (AVX-512; AVX512_BF16 for bfloat16): the
    kernel's own rule (``linear_packed_*`` return -2 without them, kernels/decoder.c)."""
    return _cpu_has("avx512f") and (dtype != torch.bfloat16 or _cpu_has("avx512_bf16"))


def _gemm_kernels(dtype: torch.dtype = torch.float32) -> native.Kernels:
    """The kernels, or a skip where the CPU cannot run the GEMM kernel in ``dtype``."""
    if not _gemm_capable(dtype):
        pytest.skip("the GEMM kernel needs AVX-512 (and AVX512_BF16 for bfloat16)")
    return native.kernels("native")


needs_mkldnn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


def _kernel_layout(w: torch.Tensor) -> torch.Tensor:
    """``w`` ``[N, K]`` (N a multiple of 64; K even in bfloat16) laid out as the GEMM kernel reads it, written from the
    layout the kernel's source documents (``linear_packed_*`` in kernels/decoder.c), not from oneDNN:
    float32 ``W[o, k]`` at ``(o / 64)·K·64 + k·64 + o % 64``; bfloat16 at ``(o / 64)·K·64 + (k / 2)·128 + (o % 64)·2 + k % 2``."""
    n, k = w.shape
    if w.dtype == torch.bfloat16:
        return w.reshape(n // 64, 64, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return w.reshape(n // 64, 64, k).permute(0, 2, 1).contiguous()


def _onednn_bytes(packed: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a oneDNN tensor (a ``_reorder_linear_weight`` result), as uint8."""
    out = torch.empty(torch.ops.mkldnn._nbytes(packed), dtype=torch.uint8)
    ctypes.memmove(out.data_ptr(), torch.ops.mkldnn.data_ptr(packed), out.numel())
    return out


def _same_bytes(a: torch.Tensor, kernel_layout: torch.Tensor) -> bool:
    """Whether oneDNN's packed ``a`` holds exactly the kernel's layout (:func:`_kernel_layout`)."""
    b = kernel_layout.view(-1).view(torch.uint8)
    got = _onednn_bytes(a)
    return got.numel() == b.numel() and torch.equal(got, b)


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x·Wᵀ (+ b) in float64 of the (rounded) inputs and its error bound: γ_K·Σ|x||w| for float32 accumulation in
    any order (+ half an ulp of the bfloat16 output)."""
    k = x.shape[1]
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = k * 2**-24 / (1 - k * 2**-24) * ((x.double().abs() @ w.double().abs().T) + (0 if b is None else b.double().abs()))
    if dtype == torch.bfloat16:
        bound = bound * (1 + 2**-8) + want.abs() * 2**-8
    return want, bound


SHAPES = [(960, 576, False), (576, 1536, True), (128, 96, True), (320, 64, True)]


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "bias"), SHAPES)
def test_kernel_linear_matches_float64(dtype: torch.dtype, n: int, k: int, bias: bool) -> None:
    """The few-row GEMM on a weight in the layout it documents (packed here, independently of oneDNN, so this runs
    on every CPU that has the kernel's instructions whatever oneDNN picks there) against x·Wᵀ (+ b) in float64, for
    1 row to past several row blocks; every thread split gives the same bits. A CPU without the instructions: the
    kernel declines (the engine then keeps oneDNN: test_engine_linear_takes_the_kernel_only_on_the_layout_it_reads)."""
    kn = native.kernels("native")
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    wk = _kernel_layout(w)
    if not _gemm_capable(dtype):
        with pytest.raises(RuntimeError):
            kn.linear(torch.randn(2, k).to(dtype), wk.data_ptr(), n, k, b, threads=1)
        return
    for rows in (1, 5, 6, 7, 16, 128):
        x = torch.randn(rows, k, generator=g).to(dtype)
        got = kn.linear(x, wk.data_ptr(), n, k, b, threads=2)
        assert got.dtype == dtype and got.shape == (rows, n)
        want, bound = _bound(x, w, b, dtype)
        err = (got.double() - want).abs()
        assert (err <= bound).all(), (rows, (err - bound).max().item())
        # the split over threads (whole blocks and, where they do not divide evenly, half blocks) changes no sum
        for threads in (1, 3):
            assert torch.equal(kn.linear(x, wk.data_ptr(), n, k, b, threads=threads), got), threads


@needs_cc
@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k", "bias"), SHAPES)
@pytest.mark.parametrize("onednn_layout", ["this-cpu", "plain"])
def test_engine_linear_takes_the_kernel_only_on_the_layout_it_reads(dtype: torch.dtype, n: int, k: int,
                                                                    bias: bool, onednn_layout: str,
                                                                    monkeypatch) -> None:
    """The product's rule on whatever layout oneDNN picks on this CPU (with AMX it packs bfloat16 otherwise):
    the layout check accepts oneDNN's packed weight exactly when its bytes are the kernel's layout; the engine's
    ``Linear`` then runs the kernel, else falls back to oneDNN for every size — and either way its few-row
    outputs are within the float64 bound. ``plain``: oneDNN handed a layout the kernel does not read (its plain
    ``[out, in]`` one, as many bytes), so the fallback runs on every host, not only where oneDNN packs otherwise."""
    from pipeline.cpu_runtime.linear import Linear

    kn = native.kernels("native")
    if onednn_layout == "plain":
        monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", lambda w, batch_hint: w.to_mkldnn())
    g = torch.Generator().manual_seed(n * k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    lin = Linear(w, b, packed=True)
    same = _same_bytes(lin.weight, _kernel_layout(w))
    if onednn_layout == "plain":
        assert not same
    readable = same and _gemm_capable(dtype)  # the kernel reads it, and this CPU can run the kernel
    assert kn.packed_layout_ok(lin.weight, n, k, dtype, b) == readable
    assert lin.use_native(kn) == readable
    for rows in (1, 7):
        x = torch.randn(rows, k, generator=g).to(dtype)
        got = lin(x)
        onednn = torch.ops.mkldnn._linear_pointwise(x, lin.weight, b, "none", [], "")
        if readable:
            assert torch.equal(got, kn.linear(x, torch.ops.mkldnn.data_ptr(lin.weight), n, k, b, torch.get_num_threads()))
        else:  # the fallback: oneDNN's own GEMM, bit for bit
            assert torch.equal(got, onednn)
        want, bound = _bound(x, w, b, dtype)
        assert ((got.double() - want).abs() <= bound).all()


@needs_cc
@needs_mkldnn
def test_packed_layout_check_refuses_what_the_kernel_would_misread() -> None:
    kn = _gemm_kernels()
    w = torch.randn(576, 1536)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
    assert kn.packed_layout_ok(packed, 576, 1536, torch.float32, None) == _same_bytes(packed, _kernel_layout(w))
    # the same weight as a oneDNN tensor in its plain [out, in] layout: as many bytes, other places (oneDNN
    # itself reads it right)
    plain = w.to_mkldnn()
    assert torch.ops.mkldnn._nbytes(plain) == w.numel() * 4
    assert not kn.packed_layout_ok(plain, 576, 1536, torch.float32, None)
    # in-features not a multiple of 16: oneDNN pads the packed weight
    assert not kn.packed_layout_ok(torch.ops.mkldnn._reorder_linear_weight(torch.randn(64, 18), 64), 64, 18,
                                   torch.float32, None)
    # out-features not a multiple of 64: the kernel declines, and refuses a direct call
    odd = torch.ops.mkldnn._reorder_linear_weight(torch.randn(100, 64), 64)
    assert not kn.packed_layout_ok(odd, 100, 64, torch.float32, None)
    with pytest.raises(RuntimeError, match="unsupported shape"):
        kn.linear(torch.randn(2, 64), torch.ops.mkldnn.data_ptr(odd), 100, 64, None, threads=1)
    with pytest.raises(ValueError, match="does not match a weight of 1536 inputs"):  # would read past the weight
        kn.linear(torch.randn(2, 2048), torch.ops.mkldnn.data_ptr(plain), 576, 1536, None, threads=1)


@needs_cc
@needs_mkldnn
def test_portable_build_keeps_onednn_for_every_gemm(tmp_path, monkeypatch) -> None:
    """Built without AVX-512 the GEMM kernel declines (-2) and the layout check says no, so the engine keeps
    oneDNN for every size (decode attention and the glue still run their portable loops)."""
    monkeypatch.setenv("TRTPIPE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-mno-avx512f"))
    kn = native.load()
    assert kn.name == "native"
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(128, 64), 64)
    assert not kn.packed_layout_ok(packed, 128, 64, torch.float32, None)


@needs_cc
@needs_mkldnn
def test_engine_linear_runs_the_kernel_up_to_its_row_limit_and_onednn_above() -> None:
    from pipeline.cpu_runtime.linear import NATIVE_GEMM_MAX_ROWS, Linear

    kn = _gemm_kernels()
    g = torch.Generator().manual_seed(11)
    w = torch.randn(192, 256, generator=g)
    lin = Linear(w, None, packed=True)
    if not _same_bytes(lin.weight, _kernel_layout(w)):  # the rule itself: test_engine_linear_takes_the_kernel_only_...
        assert not lin.use_native(kn)
        pytest.skip("oneDNN packs this weight in another layout on this CPU: the engine keeps oneDNN for every size")
    assert lin.use_native(kn)
    ptr = torch.ops.mkldnn.data_ptr(lin.weight)
    for rows in (1, NATIVE_GEMM_MAX_ROWS):
        x = torch.randn(rows, 256, generator=g)
        assert torch.equal(lin(x), kn.linear(x, ptr, 192, 256, None, torch.get_num_threads()))
    x = torch.randn(NATIVE_GEMM_MAX_ROWS + 1, 256, generator=g)
    assert torch.equal(lin(x), torch.ops.mkldnn._linear_pointwise(x, lin.weight, None, "none", [], ""))
    assert not lin.use_native(None)  # back to oneDNN for every size
    x = torch.randn(3, 256, generator=g)
    assert torch.equal(lin(x), torch.ops.mkldnn._linear_pointwise(x, lin.weight, None, "none", [], ""))


def test_build_refuses_a_bad_kernel_choice_before_quantize(tmp_path) -> None:
    """`trtpipe build` of the CPU recipe with a bad $TRTPIPE_CPU_KERNELS: one line naming the variable, exit 2, before
    any stage (nothing written; no calibration run: well under the ~50 s of a first quantize)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "build"
    env = {**os.environ, native.KERNELS_ENV: "fast"}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "build", str(repo / "recipes" / "smollm2_135m_cpu_fp8.yaml"),
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert any("TRTPIPE_CPU_KERNELS='fast' is not one of auto, native, torch" in ln for ln in lines), lines
    assert "Traceback" not in proc.stderr
    assert not out.exists()


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(dtype: torch.dtype) -> None:
    """The MLP's silu(gate) · up on the fused gate/up output against torch's ops on the same dtype (an inter width
    that is not a multiple of 16, so the vector and the scalar loops both run; gates from -100 to 100)."""
    kn = native.kernels("native")
    g = torch.Generator().manual_seed(5)
    rows, inter = 5, 1000
    gu = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gu[0, :7] = torch.tensor([-100.0, -88.0, -20.0, 0.0, 20.0, 88.0, 100.0]).to(dtype)
    got = kn.silu_mul(gu)
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    assert got.dtype == dtype and got.shape == (rows, inter)
    if dtype == torch.float32:
        assert torch.allclose(got, want, rtol=4e-7, atol=1e-30), (got - want).abs().max()  # gates < -87: both ~0
    else:  # both round silu(g) to bfloat16, then the product: equal but where silu sits on a rounding boundary
        assert (got != want).float().mean() < 0.01
        assert torch.allclose(got.float(), want.float(), rtol=8e-3, atol=1e-30)  # gates < -87: both ~0
