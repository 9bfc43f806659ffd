"""The images, checked without Docker: the Dockerfiles statically, the locked serving requirements against
pyproject and in a fresh venv that serves (slow)."""

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
from pathlib import Path

import pytest
import tomllib
import yaml
from metric_refs import REPO, missing_metrics, promtool_input
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from serve.api.config import ServerSettings

DOCKER = REPO / "deploy" / "docker"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
SERVING_IMAGES = {"Dockerfile.cpu": "requirements-serve.txt", "Dockerfile.gpu": "requirements-serve-gpu.txt"}
GRPC_PORT = ServerSettings.model_fields["port"].default
METRICS_PORT = ServerSettings.model_fields["metrics_port"].default
HTTP_PORT = ServerSettings.model_fields["http_port"].default


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
        "serve.api.metrics, serve.api.http.server"
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
