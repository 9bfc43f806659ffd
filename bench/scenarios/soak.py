"""Soak: rounds of mixed load against a server subprocess; between rounds the server must return to idle.

    textgen-bench soak                      # `make soak`: 6 rounds of 25 s, ~3 minutes
    textgen-bench soak --rounds 3 --round-seconds 10 --bundle models/demo/bundle

Each round, `--clients` concurrent clients (more than the server's batch rows plus queue places) send a mix of
streams, unary calls, streams cancelled after their first message, streams with deadlines too short to finish,
invalid requests and small RPCs. After each round the soak waits for the server to go idle, then samples its
RSS (from /proc: the server process and its engine process together) and its load gauges. It fails (exit 1)
when a gauge does not return to 0, when a call ends with a status outside the expected set, or when RSS grows
by more than the tolerance between the end of the first round (allocator pools, ONNX Runtime and gRPC buffers
are warm by then) and any later round.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from bench.bundles import demo_bundle
from bench.proc import tree_rss_mib
from bench.servers import free_port, server_process, textgen_command
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

GAUGES = ("textgen_requests_running", "textgen_requests_waiting", "textgen_kv_cache_slots_used")
# What a correct server answers this mix with; anything else (INTERNAL, UNKNOWN, UNAVAILABLE) is a failure.
EXPECTED_CODES = frozenset({"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED", "CANCELLED", "INVALID_ARGUMENT"})
PROMPTS = (
    "The history of the city",
    "def parse(text):",
    "Once upon a time, in a small village",
    "import os\nimport sys\n",
    "In the beginning",
    "class Node:",
)
ACTIONS = ("stream", "stream", "stream", "unary", "unary", "cancel", "deadline", "invalid", "small")


@dataclass(frozen=True)
class Round:
    codes: Counter[str]
    rss_mib: float
    gauges: dict[str, float]
    idle_seconds: float


# --- the load ---------------------------------------------------------------------------------------------


def generate(rng: random.Random) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        text=rng.choice(PROMPTS),
        sampling=pb.SamplingParams(temperature=rng.choice((0.0, 0.8))),
        stopping=pb.StoppingCriteria(max_new_tokens=rng.randint(1, 32), ignore_eos=True),
    )


def invalid(rng: random.Random) -> pb.GenerateRequest:
    return rng.choice(
        (
            pb.GenerateRequest(text=""),
            pb.GenerateRequest(text="x", sampling=pb.SamplingParams(temperature=-1.0)),
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[2**31] * 3)),
            pb.GenerateRequest(text="x", stopping=pb.StoppingCriteria(stop=["s" * 1000])),
        )
    )


async def one_call(stub: pb_grpc.TextGenerationStub, action: str, rng: random.Random) -> str:
    """Runs one call of the mix; returns the status code name it ended with."""
    try:
        if action == "stream":
            async for _message in stub.GenerateStream(generate(rng), timeout=60):
                pass
        elif action == "unary":
            await stub.Generate(generate(rng), timeout=60)
        elif action == "cancel":
            call = stub.GenerateStream(generate(rng), timeout=60)
            await call.read()
            call.cancel()
            return grpc.StatusCode.CANCELLED.name
        elif action == "deadline":
            async for _message in stub.GenerateStream(generate(rng), timeout=rng.uniform(0.01, 0.2)):
                pass
        elif action == "invalid":
            await stub.Generate(invalid(rng), timeout=60)
        else:
            await stub.Tokenize(pb.TokenizeRequest(text=rng.choice(PROMPTS)), timeout=60)
    except grpc.aio.AioRpcError as exc:
        return exc.code().name
    return grpc.StatusCode.OK.name


async def client(target: str, seed: int, until: float) -> Counter[str]:
    rng = random.Random(seed)
    codes: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        while time.monotonic() < until:
            code = await one_call(stub, rng.choice(ACTIONS), rng)
            codes[code] += 1
            if code == "RESOURCE_EXHAUSTED":
                await asyncio.sleep(0.05)  # refused clients back off, as real ones would
    return codes


async def load(target: str, clients: int, seconds: float, seed: int) -> Counter[str]:
    until = time.monotonic() + seconds
    counts = await asyncio.gather(*(client(target, seed * 1000 + i, until) for i in range(clients)))
    return sum(counts, Counter())


# --- the server's state -----------------------------------------------------------------------------------


def gauges(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
        return {s.name: s.value for f in families for s in f.samples if s.name in GAUGES}


def wait_idle(metrics_url: str, timeout: float = 30.0) -> tuple[dict[str, float], float]:
    """The load gauges once they are all 0 (or at the timeout), and how long that took."""
    start = time.monotonic()
    while True:
        values = gauges(metrics_url)
        if all(v == 0 for v in values.values()) or time.monotonic() - start > timeout:
            return values, time.monotonic() - start
        time.sleep(0.05)


# --- the run ----------------------------------------------------------------------------------------------


def ensure_bundle(bundle: Path | None, scratch: Path) -> Path:
    """The given bundle, else the demo bundle when it has been built, else a random tiny one (seconds)."""
    if bundle is not None:
        return bundle
    if (demo_bundle() / "manifest.json").exists():
        return demo_bundle()
    from export.pipeline import random_bundle  # torch: only when no bundle is at hand

    return random_bundle("tiny", scratch / "tiny", seed=0, progress=False).root


def soak(args: argparse.Namespace, bundle: Path, log_path: Path) -> list[Round]:
    port, metrics_port = free_port(), free_port()
    target, metrics_url = f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics"
    command = textgen_command(
        bundle,
        *("--host", "127.0.0.1", "--port", str(port), "--metrics-host", "127.0.0.1"),
        *("--metrics-port", str(metrics_port), "--http-port", "0"),
        *("--max-batch-size", str(args.max_batch_size), "--max-queue", str(args.max_queue)),
    )
    rounds: list[Round] = []
    with server_process(command, log_path, target) as process:
        for number in range(args.rounds):
            codes = asyncio.run(load(target, args.clients, args.round_seconds, seed=number))
            values, idle_seconds = wait_idle(metrics_url)
            rounds.append(Round(codes, tree_rss_mib(process.pid), values, idle_seconds))
            print(f"round {number + 1}/{args.rounds}: {sum(codes.values())} calls", flush=True)
    return rounds


def table(rounds: list[Round]) -> str:
    codes = sorted(set().union(*(r.codes for r in rounds)))
    header = [
        "round",
        "calls",
        *codes,
        "RSS MiB",
        "dRSS",
        *(g.removeprefix("textgen_") for g in GAUGES),
        "idle s",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    base = rounds[0].rss_mib
    for number, r in enumerate(rounds, 1):
        cells = [str(number), str(sum(r.codes.values())), *(str(r.codes[c]) for c in codes)]
        cells += [f"{r.rss_mib:.1f}", f"{r.rss_mib - base:+.1f}"]
        cells += [*(f"{r.gauges.get(g, -1):g}" for g in GAUGES), f"{r.idle_seconds:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failures(rounds: list[Round], tolerance_mib: float) -> list[str]:
    found = []
    for number, r in enumerate(rounds, 1):
        if set(r.gauges) != set(GAUGES) or any(r.gauges.values()):
            found.append(f"round {number}: the load gauges did not return to 0: {r.gauges}")
        unexpected = {c: n for c, n in r.codes.items() if c not in EXPECTED_CODES}
        if unexpected:
            found.append(f"round {number}: unexpected status codes {unexpected}")
    base = rounds[0].rss_mib
    for number, r in enumerate(rounds[1:], 2):
        if r.rss_mib - base > tolerance_mib:
            found.append(
                f"round {number}: RSS {r.rss_mib:.1f} MiB is {r.rss_mib - base:.1f} MiB above round 1's "
                f"{base:.1f} MiB (tolerance {tolerance_mib} MiB)"
            )
    return found


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bundle", type=Path, help="default: the demo bundle if built, else a random tiny one")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--round-seconds", type=float, default=25.0)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--max-batch-size", type=int, default=4)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--rss-tolerance-mib", type=float, default=16.0, help="allowed growth after round 1")
    p.add_argument("--log", type=Path, help="server log file (default: a temporary file)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.rounds < 2:
        parser().error("--rounds must be at least 2: round 1 is the baseline")
    with tempfile.TemporaryDirectory(prefix="textgen-soak-") as scratch:
        bundle = ensure_bundle(args.bundle, Path(scratch))
        log_path = args.log or Path(scratch) / "server.log"
        started = time.monotonic()
        rounds = soak(args, bundle, log_path)
        print(
            f"\nsoak of {bundle} ({args.clients} clients, batch {args.max_batch_size}, "
            f"queue {args.max_queue}, {args.rounds} x {args.round_seconds:g} s, "
            f"{time.monotonic() - started:.0f} s in all)\n"
        )
        print(table(rounds))
        found = failures(rounds, args.rss_tolerance_mib)
    for failure in found:
        print(f"FAIL {failure}")
    print("\nsoak: " + ("FAILED" if found else "passed"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
