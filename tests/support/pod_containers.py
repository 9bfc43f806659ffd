"""textgen's images run with Docker as deploy/k8s runs them: a pod template's user and groups, read-only root
file system, capabilities, resource limits, volumes and environment become `docker run` flags, read from the
manifests so the test and the manifests cannot drift. Containers use the host's network; the test moves every
listener to 127.0.0.1 and a free port (`loopback_environment`), nothing else.

The manifests are read as kustomize would merge them for one overlay: the base's Deployment, the overlay's
image and the textgen-config literals of base and overlay (tests/deploy/test_manifests.py renders them with
kustomize itself and validates the result).
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_tools import free_port

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
CONFIG_MAP = "textgen-config"
SERVING = health_pb2.HealthCheckResponse.SERVING
# Kubernetes quantity suffixes -> docker's (both binary).
_MEMORY_UNITS = {"Ki": "k", "Mi": "m", "Gi": "g"}


def read_yaml(path: Path) -> dict[str, Any]:
    document = yaml.safe_load(path.read_text())
    assert isinstance(document, dict), path
    return document


def image_ref(kustomization: Path, container: dict[str, Any]) -> str:
    """The container's image as the kustomization sets it (`images:` newName:newTag): what build.sh tags."""
    (entry,) = read_yaml(kustomization / "kustomization.yaml")["images"]
    assert entry["name"] == container["image"], (entry, container["image"])
    return f"{entry['newName']}:{entry['newTag']}"


def config_literals(*kustomizations: Path) -> dict[str, str]:
    """textgen-config's data: each kustomization's literals over the ones before (behavior: merge)."""
    data: dict[str, str] = {}
    for kustomization in kustomizations:
        for generator in read_yaml(kustomization / "kustomization.yaml").get("configMapGenerator", []):
            if generator["name"] == CONFIG_MAP:
                data |= dict(literal.split("=", 1) for literal in generator["literals"])
    return data


def pod_spec(manifest: Path) -> dict[str, Any]:
    """The pod template's spec of a Deployment or a Job."""
    spec: dict[str, Any] = read_yaml(manifest)["spec"]["template"]["spec"]
    return spec


def container_of(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["containers"]
    return dict(container)


def claim_mount(pod: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The claim of the pod's one PersistentVolumeClaim volume, and the container's mount of it."""
    (volume,) = (v for v in pod["volumes"] if "persistentVolumeClaim" in v)
    (mount,) = (m for m in container_of(pod)["volumeMounts"] if m["name"] == volume["name"])
    return volume["persistentVolumeClaim"]["claimName"], mount


def memory_flag(quantity: str) -> str:
    for suffix, unit in _MEMORY_UNITS.items():
        if quantity.endswith(suffix):
            return quantity.removesuffix(suffix) + unit
    return quantity


def cpus(quantity: str) -> float:
    return int(quantity.removesuffix("m")) / 1000 if quantity.endswith("m") else float(quantity)


def user_flags(pod: dict[str, Any]) -> list[str]:
    context = pod["securityContext"] | container_of(pod).get("securityContext", {})
    assert context["runAsNonRoot"] and context["runAsUser"] != 0
    flags = ["--user", f"{context['runAsUser']}:{context['runAsGroup']}"]
    return flags + (["--group-add", str(context["fsGroup"])] if "fsGroup" in context else [])


def security_flags(container: dict[str, Any]) -> list[str]:
    context = container["securityContext"]
    assert not context.get("privileged", False)
    flags = ["--read-only"] if context.get("readOnlyRootFilesystem") else []
    flags += [f"--cap-drop={cap}" for cap in context.get("capabilities", {}).get("drop", [])]
    if context.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    return flags  # seccompProfile RuntimeDefault: Docker's default profile


def resource_flags(container: dict[str, Any]) -> list[str]:
    """The limits; a CPU limit above this machine's CPUs (Docker refuses those) becomes all of them."""
    limits = container["resources"]["limits"]
    available = os.cpu_count() or 1
    return ["--cpus", str(min(cpus(limits["cpu"]), available)), "--memory", memory_flag(limits["memory"])]


def volume_flags(pod: dict[str, Any], claims: Mapping[str, Path]) -> list[str]:
    """emptyDir -> a tmpfs of its size limit; a PersistentVolumeClaim -> the host folder given for it."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    flags: list[str] = []
    for mount in container_of(pod)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            size = memory_flag(volume["emptyDir"]["sizeLimit"])
            flags += ["--tmpfs", f"{mount['mountPath']}:size={size},mode=1777"]
            continue
        claim = volume["persistentVolumeClaim"]
        host = claims[claim["claimName"]] / mount.get("subPath", "")
        read_only = mount.get("readOnly", False) or claim.get("readOnly", False)
        flags += ["--volume", f"{host}:{mount['mountPath']}:{'ro' if read_only else 'rw'}"]
    return flags


def pod_flags(pod: dict[str, Any], claims: Mapping[str, Path]) -> list[str]:
    """`docker run` flags for the pod's container: user, security, limits, volumes."""
    container = container_of(pod)
    limits = [*security_flags(container), *resource_flags(container)]
    return [*user_flags(pod), *limits, *volume_flags(pod, claims)]


def environment(
    container: dict[str, Any], config: Mapping[str, str], secrets: Mapping[tuple[str, str], str]
) -> dict[str, str]:
    """envFrom the ConfigMap, then env: plain values and secretKeyRefs looked up in `secrets`."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == CONFIG_MAP, source
        env |= config
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[entry["name"]] = secrets[(ref["name"], ref["key"])]
    return env


def port_settings(container: dict[str, Any], env: Mapping[str, str]) -> dict[str, str]:
    """Each named container port -> the TEXTGEN_*_PORT variable that sets it (found by its value)."""
    found: dict[str, str] = {}
    for port in container["ports"]:
        names = [k for k, v in env.items() if k.endswith("_PORT") and v == str(port["containerPort"])]
        assert len(names) == 1, f"port {port['name']}: set by {names}"
        found[port["name"]] = names[0]
    return found


def loopback_environment(
    env: Mapping[str, str], ports: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, int]]:
    """`env` with every listener on 127.0.0.1 and each port free on this host; the host port of each name."""
    hosts = {k: "127.0.0.1" for k in ("TEXTGEN_HOST", "TEXTGEN_HTTP_HOST", "TEXTGEN_METRICS_HOST")}
    chosen = {name: free_port() for name in ports}
    return {**env, **hosts, **{ports[name]: str(port) for name, port in chosen.items()}}, chosen


def env_flags(env: Mapping[str, str]) -> list[str]:
    return [f"--env={k}={v}" for k, v in env.items()]


def docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


def health(target: str, timeout: float, service: str = "") -> int:
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


@dataclass
class Container:
    """A detached container of `image` with the pod's flags; `ports`: host port of each named port."""

    name: str
    ports: dict[str, int]

    @classmethod
    def start(cls, image: str, flags: list[str], env: Mapping[str, str], ports: dict[str, int]) -> Container:
        name = f"textgen-images-{uuid.uuid4().hex[:12]}"
        flags = [*flags, *env_flags(env)]
        result = docker("run", "--detach", "--name", name, "--network", "host", *flags, image)
        assert result.returncode == 0, result.stderr
        return cls(name, ports)

    def state(self) -> dict[str, Any]:
        result = docker("inspect", "--format", "{{json .State}}", self.name)
        assert result.returncode == 0, result.stderr
        state: dict[str, Any] = yaml.safe_load(result.stdout)
        return state

    def logs(self) -> str:
        result = docker("logs", self.name)
        return result.stdout + result.stderr

    def probe(self, probe: dict[str, Any], port_names: Mapping[int, str]) -> int:
        """A gRPC probe of the manifest against the port it names, with its timeout."""
        grpc_probe = probe["grpc"]
        target = f"127.0.0.1:{self.ports[port_names[grpc_probe['port']]]}"
        return health(target, probe.get("timeoutSeconds", 1), grpc_probe.get("service", ""))

    def wait_ready(self, probe: dict[str, Any], port_names: Mapping[int, str], timeout: float) -> float:
        """Seconds until `probe` answers SERVING; fails if the container exits or `timeout` passes."""
        started = time.monotonic()
        while True:
            try:
                if self.probe(probe, port_names) == SERVING:
                    return time.monotonic() - started
            except grpc.RpcError:
                pass
            assert self.state()["Running"], f"the container exited:\n{self.logs()}"
            assert time.monotonic() - started < timeout, f"not ready in {timeout} s:\n{self.logs()}"
            time.sleep(0.2)

    def remove(self) -> None:
        docker("rm", "--force", self.name)
