"""`trtpipe deploy k8s` for `serving.frontend: trtllm-serve`: real renders of the H200 PyTorch recipe, checked on the
files written (Helm's own engine, kubernetes-validate and the pinned CRD schemas; no mocks).

The command a pod runs is the engine stage's: the test builds the recipe with `trtpipe build --dry-run` and
compares the rendered argv with the build's `engine/trtllm_serve.json`. The probes must hit trtllm-serve's
`/health` (the contract's route) on the port that argv serves; the Prometheus route is scraped only where
upstream mounts it (`return_perf_metrics`). A Triton recipe keeps its Triton shape; refused combinations exit 2
with one line and write nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.errors import StageError
from pipeline.deploy import trtllm_serve as ts
from pipeline.deploy import validate as kval
from pipeline.deploy.helm import render_chart
from pipeline.deploy.stage import run
from pipeline.serve.frontend import trtllm_serve_argv
from pipeline.trtllm.llmapi import llmapi_contract

REPO = Path(__file__).resolve().parents[1]
PYT = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
TRT = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
TS = ["serving.frontend=trtllm-serve"]
PERF = TS + ["build.pytorch.return_perf_metrics=true"]
TP8PP2 = ["target.tp_size=8", "target.pp_size=2", "target.num_gpus=16", "target.gpus_per_node=8"]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def objects(out: Path) -> dict[str, list[dict]]:
    """``{kind: [objects]}`` of everything validated in ``out`` (rendered chart, or the plain manifests)."""
    root = out / "rendered" if (out / "rendered").is_dir() else out
    objs: dict[str, list[dict]] = {}
    for f in sorted(root.rglob("*.yaml")):
        for d in docs(f):
            objs.setdefault(d["kind"], []).append(d)
    return objs


def _build(tmp: Path, name: str, *sets: str) -> Path:
    """`trtpipe build RECIPE --dry-run` (the engine stage writes trtllm_serve.json and the options YAML)."""
    out = tmp / name
    args = [a for s in sets for a in ("--set", s)]
    subprocess.run([sys.executable, "-m", "pipeline.cli", "build", str(PYT), "--dry-run", *args, "--out", str(out)],
                   check=True, capture_output=True, cwd=tmp, env=ENV, timeout=300)
    return out


def _value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ts")
    builds = base / "builds"
    builds.mkdir()
    res = {"build": _build(builds, "llama31_8b_h200_fp8_pytorch", *TS)}
    res["helm"] = run(PYT, base / "helm", overrides=TS)
    res["kserve"] = run(PYT, base / "kserve", fmt="kserve", overrides=TS)
    res["perf"] = run(PYT, base / "perf", overrides=PERF)
    res["perf-kserve"] = run(PYT, base / "perf-kserve", fmt="kserve", overrides=PERF)
    res["lws"] = run(PYT, base / "lws", overrides=TS + TP8PP2)
    res["from-build"] = run(res["build"], base / "from-build")
    res["lws-build"] = _build(builds, "tp8pp2", *TS, *TP8PP2)
    res["lws-from-build"] = run(res["lws-build"], base / "lws-from-build")
    # the recipe rendered for a volume mounted where the dry-run build lives: same paths as the build's argv
    res["recipe-at-build"] = run(PYT, base / "recipe-at-build", overrides=TS, mount_path=str(builds))
    return res


def _server(out: Path) -> dict:
    objs = objects(out)
    if "Deployment" in objs:
        return objs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    return objs["LeaderWorkerSet"][0]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]


# ------------------------------------------------------------------------------------------ renders + validation
@pytest.mark.parametrize("key,kinds", [
    ("helm", {"Deployment", "Service", "PodDisruptionBudget", "Job"}),
    ("perf", {"Deployment", "Service", "PodDisruptionBudget", "Job", "PodMonitor"}),
    ("lws", {"LeaderWorkerSet", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget", "Job"}),
    ("kserve", {"ServingRuntime", "InferenceService"}),
    ("perf-kserve", {"ServingRuntime", "InferenceService"}),
    ("from-build", {"Deployment", "Service", "PodDisruptionBudget", "Job"}),
    ("lws-from-build", {"LeaderWorkerSet", "Service", "ServiceAccount", "Role", "RoleBinding", "PodDisruptionBudget",
                        "Job"}),
])
def test_renders_and_every_object_passes_the_triton_paths_validation(outs, key, kinds):
    r = outs[key]
    objs = objects(r.out)
    assert set(objs) == kinds
    checked = 0
    for kind, items in objs.items():
        for obj in items:
            assert kval.object_errors(obj) == [], kind
            checked += 1
    manifest = json.loads((r.out / "manifest.json").read_text())
    assert manifest["frontend"] == "trtllm-serve" and manifest["objects_validated"] == checked == r.objects
    assert "triton" not in json.dumps(objs).replace("tritonserver:", "")  # no Triton flag, port, route or secret


def test_validation_catches_a_broken_trtllm_serve_object(outs):
    dep = objects(outs["helm"].out)["Deployment"][0]
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"] = [8000]
    assert kval.object_errors(dep)
    rt = objects(outs["kserve"].out)["ServingRuntime"][0]
    rt["spec"]["supportedModelFormats"][0]["autoSelect"] = "no"
    assert kval.object_errors(rt)


# ------------------------------------------------------------------------------------------ the command line
def test_container_command_is_the_builds_trtllm_serve_argv(outs):
    stored = json.loads((outs["build"] / "engine" / "trtllm_serve.json").read_text())
    host_port = _value(stored["argv"], "--port")
    want = trtllm_serve_argv(stored, "0.0.0.0", int(host_port))
    # a build directory: the argv it stored, bound to all interfaces
    assert _server(outs["from-build"].out)["command"] == want
    # a recipe: the engine stage's function makes the same argv (no flag spelled a second time)
    assert _server(outs["recipe-at-build"].out)["command"] == want
    assert want[0] == "trtllm-serve" and _value(want, "--host") == "0.0.0.0"
    # the options YAML ships on the build volume, as the Triton repository does
    options = Path(_value(want, "--extra_llm_api_options"))
    assert options.is_file() and options == outs["build"] / "engine" / "trtllm_serve_options.yaml"
    mounts = _server(outs["from-build"].out)["volumeMounts"]
    assert any(str(options).startswith(m["mountPath"] + "/") and m["name"] == "builds" for m in mounts)


def test_recipe_render_serves_the_recipes_checkpoint_and_options(outs):
    argv = _server(outs["helm"].out)["command"]
    spec_build = "/models/llama31_8b_h200_fp8_pytorch"
    assert argv[1] == _value(argv, "--tokenizer") == f"{spec_build}/quantize/hf_ckpt"
    assert _value(argv, "--extra_llm_api_options") == f"{spec_build}/engine/trtllm_serve_options.yaml"
    assert (_value(argv, "--backend"), _value(argv, "--tp_size"), _value(argv, "--pp_size")) == ("pytorch", "1", "1")


def test_probes_hit_health_on_the_served_port(outs):
    health = llmapi_contract()["trtllm_serve"]["routes"]["health"]["path"]
    assert health == ts.HEALTH_PATH == "/health"
    for key in ("helm", "perf", "lws", "from-build"):
        objs = objects(outs[key].out)
        c = _server(outs[key].out)
        argv = c["command"] if "--port" in c["command"] else c["args"][0].split()  # LWS leader: its mpirun script
        port = int(_value(argv, "--port"))
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports == {"http": port}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": health, "port": "http"}, (key, probe)
        assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 1800
        svc = objs["Service"][0]["spec"]["ports"]
        assert [(p["name"], p["port"], p["targetPort"]) for p in svc] == [("http", port, "http")]
    rt = objects(outs["kserve"].out)["ServingRuntime"][0]["spec"]["containers"][0]
    port = int(_value(rt["command"], "--port"))
    assert port == rt["ports"][0]["containerPort"] == 8080  # KServe's data-plane HTTP port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert rt[probe]["httpGet"] == {"path": health, "port": port}


def test_gpu_resources_are_as_for_triton(outs):
    for key, gpus in (("helm", "1"), ("lws", "8")):
        res = _server(outs[key].out)["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == gpus
    model = objects(outs["kserve"].out)["InferenceService"][0]["spec"]["predictor"]["model"]
    assert model["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert model["modelFormat"] == {"name": ts.KSERVE_FORMAT} and "protocolVersion" not in model
    rt = objects(outs["kserve"].out)["ServingRuntime"][0]
    assert model["runtime"] == rt["metadata"]["name"]
    assert rt["spec"]["supportedModelFormats"][0]["name"] == ts.KSERVE_FORMAT and "protocolVersions" not in rt["spec"]


# ------------------------------------------------------------------------------------------ metrics, autoscaling
def test_prometheus_route_is_scraped_only_where_upstream_mounts_it(outs):
    assert "PodMonitor" not in objects(outs["helm"].out)
    pm = objects(outs["perf"].out)["PodMonitor"][0]["spec"]["podMetricsEndpoints"]
    assert pm == [{"port": "http", "path": "/prometheus/metrics", "interval": "6s"}]
    assert "annotations" not in objects(outs["kserve"].out)["ServingRuntime"][0]["spec"]
    ann = objects(outs["perf-kserve"].out)["ServingRuntime"][0]["spec"]["annotations"]
    assert ann == {"prometheus.kserve.io/port": "8080", "prometheus.kserve.io/path": "/prometheus/metrics"}
    for key in ("helm", "perf", "lws"):
        objs = objects(outs[key].out)
        assert not {"HorizontalPodAutoscaler", "PrometheusRule"} & set(objs)
        assert not (outs[key].out / "prometheus-adapter-values.yaml").exists()
        assert not list((outs[key].out / "chart").glob("*/dashboards"))
    # without an HPA the workload carries its replica count
    assert objects(outs["helm"].out)["Deployment"][0]["spec"]["replicas"] == 1


def _chart(outs, key="helm") -> Path:
    return next((outs[key].out / "chart").iterdir())


def test_helm_values_schema_and_templates_refuse_what_trtllm_serve_cannot_do(outs):
    for bad, msg in (({"autoscaling": {"enabled": True}}, "/autoscaling/enabled"),  # the schema, before any template
                     ({"monitoring": {"prometheusRule": {"enabled": True}}}, "/monitoring/prometheusRule/enabled"),
                     ({"monitoring": {"podMonitor": {"enabled": True}}}, "return_perf_metrics"),
                     ({"triton": {"binary": "tritonserver"}}, "triton"),
                     ({"trtllmServe": {"port": 0}}, "port")):
        with pytest.raises(StageError, match=msg):
            render_chart(_chart(outs), values=bad)


def test_port_value_moves_the_process_the_service_and_the_probes_together(outs):
    rendered = render_chart(_chart(outs), values={"trtllmServe": {"port": 9000}})
    objs = {d["kind"]: d for key, text in rendered.items() if key.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d}
    c = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert _value(c["command"], "--port") == "9000" and c["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert objs["Service"]["spec"]["ports"][0]["port"] == 9000
    args = objs["Job"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:5] == ["bench", "--api", "openai", "--url", f"http://{objs['Service']['metadata']['name']}:9000/v1"]


@pytest.mark.parametrize("key", ["helm", "perf", "lws"])
def test_helm_lint_strict_finds_no_warning(outs, key):
    import helm_python

    report = helm_python.lint(str(_chart(outs, key)), strict=True)
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []


# ------------------------------------------------------------------------------------------ multi-node
def test_tp8_pp2_leader_runs_every_rank_under_trtllm_llmapi_launch(outs):
    """TP8 × PP2 on 8-GPU nodes: an LWS of 2 pods; the leader's mpirun starts 16 ranks, each
    `trtllm-llmapi-launch <the build's trtllm-serve argv>` (rank 0 serves, the others are MPI workers)."""
    stored = json.loads((outs["lws-build"] / "engine" / "trtllm_serve.json").read_text())
    want = trtllm_serve_argv(stored, "0.0.0.0", int(_value(stored["argv"], "--port")))
    for key in ("lws", "lws-from-build"):
        objs = objects(outs[key].out)
        assert "Deployment" not in objs
        lws = objs["LeaderWorkerSet"][0]["spec"]["leaderWorkerTemplate"]
        assert lws["size"] == 2
        leader = lws["leaderTemplate"]["spec"]["containers"][0]
        assert leader["name"] == ts.CONTAINER == lws["workerTemplate"]["spec"]["containers"][0]["name"]
        assert "env" not in leader  # no Triton admin key
        script = leader["args"][0]
        assert f"-c {ts.CONTAINER} -- /bin/sh -c" in script  # mpirun's kubectl-exec agent reaches this container
        mpirun = script.strip().splitlines()[-1]
        assert mpirun.startswith('exec mpirun --allow-run-as-root --host "$hosts" ')
        head, served = mpirun.split(f" {ts.LAUNCHER} ", 1)
        assert head.split()[-2:] == ["-n", "16"] and mpirun.count(ts.LAUNCHER) == 1
        if key == "lws-from-build":
            assert served.split() == want
        assert (_value(served.split(), "--tp_size"), _value(served.split(), "--pp_size")) == ("8", "2")
        assert objs["Service"][0]["spec"]["selector"]["trtpipe.dev/role"] == "leader"


# ------------------------------------------------------------------------------------------ Triton unchanged
def test_triton_recipes_keep_their_triton_shape(tmp_path):
    """The trtllm-serve branches leave a Triton render as it was: Triton's argv with the admin key, three ports,
    Triton's health routes and metrics port, the admin Secret, the HPA stack, the dashboard."""
    for recipe in (PYT, TRT):
        r = run(recipe, tmp_path / recipe.stem)
        objs = objects(r.out)
        assert set(objs) == {"Deployment", "Service", "PodMonitor", "PrometheusRule", "HorizontalPodAutoscaler",
                             "PodDisruptionBudget", "Job", "Secret"}
        c = objs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
        assert list(c) == ["name", "image", "imagePullPolicy", "command", "env", "ports", "startupProbe",
                           "readinessProbe", "livenessProbe", "resources", "volumeMounts"]
        assert c["name"] == "triton" and c["command"][0] == "/opt/tritonserver/bin/tritonserver"
        assert c["env"][0]["name"] == "TRITON_ADMIN_KEY"
        assert [p["name"] for p in c["ports"]] == [p["name"] for p in objs["Service"][0]["spec"]["ports"]] == \
            ["http", "grpc", "metrics"]
        assert (c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]) == \
            ("/v2/health/ready", "/v2/health/live")
        assert objs["PodMonitor"][0]["spec"]["podMetricsEndpoints"][0] == {"port": "metrics", "path": "/metrics",
                                                                         "interval": "6s"}
        values = yaml.safe_load(next((r.out / "chart").glob("*/values.yaml")).read_text())
        assert "triton" in values and "trtllmServe" not in values
        dumped = json.dumps(objs)
        assert "trtllm-serve" not in dumped and ts.LAUNCHER not in dumped and f'"{ts.HEALTH_PATH}"' not in dumped
        assert (r.out / "prometheus-adapter-values.yaml").is_file()
        assert json.loads((r.out / "manifest.json").read_text())["frontend"] == "triton"


# ------------------------------------------------------------------------------------------ refusals
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "deploy", "k8s", *args], capture_output=True,
                          text=True, cwd=cwd, env=ENV, timeout=120)


def _sets(*sets: str) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.mark.parametrize("args,fault", [
    ([str(PYT), "--format", "dynamo", *_sets(*TS)], "--format dynamo: serving.frontend is 'trtllm-serve'"),
    ([str(PYT), "--format", "kserve", *_sets(*TS, *TP8PP2)], "--format kserve"),
    ([str(TRT), *_sets(*TS)], "serving.frontend"),
])
def test_refused_combinations_are_one_line_exit_2_and_write_nothing(tmp_path, args, fault):
    out = tmp_path / "out"
    p = _cli(*args, "--out", str(out), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fault in lines[0] and "Traceback" not in p.stderr, p.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_a_triton_build_deployed_as_trtllm_serve_asks_for_a_rebuild(tmp_path):
    build = _build(tmp_path, "tritonbuild")
    out = tmp_path / "out"
    p = _cli(str(build), *_sets(*TS), "--out", str(out), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "trtllm_serve.json" in lines[0] and "serving.frontend=trtllm-serve" in lines[0]
    assert not out.exists()


def test_cli_renders_a_trtllm_serve_deployment(tmp_path):
    p = _cli(str(PYT), *_sets(*TS), "--out", str(tmp_path / "k"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "objects valid" in p.stdout
    assert _server(tmp_path / "k")["command"][0] == "trtllm-serve"
