"""PNG plots of a run directory, drawn from its ``summary.csv`` only (matplotlib, Agg backend).

``plots/throughput.png``          output token throughput (tokens/s) vs load, one line per ISL:OSL
``plots/ttft.png``                TTFT p50/p90/p99 (ms) vs load
``plots/itl.png``                 ITL p50/p90/p99 (ms) vs load
``plots/throughput_latency.png``  output tokens/s vs per-user tokens/s (one curve per ISL:OSL,
                                  points labelled with the load) — the throughput–latency curve
``plots/telemetry.png``           per load: GPU utilisation %, memory used (MiB) and power (W) mean/peak from NVML,
                                  or, on a CPU host, the server process tree's CPU % and RSS (MiB) mean/peak
                                  (only when the run has telemetry; :mod:`pipeline.bench.telemetry`)

Load is concurrency (closed loop) or request rate in requests/s (open loop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.bench import telemetry
from pipeline.bench.summary_csv import column, read_summary

PLOTS = "plots"


def _load(row: dict[str, Any]) -> float:
    return row["concurrency"] if row.get("concurrency") is not None else row["request_rate"]


def _by_scenario(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(str(r["scenario"]), []).append(r)
    return {k: sorted(v, key=_load) for k, v in out.items()}


def write_plots(run_dir: Path) -> list[Path]:
    """Draw the plots of ``run_dir`` into ``run_dir/plots``; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_summary(run_dir)
    if not rows:
        return []
    out = Path(run_dir) / PLOTS
    out.mkdir(exist_ok=True)
    groups = _by_scenario(rows)
    xlabel = "concurrency (requests in flight)" if rows[0].get("concurrency") is not None else "request rate (requests/s)"
    log_x = len({_load(r) for r in rows}) > 2 and min(_load(r) for r in rows) > 0
    written = []

    def finish(fig: Any, ax: Any, name: str, ylabel: str, title: str, x: str = xlabel) -> None:
        ax.set_xlabel(x)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(out / name)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sc, rs in groups.items():
        ax.plot([_load(r) for r in rs], [r[column("output_token_throughput")] for r in rs], marker="o", label=f"ISL:OSL {sc}")
    if log_x:
        ax.set_xscale("log", base=2)
    finish(fig, ax, "throughput.png", "output tokens/s", "Output token throughput")

    for tag, name, title in (("time_to_first_token", "ttft.png", "Time to first token"),
                             ("inter_token_latency", "itl.png", "Inter-token latency")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for sc, rs in groups.items():
            for stat, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
                ax.plot([_load(r) for r in rs], [r[column(tag, stat)] for r in rs], style, marker="o", label=f"{sc} {stat}")
        if log_x:
            ax.set_xscale("log", base=2)
        finish(fig, ax, name, "ms", f"{title} percentiles")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for sc, rs in groups.items():
        xs = [r[column("output_token_throughput_per_user", "avg")] for r in rs]
        ys = [r[column("output_token_throughput")] for r in rs]
        ax.plot(xs, ys, marker="o", label=f"ISL:OSL {sc}")
        for x, y, r in zip(xs, ys, rs):
            if x is not None and y is not None:
                ax.annotate(f"{_load(r):g}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize="x-small")
    finish(fig, ax, "throughput_latency.png", "output tokens/s (all users)", "Throughput vs per-user speed",
           x="output tokens/s per user (avg)")
    if (panels := _telemetry_panels(rows)):
        fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4.2), squeeze=False)
        for ax, (key, label) in zip(axes[0], panels):
            for sc, rs in groups.items():
                xs = [_load(r) for r in rs]
                ax.plot(xs, [r.get(telemetry.column(key, "mean")) for r in rs], marker="o", label=f"{sc} mean")
                ax.plot(xs, [r.get(telemetry.column(key, "peak")) for r in rs], "--", marker="^", label=f"{sc} peak")
            if log_x:
                ax.set_xscale("log", base=2)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="x-small")
        fig.suptitle(f"Telemetry per load point (source: {rows[0].get('telemetry_source')})")
        fig.tight_layout()
        fig.savefig(out / "telemetry.png", dpi=110)
        plt.close(fig)
        written.append(out / "telemetry.png")
    return written


#: what the telemetry plot shows, by source: (quantity key, axis label)
_PANELS = {"nvml": (("gpu_util", "GPU utilisation (%)"), ("fb_used", "memory used (MiB)"), ("power_usage", "power (W)")),
           "process": (("cpu_util", "server CPU (% of one core)"), ("rss", "server RSS (MiB)")),
           "host": (("host_cpu_util", "host CPU (% of all cores)"),)}


def _telemetry_panels(rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The telemetry panels the rows have values for (none without telemetry)."""
    panels = _PANELS.get(str(rows[0].get("telemetry_source")), ())
    return [(k, lbl) for k, lbl in panels if any(r.get(telemetry.column(k, "mean")) is not None for r in rows)]
