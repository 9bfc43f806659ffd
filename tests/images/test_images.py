"""The built images against a real container engine (`make images`, then `make test-images`; not
part of `make test`): the exporter image writes the demo bundle into a mounted folder as the export Job
runs it; the CPU serving image serves it as the Deployment of deploy/k8s/overlays/cpu runs it (its user,
read-only root file system, capabilities, limits, environment, volumes and probes, all read from the
manifests); its answers equal those of the venv's server on the same bundle; it drains four streams on
SIGTERM within the grace period; it refuses a missing, corrupt or unreadable bundle with exit code 1 and one
log line.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
from metric_refs import missing_metrics
from pod_containers import (
    K8S,
    SERVING,
    Container,
    claim_mount,
    config_literals,
    container_of,
    docker,
    env_flags,
    environment,
    image_ref,
    loopback_environment,
    pod_flags,
    pod_spec,
    port_settings,
)
from server_process import ServerProcess

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

pytestmark = pytest.mark.images

OVERLAY = K8S / "overlays" / "cpu"
EXPORT = K8S / "export"
DEPLOYMENT = pod_spec(K8S / "base" / "deployment.yaml")
JOB = pod_spec(EXPORT / "job.yaml")
SERVER = container_of(DEPLOYMENT)
EXPORTER = container_of(JOB)
SERVING_IMAGE = image_ref(OVERLAY, SERVER)
EXPORT_IMAGE = image_ref(EXPORT, EXPORTER)
TOKEN = "images-test-token"
SECRETS = {("textgen-auth", "token"): TOKEN}
METADATA = [("authorization", f"Bearer {TOKEN}")]
PROMPTS = ["def main(", "import os\n", "class Parser:"]
MAX_NEW_TOKENS = 24
# The port each probe names, by number (a gRPC probe's port is a number), -> that port's name.
PORT_NAMES = {p["containerPort"]: p["name"] for p in SERVER["ports"]}


@pytest.fixture(scope="module", autouse=True)
def engine() -> None:
    """The images must exist (`make images`); a missing engine or image is a failure here, not a skip."""
    assert shutil.which("docker"), "no docker client on PATH"
    for image in (SERVING_IMAGE, EXPORT_IMAGE):
        assert docker("image", "inspect", image).returncode == 0, f"{image}: build it with `make images`"


def owned_by_pod(path: Path, pod: dict[str, Any]) -> Path:
    """A host folder the pod's user may write, as a volume with fsGroup would be."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() == 0:
        os.chown(path, pod["securityContext"]["runAsUser"], pod["securityContext"]["fsGroup"])
    else:
        path.chmod(0o777)
    return path


@dataclass(frozen=True)
class Export:
    volume: Path  # the claim's folder: checkpoint.pt in, bundle/ out
    result: subprocess.CompletedProcess[str]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, demo_checkpoint: Path) -> Export:
    """The export Job's container on a host folder standing for its claim, holding the demo checkpoint."""
    volume = owned_by_pod(tmp_path_factory.mktemp("claim") / "volume", JOB)
    checkpoint = volume / "checkpoint.pt"
    shutil.copyfile(demo_checkpoint, checkpoint)
    checkpoint.chmod(0o644)
    flags = pod_flags(JOB, {claim_mount(JOB)[0]: volume})
    command = ["run", "--rm", "--network", "none", *flags, EXPORT_IMAGE, *EXPORTER["args"]]
    return Export(volume, docker(*command, timeout=600))


@pytest.fixture(scope="module")
def bundle(exported: Export) -> Path:
    assert exported.result.returncode == 0, exported.result.stdout + exported.result.stderr
    return exported.volume / claim_mount(DEPLOYMENT)[1]["subPath"]


def serving_flags(volume: Path) -> list[str]:
    return pod_flags(DEPLOYMENT, {claim_mount(DEPLOYMENT)[0]: volume})


def serving_environment() -> tuple[dict[str, str], dict[str, int]]:
    env = environment(SERVER, config_literals(K8S / "base", OVERLAY), SECRETS)
    return loopback_environment(env, port_settings(SERVER, env))


def startup_budget() -> float:
    """What the startup probe allows before the kubelet restarts the container."""
    probe = SERVER["startupProbe"]
    return float(probe["periodSeconds"] * probe["failureThreshold"])


@contextmanager
def serving(volume: Path) -> Iterator[Container]:
    """The serving image as the Deployment runs it on `volume` (its claim), until the startup probe passes."""
    env, ports = serving_environment()
    started = time.monotonic()
    container = Container.start(SERVING_IMAGE, serving_flags(volume), env, ports)
    try:
        container.wait_ready(SERVER["startupProbe"], PORT_NAMES, startup_budget())
        print(f"{SERVING_IMAGE}: start to ready {time.monotonic() - started:.1f} s")
        yield container
    finally:
        container.remove()


@pytest.fixture(scope="module")
def served(exported: Export, bundle: Path) -> Iterator[Container]:
    """The serving container on the exported bundle (`bundle` fails first if the export failed)."""
    with serving(exported.volume) as container:
        yield container


@pytest.fixture(scope="module")
def reference(bundle: Path) -> Iterator[str]:
    """The venv's server (`python -m serve`, what `textgen-serve` runs) on the same bundle; no token, as its
    environment has no TEXTGEN_* variable."""
    server = ServerProcess("--bundle", str(bundle))
    try:
        yield server.wait_serving()
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=60)


def greedy(prompt: str, max_new_tokens: int = MAX_NEW_TOKENS, ignore_eos: bool = False) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=prompt,
        sampling=pb.SamplingParams(temperature=0.0),
        stopping=pb.StoppingCriteria(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos),
    )


def generate(target: str, prompt: str) -> tuple[list[int], str]:
    with grpc.insecure_channel(target) as channel:
        response = pb_grpc.TextGenerationStub(channel).Generate(greedy(prompt), metadata=METADATA, timeout=60)
    return list(response.token_ids), response.text


def generate_stream(target: str, prompt: str) -> tuple[list[int], str]:
    tokens: list[int] = []
    text = ""
    with grpc.insecure_channel(target) as channel:
        for message in pb_grpc.TextGenerationStub(channel).GenerateStream(
            greedy(prompt), metadata=METADATA, timeout=60
        ):
            tokens += message.token_ids
            text += message.text
    return tokens, text


def grpc_target(container: Container) -> str:
    return f"127.0.0.1:{container.ports['grpc']}"


def openai_client(container: Container) -> openai.OpenAI:
    base = f"http://127.0.0.1:{container.ports['http']}/v1"
    return openai.OpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=60)


def http_text(client: openai.OpenAI, model: str, prompt: str) -> tuple[str, int]:
    completion = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0
    )
    assert completion.usage is not None
    return completion.choices[0].text, completion.usage.completion_tokens


def http_stream_text(client: openai.OpenAI, model: str, prompt: str) -> str:
    chunks = client.completions.create(
        model=model, prompt=prompt, max_tokens=MAX_NEW_TOKENS, temperature=0, stream=True
    )
    return "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)


def url_text(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


def test_the_exporter_writes_the_bundle_into_the_mounted_folder(exported: Export, bundle: Path) -> None:
    output = exported.result.stdout + exported.result.stderr
    assert "PASSED" in output and "bundle written to" in output, output
    assert {"manifest.json", "model.onnx", "tokenizer.json"} <= {p.name for p in bundle.iterdir()}
    if os.geteuid() == 0:  # written by the Job's user, not root
        assert bundle.stat().st_uid == JOB["securityContext"]["runAsUser"]


def test_the_probes_answer(served: Container) -> None:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert served.probe(SERVER[probe], PORT_NAMES) == SERVING, probe
    status, _ = url_text(f"http://127.0.0.1:{served.ports['http']}/health")
    assert status == 200


def test_answers_equal_the_venv_server(served: Container, reference: str) -> None:
    client = openai_client(served)
    model = client.models.list().data[0].id
    for prompt in PROMPTS:
        tokens, text = generate(reference, prompt)
        assert tokens, prompt
        assert generate(grpc_target(served), prompt) == (tokens, text), prompt
        assert generate_stream(grpc_target(served), prompt) == (tokens, text), prompt
        assert http_text(client, model, prompt) == (text, len(tokens)), prompt
        assert http_stream_text(client, model, prompt) == text, prompt


def test_metrics_scrape_has_every_metric_the_deploy_files_use(served: Container) -> None:
    generate(grpc_target(served), PROMPTS[0])
    status, scrape = url_text(f"http://127.0.0.1:{served.ports['metrics']}/metrics")
    assert status == 200
    assert missing_metrics(scrape) == {}


class Stream:
    """A long greedy stream read on a thread: its tokens, finish reason, first message and last one's time."""

    def __init__(self, target: str, max_new_tokens: int) -> None:
        self.tokens: list[int] = []
        self.finish = pb.FINISH_REASON_UNSPECIFIED
        self.first = threading.Event()
        self.last_at = 0.0
        self.request = greedy(PROMPTS[0], max_new_tokens, ignore_eos=True)
        self.thread = threading.Thread(target=self._run, args=(target,), daemon=True)
        self.thread.start()

    def _run(self, target: str) -> None:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.TextGenerationStub(channel)
            for message in stub.GenerateStream(self.request, metadata=METADATA, timeout=120):
                self.tokens += message.token_ids
                self.finish = message.finish_reason
                self.last_at = time.monotonic()
                self.first.set()


def test_sigterm_lets_four_streams_finish_and_exits_0_within_the_grace_period(exported: Export) -> None:
    """As the kubelet stops a pod: the preStop hook, then SIGTERM (the image's STOPSIGNAL), then SIGKILL at
    terminationGracePeriodSeconds after the start of it all (`docker stop --time`)."""
    grace = DEPLOYMENT["terminationGracePeriodSeconds"]
    pre_stop = SERVER["lifecycle"]["preStop"]["exec"]["command"]
    with serving(exported.volume) as container:
        stopping = time.monotonic()
        hook = docker("exec", container.name, *pre_stop, timeout=grace)
        assert hook.returncode == 0, hook.stderr
        streams = [Stream(grpc_target(container), 200) for _ in range(4)]
        assert all(stream.first.wait(30) for stream in streams)
        signalled = time.monotonic()
        left = grace - (signalled - stopping)
        stop = docker("stop", "--time", str(int(left)), container.name, timeout=grace + 30)
        stopped = time.monotonic()
        for stream in streams:
            stream.thread.join(30)
        state, logs = container.state(), container.logs()
    assert stop.returncode == 0, stop.stderr
    assert state["ExitCode"] == 0, logs
    assert stopped - stopping <= grace
    for stream in streams:
        assert stream.last_at > signalled, "the stream had finished before SIGTERM: it proves nothing"
        assert (stream.finish, len(stream.tokens)) == (pb.FINISH_REASON_LENGTH, 200)


def give_to_pod(path: Path) -> None:
    """Owned by the pod's user (as root) or readable by all, like the exporter's output."""
    for item in [path, *path.rglob("*")]:
        if os.geteuid() == 0:
            os.chown(
                item, DEPLOYMENT["securityContext"]["runAsUser"], DEPLOYMENT["securityContext"]["fsGroup"]
            )
        else:
            item.chmod(0o755 if item.is_dir() else 0o644)


def broken_claim(kind: str, bundle: Path, root: Path) -> Path:
    """A claim folder whose bundle is missing (an empty folder), corrupt (a byte of the graph changed after
    export) or unreadable by the pod's user (a folder only its owner, not that user, may open)."""
    volume = owned_by_pod(root / "volume", DEPLOYMENT)
    target = volume / bundle.name
    if kind == "missing":
        target.mkdir()
        give_to_pod(target)
        return volume
    shutil.copytree(bundle, target)
    give_to_pod(target)
    if kind == "corrupt":
        graph = target / "model_inplace.onnx"  # the graph the server opens at start
        data = bytearray(graph.read_bytes())
        data[len(data) // 2] ^= 0xFF
        graph.write_bytes(bytes(data))
    else:
        os.chown(target, os.geteuid(), os.getegid())
        target.chmod(0o700)
    return volume


@pytest.mark.parametrize(
    ("kind", "message"),
    [
        ("missing", "manifest missing"),
        ("corrupt", "checksum mismatch"),
        ("unreadable", "Permission denied"),
    ],
)
def test_refuses_a_bad_bundle_with_exit_1_and_one_line(
    kind: str, message: str, bundle: Path, tmp_path: Path
) -> None:
    if kind == "unreadable" and os.geteuid() == DEPLOYMENT["securityContext"]["runAsUser"]:
        pytest.fail("run as another user than the pod's: its folders would be readable to it")
    volume = broken_claim(kind, bundle, tmp_path)
    env, _ = serving_environment()
    flags = [*serving_flags(volume), *env_flags(env)]
    result = docker("run", "--rm", "--network", "host", *flags, SERVING_IMAGE)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if " ERROR " in line]
    assert result.returncode == 1, output
    assert len(errors) == 1 and message in errors[0], output
    assert "Traceback" not in output
    assert output.rstrip().endswith(errors[0]), "the refusal is the last line"
