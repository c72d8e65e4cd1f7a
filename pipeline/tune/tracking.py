"""MLflow tracking of a sweep: one parent run per tune, one child run per point.

Default store: SQLite at ``<run dir>/mlflow.db`` with artifacts under ``<run dir>/mlruns`` (``--mlflow-uri`` for
another tracking server). Params of a child = the point's flattened resolved recipe (``build.max_batch_size``…)
plus library versions; metrics = bench.json's AIPerf-named metrics (``output_token_throughput``,
``time_to_first_token.p99``, …) logged per load point with ``step`` = its concurrency (the first scenario;
other scenarios are prefixed ``<isl>x<osl>/``), averaged over repeats, plus ``objective`` and ``speedup``;
artifacts = recipe.yaml, point.json, the bench/eval JSON. The parent gets report.md, results.json, pareto.png
and best_recipe.yaml. Rerunning a tune reuses the parent run and logs only points not logged before
(``<run dir>/mlflow_runs.json`` maps point ids to run ids).

Only this module imports ``mlflow`` (the ``tune`` extra: ``mlflow-skinny`` + SQLAlchemy + Alembic).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from pipeline.core.errors import UserError

RUNS_FILE = "mlflow_runs.json"
EXPERIMENT = "trtpipe-tune"
#: MLflow's limit on one param value (mlflow.utils.validation.MAX_PARAM_VAL_LENGTH in mlflow 3.x)
MAX_PARAM_LEN = 6000


def default_uri(out: Path) -> str:
    """``sqlite:///<abs run dir>/mlflow.db``."""
    return f"sqlite:///{(Path(out) / 'mlflow.db').resolve()}"


class Tracker:
    """Logs a sweep to MLflow; ``log_point`` for each finished point, ``finish`` with the report files."""

    def __init__(self, out: Path, tune_name: str, uri: str | None, params: dict[str, Any]):
        try:
            import mlflow  # noqa: F401
            from mlflow.tracking import MlflowClient
        except ImportError:
            raise UserError("MLflow is not installed: pip install 'trtpipe[tune]' (mlflow-skinny), or pass --no-mlflow") from None
        for name in ("mlflow", "alembic"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self.out = Path(out)
        self.uri = uri or default_uri(out)
        self.client = MlflowClient(tracking_uri=self.uri)
        exp = self.client.get_experiment_by_name(EXPERIMENT)
        if exp is None:
            loc = (self.out / "mlruns").resolve().as_uri() if uri is None else None
            self.exp_id = self.client.create_experiment(EXPERIMENT, artifact_location=loc)
        else:
            self.exp_id = exp.experiment_id
        self.runs_file = self.out / RUNS_FILE
        state = json.loads(self.runs_file.read_text()) if self.runs_file.is_file() else {}
        self.state = state if state.get("uri") == self.uri else {"uri": self.uri, "points": {}}
        parent = self.state.get("parent")
        if parent is None or not self._exists(parent):
            run = self.client.create_run(self.exp_id, run_name=tune_name, tags={"trtpipe.kind": "tune"})
            self.state.update(parent=run.info.run_id, points={})
            self._log_params(run.info.run_id, params)
        self.parent = self.state["parent"]
        self._save()

    def _exists(self, run_id: str) -> bool:
        try:
            self.client.get_run(run_id)
            return True
        except Exception:  # noqa: BLE001 - MlflowException for a run of another store
            return False

    def _save(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs_file.write_text(json.dumps(self.state, indent=2) + "\n")

    def _log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], str(v)[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(run_id, params=items[i:i + 100])

    def log_point(self, doc: dict[str, Any], recipe: Any, speedup: float | None) -> str | None:
        """Log a finished or skipped point as a child run (once); returns its run id."""
        from mlflow.entities import Metric

        from pipeline.core import artifacts
        from pipeline.recipe.consumers import flatten

        pid = doc["id"]
        if pid in self.state["points"]:
            return self.state["points"][pid]
        run = self.client.create_run(self.exp_id, run_name=doc["label"], tags={
            "mlflow.parentRunId": self.parent, "trtpipe.point": pid, "trtpipe.status": doc["status"],
            "trtpipe.gate": str((doc.get("gate") or {}).get("verdict", "")), "trtpipe.reason": str(doc.get("reason", ""))[:5000]})
        rid = run.info.run_id
        params = flatten(recipe.model_dump(mode="json")) if recipe is not None else {}
        params |= {f"version.{k}": v for k, v in artifacts.library_versions("trtpipe", "torch", "nvidia-modelopt",
                                                                            "transformers", "tritonclient").items()}
        self._log_params(rid, params)
        metrics: list[Metric] = []
        ts = 0
        first = None
        agg: dict[tuple[str, int], list[float]] = {}
        for rep in doc.get("repeats", []):
            for i, lp in enumerate(rep["load_points"]):
                first = first or lp["scenario"]
                prefix = "" if lp["scenario"] == first else lp["scenario"].replace(":", "x") + "/"
                step = lp["concurrency"] if lp.get("concurrency") is not None else i
                for k, v in lp["metrics"].items():
                    agg.setdefault((prefix + k, step), []).append(v)
        for (k, step), vs in agg.items():
            metrics.append(Metric(k.replace("%", "pct"), sum(vs) / len(vs), ts, step))
        if doc.get("value") is not None:
            metrics.append(Metric("objective", doc["value"], ts, 0))
        if speedup is not None:
            metrics.append(Metric("speedup", speedup, ts, 0))
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(rid, metrics=metrics[i:i + 1000])
        pdir = self.out / "points" / pid
        for f in ("recipe.yaml", "point.json"):
            if (pdir / f).is_file():
                self.client.log_artifact(rid, str(pdir / f))
        for b in sorted(pdir.glob("bench-*/bench.json")):
            self.client.log_artifact(rid, str(b), artifact_path=b.parent.name)
        if (pdir / "eval" / "eval.json").is_file():
            self.client.log_artifact(rid, str(pdir / "eval" / "eval.json"), artifact_path="eval")
        self.client.set_terminated(rid, "FINISHED" if doc["status"] == "DONE" else "KILLED" if doc["status"] == "SKIPPED" else "FAILED")
        if doc["status"] != "FAILED":
            self.state["points"][pid] = rid
            self._save()
        return rid

    def finish(self, files: dict[str, Path], best: str | None) -> None:
        """Attach the report files to the parent run and end it."""
        for p in files.values():
            if p.is_file():
                self.client.log_artifact(self.parent, str(p))
        if best is not None:
            self.client.set_tag(self.parent, "trtpipe.best", best)
        self.client.set_terminated(self.parent)
