"""An urgent request on a saturated server, under `--scheduling-policy fcfs` and `priority`, alternated.

    textgen-bench priority --bundle models/demo/bundle --rounds 6 --new-tokens 192 --threads 1

Each run starts a server with `--max-batch-size ROWS` and the policy, warms it up, then sends `--streams`
low-priority streams (priority 5) at once, more than the rows, so the rows decode and the rest wait. After
`--urgent-after` seconds one high-priority stream (priority 0) is sent. Under fcfs it waits for the queue;
under priority it goes first and, the rows being busy, preempts the latest of the decoding streams, which
resumes once a row frees up. Reported per policy (medians over the rounds): the urgent stream's time to
first token and total time; the preempted stream's total time and longest wait between two tokens (it is
the stream that waited longest in the round's priority run; under fcfs, the same request, sent in the same
place, is not preempted); all streams' median total time and when the last one ended; the preemptions the
server counted (`textgen_preemptions_total`). The policies alternate as `bench/scenarios/serve_ab.py`'s
configurations do (this machine's speed drifts).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

import grpc

from bench.loadgen import LoadConfig, Prompt, RequestRecord, build_prompts, send
from bench.report import RESULTS, write_json
from bench.rounds import in_turn
from bench.servers import free_port, server_process, textgen_command
from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

POLICIES = ("fcfs", "priority")
LOW, HIGH = 5, 0  # the streams' priority and the urgent request's: lower is more urgent


@dataclass(frozen=True)
class Figures:
    urgent_ttft_ms: float
    urgent_e2el_ms: float
    watched_e2el_ms: float  # the watched stream's total time (the one preempted under priority)
    watched_pause_ms: float  # its longest wait between two tokens
    streams_e2el_p50_ms: float
    streams_end_s: float  # when the last stream ended, from the first one's start
    preemptions: float


class Run(NamedTuple):
    records: list[RequestRecord]  # the streams', then the urgent request's
    preemptions: float  # counted by the server during the run


def messages(prompts: list[Prompt], config: LoadConfig) -> list[pb.GenerateRequest]:
    """The low-priority streams, then the urgent one."""
    *streams, urgent = [prompt.message(f"low-{i}", config) for i, prompt in enumerate(prompts)]
    for message in streams:
        message.priority = LOW
    urgent.request_id, urgent.priority = "urgent", HIGH
    return [*streams, urgent]


async def contend(target: str, args: argparse.Namespace, warm_up: bool = False) -> list[RequestRecord]:
    """One load: the streams at once, the urgent request `--urgent-after` seconds later; its record last."""
    config = LoadConfig(
        target=target, input_len=args.input_len, max_new_tokens=args.new_tokens, ignore_eos=True
    )
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        prompts = build_prompts(config, args.streams + 1, info, _no_tokenizer)
        prompts[-1] = replace(prompts[-1], max_new_tokens=args.urgent_tokens)
        *streams, urgent = messages(prompts, config)
        origin = time.perf_counter()
        sent = [asyncio.create_task(send(stub, m, origin, origin, config.timeout)) for m in streams]
        if not warm_up:
            await asyncio.sleep(args.urgent_after)
            sent.append(asyncio.create_task(send(stub, urgent, origin, time.perf_counter(), config.timeout)))
        records = await asyncio.gather(*sent)
    failed = [r for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0].request_id}: {failed[0].error}")
    return records


def longest_pause(records: list[RequestRecord]) -> str:
    """The stream that waited longest between two tokens: under priority, the one preempted."""
    *streams, _urgent = records
    return max(streams, key=lambda r: max(r.itl, default=0.0)).request_id


def figures(run: Run, watched: str) -> Figures:
    """A run's figures, `watched` being the stream preempted in the same round's priority run: so its time
    under fcfs is that of the same request (sent in the same place) without the preemption."""
    *streams, urgent = run.records
    assert urgent.ttft is not None, "a streamed request has a first token"
    stream = next(r for r in streams if r.request_id == watched)
    return Figures(
        urgent_ttft_ms=urgent.ttft * 1e3,
        urgent_e2el_ms=urgent.latency * 1e3,
        watched_e2el_ms=stream.latency * 1e3,
        watched_pause_ms=max(stream.itl, default=0.0) * 1e3,
        streams_e2el_p50_ms=statistics.median(r.latency for r in streams) * 1e3,
        streams_end_s=max(r.start + r.latency for r in streams),
        preemptions=run.preemptions,
    )


def preemptions(metrics_port: int) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("textgen_preemptions_total "):
                return float(line.split()[1])
    raise RuntimeError(f"{url} has no textgen_preemptions_total")


def measure(policy: str, args: argparse.Namespace, log: Path) -> Run:
    port, metrics_port = free_port(), free_port()
    command = textgen_command(
        args.bundle.resolve(),
        *("--scheduling-policy", policy),
        *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", str(metrics_port)),
        *("--http-port", "0", "--max-batch-size", str(args.rows), "--log-level", "WARNING"),
        *(("--threads", str(args.threads)) if args.threads else ()),
    )
    target = f"127.0.0.1:{port}"
    with server_process(command, log, target):
        asyncio.run(contend(target, args, warm_up=True))
        before = preemptions(metrics_port)
        records = asyncio.run(contend(target, args))
        return Run(records, preemptions(metrics_port) - before)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True, help="model bundle")
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs both policies")
    p.add_argument("--rows", type=int, default=4, help="the server's --max-batch-size (fewer than streams)")
    p.add_argument("--streams", type=int, default=16, help="low-priority streams sent at once")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (random ids)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens each low-priority stream generates")
    p.add_argument("--urgent-tokens", type=int, default=32, help="tokens the urgent request generates")
    p.add_argument("--urgent-after", type=float, default=0.5, help="seconds after the streams it is sent")
    p.add_argument("--threads", type=int, default=None, help="textgen-serve --threads")
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)
    if args.rows >= args.streams:
        p.error(f"--rows ({args.rows}) must be fewer than --streams ({args.streams}): nothing would wait")
    log = RESULTS / "priority_bench.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Figures]] = {policy: [] for policy in POLICIES}
    for round_ in range(1, args.rounds + 1):
        done = {policy: measure(policy, args, log) for policy in in_turn(POLICIES, round_ - 1)}
        watched = longest_pause(done["priority"].records)
        for policy in POLICIES:
            runs[policy].append(figures(done[policy], watched))
        cells = "  ".join(f"[{p}] {runs[p][-1].urgent_ttft_ms:.0f}" for p in POLICIES)
        print(f"round {round_}: urgent TTFT {cells} ms", flush=True)
    print(f"medians over {args.rounds} rounds ({args.streams} streams, {args.rows} rows, {args.bundle}):")
    for policy, runs_ in runs.items():
        med = {name: statistics.median(getattr(f, name) for f in runs_) for name in asdict(runs_[0])}
        print(
            f"  [{policy}] urgent TTFT {med['urgent_ttft_ms']:.0f} ms, total {med['urgent_e2el_ms']:.0f} ms; "
            f"the preempted stream's total {med['watched_e2el_ms']:.0f} ms, longest pause "
            f"{med['watched_pause_ms']:.0f} ms; "
            f"streams' median total {med['streams_e2el_p50_ms']:.0f} ms, "
            f"the last ended at {med['streams_end_s']:.2f} s; "
            f"preemptions {med['preemptions']:.0f}"
        )
    if args.json is not None:
        write_json(args.json, {p: [asdict(f) for f in fs] for p, fs in runs.items()})
    return 0


def _no_tokenizer(text: str) -> int:
    raise AssertionError("synthetic prompts are never tokenized")


if __name__ == "__main__":
    sys.exit(main())
