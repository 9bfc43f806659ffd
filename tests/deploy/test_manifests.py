"""The Kubernetes manifests, checked without a cluster: rendered by kustomize, validated against the
Kubernetes schemas offline, and held to what the server reads, exposes and needs (memory: the pod formula)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from metric_refs import REPO
from server_process import served_memory_mib

from serve.api.config import ServerSettings
from serve.api.loading import kv_rows, served_features
from serve.api.sizing import PodMemory, pod_memory
from serve.bundle import read_manifest

K8S = REPO / "deploy" / "k8s"
GRPC_PORT = ServerSettings.model_fields["port"].default
METRICS_PORT = ServerSettings.model_fields["metrics_port"].default
HTTP_PORT = ServerSettings.model_fields["http_port"].default
# Oldest and newest Kubernetes versions the manifests are validated against (native gRPC probes: 1.27 GA).
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# Custom resources of the Prometheus Operator: no schema in kubernetes-validate; checked by hand below.
CUSTOM_KINDS = {"ServiceMonitor", "PrometheusRule"}
# Custom resources of the Gateway API Inference Extension: no schema in kubernetes-validate, and no package on
# the registries the project installs from ships their CRDs; checked by hand below.
GATEWAY_KINDS = {"InferencePool", "InferenceObjective"}
# What the LoRA overlay adds to route a client's model name to the adapters the pods serve.
REWRITE_KIND = "InferenceModelRewrite"
# The gauges the extension's endpoint picker scrapes from a model server by default (its flags
# --total-queued-requests-metric and --kv-cache-usage-percentage-metric).
GATEWAY_SCRAPED_METRICS = {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}


# Kubernetes --------------------------------------------------------------------------------


@cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl absent")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


KUSTOMIZATIONS = (
    "overlays/cpu",
    "overlays/gpu",
    "overlays/inference-gateway",
    "overlays/inference-gateway-lora",
    "export",
)


def one(objects: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def container(objects: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    return one(objects, "Deployment", "textgen")["spec"]["template"]["spec"]["containers"][0]


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_manifests_validate_against_kubernetes_schemas(kustomization: str) -> None:
    objects = render(kustomization)
    assert objects
    for obj in objects:
        if obj["kind"] in CUSTOM_KINDS | GATEWAY_KINDS | {REWRITE_KIND}:
            continue
        for version in K8S_VERSIONS:
            # strict: unknown fields are errors, as `kubectl apply --validate=strict` would make them.
            kubernetes_validate.validate(obj, version, strict=True)


def identities(objects: tuple[dict[str, Any], ...]) -> list[tuple[str, str]]:
    """Kind and name of each object; a generated ConfigMap's name without its content hash."""
    return sorted(
        (
            o["kind"],
            o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] == "ConfigMap" else o["metadata"]["name"],
        )
        for o in objects
    )


def test_overlays_render_the_same_objects() -> None:
    kinds = {o["kind"] for o in render("overlays/cpu")}
    expected = {"Namespace", "ServiceAccount", "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service"}
    expected |= {"HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy"} | CUSTOM_KINDS
    assert kinds == expected
    assert identities(render("overlays/gpu")) == identities(render("overlays/cpu"))
    assert all(o["metadata"].get("namespace", "textgen") == "textgen" for o in render("overlays/cpu"))


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_probes_and_ports_match_the_server_defaults(overlay: str) -> None:
    objects = render(overlay)
    c = container(objects)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": GRPC_PORT, "http": HTTP_PORT, "metrics": METRICS_PORT}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["grpc"], probe
    pod = one(objects, "Deployment")["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
    config = one(objects, "ConfigMap")["data"]
    assert (int(config["TEXTGEN_PORT"]), int(config["TEXTGEN_METRICS_PORT"])) == (GRPC_PORT, METRICS_PORT)
    assert int(config["TEXTGEN_HTTP_PORT"]) == HTTP_PORT
    ingress = {p["port"] for rule in one(objects, "NetworkPolicy")["spec"]["ingress"] for p in rule["ports"]}
    assert ingress == {"grpc", "http", "metrics"}
    assert {p["name"] for p in one(objects, "Service", "textgen")["spec"]["ports"]} == {
        "grpc",
        "http",
        "metrics",
    }
    for service in (o for o in objects if o["kind"] == "Service"):
        assert labels_match(service["spec"]["selector"], pod["metadata"]["labels"])
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports and port["port"] == ports[port["targetPort"]]


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_configuration_is_what_the_server_reads(overlay: str) -> None:
    objects = render(overlay)
    fields = {f"TEXTGEN_{name.upper()}" for name in ServerSettings.model_fields}
    config = one(objects, "ConfigMap")["data"]
    assert set(config) <= fields
    ServerSettings(**{k.removeprefix("TEXTGEN_").lower(): v for k, v in config.items()})  # values parse
    c = container(objects)
    assert c["envFrom"][0]["configMapRef"]["name"] == one(objects, "ConfigMap")["metadata"]["name"]
    token = next(e for e in c["env"] if e["name"] == "TEXTGEN_AUTH_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["name"] == "textgen-auth"
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts[config["TEXTGEN_BUNDLE"]]["readOnly"] is True
    # The prepared graph is written beside the read-only bundle, on a volume the replicas share.
    assert not mounts[config["TEXTGEN_COMPILED_CACHE"]].get("readOnly")
    volumes = {v["name"]: v for v in one(objects, "Deployment")["spec"]["template"]["spec"]["volumes"]}
    claim = volumes[mounts[config["TEXTGEN_COMPILED_CACHE"]]["name"]]["persistentVolumeClaim"]["claimName"]
    assert any(o["kind"] == "PersistentVolumeClaim" and o["metadata"]["name"] == claim for o in objects)


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/gpu"])
def test_pod_security(overlay: str) -> None:
    objects = render(overlay)
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["automountServiceAccountToken"] is False
    sc = container(objects)["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    for key in ("cpu", "memory"):
        assert (
            key in container(objects)["resources"]["requests"]
            and key in container(objects)["resources"]["limits"]
        )


def test_termination_leaves_time_to_drain() -> None:
    objects = render("overlays/cpu")
    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    pause = container(objects)["lifecycle"]["preStop"]["exec"]["command"]
    assert pause[0] == "sleep"
    grace = float(one(objects, "ConfigMap")["data"]["TEXTGEN_GRACE_SECONDS"])
    assert pod["terminationGracePeriodSeconds"] > int(pause[1]) + grace


def test_gpu_overlay_requests_a_gpu() -> None:
    c = container(render("overlays/gpu"))
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "gpu" in c["image"] and "cpu" in container(render("overlays/cpu"))["image"]
    assert "nvidia.com/gpu" not in container(render("overlays/cpu"))["resources"]["limits"]
    providers = one(render("overlays/gpu"), "ConfigMap")["data"]["TEXTGEN_PROVIDERS"]
    assert providers.split(",")[0] == "CUDAExecutionProvider"


def test_headless_service_for_client_side_balancing() -> None:
    services = {s["metadata"]["name"]: s["spec"] for s in render("overlays/cpu") if s["kind"] == "Service"}
    assert services["textgen"]["type"] == "ClusterIP" and services["textgen"].get("clusterIP") != "None"
    assert services["textgen-headless"]["clusterIP"] == "None"


def test_autoscaling_and_disruption_budget_target_the_deployment() -> None:
    objects = render("overlays/cpu")
    deployment = one(objects, "Deployment")
    hpa = one(objects, "HorizontalPodAutoscaler")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "textgen"}
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "textgen_requests_waiting"
    assert "replicas" not in deployment["spec"], "the HPA owns the replica count"
    pdb = one(objects, "PodDisruptionBudget")["spec"]
    assert labels_match(pdb["selector"]["matchLabels"], deployment["spec"]["template"]["metadata"]["labels"])
    assert pdb["maxUnavailable"] < hpa["minReplicas"]


def test_service_monitor_selects_the_metrics_service() -> None:
    """ServiceMonitor has no schema offline: check that it selects a Service with a `metrics` port."""
    objects = render("overlays/cpu")
    monitor = one(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selected = [
        s
        for s in objects
        if s["kind"] == "Service"
        and labels_match(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    assert [s["metadata"]["name"] for s in selected] == ["textgen"]
    port_names = {p["name"] for p in selected[0]["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= port_names
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [selected[0]["metadata"]["namespace"]]


def test_inference_gateway_overlay_adds_only_the_pool_and_objective() -> None:
    gateway = render("overlays/inference-gateway")
    assert sorted({o["kind"] for o in gateway} - {o["kind"] for o in render("overlays/cpu")}) == sorted(
        GATEWAY_KINDS
    )
    assert identities(tuple(o for o in gateway if o["kind"] not in GATEWAY_KINDS)) == identities(
        render("overlays/cpu")
    )


def test_inference_pool_selects_the_pods_and_their_http_port() -> None:
    """InferencePool has no schema offline: check that it selects the Deployment's pods on the HTTP port."""
    objects = render("overlays/inference-gateway")
    pool = one(objects, "InferencePool", "textgen")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    deployment = one(objects, "Deployment", "textgen")
    assert pool["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels_match(pool["spec"]["selector"]["matchLabels"], pod_labels)
    ports = {p["name"]: p["containerPort"] for p in container(objects)["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]] == [HTTP_PORT]
    picker = pool["spec"]["endpointPickerRef"]
    assert picker["name"] and 0 < picker["port"]["number"] < 65536
    assert picker["failureMode"] in {"FailOpen", "FailClose"}


def test_inference_objective_references_the_pool() -> None:
    objects = render("overlays/inference-gateway")
    objective = one(objects, "InferenceObjective")
    assert objective["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    ref = objective["spec"]["poolRef"]
    pool = one(objects, "InferencePool", ref["name"])
    assert (ref["group"], ref["kind"]) == (pool["apiVersion"].split("/")[0], pool["kind"])
    assert isinstance(objective["spec"]["priority"], int)


def test_the_lora_overlay_rewrites_a_model_to_adapters_every_pod_serves() -> None:
    """Beside the gateway overlay's objects, a rewrite whose targets are adapters the server's TEXTGEN_LORA
    names, each in a folder on the bundle volume."""
    objects = render("overlays/inference-gateway-lora")
    others = tuple(o for o in objects if o["kind"] != REWRITE_KIND)
    assert identities(others) == identities(render("overlays/inference-gateway"))
    rewrite = one(objects, REWRITE_KIND)
    assert rewrite["apiVersion"] == "inference.networking.x-k8s.io/v1alpha2"
    ref = rewrite["spec"]["poolRef"]
    pool = one(objects, "InferencePool", ref["name"])
    assert (ref["group"], ref["kind"]) == (pool["apiVersion"].split("/")[0], pool["kind"])
    config = one(objects, "ConfigMap")["data"]
    served = dict(ServerSettings(bundle=REPO, lora=config["TEXTGEN_LORA"]).lora)
    mount = next(m for m in container(objects)["volumeMounts"] if m["name"] == "bundle")["mountPath"]
    assert all(folder.is_relative_to(mount) for folder in served.values())
    for rule in rewrite["spec"]["rules"]:
        assert all(match["model"]["value"] not in served for match in rule["matches"])
        assert {target["modelRewrite"] for target in rule["targets"]} <= set(served)
        assert sum(target["weight"] for target in rule["targets"]) > 0


def test_the_gateway_scrapes_what_the_server_exposes() -> None:
    """The endpoint picker's default metric names are among the aliases the server exports."""
    from serve.api.metrics import GATEWAY_ALIASES, LORA_REQUESTS_INFO

    assert set(GATEWAY_ALIASES) >= GATEWAY_SCRAPED_METRICS
    docs = (REPO / "docs" / "deploy.md").read_text()
    assert all(name in docs for name in {*GATEWAY_SCRAPED_METRICS, LORA_REQUESTS_INFO})


def test_prometheus_rule_is_well_formed() -> None:
    """PrometheusRule has no schema offline; its groups are the promtool-checked rules (test_monitoring)."""
    rule = one(render("overlays/cpu"), "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) == {"name", "rules"}
        for r in group["rules"]:
            assert ("record" in r) != ("alert" in r) and isinstance(r["expr"], str)


def test_network_policies_select_the_pods() -> None:
    for kustomization, component in (("overlays/cpu", "server"), ("export", "export")):
        objects = render(kustomization)
        policy = one(objects, "NetworkPolicy")["spec"]
        workload = next(o for o in objects if o["kind"] in {"Deployment", "Job"})
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == component
        assert labels_match(policy["podSelector"]["matchLabels"], labels)
        assert policy["egress"] == []


def test_export_job_writes_where_the_server_reads() -> None:
    job = one(render("export"), "Job", "textgen-export")["spec"]["template"]["spec"]
    args = job["containers"][0]["args"]
    out = Path(args[args.index("--out") + 1])
    volume_mount = job["containers"][0]["volumeMounts"][0]
    claim = next(v for v in job["volumes"] if v["name"] == volume_mount["name"])["persistentVolumeClaim"]
    server = render("overlays/cpu")
    served_mount = next(m for m in container(server)["volumeMounts"] if m["name"] == "bundle")
    server_volume = next(
        v for v in one(server, "Deployment")["spec"]["template"]["spec"]["volumes"] if v["name"] == "bundle"
    )
    assert claim["claimName"] == server_volume["persistentVolumeClaim"]["claimName"]
    assert out.relative_to(volume_mount["mountPath"]) == Path(served_mount["subPath"])


def iter_files(kind: str) -> Iterator[Path]:
    yield from sorted(K8S.rglob(f"*{kind}"))


def test_every_manifest_file_is_used() -> None:
    """A manifest that no kustomization lists would silently never be deployed."""
    listed: set[Path] = set()
    for kustomization in iter_files("kustomization.yaml"):
        spec = yaml.safe_load(kustomization.read_text())
        names = spec.get("resources", []) + [p["path"] for p in spec.get("patches", [])]
        listed |= {(kustomization.parent / n).resolve() for n in names}
    manifests = {p.resolve() for p in iter_files(".yaml") if p.name != "kustomization.yaml"}
    manifests -= {(K8S / "prometheus-adapter" / "values.yaml").resolve()}  # Helm values, not a manifest
    assert manifests - listed == set()


# Pod memory --------------------------------------------------------------------------------

# How far above a served demo's measured resident memory the formula may predict: its fixed part has room for
# other CPUs and library versions, but a formula this far above what a pod holds is wrong.
MEMORY_SLACK = 1.5


def mib(quantity: str) -> float:
    """A Kubernetes memory quantity in MiB (Mi and Gi, the ones the manifests use)."""
    number, unit = re.fullmatch(r"(\d+)(Mi|Gi)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * (1024 if unit == "Gi" else 1)


def demo_pod_memory(overlay: str, bundle: Path) -> tuple[ServerSettings, PodMemory]:
    """The overlay's settings with the demo bundle, and what the sizing formula gives a pod serving them."""
    config = one(render(overlay), "ConfigMap")["data"]
    settings = ServerSettings(
        **{k.removeprefix("TEXTGEN_").lower(): v for k, v in config.items()} | {"bundle": bundle}
    )
    manifest = read_manifest(bundle)
    return settings, pod_memory(bundle, manifest, kv_rows(settings, manifest), served_features(settings))


@pytest.mark.parametrize("overlay", ["overlays/cpu", "overlays/inference-gateway"])
def test_memory_requests_and_limits_are_the_formulas_for_the_demo(overlay: str, demo_bundle: Path) -> None:
    _, pod = demo_pod_memory(overlay, demo_bundle)
    resources = container(render(overlay))["resources"]
    assert (resources["requests"]["memory"], resources["limits"]["memory"]) == (
        f"{pod.request_mib}Mi",
        f"{pod.limit_mib}Mi",
    )


def test_the_gpu_overlay_covers_the_formula_for_the_demo(demo_bundle: Path) -> None:
    _, pod = demo_pod_memory("overlays/gpu", demo_bundle)
    resources = container(render("overlays/gpu"))["resources"]
    assert mib(resources["requests"]["memory"]) >= pod.request_mib
    assert mib(resources["limits"]["memory"]) >= pod.limit_mib


def test_the_formula_covers_what_a_served_demo_holds(demo_bundle: Path) -> None:
    """The demo served as the CPU overlay configures it (an engine process; its threads and rows), after 4
    requests: the resident memory of all its processes is within the formula's request, and not far below
    it; their peaks within its limit."""
    settings, pod = demo_pod_memory("overlays/cpu", demo_bundle)
    args = (
        *("--bundle", str(demo_bundle)),
        *("--max-batch-size", str(settings.max_batch_size), "--threads", str(settings.threads)),
        *("--prefix-cache-rows", str(settings.prefix_cache_rows)),
        "--engine-process" if settings.engine_process else "--no-engine-process",
    )
    body = {"model": "textgen-demo", "prompt": "Once upon a time", "max_tokens": 16}
    steady, peak = served_memory_mib(args, [body] * 4)
    assert steady <= pod.request_mib <= MEMORY_SLACK * steady, (steady, pod.describe())
    assert peak <= pod.limit_mib, (peak, pod.describe())
