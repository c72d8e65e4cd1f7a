"""The CPU engine's native decode-attention kernel (``pipeline/cpu_runtime/kernels/decode_attention.c``):
built with this machine's C compiler, checked against softmax attention computed here in float64, its build
cache, and the torch fallback when it cannot be built."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

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
    kernel = native.decode_attention("native")
    g = torch.Generator().manual_seed(group * 1000 + d)
    num_slots, kvh, slot_len = 7, 2, 300
    k = (torch.randn(num_slots, kvh, slot_len, d, generator=g) * 2).to(kv_dtype)
    v = torch.randn(num_slots, kvh, slot_len, d, generator=g).to(kv_dtype)
    # slots out of order with gaps; lengths from 1 token to the whole slot, and lengths that are not multiples of 16
    slots = torch.tensor([5, 0, 3, 6], dtype=torch.int64)
    lens = torch.tensor([1, 17, 300, 129], dtype=torch.int64)
    q = torch.randn(len(slots), kvh, group, d, generator=g)
    scale = 1 / math.sqrt(d)
    got = kernel(q, k, v, slots, lens, scale, threads=2)
    want = _reference(q, k.float(), v.float(), slots, lens, scale)
    assert got.dtype == torch.float32 and got.shape == q.shape
    err = (got.double() - want).abs().max().item()
    assert err < 2e-6 * want.abs().max().item() + 1e-7, err
    # one token of context: the output is that token's value row, whatever the scores
    assert torch.allclose(got[0], v[5, :, :1].float().expand(kvh, group, d), atol=1e-7)
    # the same result on one thread (the work split does not change any item's arithmetic)
    assert torch.equal(kernel(q, k, v, slots, lens, scale, threads=1), got)


@needs_cc
def test_kernel_is_built_once_per_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TRTPIPE_KERNEL_CACHE", str(tmp_path / "cache"))
    first = native.build()
    mtime = first.stat().st_mtime_ns
    assert native.build() == first and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    changed = tmp_path / native.SOURCE.name
    changed.write_text(native.SOURCE.read_text() + "\n/* changed */\n")
    other = native.build(changed)
    assert other != first and other.is_file()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, other.name])  # no temp left


def test_without_a_compiler_the_engine_takes_the_torch_path(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setenv("TRTPIPE_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native._load_cached.cache_clear()
    try:
        with pytest.raises(native.KernelUnavailable, match="no-such-cc"):
            native.decode_attention("native")
        with caplog.at_level("WARNING", logger=native.__name__):
            assert native.decode_attention("auto") is None
        assert "torch path" in caplog.text and "no-such-cc" in caplog.text
        monkeypatch.setenv(native.ATTENTION_ENV, "auto")
        assert native.decode_attention() is None
    finally:
        native._load_cached.cache_clear()
    broken = tmp_path / "broken.c"
    broken.write_text("int f( {\n")
    monkeypatch.delenv("CC")
    if shutil.which("cc") or shutil.which("gcc"):
        with pytest.raises(native.KernelUnavailable, match="could not build broken.c"):
            native.build(broken)
        assert not any((tmp_path / "cache").glob("*"))  # nothing half-written
    assert native.decode_attention("torch") is None
    with pytest.raises(ValueError, match="TRTPIPE_CPU_ATTENTION='fast' is not one of auto, native, torch"):
        native.decode_attention("fast")
