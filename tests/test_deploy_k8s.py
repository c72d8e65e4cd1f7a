"""`trtpipe deploy k8s`: the rendered Helm chart, Dynamo and KServe manifests, checked on the files written.

Every object is validated against the Kubernetes OpenAPI schemas (kubernetes-validate) and the pinned CRD
schemas; the cross-reference tests tie the objects to each other and to their sources: the HPA metric, the
PrometheusRule record and the prometheus-adapter rule; Service ports, container ports and Triton's flags;
GPU requests and tp × pp; probe paths and Triton's HTTP routes; the image and the release matrix.
Helm templating runs in Helm's own Go engine (PyPI helm-python-sdk).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.core.errors import StageError, UserError
from pipeline.deploy import metrics
from pipeline.deploy import validate as kval
from pipeline.deploy.helm import render_chart
from pipeline.deploy.spec import resolve
from pipeline.deploy.stage import run
from pipeline.trtllm import release

REPO = Path(__file__).resolve().parents[1]
TRT = REPO / "recipes" / "llama31_8b_h200_fp8.yaml"
PYT = REPO / "recipes" / "llama31_8b_h200_fp8_pytorch.yaml"
CPU = REPO / "recipes" / "smollm2_135m_cpu_fp8.yaml"
TP8PP2 = ["target.tp_size=8", "target.pp_size=2", "target.num_gpus=16", "target.gpus_per_node=8"]
DYNAMO_IMAGE = "registry.example.com/dynamo/tensorrtllm-runtime:test"
#: Triton's HTTP routes for health (triton-inference-server/server src/http_server.cc@10f2a691ab7b:1182)
TRITON_HEALTH_ROUTE = re.compile(r"/v2(?:/health/(live|ready))?")
#: Triton's metrics route (server src/http_server.h@13480cbf300d:155)
TRITON_METRICS_ROUTE = re.compile(r"/metrics/?")
#: the admin-API flags every Triton rank gets, as local `trtpipe serve` off loopback (pipeline.serve.stage)
_ADMIN = "model-repository,shared-memory,logging,trace:triton-admin-key=$(TRITON_ADMIN_KEY)"
RESTRICTED = [f"--http-restricted-api={_ADMIN}", f"--grpc-restricted-protocol={_ADMIN}"]


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(out: Path) -> dict[str, dict]:
    """``{kind: object}`` of a rendered chart (one object per kind, except RBAC which is not needed here)."""
    objs = {}
    for f in sorted((out / "rendered").rglob("*.yaml")):
        for d in docs(f):
            objs.setdefault(d["kind"], d)
    return objs


@pytest.fixture(scope="module")
def outs(tmp_path_factory):
    """Every format of both shipped GPU recipes, plus TP=8 × PP=2 on 8-GPU nodes, rendered once."""
    base = tmp_path_factory.mktemp("deploy")
    res = {}
    for key, recipe in (("trt", TRT), ("pyt", PYT)):
        for fmt in ("helm", "dynamo", "kserve"):
            res[key, fmt] = run(recipe, base / f"{key}-{fmt}", fmt=fmt, dynamo_image=DYNAMO_IMAGE)
    res["lws", "helm"] = run(TRT, base / "lws-helm", overrides=TP8PP2)
    res["lws", "dynamo"] = run(TRT, base / "lws-dynamo", fmt="dynamo", overrides=TP8PP2, dynamo_image=DYNAMO_IMAGE)
    return res


# ------------------------------------------------------------------------------------------ all formats
@pytest.mark.parametrize("key", ["trt", "pyt"])
@pytest.mark.parametrize("fmt", ["helm", "dynamo", "kserve"])
def test_shipped_recipes_render_every_format(outs, key, fmt):
    r = outs[key, fmt]
    manifest = json.loads((r.out / "manifest.json").read_text())
    assert manifest["format"] == fmt and manifest["stage"] == "deploy_k8s"
    assert set(manifest["files"]) == {p.relative_to(r.out).as_posix() for p in r.out.rglob("*") if p.is_file()} - {"manifest.json"}
    yaml_files = [r.out / f for f in r.files if f.endswith(".yaml") and (fmt != "helm" or f.startswith("rendered/"))]
    n_objects = sum(len(docs(f)) for f in yaml_files)
    assert r.objects == manifest["objects_validated"] == n_objects > 0
    kinds = {d["kind"] for f in yaml_files for d in docs(f)}
    expected = {
        "helm": {"Deployment", "Service", "PodMonitor", "PrometheusRule", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Job",
                 "Secret"},
        "dynamo": {"DynamoGraphDeployment"},
        "kserve": {"ServingRuntime", "InferenceService"},
    }[fmt]
    assert kinds == expected
    assert not list(r.out.parent.glob(f".{r.out.name}.tmp-*")), "temp dir left behind"


def test_every_rendered_object_passes_schema_validation(outs):
    checked = 0
    for r in outs.values():
        for f in r.out.rglob("*.yaml"):
            if "chart" in f.relative_to(r.out).parts or f.name == "prometheus-adapter-values.yaml":
                continue
            for obj in docs(f):
                assert kval.object_errors(obj) == [], f"{f}: {obj['kind']}"
                checked += 1
    assert checked == sum(r.objects for r in outs.values())


def test_validation_rejects_broken_objects(outs):
    """The validators can fail: a typo'd field, a wrong type, a CRD bound and a CRD enum are all caught."""
    objs = by_kind(outs["trt", "helm"].out)
    dep = json.loads(json.dumps(objs["Deployment"]))
    dep["spec"]["template"]["spec"]["containers"][0]["portz"] = []
    assert any("portz" in e for e in kval.object_errors(dep))
    svc = json.loads(json.dumps(objs["Service"]))
    svc["spec"]["ports"][0]["port"] = "eight thousand"
    assert kval.object_errors(svc)
    lws = docs(outs["lws", "helm"].out / "rendered" / "leaderworkerset.yaml")[0]
    lws["spec"]["leaderWorkerTemplate"]["size"] = 0
    assert any("size" in e for e in kval.object_errors(lws))
    lws["spec"]["leaderWorkerTemplate"]["size"] = 2
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagePullPolicy"] = 3
    assert any("imagePullPolicy" in e for e in kval.object_errors(lws))
    pm = json.loads(json.dumps(objs["PodMonitor"]))
    pm["spec"]["podMetricsEndpoints"][0]["interval"] = "6 seconds"
    assert kval.object_errors(pm)
    dgd = docs(outs["pyt", "dynamo"].out / "dynamographdeployment.yaml")[0]
    dgd["spec"]["backendFramework"] = "tensorrt"
    assert kval.object_errors(dgd)
    with pytest.raises(StageError, match="no schema"):
        kval.object_errors({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}})


# ------------------------------------------------------------------------------------------ cross-references
@pytest.mark.parametrize("key", ["trt", "pyt", "lws"])
def test_hpa_metric_is_the_rule_record_and_the_adapter_rule(outs, key):
    out = outs[key, "helm"].out
    objs = by_kind(out)
    hpa = objs["HorizontalPodAutoscaler"]["spec"]
    metric = hpa["metrics"][0]
    assert metric["type"] == "Pods" and metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    records = {r["record"]: r["expr"] for g in objs["PrometheusRule"]["spec"]["groups"] for r in g["rules"]}
    adapter = yaml.safe_load((out / "prometheus-adapter-values.yaml").read_text())["rules"]["custom"]
    exposed = {a["name"]["as"]: a for a in adapter}
    engine = "pytorch" if key == "pyt" else "tensorrt"
    assert name == metrics.SIGNALS[metrics.default_signal(engine)].record
    assert name in records and name in exposed
    assert exposed[name]["seriesQuery"].startswith(name + "{")
    assert set(records) == set(exposed), "every recorded signal is exposed by the adapter and vice versa"
    if engine == "tensorrt":
        # audit finding 6: the C++ backend's execute() only enqueues, so Triton's queue/compute ratio stays ~0;
        # the default is the executor's own waiting queue
        assert name == "triton:trtllm_waiting:requests"
        assert 'nv_trt_llm_request_metrics{model="tensorrt_llm",request_type="waiting"}' in records[name]
        assert metric["pods"]["target"]["averageValue"] == "8"
    else:
        # the tutorial's signal: queue time over compute time, per pod (the LLM-API model exports nothing else)
        assert name == "triton:queue_compute:ratio"
        assert "nv_inference_queue_duration_us" in records[name] and "nv_inference_compute_infer_duration_us" in records[name]
        assert metric["pods"]["target"]["averageValue"] == "1000m"
    # HPA target: the chart's workload
    kind = "LeaderWorkerSet" if key == "lws" else "Deployment"
    assert hpa["scaleTargetRef"]["kind"] == kind and hpa["scaleTargetRef"]["name"] == objs[kind]["metadata"]["name"]


def test_signals_offered_match_what_each_backend_exports(outs):
    """The C++ backend offers waiting requests and KV-cache use; the LLM-API model only Triton's core series."""
    assert set(metrics.signals_for("tensorrt")) == {"queue_compute_ratio", "waiting_requests", "kv_cache_utilization"}
    assert set(metrics.signals_for("pytorch")) == {"queue_compute_ratio"}
    for engine in ("tensorrt", "pytorch"):
        for s in metrics.signals_for(engine).values():
            used = set(re.findall(r"\b(nv_[a-z_]+)\b", s.expr))
            assert used and used <= set(metrics.EXPORTED_SERIES[engine]), (engine, s.key, used)
    for key, engine in (("trt", "tensorrt"), ("pyt", "pytorch")):
        rule = by_kind(outs[key, "helm"].out)["PrometheusRule"]
        assert {r["record"] for g in rule["spec"]["groups"] for r in g["rules"]} == {
            s.record for s in metrics.signals_for(engine).values()}
        schema = json.loads(next((outs[key, "helm"].out / "chart").glob("*/values.schema.json")).read_text())
        assert schema["properties"]["autoscaling"]["properties"]["metric"]["enum"] == sorted(metrics.signals_for(engine))


def _container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _flag(argv: list[str], flag: str) -> list[str]:
    return [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]


@pytest.mark.parametrize("key", ["trt", "pyt"])
def test_service_ports_equal_container_ports_equal_triton_flags(outs, key):
    objs = by_kind(outs[key, "helm"].out)
    container = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    cports = _container_ports(container)
    argv = container["command"]
    for p in objs["Service"]["spec"]["ports"]:
        assert cports[p["targetPort"]] == p["port"]
        assert _flag(argv, f"--{p['name']}-port") == [str(p["port"])]
    assert {p["name"] for p in objs["Service"]["spec"]["ports"]} == {"http", "grpc", "metrics"}
    # the whole argv is pipeline.triton.server.triton_command's, as `trtpipe serve` would launch it
    spec = resolve(TRT if key == "trt" else PYT)
    assert argv == spec.triton_argv(extra_args=RESTRICTED)
    assert _flag(argv, "--model-repository") == [f"{spec.build_dir}/triton_repo"]
    # the Service and PodMonitor select the Deployment's pods
    pod_labels = objs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for sel in (objs["Service"]["spec"]["selector"], objs["PodMonitor"]["spec"]["selector"]["matchLabels"],
                objs["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
                objs["Deployment"]["spec"]["selector"]["matchLabels"]):
        assert sel.items() <= pod_labels.items()
    assert objs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_kserve_runtime_ports_and_flags(outs):
    for key in ("trt", "pyt"):
        rt = docs(outs[key, "kserve"].out / "servingruntime.yaml")[0]
        c = rt["spec"]["containers"][0]
        assert _flag(c["command"], "--http-port") == [str(c["ports"][0]["containerPort"])] == ["8080"]
        assert rt["spec"]["annotations"]["prometheus.kserve.io/port"] == _flag(c["command"], "--metrics-port")[0]
        isvc = docs(outs[key, "kserve"].out / "inferenceservice.yaml")[0]
        assert isvc["spec"]["predictor"]["model"]["runtime"] == rt["metadata"]["name"]
        mounts = isvc["spec"]["predictor"]["model"]["volumeMounts"]
        assert any(_flag(c["command"], "--model-repository")[0].startswith(m["mountPath"] + "/") for m in mounts)


@pytest.mark.parametrize("key,tp,pp", [("trt", 1, 1), ("pyt", 1, 1)])
def test_gpu_requests_equal_tp_times_pp_single_node(outs, key, tp, pp):
    objs = by_kind(outs[key, "helm"].out)
    res = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"] == str(tp * pp)
    isvc = docs(outs[key, "kserve"].out / "inferenceservice.yaml")[0]
    assert isvc["spec"]["predictor"]["model"]["resources"]["limits"]["nvidia.com/gpu"] == str(tp * pp)
    dgd = docs(outs[key, "dynamo"].out / "dynamographdeployment.yaml")[0]
    assert dgd["spec"]["services"]["TRTLLMWorker"]["resources"]["limits"]["gpu"] == str(tp * pp)


def test_tp8_pp2_on_8_gpu_nodes_is_a_leaderworkerset_of_size_2(outs):
    out = outs["lws", "helm"].out
    objs = by_kind(out)
    assert "Deployment" not in objs
    lws = objs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert lws["size"] == 2
    per_pod = {int(t["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
               for t in (lws["leaderTemplate"], lws["workerTemplate"])}
    assert per_pod == {8} and lws["size"] * 8 == 8 * 2
    script = lws["leaderTemplate"]["spec"]["containers"][0]["args"][0]
    mpirun = script.strip().splitlines()[-1]
    assert mpirun.startswith("exec mpirun --allow-run-as-root --host ")
    assert mpirun.count("/opt/tritonserver/bin/tritonserver") == 16 and mpirun.count(" : ") == 15
    assert mpirun.count("--load-model=tensorrt_llm") == 15  # every rank but 0
    assert mpirun.count("--allow-http=false") == 15  # only rank 0 serves
    assert '${LWS_LEADER_ADDRESS}:8' in script and '${worker}:8' in script
    # only the leaders take traffic and are what the HPA averages over (LWS hpaPodSelector = leaders)
    assert objs["Service"]["spec"]["selector"]["trtpipe.dev/role"] == "leader"
    assert lws["leaderTemplate"]["metadata"]["labels"]["trtpipe.dev/role"] == "leader"
    role = [d for d in docs(out / "rendered" / "rbac.yaml") if d["kind"] == "Role"][0]
    assert {"pods/exec"} <= {r for rule in role["rules"] for r in rule["resources"]}
    dgd = docs(outs["lws", "dynamo"].out / "dynamographdeployment.yaml")[0]
    assert dgd["spec"]["services"]["TRTLLMWorker"]["multinode"] == {"nodeCount": 2}
    assert dgd["spec"]["services"]["TRTLLMWorker"]["resources"]["limits"]["gpu"] == "8"


def test_probe_paths_exist_in_triton(outs):
    for key in ("trt", "pyt", "lws"):
        objs = by_kind(outs[key, "helm"].out)
        work = objs.get("Deployment") or objs["LeaderWorkerSet"]
        pod = work["spec"]["template"]["spec"] if "template" in work["spec"] else \
            work["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
        c = pod["containers"][0]
        probes = [c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")]
        for p in probes:
            assert TRITON_HEALTH_ROUTE.fullmatch(p["httpGet"]["path"]) and p["httpGet"]["port"] == "http"
        assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
        assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert TRITON_METRICS_ROUTE.fullmatch(objs["PodMonitor"]["spec"]["podMetricsEndpoints"][0]["path"])
        start = c["startupProbe"]
        assert start["periodSeconds"] * start["failureThreshold"] >= 1800


def test_image_is_the_release_matrix_container_of_the_engines_tensorrt_llm(outs, tmp_path):
    want = release.for_tensorrt_llm(release.default_tensorrt_llm()).image
    for key in ("trt", "pyt"):
        objs = by_kind(outs[key, "helm"].out)
        assert objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == want
        rt = docs(outs[key, "kserve"].out / "servingruntime.yaml")[0]
        assert rt["spec"]["containers"][0]["image"] == want
        assert outs[key, "helm"].manifest["image"] == want
    # a build whose engine came from another TensorRT-LLM gets that release's container
    build = tmp_path / "b"
    subprocess.run([sys.executable, "-m", "pipeline.cli", "build", str(TRT), "--dry-run", "--out", str(build)],
                   check=True, capture_output=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    man = json.loads((build / "engine" / "manifest.json").read_text())
    other = release.releases()[0]
    assert other.tensorrt_llm != release.default_tensorrt_llm()
    man.setdefault("versions", {})["tensorrt_llm"] = other.tensorrt_llm
    (build / "engine" / "manifest.json").write_text(json.dumps(man))
    r = run(build, tmp_path / "o")
    assert by_kind(r.out)["Deployment"]["spec"]["template"]["spec"]["containers"][0]["image"] == other.image
    man["versions"]["tensorrt_llm"] = "0.0.1"
    (build / "engine" / "manifest.json").write_text(json.dumps(man))
    with pytest.raises(UserError, match="0.0.1"):
        run(build, tmp_path / "o2")
    assert not (tmp_path / "o2").exists()


def test_build_directory_is_mounted_where_the_repository_points(tmp_path):
    build = tmp_path / "art" / "mybuild"
    subprocess.run([sys.executable, "-m", "pipeline.cli", "build", str(PYT), "--dry-run", "--out", str(build)],
                   check=True, capture_output=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)})
    r = run(build, tmp_path / "o")
    dep = by_kind(r.out)["Deployment"]["spec"]["template"]["spec"]
    mount = dep["containers"][0]["volumeMounts"][0]["mountPath"]
    model_yaml = yaml.safe_load((build / "triton_repo" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    assert model_yaml["model"].startswith(mount + "/") and mount == str(build.parent)
    assert _flag(dep["containers"][0]["command"], "--model-repository") == [f"{build}/triton_repo"]
    with pytest.raises(UserError, match="not under --mount-path"):
        run(build, tmp_path / "o2", mount_path="/models")


# ------------------------------------------------------------------------------------------ Helm values
def _chart(outs, key="trt") -> Path:
    return next((outs[key, "helm"].out / "chart").iterdir())


def test_values_yaml_satisfies_its_schema_and_helm_checks_overrides(outs):
    import jsonschema

    chart = _chart(outs)
    values = yaml.safe_load((chart / "values.yaml").read_text())
    jsonschema.validate(values, json.loads((chart / "values.schema.json").read_text()))
    for bad, msg in (
        ({"replicas": -1}, "replicas"),
        ({"autoscaling": {"metric": "gpu_util"}}, "metric"),
        ({"modelRepository": {"source": "nfs"}}, "source"),
        ({"modelRepository": {"source": "objectStore"}}, "objectStore"),
        ({"unknownKey": 1}, "unknownKey"),
    ):
        with pytest.raises(StageError, match=msg):
            render_chart(chart, values=bad)
    with pytest.raises(StageError, match="metric"):  # the LLM-API backend exports no nv_trt_llm_* series
        render_chart(_chart(outs, "pyt"), values={"autoscaling": {"metric": "waiting_requests"}})


@pytest.mark.parametrize("signal", ["waiting_requests", "kv_cache_utilization"])
def test_cpp_backend_metric_options_render(outs, signal):
    rendered = render_chart(_chart(outs), values={"autoscaling": {"metric": signal}})
    hpa = yaml.safe_load(next(v for k, v in rendered.items() if k.endswith("/hpa.yaml")))
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == metrics.SIGNALS[signal].record
    assert hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"] == metrics.SIGNALS[signal].target


def _render_objs(chart: Path, values: dict) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for key, text in render_chart(chart, values=values).items():
        if key.endswith(".yaml"):
            for d in yaml.safe_load_all(text):
                if d:
                    out.setdefault(d["kind"], []).append(d)
    return out


def test_build_source_renders_a_pre_install_build_job_on_a_created_pvc(outs):
    objs = _render_objs(_chart(outs), {"modelRepository": {"source": "build", "pvc": {"create": True}}})
    jobs = {j["metadata"]["name"]: j for j in objs["Job"]}
    build = next(j for n, j in jobs.items() if n.endswith("-build"))
    pvc = objs["PersistentVolumeClaim"][0]
    assert build["metadata"]["annotations"]["helm.sh/hook"] == "pre-install,pre-upgrade"
    assert int(pvc["metadata"]["annotations"]["helm.sh/hook-weight"]) < int(build["metadata"]["annotations"]["helm.sh/hook-weight"])
    _assert_pvc_survives_upgrades(pvc)
    c = build["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert yaml.safe_load(env["TRTPIPE_RECIPE"])["target"]["gpu"] == "h200"
    assert env["TRTPIPE_BUILD_DIR"] == resolve(TRT).build_dir
    assert "trtpipe build /tmp/recipe.yaml" in c["args"][0]
    assert build["spec"]["template"]["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H200"
    for kind, items in objs.items():
        for obj in items:
            assert kval.object_errors(obj) == [], kind


def test_object_store_source_fills_an_emptydir_before_triton_starts(outs):
    values = {"modelRepository": {"source": "objectStore",
                                  "objectStore": {"uri": "s3://bucket/builds/llama", "image": "amazon/aws-cli:2"}}}
    objs = _render_objs(_chart(outs), values)
    pod = objs["Deployment"][0]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["volumeMounts"][0]["mountPath"] == pod["containers"][0]["volumeMounts"][0]["mountPath"]
    assert {"name": "builds", "emptyDir": {}} in pod["volumes"]
    assert "PersistentVolumeClaim" not in objs
    for items in objs.values():
        for obj in items:
            assert kval.object_errors(obj) == []


def test_bench_job_targets_the_service_grpc_port(outs):
    objs = by_kind(outs["trt", "helm"].out)
    job = objs["Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "test"
    args = job["spec"]["template"]["spec"]["containers"][0]["args"]
    url = args[args.index("--url") + 1]
    grpc = next(p["port"] for p in objs["Service"]["spec"]["ports"] if p["name"] == "grpc")
    assert url == f"{objs['Service']['metadata']['name']}:{grpc}"
    assert args[args.index("--model") + 1] == "ensemble"
    assert args[args.index("--tokenizer") + 1] == f"{resolve(TRT).build_dir}/triton_repo/preprocessing/tokenizer"


def test_grafana_dashboard_plots_the_recorded_signals(outs):
    dash = json.loads((_chart(outs) / "dashboards" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    for s in metrics.signals_for("tensorrt").values():
        assert s.record in exprs
    # the DCGM exporter's series beside Triton's (#49), per pod of this deployment
    dcgm = {p["title"]: p["targets"][0]["expr"] for p in dash["panels"] if "DCGM_FI_" in p["targets"][0]["expr"]}
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
            "DCGM_FI_DEV_GPU_TEMP"} <= {e.split("(")[-1].split("{")[0] for e in dcgm.values()}
    assert all('namespace="$namespace"' in e and "by (pod)" in e for e in dcgm.values())


# ------------------------------------------------------------------------------------------ user mistakes
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "deploy", "k8s", *args], capture_output=True,
                          text=True, cwd=cwd, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}, timeout=120)


@pytest.mark.parametrize("args,fault", [
    (["missing.yaml"], "missing.yaml: no such recipe file"),
    ([str(TRT), "--format", "yaml"], "--format 'yaml'"),
    ([str(CPU)], "target.gpu is 'cpu'"),
    ([str(TRT), "--format", "kserve", *[a for s in TP8PP2 for a in ("--set", s)]], "--format kserve"),
    ([str(TRT), "--set", "target.gpus_per_node=3", "--set", "target.tp_size=8", "--set", "target.num_gpus=8"],
     "target.gpus_per_node"),
])
def test_user_mistakes_are_one_line_and_write_nothing(tmp_path, args, fault):
    out = tmp_path / "out"
    p = _cli(*args, "--out", str(out), cwd=tmp_path)
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fault in lines[0] and "Traceback" not in p.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_cli_renders_and_reports(tmp_path):
    p = _cli(str(TRT), "--out", str(tmp_path / "k"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert "objects valid" in p.stdout and "26.04-trtllm-python-py3" in p.stdout
    assert (tmp_path / "k" / "rendered" / "deployment.yaml").is_file()


def test_a_failed_rerun_leaves_the_previous_output(outs, tmp_path):
    out = tmp_path / "o"
    run(TRT, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(UserError):
        run(TRT, out, fmt="kserve", overrides=TP8PP2)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# ------------------------------------------------------------------------------------------ upstream CRDs
UPSTREAM = os.environ.get("TRTPIPE_UPSTREAM_CRDS")


@pytest.mark.skipif(not UPSTREAM, reason="set TRTPIPE_UPSTREAM_CRDS to a directory of upstream CRD YAMLs")
def test_objects_validate_against_the_full_upstream_crds(outs):
    """Developer check: the objects also pass the complete upstream CRDs (LWS, prometheus-operator, KServe, …)."""
    import jsonschema

    crds = {}
    for f in Path(UPSTREAM).glob("*.yaml"):
        for crd in yaml.safe_load_all(f.read_text()):
            if crd and crd.get("kind") == "CustomResourceDefinition":
                for v in crd["spec"]["versions"]:
                    crds[(f"{crd['spec']['group']}/{v['name']}", crd["spec"]["names"]["kind"])] = v["schema"]["openAPIV3Schema"]
    seen = set()
    for r in outs.values():
        for f in r.out.rglob("*.yaml"):
            if "chart" in f.relative_to(r.out).parts or f.name == "prometheus-adapter-values.yaml":
                continue
            for obj in docs(f):
                key = (obj["apiVersion"], obj["kind"])
                if key in crds:
                    errors = [e.message for e in jsonschema.Draft7Validator(crds[key]).iter_errors(obj)]
                    assert errors == [], (key, errors[:3])
                    seen.add(key)
    assert seen, "no CRD of the directory matched a rendered object"
    print("validated against upstream CRDs:", sorted(seen))


@pytest.mark.parametrize("key", ["trt", "pyt", "lws"])
def test_helm_lint_strict_finds_no_warning(outs, key):
    """`helm lint --strict` (Helm's own linter, through libhelm_c): only INFO notes (e.g. "icon is recommended")."""
    import helm_python

    report = helm_python.lint(str(_chart(outs, key)), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # 1 INFO, 2 WARNING, 3 ERROR


# ------------------------------------------------------------------------------------------ audit 2026-11-26
def _assert_pvc_survives_upgrades(pvc: dict) -> None:
    """Helm deletes a hook's resource before re-running the hook when its delete policies include
    before-hook-creation, which is also the default when none is given (helm/helm pkg/action/hooks.go@009883726a2d
    execHook:48-56, deleteHookByPolicy); resource-policy: keep does not apply to hooks."""
    ann = pvc["metadata"]["annotations"]
    events = ann["helm.sh/hook"].split(",")
    assert events == ["pre-install"], "a pre-upgrade PVC hook is deleted and re-created (empty) on every upgrade"
    policies = ann.get("helm.sh/hook-delete-policy", "").split(",")
    assert policies != [""] and "before-hook-creation" not in policies


def test_build_pvc_is_a_pre_install_hook_helm_never_deletes(outs):
    """Audit finding 1: `helm upgrade` must not delete the PVC that holds the engines."""
    objs = _render_objs(_chart(outs), {"modelRepository": {"source": "build", "pvc": {"create": True}}})
    _assert_pvc_survives_upgrades(objs["PersistentVolumeClaim"][0])
    # with a PVC the user made (create: false), the chart renders none
    assert "PersistentVolumeClaim" not in _render_objs(_chart(outs), {"modelRepository": {"source": "build"}})


def test_tp16_on_8_gpu_nodes_leader_gets_kubectl_from_a_pinned_init_container(tmp_path):
    """Audit finding 2: the stock Triton image has no kubectl; the leader copies it from the Kubernetes project's
    kubectl image (pinned tag) into an emptyDir before mpirun uses `kubectl exec` as its rsh agent."""
    from pipeline.deploy.helm import KUBECTL_IMAGE

    r = run(TRT, tmp_path / "tp16", overrides=["target.tp_size=16", "target.num_gpus=16", "target.gpus_per_node=8"])
    objs = by_kind(r.out)
    lws = objs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert lws["size"] == 2
    leader = lws["leaderTemplate"]["spec"]
    init = {c["name"]: c for c in leader["initContainers"]}["kubectl"]
    assert init["image"] == KUBECTL_IMAGE and re.fullmatch(r"registry\.k8s\.io/kubectl:v1\.\d+\.\d+", KUBECTL_IMAGE)
    assert init["command"][:2] == ["/bin/cp", "/bin/kubectl"]
    tools_dir = init["command"][2].rsplit("/", 1)[0]
    assert {"name": "tools", "mountPath": tools_dir} in init["volumeMounts"]
    assert {"name": "tools", "emptyDir": {}} in leader["volumes"]
    triton = leader["containers"][0]
    assert any(m["name"] == "tools" and m["mountPath"] == tools_dir for m in triton["volumeMounts"])
    script = triton["args"][0]
    assert f"{tools_dir}/kubectl exec" in script and "plm_rsh_agent /tmp/trtpipe-kubexec" in script
    mpirun = script.strip().splitlines()[-1]
    assert mpirun.count("/opt/tritonserver/bin/tritonserver") == 16 and mpirun.count("--allow-http=false") == 15
    # the image stays the stock release-matrix container: nothing custom is needed
    assert triton["image"] == release.default_release().image
    for worker_c in lws["workerTemplate"]["spec"]["containers"]:
        assert worker_c["image"] == release.default_release().image


def test_shm_never_exceeds_the_pod_memory_limit(outs, tmp_path):
    """Audit finding 9: a memory-backed emptyDir is charged to the pod's memory limit."""
    from pipeline.deploy.spec import gib

    def check(pod: dict) -> None:
        limit = min(gib(c["resources"]["limits"]["memory"]) for c in pod["containers"])
        for v in pod["volumes"]:
            if (v.get("emptyDir") or {}).get("medium") == "Memory":
                assert gib(v["emptyDir"]["sizeLimit"]) <= limit, (v, limit)

    for key in ("trt", "pyt", "lws"):
        objs = by_kind(outs[key, "helm"].out)
        if "Deployment" in objs:
            check(objs["Deployment"]["spec"]["template"]["spec"])
        else:
            lws = objs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
            check(lws["leaderTemplate"]["spec"])
            check(lws["workerTemplate"]["spec"])
    isvc = docs(outs["trt", "kserve"].out / "inferenceservice.yaml")[0]["spec"]["predictor"]
    check({"containers": [isvc["model"]], "volumes": isvc["volumes"]})


def test_dynamo_worker_needs_no_secret_and_the_image_comes_from_the_release_matrix(outs, tmp_path):
    """Audit finding 3 (envFromSecret becomes a non-optional envFrom.secretRef in Dynamo's operator) and the
    Dynamo runtime image sourced from Dynamo's release files: `--format dynamo` renders without --dynamo-image."""
    for key in ("trt", "pyt", "lws"):
        dgd = docs(outs[key, "dynamo"].out / "dynamographdeployment.yaml")[0]
        for svc in dgd["spec"]["services"].values():
            assert "envFromSecret" not in svc
    dyn = release.default_release().dynamo_runtime
    assert dyn is not None and dyn.image == "nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:0.8.1.post3"
    assert dyn.tensorrt_llm.startswith("1.2.") and "release-artifacts.md@" in dyn.source
    r = run(PYT, tmp_path / "dyn", fmt="dynamo")
    dgd = docs(r.out / "dynamographdeployment.yaml")[0]
    assert r.image == dyn.image
    assert {s["extraPodSpec"]["mainContainer"]["image"] for s in dgd["spec"]["services"].values()} == {dyn.image}
    assert dgd["metadata"]["annotations"]["trtpipe.dev/dynamo-tensorrt-llm"] == dyn.tensorrt_llm


def test_dynamo_without_a_sourced_image_asks_for_one(tmp_path, monkeypatch):
    rel = release.default_release().model_copy(update={"dynamo_runtime": None})
    monkeypatch.setattr(release, "for_tensorrt_llm", lambda version=None: rel)
    with pytest.raises(UserError, match="--dynamo-image"):
        run(PYT, tmp_path / "d", fmt="dynamo")
    assert not (tmp_path / "d").exists()


def test_dynamo_runtime_is_matched_by_tensorrt_llm_series():
    assert release.dynamo_runtime_for("1.2.1").tensorrt_llm == "1.2.0rc6.post3"
    assert release.dynamo_runtime_for("1.1.0").image.endswith(":0.6.1")
    assert release.dynamo_runtime_for("9.9.0") is None
    for d in release.dynamo_runtimes():
        assert d.image.startswith("nvcr.io/nvidia/ai-dynamo/tensorrtllm-runtime:") and d.source


def test_kserve_deployment_mode_is_accepted_by_kserve_0_15_to_0_20(outs):
    """Audit finding 4: "Standard" first appears in kserve v0.16 pkg/constants/constants.go; "RawDeployment" is
    v0.15's and still accepted by v0.20 (LegacyRawDeployment)."""
    for key in ("trt", "pyt"):
        isvc = docs(outs[key, "kserve"].out / "inferenceservice.yaml")[0]
        assert isvc["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"


def test_kserve_makes_no_cpu_hpa_that_could_never_act(outs):
    """Audit finding 5: without an autoscaler class KServe creates a CPU-utilization HPA (hpa_reconciler.go), which a
    GPU server's CPU does not track. "external" (v0.15 … v0.20) makes KServe create none; replicas are fixed."""
    for key in ("trt", "pyt"):
        isvc = docs(outs[key, "kserve"].out / "inferenceservice.yaml")[0]
        assert isvc["metadata"]["annotations"]["serving.kserve.io/autoscalerClass"] == "external"
        pred = isvc["spec"]["predictor"]
        assert pred["minReplicas"] == pred["maxReplicas"] == 1
        req = pred["model"]["resources"]["requests"]
        assert {"cpu", "memory", "nvidia.com/gpu"} <= set(req)


def test_triton_admin_apis_are_restricted_with_a_key_from_a_secret(outs):
    """As local `trtpipe serve` off loopback: the admin APIs need the key, inference and health stay open."""
    for key in ("trt", "pyt", "lws"):
        objs = by_kind(outs[key, "helm"].out)
        secret = objs["Secret"]
        assert secret["type"] == "Opaque" and len(__import__("base64").b64decode(secret["data"]["admin-key"])) >= 32
        if "Deployment" in objs:
            c = objs["Deployment"]["spec"]["template"]["spec"]["containers"][0]
            argv = c["command"]
            ranks = max(1, argv.count(":") + 1)
            assert argv.count(RESTRICTED[0]) == argv.count(RESTRICTED[1]) == ranks
        else:
            c = objs["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
            mpirun = c["args"][0].strip().splitlines()[-1]
            assert mpirun.count(RESTRICTED[0]) == mpirun.count(RESTRICTED[1]) == 16
        env = {e["name"]: e for e in c["env"]}
        ref = env["TRITON_ADMIN_KEY"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "admin-key"}  # required: no open fallback
        # health and inference are not among the restricted APIs
        assert not {"health", "inference", "metadata"} & set(_ADMIN.split(":")[0].split(","))
    rt = docs(outs["trt", "kserve"].out / "servingruntime.yaml")[0]["spec"]["containers"][0]
    assert RESTRICTED[0] in rt["command"] and RESTRICTED[1] in rt["command"]
    assert rt["env"][0]["valueFrom"]["secretKeyRef"]["key"] == "admin-key"


def test_an_existing_admin_secret_can_be_referenced(outs):
    objs = _render_objs(_chart(outs), {"triton": {"adminApi": {"secret": {"create": False, "name": "my-key", "key": "k"}}}})
    assert "Secret" not in objs
    c = objs["Deployment"][0]["spec"]["template"]["spec"]["containers"][0]
    assert c["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "my-key", "key": "k"}


def test_missing_deploy_extra_names_the_extra(tmp_path):
    """Audit finding 8: the CLI printed errors as rich markup, which ate "[deploy]" from the install hint; it now
    prints the error text as text (pipeline/commands/common.py)."""
    block = tmp_path / "block"
    block.mkdir()
    (block / "kubernetes_validate.py").write_text("raise ImportError('blocked for the test')\n")
    p = subprocess.run([sys.executable, "-m", "pipeline.cli", "deploy", "k8s", str(TRT), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{block}{os.pathsep}{REPO}", "COLUMNS": "200"})
    assert p.returncode != 0
    assert "pip install 'trtpipe[deploy]'" in p.stderr, p.stderr
    assert not (tmp_path / "o").exists()
