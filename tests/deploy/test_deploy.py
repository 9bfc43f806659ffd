"""Deployment files, checked without Docker or a cluster: the Dockerfiles statically, the locked serving
requirements in a fresh venv (slow), the Kubernetes manifests rendered by kustomize and validated against the
Kubernetes schemas offline."""

from __future__ import annotations

import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import tomllib
import yaml
from metric_refs import REPO, missing_metrics, promtool_input
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from server_process import served_memory_mib

from serve.api.config import ServerSettings
from serve.api.loading import kv_rows, served_features
from serve.api.sizing import PodMemory, pod_memory
from serve.bundle import read_manifest

DOCKER = REPO / "deploy" / "docker"
K8S = REPO / "deploy" / "k8s"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SERVING_IMAGES = {"Dockerfile.cpu": "requirements-serve.txt", "Dockerfile.gpu": "requirements-serve-gpu.txt"}
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


# Dockerfiles --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    command: str  # upper case: FROM, COPY, RUN...
    args: str


def instructions(dockerfile: Path) -> list[Instruction]:
    """The instructions of a Dockerfile, continuation lines joined, comments dropped."""
    logical, current = [], ""
    for line in dockerfile.read_text().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += stripped.removesuffix("\\").strip() + " "
        if not stripped.endswith("\\"):
            logical.append(current.strip())
            current = ""
    return [Instruction(text.split(" ", 1)[0].upper(), text.split(" ", 1)[1]) for text in logical]


def stages(dockerfile: Path) -> list[list[Instruction]]:
    """Instructions grouped by build stage (each starts with FROM); the global ARGs before it are left out."""
    grouped: list[list[Instruction]] = []
    for instruction in instructions(dockerfile):
        if instruction.command == "FROM":
            grouped.append([])
        if grouped:
            grouped[-1].append(instruction)
    return grouped


def global_args(dockerfile: Path) -> dict[str, str]:
    """The build arguments declared before the first FROM, with their defaults."""
    declared: dict[str, str] = {}
    for instruction in instructions(dockerfile):
        if instruction.command == "FROM":
            break
        if instruction.command == "ARG":
            name, _, default = instruction.args.partition("=")
            declared[name] = default
    return declared


def base_image(dockerfile: Path, stage: list[Instruction]) -> str:
    """A stage's FROM image, build arguments replaced by their defaults."""
    image = stage[0].args.split()[0]
    for name, default in global_args(dockerfile).items():
        image = image.replace(f"${{{name}}}", default)
    return image


# What build.sh fills (pip download on the host) and the builds install from, with no package index.
WHEELHOUSE = "deploy/docker/wheels"
BUILD_SCRIPT = DOCKER / "build.sh"


def exec_form(args: str) -> list[str]:
    words = yaml.safe_load(args)  # a JSON array is YAML
    assert isinstance(words, list), f"not exec form (a JSON array): {args}"
    return words


DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))


def test_the_three_images_exist() -> None:
    assert {p.name for p in DOCKERFILES} == {"Dockerfile.cpu", "Dockerfile.gpu", "Dockerfile.export"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_tag(dockerfile: Path) -> None:
    names: set[str] = set()
    for stage in stages(dockerfile):
        words = stage[0].args.split()
        image = base_image(dockerfile, stage)
        if image not in names:
            # A version in the tag (not latest, not a bare major like 3): python:3.11.7-slim-bookworm.
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+[\w.+-]*|[\w./-]+@sha256:[0-9a-f]{64}", image), image
        if len(words) == 3 and words[1].upper() == "AS":
            names.add(words[2])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_runs_as_non_root(dockerfile: Path) -> None:
    users = [i.args for i in stages(dockerfile)[-1] if i.command == "USER"]
    assert users, "the final stage sets no USER: it would run as root"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copy_sources_exist(dockerfile: Path) -> None:
    for instruction in instructions(dockerfile):
        if instruction.command not in {"COPY", "ADD"}:
            continue
        words = shlex.split(instruction.args)
        if any(w.startswith("--from") for w in words):
            continue  # from another stage, not from the build context
        sources = [w for w in words if not w.startswith("--")][:-1]
        assert sources, instruction
        for source in sources:
            if source.startswith(WHEELHOUSE):
                continue  # filled by build.sh: test_builds_install_from_the_wheelhouse_only
            assert (REPO / source).exists(), (
                f"{dockerfile.name}: COPY source {source} is not in the repository"
            )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_is_a_build_argument(dockerfile: Path) -> None:
    """build.sh and build_base.sh swap the base (a local one where the registry is out of reach)."""
    assert "BASE_IMAGE" in global_args(dockerfile)
    assert stages(dockerfile)[0][0].args.split()[0] == "${BASE_IMAGE}"
    assert "BASE_IMAGE=$BASE_IMAGE" in BUILD_SCRIPT.read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_builds_install_from_the_wheelhouse_only(dockerfile: Path) -> None:
    """Every pip of the build stage reads the wheelhouse build.sh fills for this image, never an index."""
    image = dockerfile.suffix.removeprefix(".")
    assert f"[{image}]={dockerfile.name}" in BUILD_SCRIPT.read_text()
    build = stages(dockerfile)[-2]
    env = " ".join(i.args for i in build if i.command == "ENV").split()
    assert {"PIP_NO_INDEX=1", "PIP_FIND_LINKS=/tmp/wheels"} <= set(env)
    assert f"{WHEELHOUSE}/{image} /tmp/wheels" in [i.args for i in build if i.command == "COPY"]
    assert "index-url" not in " ".join(i.args for i in build if i.command == "RUN")


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_entrypoint_is_a_console_script(dockerfile: Path) -> None:
    entrypoints = [i for i in instructions(dockerfile) if i.command == "ENTRYPOINT"]
    assert len(entrypoints) == 1
    script = exec_form(entrypoints[0].args)[0]
    expected = "textgen-export" if dockerfile.name == "Dockerfile.export" else "textgen-serve"
    assert script == expected
    assert script in PYPROJECT["project"]["scripts"]


@pytest.mark.parametrize("name", sorted(SERVING_IMAGES))
def test_serving_image_contract(name: str) -> None:
    dockerfile = DOCKER / name
    final = stages(dockerfile)[-1]
    by_command = {i.command: i.args for i in final}
    assert set(by_command["EXPOSE"].split()) == {str(GRPC_PORT), str(HTTP_PORT), str(METRICS_PORT)}
    assert by_command["STOPSIGNAL"] == "SIGTERM"
    health = exec_form(by_command["HEALTHCHECK"].split(" CMD ", 1)[1])
    assert health[:2] == ["textgen-client", "health"]
    assert health[health.index("--target") + 1] == f"127.0.0.1:{GRPC_PORT}"
    assert "TEXTGEN_BUNDLE=/models/bundle" in by_command["ENV"]
    assert f"TEXTGEN_HTTP_PORT={HTTP_PORT}" in by_command["ENV"]


@pytest.mark.parametrize(("name", "lock"), sorted(SERVING_IMAGES.items()))
def test_serving_images_install_the_lock_and_no_torch(name: str, lock: str) -> None:
    text = (DOCKER / name).read_text()
    assert f"deploy/docker/{lock}" in text
    runs = " ".join(i.args for i in instructions(DOCKER / name) if i.command == "RUN")
    assert "--require-hashes" in runs
    copied = " ".join(i.args for i in instructions(DOCKER / name) if i.command == "COPY")
    assert "export" not in copied.split(), "the exporter (torch) is not part of a serving image"
    pinned = locked(DOCKER / lock)
    assert "torch" not in pinned
    assert not any(n.startswith("nvidia-") or n == "triton" for n in pinned)


def locked(lock: Path) -> dict[str, str]:
    """name -> version of every `name==version` line of a pip requirements lock."""
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s\\;]+)", lock.read_text(), flags=re.MULTILINE)
    return {canonicalize_name(name): version for name, version in pins}


# Each image's lock, the extras deploy/docker/lock.sh resolves it with, and the image's Python.
# tracing: the serving images export request spans with --otlp-traces-endpoint.
LOCKS = [
    ("requirements-serve.txt", ["cpu", "tracing"], "3.11"),
    ("requirements-serve-gpu.txt", ["gpu", "tracing"], "3.12"),
    ("requirements-export.txt", ["cpu", "export"], "3.11"),
]
# How uv's `# via` annotations name the project itself.
PROJECT_VIA = f"{PYPROJECT['project']['name']} (pyproject.toml)"


def required(extras: list[str], python: str) -> list[Requirement]:
    """pyproject's dependencies and those of `extras` that apply on `python`."""
    wanted = list(PYPROJECT["project"]["dependencies"])
    for extra in extras:
        wanted += PYPROJECT["project"]["optional-dependencies"][extra]
    specs = map(Requirement, wanted)
    return [s for s in specs if s.marker is None or s.marker.evaluate({"python_version": python})]


def locked_because(lock: Path) -> dict[str, set[str]]:
    """name -> what uv's `# via` annotations say requires it: packages, the project, `-r file` inputs."""
    graph: dict[str, set[str]] = {}
    current = ""
    for line in lock.read_text().splitlines():
        pin = re.match(r"([A-Za-z0-9_.-]+)==", line)
        if pin:
            current = canonicalize_name(pin[1])
            graph[current] = set()
            continue
        note = re.match(r"\s+#\s+(?:via\b)?\s*(.*)", line)
        if current and note and note[1]:
            graph[current].add(note[1])
    return graph


@pytest.mark.parametrize(("lock", "extras", "python"), LOCKS)
def test_locks_are_resolved_for_their_image(lock: str, extras: list[str], python: str) -> None:
    """The command uv recorded in the lock: the image's extras and Python (lock.sh runs it)."""
    command = (DOCKER / lock).read_text().splitlines()[1]
    assert re.findall(r"--extra (\S+)", command) == extras
    assert f"--python-version {python}" in command


@pytest.mark.parametrize(("lock", "extras", "python"), LOCKS)
def test_locks_hold_nothing_pyproject_dropped(lock: str, extras: list[str], python: str) -> None:
    """A dependency removed from pyproject.toml without re-running deploy/docker/lock.sh fails: every locked
    package is required by the project as it is now, or by another locked package."""
    graph = locked_because(DOCKER / lock)
    direct = {name for name, why in graph.items() if PROJECT_VIA in why}
    wanted = {canonicalize_name(spec.name) for spec in required(extras, python)}
    assert direct == wanted, (
        f"{lock} and pyproject.toml differ in {direct ^ wanted}: run deploy/docker/lock.sh"
    )
    for name, why in graph.items():
        assert why, f"{lock}: nothing requires {name}"
        for source in why - {PROJECT_VIA}:
            known = source.startswith("-r ") or canonicalize_name(source) in graph
            assert known, f"{lock}: {name} via {source}"


@pytest.mark.parametrize(("lock", "extras", "python"), LOCKS)
def test_locks_satisfy_pyproject(lock: str, extras: list[str], python: str) -> None:
    """A dependency added to or tightened in pyproject.toml without re-running deploy/docker/lock.sh fails."""
    pins = locked(DOCKER / lock)
    for spec in required(extras, python):
        name = canonicalize_name(spec.name)
        assert name in pins, f"{lock} lacks {spec.name}: run deploy/docker/lock.sh"
        assert spec.specifier.contains(pins[name], prereleases=True), (
            f"{lock}: {name}=={pins[name]} vs {spec}"
        )
    assert "--hash=sha256:" in (DOCKER / lock).read_text()


def test_build_lock_satisfies_the_build_system() -> None:
    """The images build the project without build isolation, from this lock (lock.sh writes it)."""
    pins = locked(DOCKER / "requirements-build.txt")
    for spec in map(Requirement, PYPROJECT["build-system"]["requires"]):
        name = canonicalize_name(spec.name)
        assert name in pins, f"requirements-build.txt lacks {spec.name}: run deploy/docker/lock.sh"
        assert spec.specifier.contains(pins[name]), f"requirements-build.txt: {name}=={pins[name]} vs {spec}"


@pytest.mark.slow
def test_serving_lock_installs_and_serves_in_a_fresh_venv(tmp_path: Path, tiny_bundle: Path) -> None:
    """What Dockerfile.cpu installs, in a clean venv: imports without torch, serves, answers health."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    lock = DOCKER / "requirements-serve.txt"
    subprocess.run([*pip, "--require-hashes", "--only-binary=:all:", "-r", str(lock)], check=True)
    context = build_context(DOCKER / "Dockerfile.cpu", tmp_path / "src")
    subprocess.run([*pip, "--no-deps", str(context)], check=True)
    python = str(venv / "bin" / "python")
    imports = (
        "import serve.api.lifecycle, serve.api.cli, serve.api.client, serve.engine.engine, "
        "serve.api.metrics, serve.api.openai.http_server"
    )
    subprocess.run([python, "-c", imports], check=True, cwd=tmp_path)
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, cwd=tmp_path, check=False)
    assert no_torch.returncode != 0 and b"No module named 'torch'" in no_torch.stderr
    with serving(venv, tiny_bundle) as (grpc_port, metrics_port):
        healthcheck = exec_form(dockerfile_healthcheck().split(" CMD ", 1)[1])
        healthcheck[healthcheck.index("--target") + 1] = f"127.0.0.1:{grpc_port}"
        result = subprocess.run(
            [str(venv / "bin" / healthcheck[0]), *healthcheck[1:]],
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0 and result.stdout.strip() == "SERVING", result.stdout + result.stderr
        client = [str(venv / "bin" / "textgen-client"), "generate", "hello", "--max-new-tokens", "3"]
        subprocess.run([*client, "--target", f"127.0.0.1:{grpc_port}"], check=True, capture_output=True)
        scrape = urlopen_text(f"http://127.0.0.1:{metrics_port}/metrics")
    # The live scrape after one request has every metric the dashboard, the rules and the HPA name.
    assert missing_metrics(scrape) == {}
    promtool = shutil.which("promtool")
    if promtool is not None:  # CI installs it (.ci/system-deps.sh)
        check = subprocess.run(
            [promtool, "check", "metrics"],
            input=promtool_input(scrape),
            capture_output=True,
            text=True,
            check=False,
        )
        assert check.returncode == 0, check.stdout + check.stderr


def dockerfile_healthcheck() -> str:
    return next(i.args for i in stages(DOCKER / "Dockerfile.cpu")[-1] if i.command == "HEALTHCHECK")


def build_context(dockerfile: Path, target: Path) -> Path:
    """Copy what the build stage COPYs from the repository into `target`/src, the way Docker would."""
    for instruction in stages(dockerfile)[0]:
        if instruction.command != "COPY":
            continue
        *sources, destination = shlex.split(instruction.args)
        if destination.startswith("/src"):
            into = target / destination.removeprefix("/src").lstrip("/")
            for source in sources:
                path = REPO / source
                if path.is_dir():
                    shutil.copytree(path, into, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    into.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(path, into / path.name)
    return target


def urlopen_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


@contextmanager
def serving(venv: Path, bundle: Path) -> Iterator[tuple[int, int]]:
    """`textgen-serve` of the venv on free loopback ports until SERVING; stopped with SIGTERM, must exit 0."""
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "TEXTGEN_BUNDLE": str(bundle),
        "TEXTGEN_HOST": "127.0.0.1",
        "TEXTGEN_PORT": str(ports[0]),
        "TEXTGEN_METRICS_PORT": str(ports[1]),
        "TEXTGEN_HTTP_PORT": "0",
    }
    process = subprocess.Popen([str(venv / "bin" / "textgen-serve")], env=env)
    try:
        wait_serving(venv, ports[0], process)
        yield ports[0], ports[1]
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0


def wait_serving(venv: Path, port: int, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    client = [str(venv / "bin" / "textgen-client"), "health", "--target", f"127.0.0.1:{port}"]
    deadline = time.monotonic() + timeout
    while subprocess.run(client, capture_output=True, check=False).returncode != 0:
        assert process.poll() is None, "textgen-serve exited during start-up"
        assert time.monotonic() < deadline, f"textgen-serve did not report SERVING within {timeout} s"
        time.sleep(0.5)


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
