"""Issue 48 item 4: the planner's held-out errors (a GPU, a model, a TP degree left out of the fit) and the ± band the CLI
prints, which comes from them (pipeline/data/plan_generalisation.yaml), not from the fit's own residuals."""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.plan import calibration as cal
from pipeline.plan import calibration_pytorch as calp
from pipeline.plan import generalisation as gen
from pipeline.plan.model_inputs import gpu_efficiency, held_out_band, pytorch_efficiency

REPO = Path(__file__).resolve().parents[1]


def _set(engine: str, kind: str, held_out: str) -> dict:
    return next(s for s in gen.shipped()["engines"][engine]["sets"] if s["kind"] == kind and s["held_out"] == held_out)


def test_h200_left_out_of_the_engine_fit_recomputed():
    """The engine path with the H200 left out: fitted here on the other three GPUs' published points only, predicted on
    the H200's; the shipped table says the same."""
    train = [p for p in gen.tensorrt_points() if p.gpu != "h200"]
    assert {p.gpu for p in train} == {"h100_sxm", "l40s", "a100_80gb"}
    res = cal.evaluate(cal.fit(train), [p for p in gen.tensorrt_points() if p.gpu == "h200"])
    errs = [r.predicted / r.published - 1 for r in res]
    row = _set("tensorrt", "gpu", "h200")
    assert row["n"] == len(errs) == 9
    assert row["median_abs_error"] == pytest.approx(statistics.median(abs(e) for e in errs), abs=2e-3)
    assert row["max_abs_error"] == pytest.approx(max(abs(e) for e in errs), abs=2e-3)
    assert row["bias"] == pytest.approx(statistics.fmean(errs), abs=2e-3)


def test_tp8_left_out_of_the_pytorch_fit_recomputed():
    """The PyTorch backend with every TP8 column (405B on H100 and H200) left out: fitted here on the TP1/TP2 columns,
    predicted on the TP8 ones; the RMS ln error and the over-predicted count agree with the shipped table."""
    train = [p for p in calp.points() if p.tp != 8]
    held = [p for p in calp.points() if p.tp == 8]
    assert len(train) == 40 and len(held) == 20
    res = calp.evaluate(calp.fit(train), held)
    rms = math.sqrt(statistics.fmean(math.log(r.predicted / r.published) ** 2 for r in res))
    row = _set("pytorch", "tp", "tp8")
    assert row["rms_log_error"] == pytest.approx(rms, abs=2e-3)
    assert row["over"] == sum(r.predicted > r.published for r in res)


def test_every_kind_is_held_out():
    doc = gen.shipped()
    kinds = {e: {(s["kind"], s["held_out"]) for s in v["sets"]} for e, v in doc["engines"].items()}
    assert {("gpu", g) for g in ("h100_sxm", "l40s", "a100_80gb", "h200")} <= kinds["tensorrt"]
    assert {("model", "Llama-3.1-8B-Instruct"), ("model", "Llama-3.3-70B-Instruct"), ("model", "Llama-3.1-405B-Instruct"),
            ("tp", "tp1"), ("tp", "tp2"), ("tp", "tp8"), ("gpu", "h100_sxm"), ("gpu", "h200")} <= kinds["pytorch"]
    # each held-out group covers exactly the points of the table that have it
    assert sum(s["n"] for s in doc["engines"]["pytorch"]["sets"] if s["kind"] == "tp") == len(calp.points())
    assert sum(s["n"] for s in doc["engines"]["tensorrt"]["sets"] if s["kind"] == "gpu") == len(gen.tensorrt_points())


def test_band_is_the_largest_held_out_rms_not_the_fit_residual():
    doc = gen.shipped()
    for engine, eff in (("tensorrt", gpu_efficiency()), ("pytorch", pytorch_efficiency())):
        sets = doc["engines"][engine]["sets"]
        band = max(math.sqrt(statistics.fmean(math.log(p["predicted"] / p["published"]) ** 2 for p in s["points"]))
                   for s in sets)
        assert eff.rel_error == held_out_band(engine) == pytest.approx(band, abs=1e-3)
    # the fit's own residuals are smaller than what it does on data it had not seen
    assert cal.shipped()["fit"]["rms_log_error"] < held_out_band("tensorrt")
    assert calp.shipped()["fit"]["rms_log_error"] < held_out_band("pytorch")


def test_cli_prints_the_held_out_band():
    out = CliRunner().invoke(app, ["plan", str(REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"), "--isl", "1000",
                                   "--osl", "1000"], terminal_width=250)
    assert out.exit_code == 0, out.output
    assert f"±{held_out_band('pytorch'):.0%}" in out.output


def test_docs_carry_the_held_out_tables():
    """docs/plan.md holds every held-out row of the shipped file, as :func:`generalisation.markdown` prints it."""
    text = (REPO / "docs" / "plan.md").read_text()
    for line in gen.markdown(gen.shipped()).splitlines():
        if line.startswith(("| gpu", "| model", "| tp")):
            assert line in text, line


def test_summarise_refuses_an_empty_group():
    with pytest.raises(ValueError, match="no points"):
        gen.summarise("gpu", "x", [])


def test_shipped_file_reproduces():
    """benchmarks/plan_generalisation.py --check: recomputing gives the shipped bands (a few seconds of refits)."""
    doc = gen.document("today")
    for engine, v in doc["engines"].items():
        assert v["band"] == pytest.approx(gen.shipped()["engines"][engine]["band"], abs=2e-3)
        assert re.match(r"(gpu|model|tp|isl_osl) ", v["band_from"])
