"""The GPU catalog: required GPUs, one memory convention (nvidia-smi MiB), datasheet figures, lookups."""

from __future__ import annotations

import pytest

from pipeline.core import hardware

REQUIRED = ["a100_40gb", "a100_80gb", "h100_sxm", "h100_pcie", "h200", "l40s", "l4", "a10g", "rtx4090", "b200"]


def test_required_gpus_are_in_the_catalog():
    assert set(REQUIRED) <= set(hardware.catalog())


@pytest.mark.parametrize("key", REQUIRED)
def test_entry_is_consistent(key):
    g = hardware.catalog()[key]
    assert g.memory_gib == pytest.approx(g.memory_mib / 1024, abs=0.01)
    assert g.memory_bytes == g.memory_mib * 2**20
    # the nvidia-smi total is within 10 % of the datasheet figure (decimal GB): same memory, other units
    assert 0.9 < g.memory_mib * 2**20 / (g.memory_gb * 1e9) < 1.1
    assert g.memory_bandwidth_tbs > 0 and g.bf16_tflops > 0
    assert g.fp8 == (g.fp8_tflops is not None) and g.fp4 == (g.fp4_tflops is not None)
    if g.fp8_tflops:
        assert g.fp8_tflops == pytest.approx(2 * g.bf16_tflops, rel=0.02)  # FP8 is twice BF16 on every FP8 GPU
    if g.fp4_tflops:
        assert g.fp4_tflops == pytest.approx(2 * g.fp8_tflops, rel=0.02)
    assert g.int8_tops is not None and g.int8_tops >= g.bf16_tflops
    assert g.source and "memory_mib" in g.sources
    assert g.fp8 == (g.arch in ("ada", "hopper", "blackwell"))
    assert g.fp4 == (g.arch == "blackwell")


def test_known_figures():
    c = hardware.catalog()
    # the datasheet's "141 GB" H200 is decimal GB: nvidia-smi shows 143771 MiB = 140.40 GiB
    assert c["h200"].memory_mib == 143771 and c["h200"].memory_gib == 140.4 and c["h200"].memory_gb == 141
    assert c["h100_sxm"].memory_mib == 81559 and c["a100_80gb"].memory_mib == 81920 and c["a100_40gb"].memory_mib == 40960
    assert c["h100_sxm"].memory_bandwidth_tbs == 3.35 and c["h200"].memory_bandwidth_tbs == 4.8
    assert c["a100_40gb"].memory_bandwidth_tbs == 1.555 and c["a100_80gb"].memory_bandwidth_tbs == 2.039
    assert c["h100_sxm"].bf16_tflops == 989 and c["h100_sxm"].fp8_tflops == 1979  # dense = sparse / 2
    assert c["l40s"].bf16_tflops == 362 and c["l4"].memory_bandwidth_tbs == 0.3
    assert c["rtx4090"].bf16_tflops == 165.2 and c["b200"].fp4_tflops == 9000
    assert [c[k].compute_capability for k in ("a100_80gb", "a10g", "l4", "h200", "b200")] == ["8.0", "8.6", "8.9", "9.0", "10.0"]


def test_lookup_by_key_and_alias_case_insensitive():
    assert hardware.lookup("H200").key == "h200"
    assert hardware.lookup(" a100 ").key == "a100_80gb"
    assert hardware.lookup("4090").key == "rtx4090"
    assert hardware.lookup("h300") is None
    assert hardware.lookup("cpu") is None


def test_inconsistent_entry_is_rejected():
    g = hardware.catalog()["l4"].model_dump()
    g["memory_gib"] = 24.0  # the datasheet figure, not memory_mib / 1024
    with pytest.raises(ValueError, match="memory_gib"):
        hardware.GpuSpec(**g)


@pytest.mark.parametrize("key", REQUIRED)
def test_every_constant_names_its_source(key):
    """Each numeric constant of an entry carries its own source: a URL, a datasheet or a stated derivation."""
    g = hardware.catalog()[key]
    for field in hardware.SOURCED_FIELDS:
        if getattr(g, field) is None:
            continue
        src = g.sources.get(field, "")
        assert src, f"{key}.{field} has no source"
        assert "http" in src or "derived" in src or "assumed" in src, f"{key}.{field}: {src!r} names no URL nor derivation"


def test_entry_without_a_source_is_rejected():
    g = hardware.catalog()["h200"].model_dump()
    g["sources"] = {k: v for k, v in g["sources"].items() if k != "memory_bandwidth_tbs"}
    with pytest.raises(ValueError, match="no source for memory_bandwidth_tbs"):
        hardware.GpuSpec(**g)
