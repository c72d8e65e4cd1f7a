"""Device telemetry per load point: NVML on a GPU host, else the host's view of the server process.

While a load point's measured phase runs, a background thread samples every :data:`INTERVAL_S` seconds; the load
point's ``telemetry`` block in bench.json holds, per device, the mean and peak of each quantity, the source, the
interval and the sample count. Names follow NVML's functions and the DCGM exporter's series for the same quantity
(nvml.h of NVIDIA/go-nvml@4ecf9856e622 and etc/default-counters.csv of NVIDIA/dcgm-exporter@691c92762eb5, as
shared/reference/observability-and-mig.md §1–§2 reads them):

==================  ==========================================================  ==============================  =====
key                 NVML call (nvml.h line)                                     DCGM exporter series (csv line)  unit
==================  ==========================================================  ==============================  =====
gpu_util            ``nvmlDeviceGetUtilizationRates().gpu`` (7088; 245-249)     ``DCGM_FI_DEV_GPU_UTIL`` (22)    %
mem_copy_util       ``nvmlDeviceGetUtilizationRates().memory``                  ``DCGM_FI_DEV_MEM_COPY_UTIL``    %
fb_used             ``nvmlDeviceGetMemoryInfo().used`` (6708; bytes → MiB)      ``DCGM_FI_DEV_FB_USED`` (45-47)  MiB
power_usage         ``nvmlDeviceGetPowerUsage`` (6558; mW → W)                  ``DCGM_FI_DEV_POWER_USAGE`` (14) W
sm_clock            ``nvmlDeviceGetClockInfo(NVML_CLOCK_SM)`` (5629)            ``DCGM_FI_DEV_SM_CLOCK`` (6)     MHz
gpu_temp            ``nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)`` (5958)   ``DCGM_FI_DEV_GPU_TEMP`` (11)    °C
==================  ==========================================================  ==============================  =====

NVML's utilisation is the share of "the past sample period" (1/6 s to 1 s by product, nvml.h:243) in which a kernel
ran; it is not supported on MIG devices (nvml.h:7075): those fields are then absent, the others still sampled.

Without NVML (no driver: ``NVMLError_LibraryNotFound``, e.g. every CPU host), the source is ``process``: the server's
process tree (the pid given, else the detached ``trtpipe serve`` server of the URL, else the process listening on the
URL's local port) through psutil (``/proc/<pid>/stat`` and ``statm``): ``cpu_util`` (% of one core, summed over the
tree: Triton and its python-backend stubs, where the CPU engine runs), ``rss`` (MiB, summed), and ``host_cpu_util``
(% of all cores of the machine, psutil.cpu_percent: the bench client shares it). When no server process is found
(a remote server) the source is ``host`` with ``host_cpu_util`` only. The run's notes say which source was used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any

#: sampling interval, s (NVML's own utilisation period is 1/6–1 s)
INTERVAL_S = 0.5
#: quantities by key: unit (the key of a CSV column is ``<key>_<unit>_<mean|peak>``)
UNITS = {"gpu_util": "pct", "mem_copy_util": "pct", "fb_used": "mib", "power_usage": "w", "sm_clock": "mhz",
         "gpu_temp": "c", "cpu_util": "pct", "rss": "mib", "host_cpu_util": "pct"}
MIB = 1 << 20


def column(key: str, stat: str) -> str:
    """The summary.csv column of one quantity's statistic, e.g. ``gpu_util_pct_mean``."""
    return f"{key}_{UNITS[key]}_{stat}"


CSV_COLUMNS = ["telemetry_source", *(column(k, s) for k in UNITS for s in ("mean", "peak"))]


class _Nvml:
    """NVML devices (``pynvml``, the nvidia-ml-py package); raises ``pynvml.NVMLError`` when NVML is unavailable."""

    def __init__(self) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        self.names = [_text(pynvml.nvmlDeviceGetName(h)) for h in self.handles]

    def sample(self) -> list[dict[str, float]]:
        nv, out = self.nv, []
        for h in self.handles:
            row: dict[str, float] = {}
            calls = {
                "gpu_util": lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).gpu,
                "mem_copy_util": lambda h=h: nv.nvmlDeviceGetUtilizationRates(h).memory,
                "fb_used": lambda h=h: nv.nvmlDeviceGetMemoryInfo(h).used / MIB,
                "power_usage": lambda h=h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "sm_clock": lambda h=h: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                "gpu_temp": lambda h=h: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
            }
            for key, call in calls.items():
                try:
                    row[key] = float(call())
                except nv.NVMLError:  # e.g. utilisation on a MIG device: not supported
                    pass
            out.append(row)
        return out

    def close(self) -> None:
        with contextlib.suppress(self.nv.NVMLError):
            self.nv.nvmlShutdown()


class _Process:
    """The server's process tree (psutil): CPU % of one core and RSS summed over it, and the host's CPU %."""

    def __init__(self, pid: int | None) -> None:
        import psutil

        self.ps, self.pid = psutil, pid
        self.last: dict[tuple[int, float], float] = {}
        self.t_last = time.perf_counter()
        psutil.cpu_percent(interval=None)  # the first call only sets psutil's reference point
        self._tree()

    def _tree(self) -> dict[tuple[int, float], tuple[float, int]]:
        """``{(pid, create_time): (cpu seconds, rss bytes)}`` of the tree now (processes that vanish are skipped)."""
        if self.pid is None:
            return {}
        ps = self.ps
        try:
            root = ps.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except ps.Error:
            return {}
        out = {}
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    out[(p.pid, p.create_time())] = (t.user + t.system, p.memory_info().rss)
            except ps.Error:
                continue
        return out

    def sample(self) -> list[dict[str, float]]:
        now, tree = time.perf_counter(), self._tree()
        dt, self.t_last = now - self.t_last, now
        row = {"host_cpu_util": float(self.ps.cpu_percent(interval=None))}
        if tree:
            # CPU time of processes seen in the previous sample too (a new stub's whole past is not this interval's)
            busy = sum(cpu - self.last[k] for k, (cpu, _) in tree.items() if k in self.last)
            if self.last and dt > 0:
                row["cpu_util"] = 100.0 * max(busy, 0.0) / dt
            row["rss"] = sum(rss for _, rss in tree.values()) / MIB
        self.last = {k: cpu for k, (cpu, _) in tree.items()}
        return [row]

    def close(self) -> None:
        pass


@dataclasses.dataclass
class Probe:
    """What a run samples: ``source`` (``nvml`` | ``process`` | ``host``), device names, the reader, and
    ``note``: the one line for the run's notes (which source, and why not NVML)."""

    source: str
    devices: list[str]
    reader: Any
    note: str
    interval_s: float = INTERVAL_S

    def close(self) -> None:
        """Release NVML (idempotent enough: errors on shutdown are ignored)."""
        self.reader.close()


def open_probe(server_pid: int | None = None, url: str | None = None, *, interval_s: float = INTERVAL_S) -> Probe:
    """The telemetry source of a run: NVML when it initialises, else the server's process tree (``server_pid``, else
    :func:`find_server_pid` of ``url``), else the host. Never raises: a failing source falls back to the next."""
    why = ""
    try:
        nv = _Nvml()
        if nv.handles:
            return Probe("nvml", nv.names, nv, f"device telemetry: NVML (nvidia-ml-py), {len(nv.handles)} GPU(s) "
                         f"({', '.join(sorted(set(nv.names)))}), every {interval_s:g} s", interval_s)
        nv.close()
        why = "NVML found no GPU"
    except Exception as e:  # noqa: BLE001 - pynvml.NVMLError_LibraryNotFound on CPU hosts, ImportError without the package
        why = f"NVML unavailable ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
    pid = server_pid if server_pid is not None else find_server_pid(url)
    proc = _Process(pid)
    if pid is not None and proc._tree():
        return Probe("process", [f"server process tree (pid {pid})"], proc,
                     f"device telemetry: {why}; host view of the server process tree pid {pid} (psutil: CPU %, RSS), "
                     f"every {interval_s:g} s", interval_s)
    return Probe("host", ["host"], proc, f"device telemetry: {why}; server process not found on this host — host CPU % "
                 f"only (psutil), every {interval_s:g} s", interval_s)


def find_server_pid(url: str | None) -> int | None:
    """The pid of the server at ``url`` on this host: the detached ``trtpipe serve`` server when it serves that
    URL (artifacts/serve.json), else the process listening on the URL's port on a local address; ``None`` otherwise
    (a remote server, or one whose sockets psutil may not read)."""
    if not url:
        return None
    from pipeline.serve import registry

    try:
        state = registry.read_state(registry.state_path())
        target = registry._host_port(url)
        if state and registry.state_alive(state) and target is not None and target in {
                registry._host_port(state.get("grpc_url") or ""), registry._host_port(f"http://{state.get('http_url') or ''}")}:
            return int(state["pid"])
        if target is None or target[0] != "localhost":
            return None
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == target[1] and c.pid:
                return int(c.pid)
    except Exception:  # noqa: BLE001 - psutil.AccessDenied, an unreadable state file: no pid
        return None
    return None


class Sampler:
    """Samples a :class:`Probe` on a thread between :meth:`start` and :meth:`stop` (one load point's measured phase)."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe
        self.rows: list[list[dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-telemetry", daemon=True)
        self.t0 = self.t1 = 0.0

    def start(self) -> Sampler:
        """Take the first sample now and start sampling every ``probe.interval_s``; returns ``self``."""
        self.t0 = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self.rows.append(self.probe.reader.sample())
            except Exception:  # noqa: BLE001 - a device that disappears mid-run: stop sampling, keep what we have
                return
            if self._stop.wait(self.probe.interval_s):
                return

    def stop(self) -> dict[str, Any]:
        """Stop (taking a last sample) and return the load point's ``telemetry`` block (:func:`summarize`)."""
        self._stop.set()
        self._thread.join()
        with contextlib.suppress(Exception):  # a device gone at the end: the samples so far stand
            self.rows.append(self.probe.reader.sample())
        self.t1 = time.perf_counter()
        return summarize(self.probe, self.rows, self.t1 - self.t0)


def summarize(probe: Probe, rows: list[list[dict[str, float]]], window_s: float) -> dict[str, Any]:
    """The ``telemetry`` block: ``source``, ``interval_s``, ``window_s``, ``samples`` and per device ``{name,
    metrics: {key: {mean, peak, unit}}}`` (a quantity never read is left out), plus ``overall``: the mean over devices
    of each mean and the highest peak (what the CSV and plots show)."""
    devices = []
    for i, name in enumerate(probe.devices):
        series: dict[str, list[float]] = {}
        for row in rows:
            if i < len(row):
                for k, v in row[i].items():
                    series.setdefault(k, []).append(v)
        metrics = {k: {"mean": sum(v) / len(v), "peak": max(v), "unit": UNITS[k]} for k, v in series.items() if v}
        devices.append({"index": i, "name": name, "metrics": metrics})
    overall: dict[str, dict[str, float]] = {}
    for k in UNITS:
        got = [d["metrics"][k] for d in devices if k in d["metrics"]]
        if got:
            overall[k] = {"mean": sum(g["mean"] for g in got) / len(got), "peak": max(g["peak"] for g in got)}
    return {"source": probe.source, "interval_s": probe.interval_s, "window_s": window_s, "samples": len(rows),
            "devices": devices, "overall": overall}


def csv_values(block: dict[str, Any] | None) -> dict[str, Any]:
    """The :data:`CSV_COLUMNS` of one load point's ``telemetry`` block (empty cells for what it lacks)."""
    out: dict[str, Any] = {c: None for c in CSV_COLUMNS}
    if not block:
        return out
    out["telemetry_source"] = block["source"]
    for k, st in block.get("overall", {}).items():
        out[column(k, "mean")], out[column(k, "peak")] = st["mean"], st["peak"]
    return out


def flat(block: dict[str, Any] | None) -> dict[str, float]:
    """``{"telemetry.gpu_util.mean": …, "telemetry.gpu_util.peak": …}`` of a load point (for MLflow metrics)."""
    if not block:
        return {}
    return {f"telemetry.{k}.{s}": float(v) for k, st in block.get("overall", {}).items() for s, v in st.items()}


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)
