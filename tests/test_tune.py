"""``trtpipe tune``: TUNE.yaml validation, the statistics (Pareto front, speedup intervals, tie rule), the dry run of
the shipped GPU tune, and a real sweep on the CPU default (build → serve → bench, SKIPPED by the planner, resume,
MLflow read back)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.tune import analysis as an
from pipeline.tune.spec import SloSpec, load_tune, tune_json_schema

REPO = Path(__file__).resolve().parents[1]


def cli(*args: str, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], check=False, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}


# ---------------------------------------------------------------------- statistics, on hand-built numbers
def test_pareto_front_by_hand():
    pts = [(10, 100), (20, 80), (15, 90), (5, 50), (20, 70), (30, 10), (15, 90)]
    # (5,50) is dominated by (10,100); (20,70) by (20,80); the rest are not; duplicates of a front point stay;
    # sorted by tokens/s per user: (10,100), (15,90) ×2, (20,80), (30,10)
    assert an.pareto_front(pts) == [0, 2, 6, 1, 5]
    assert an.pareto_front([(1, 1)]) == [0]
    assert an.pareto_front([(1, 1), (2, 2)]) == [1]


def test_winner_needs_a_separated_interval():
    clear = an.decide({"a": [110, 112, 111], "b": [100, 101, 99], "c": [50, 51, 52]})
    assert (clear.best, clear.runner_up, clear.tie) == ("a", "b", False)
    assert clear.ratio.value == pytest.approx(111 / 100)  # mean 111 over mean 100
    assert clear.ratio.ci[0] > 1
    close = an.decide({"a": [105, 95], "b": [100, 98]})  # means 100 vs 99: the intervals overlap
    assert close.tie and close.best == "a" and close.ratio.ci[0] < 1 < close.ratio.ci[1]
    single = an.decide({"a": [110], "b": [100]})  # one repeat: no interval, never separated
    assert single.tie and single.ratio.ci is None and "fewer than 2 repeats" in single.reason
    assert an.decide({"a": [1.0]}).best == "a" and not an.decide({"a": [1.0]}).tie
    assert an.decide({}).best is None


def test_speedup_interval_and_stacked_rule():
    s = an.speedup([12, 12, 12], [10, 10, 10])
    assert s.value == pytest.approx(1.2) and s.ci == pytest.approx((1.2, 1.2)) and s.better
    assert an.speedup([11], [10]).ci is None and an.speedup([11], [10]).better  # point estimate with 1 repeat
    assert not an.speedup([9], [10]).better
    assert an.speedup([], [10]) is None


def test_objective_respects_slos():
    pts = [
        {"scenario": "64:32", "load": "c1", "metrics": {"output_token_throughput": 20.0, "time_to_first_token.p99": 100.0}},
        {"scenario": "64:32", "load": "c8", "metrics": {"output_token_throughput": 90.0, "time_to_first_token.p99": 900.0}},
        {"scenario": "64:32", "load": "c4", "metrics": {"output_token_throughput": 60.0, "time_to_first_token.p99": 400.0}},
    ]
    slo = [SloSpec(metric="time_to_first_token.p99", max=500)]
    assert an.objective(pts, "output_token_throughput", slo) == (60.0, "64:32/c4")
    assert an.objective(pts, "output_token_throughput", []) == (90.0, "64:32/c8")
    assert an.objective(pts, "output_token_throughput", [SloSpec(metric="time_to_first_token.p99", max=50)]) == (None, None)
    assert an.meets(pts[1]["metrics"], slo) == ["time_to_first_token.p99 900 > 500"]
    assert SloSpec(metric="output_token_throughput_per_user", min=5).metric == "output_token_throughput_per_user.avg"


# ---------------------------------------------------------------------- TUNE.yaml errors
BASE = "recipe: ../recipes/smollm2_135m_cpu_fp8.yaml\n"


@pytest.mark.parametrize(("body", "where", "what"), [
    ("knobs:\n  - field: build.max_batch_size\n    values: [8, 0]\n", ":4 knobs.0.values.1", "build.max_batch_size=0"),
    ("knobs:\n  - field: build.max_batch_sise\n    values: [8]\n", ":3 knobs.0.field", "not a recipe field"),
    ("knobs:\n  - field: serving.max_queue_sise\n    values: [8]\n", ":4 knobs.0.values.0", "unknown key"),
    ("knobs:\n  - field: bench.concurrency\n    values: [[1]]\n", ":3 knobs.0.field", "not a deployment knob"),
    ("knobs:\n  - field: build.max_batch_size\n    values: [8]\nrepeat: 2\n", ":5 repeat", "unknown key"),
    ("knobs:\n  - field: build.max_batch_size\n    values: [8]\nmode: sweep\n", ":5 mode", "'sweep'"),
    ("knobs:\n  - field: build.max_batch_size\n    values: [8]\nobjective:\n  slo:\n    - {metric: ttft.p99, max: 1}\n",
     ":7 objective.slo.0.metric", "unknown metric 'ttft'"),
    ("knobs: []\n", ":2 knobs", "at least 1"),
])
def test_tune_file_errors_are_one_line_exit_2_nothing_written(tmp_path, body, where, what):
    tunes = tmp_path / "tunes"
    tunes.mkdir()
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    f = tunes / "bad.yaml"
    f.write_text(BASE + body)
    res = cli("tune", str(f), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert f"{f}{where}:" in lines[0] and what in lines[0], lines[0]
    assert not (tmp_path / "out").exists() and not (tmp_path / "artifacts").exists()


def test_tune_schema_is_current():
    shipped = json.loads((REPO / "tune.schema.json").read_text())
    assert shipped == tune_json_schema(), "tune.schema.json is stale: run `trtpipe recipe schema --tune -o tune.schema.json`"


def test_shipped_tunes_load():
    cpu = load_tune(REPO / "tunes" / "smollm2_cpu.yaml")
    assert cpu.spec.modes == ["isolation", "stacked"] and cpu.base.target.gpu == "cpu"
    assert {k.field for k in cpu.spec.knobs} == {"quantization.qformat", "build.cpu.dtype", "build.max_batch_size",
                                                 "build.max_num_tokens"}


def test_cpu_dtype_point_rebuilds_the_engine_and_is_gated():
    """build.cpu.dtype changes the CPU engine's numerics but not the quantized checkpoint: the engine is rebuilt
    (the quantize stage reused) and the point goes through the accuracy gate, against a float32 baseline."""
    from pipeline.eval.stage import baseline_recipe
    from pipeline.tune.points import is_full_precision, numerics_changed
    from pipeline.tune.stage import dry_run

    tune = load_tune(REPO / "tunes" / "smollm2_cpu.yaml")
    rows = {r["label"]: r for r in dry_run(tune)}
    bf16 = rows["build.cpu.dtype=bfloat16"]
    assert bf16["rebuilds"] == ["engine", "triton_repo"] and bf16["gate"] and bf16["fits"]
    assert not rows["build.max_batch_size=8"]["gate"]
    base_bf16 = tune.base.model_copy(update={"build": tune.base.build.model_copy(
        update={"cpu": tune.base.build.cpu.model_copy(update={"dtype": "bfloat16"})})})
    assert numerics_changed(base_bf16, tune.base) and not numerics_changed(tune.base, tune.base)
    baseline = baseline_recipe(base_bf16)
    assert baseline.build.cpu.dtype == "float32" and is_full_precision(baseline)
    full_bf16 = baseline.model_copy(update={"build": base_bf16.build})
    assert not is_full_precision(full_bf16)  # full_prec weights computed in bfloat16 are not the baseline


# ---------------------------------------------------------------------- the GPU example, planned on CPU
def test_llama_h200_dry_run_plans_every_point_and_names_rebuilds(tmp_path):
    from pipeline.tune.stage import dry_run

    rows = {r["label"]: r for r in dry_run(load_tune(REPO / "tunes" / "llama31_8b_h200.yaml"))}
    assert rows["base"]["rebuilds"] == ["quantize", "engine", "triton_repo"]
    # runtime knobs of a TensorRT engine rebuild only the model repository; build knobs the engine; formats all
    assert rows["build.kv_cache_config.free_gpu_memory_fraction=0.8"]["rebuilds"] == ["triton_repo"]
    assert rows["build.enable_chunked_prefill=False"]["rebuilds"] == ["triton_repo"]
    assert rows["build.max_batch_size=256"]["rebuilds"] == ["engine", "triton_repo"]
    assert rows["int4_awq"]["rebuilds"] == ["quantize", "engine", "triton_repo"] and rows["int4_awq"]["gate"]
    assert not rows["build.max_batch_size=256"]["gate"]
    skipped = rows["build.kv_cache_config.max_tokens=2000000"]
    assert not skipped["fits"] and "max_tokens 2000000" in skipped["reason"]
    assert rows["base"]["predicted"][(1024, 128, 64)] > rows["base"]["predicted"][(1024, 128, 1)] > 0
    res = cli("tune", str(REPO / "tunes" / "llama31_8b_h200.yaml"), "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "SKIPPED" in res.stdout and "would be built and measured" in res.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written


# ---------------------------------------------------------------------- a real sweep on the CPU default
def _small_tune(tmp_path: Path, knobs: list[dict], extra: dict | None = None) -> Path:
    recipe = yaml.safe_load((REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml").read_text())
    # full precision (no calibration) and a 1-sample quality report: the quantize stage is the slow part here
    recipe["quantization"] = {"qformat": "full_prec", "kv_cache_dtype": "none",
                              "calibration": {"dataset": "embedded", "size": 4, "max_seq_length": 64, "batch_size": 4,
                                              "eval_samples": 1}}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(recipe))
    tune = {"recipe": "base.yaml", "knobs": knobs, "mode": ["isolation", "stacked"],
            "bench": {"scenarios": [{"isl": 16, "osl": 4}], "concurrency": [1, 2], "requests_per_load": 1,
                      "min_requests": 2, "warmup_requests": 0},
            "repeats": 2, **(extra or {})}
    f = tmp_path / "t.yaml"
    f.write_text(yaml.safe_dump(tune, sort_keys=False))
    return f


@pytest.fixture(scope="module")
def engine_sweep(tmp_path_factory) -> tuple[Path, Path, Path, subprocess.CompletedProcess]:
    """The engine-knob sweep, run once per module: (its working directory, TUNE.yaml, run directory, the CLI's result).
    Checked by :func:`test_real_sweep_skips_reuses_resumes_and_tracks`; its finished base point (the same base recipe)
    is resumed by :func:`test_real_sweep_gates_a_quantized_point` instead of being built, served and benched again."""
    tmp_path = tmp_path_factory.mktemp("engine-sweep")
    f = _small_tune(tmp_path, [{"field": "build.max_batch_size", "values": [8]},
                               {"field": "build.kv_cache_config.max_tokens", "values": [512]}])  # < one max_seq_len
    out = tmp_path / "run"
    return tmp_path, f, out, cli("tune", str(f), "--out", str(out), cwd=tmp_path, timeout=600)


@pytest.mark.triton
def test_real_sweep_skips_reuses_resumes_and_tracks(engine_sweep):
    tmp_path, f, out, res = engine_sweep
    assert res.returncode == 0, res.stderr[-3000:]
    # piped, as in CI or `| tee`: a line per point and stage (#44: 120 s without a line), each build stage's outcome
    for line in ("base [", ": plan (", ": build (", ": serve (", ": bench 1/2 (", "quantize: built", "engine: built"):
        assert line in res.stderr, (line, res.stderr[-3000:])
    points = {d["label"]: d for d in (json.loads(p.read_text()) for p in out.glob("points/*/point.json"))}
    # stacked adds "max_batch_size=8 + max_tokens" only when it kept max_batch_size=8 (measured noise decides)
    assert {"base", "build.max_batch_size=8", "build.kv_cache_config.max_tokens=512"} <= set(points)
    assert len(points) in (3, 4)
    base, mbs = points["base"], points["build.max_batch_size=8"]
    assert base["status"] == mbs["status"] == "DONE"
    # the planner refused a KV pool smaller than one sequence, before any build: no build dir, its reason kept
    skipped = points["build.kv_cache_config.max_tokens=512"]
    assert skipped["status"] == "SKIPPED" and "less than one max_seq_len 2304 sequence" in skipped["reason"]
    assert not (out / "points" / skipped["id"] / "build").exists()
    assert not (tmp_path / "artifacts" / ".last_build").exists()  # point builds do not become `trtpipe serve`'s default
    # an engine knob reuses the quantized checkpoint (content keys), rebuilds the engine and the repository
    assert base["stages"] == {"quantize": "built", "engine": "built", "triton_repo": "built"}
    assert mbs["stages"] == {"quantize": "reused", "engine": "built", "triton_repo": "built"}
    # ... and that CPU engine keeps the base's weight file (one inode): a runtime knob costs no new 0.5 GiB copy
    ino = {d["label"]: (out / "points" / d["id"] / "build" / "engine" / "model.safetensors").stat().st_ino for d in (base, mbs)}
    assert ino["base"] == ino["build.max_batch_size=8"]
    for d in (base, mbs):
        assert len(d["repeats"]) == 2 and d["gate"]["verdict"].startswith("not needed")
        lp = d["repeats"][0]["load_points"]
        assert [p["load"] for p in lp] == ["c1", "c2"] and lp[0]["metrics"]["output_token_throughput"] > 0
    report = (out / "report.md").read_text()
    assert "## isolation" in report and "## stacked" in report and "SKIPPED" in report and "Pareto" in report
    assert (out / "pareto.png").stat().st_size > 1000
    best = yaml.safe_load((out / "best_recipe.yaml").read_text())
    assert best["name"] == "t-best"
    results = json.loads((out / "results.json").read_text())
    assert results["decision"]["best"] in (base["id"], mbs["id"])
    assert results["decision"]["tie"] or results["decision"]["runner_up"] is not None

    # resume: a second run reuses every finished point — no build, no bench (files untouched)
    stamps = {p: p.stat().st_mtime_ns for p in [*out.glob("points/*/point.json"), *out.glob("points/*/bench-*/bench.json"),
                                                *out.glob("points/*/build/*/manifest.json")]}
    res2 = cli("tune", str(f), "--out", str(out), cwd=tmp_path, timeout=300)
    assert res2.returncode == 0, res2.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps

    # MLflow: one parent, a child per point with the flattened recipe and AIPerf-named metrics
    from mlflow.tracking import MlflowClient

    state = json.loads((out / "mlflow_runs.json").read_text())
    client = MlflowClient(tracking_uri=state["uri"])
    parent = client.get_run(state["parent"])
    assert parent.info.run_name == "t" and parent.info.status == "FINISHED"
    assert {"report.md", "results.json", "pareto.png"} <= {a.path for a in client.list_artifacts(state["parent"])}
    kids = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{state['parent']}'")
    assert len(kids) == len(points)  # the rerun logged nothing twice
    by_name = {k.info.run_name: k for k in kids}
    child = by_name["build.max_batch_size=8"]
    assert child.data.params["build.max_batch_size"] == "8" and child.data.params["quantization.qformat"] == "full_prec"
    assert "version.trtpipe" in child.data.params
    for m in ("output_token_throughput", "time_to_first_token.p99", "inter_token_latency.p50",
              "output_token_throughput_per_user.avg", "objective"):
        assert m in child.data.metrics, m
    hist = client.get_metric_history(child.info.run_id, "output_token_throughput")
    assert sorted(h.step for h in hist) == [1, 2]  # one value per concurrency
    assert by_name["build.kv_cache_config.max_tokens=512"].data.tags["trtpipe.status"] == "SKIPPED"
    assert {a.path for a in client.list_artifacts(child.info.run_id)} >= {"recipe.yaml", "point.json", "bench-1"}


def _resume_base_point(engine_sweep: tuple, out: Path) -> Path:
    """Hard-link the engine sweep's finished base point into ``out/points`` (a tune resumes a point whose
    ``point.json`` is there); returns its ``point.json`` there."""
    import os
    import shutil

    assert engine_sweep[3].returncode == 0, engine_sweep[3].stderr[-3000:]
    src = next(p.parent for p in engine_sweep[2].glob("points/*/point.json") if json.loads(p.read_text())["label"] == "base")
    shutil.copytree(src, out / "points" / src.name, copy_function=os.link)
    return out / "points" / src.name / "point.json"


@pytest.mark.slow
@pytest.mark.triton
def test_real_sweep_gates_a_quantized_point(tmp_path, engine_sweep):
    """FP8 on a full-precision base changes numerics: the point is built, benched and gated by `trtpipe eval` with the
    kld rule (the point's running server and the baseline answer context logits at once)."""
    f = _small_tune(tmp_path, [{"field": "quantization.qformat", "values": [
        {"value": "fp8", "also": {"quantization.kv_cache_dtype": "fp8", "quantization.calibration.size": 8,
                                  "quantization.calibration.max_seq_length": 64, "quantization.calibration.eval_samples": 2}}]}],
        {"mode": "isolation", "gate": {"n": 4, "max_output_tokens": 8, "rule": "kld"}, "repeats": 1})
    out = tmp_path / "run"
    base = _resume_base_point(engine_sweep, out)
    ino = base.stat().st_ino
    res = cli("tune", str(f), "--out", str(out), "--no-mlflow", cwd=tmp_path, timeout=1200)
    assert res.returncode == 0, res.stderr[-3000:]
    assert base.stat().st_ino == ino  # the base point was resumed (its point.json not rewritten), not measured again
    points = {d["label"]: d for d in (json.loads(p.read_text()) for p in out.glob("points/*/point.json"))}
    fp8 = next(d for k, d in points.items() if k.startswith("quantization.qformat=fp8"))
    assert fp8["numerics_changed"] and fp8["gate"]["verdict"] in ("PASS", "FAIL", "INCONCLUSIVE")
    doc = json.loads((out / "points" / fp8["id"] / "eval" / "eval.json").read_text())
    assert doc["verdict"] == fp8["gate"]["verdict"] and doc["rule"]["rule"] == "kld"
    assert fp8["gate"]["means"]["kld"]["mean_kld"]["value"] > 0
    assert "mean KLD" in (out / "report.md").read_text()
    assert (out / "baseline" / "triton_repo").is_dir()
    results = json.loads((out / "results.json").read_text())
    if fp8["gate"]["verdict"] != "PASS":  # never the best unless it passed
        assert results["decision"]["best"] != fp8["id"]
    assert not (out / "mlflow.db").exists()
