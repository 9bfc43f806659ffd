"""Served throughput of textgen-serve configurations, alternated round by round under one load.

    .venv/bin/textgen-bench serve-ab --bundle models/demo/bundle --threads 1 --rpc stream --rounds 6 \\
        --config=--no-engine-process --config=--engine-process

A configuration's leading `NAME=value` words are set in its server's environment, so code can be compared
with code: `--config='PYTHONPATH=/tmp/old'` serves the `serve` package of a `git worktree` at /tmp/old (the
server runs as `python -m serve` from that folder, so that folder's code runs, whatever its layout).

This machine's speed drifts by tens of percent within minutes (docs/benchmarks.md), so one run of each
configuration says little about a difference of a few percent; rounds that run every configuration in turn,
compared by their medians, do. Round r starts with configuration r mod k, so over a multiple of k rounds
each goes first equally often (what runs first in a round may run slower or faster for it). Each round
starts each configuration's server afresh, warms it up with a short load, then times `--requests`
closed-loop requests from `--clients` clients (exactly `--new-tokens` tokens each, greedy). Prints one line
per round and the medians (each configuration against the first as the median of the rounds' ratios, which
a drift between rounds leaves alone), with the CPU a generated token cost in each process over the timed
requests: the server's (the front end; in brackets its main thread, the event loop), its engine process,
and the load generator (this process); `--json` keeps every figure.

A configuration's `--bench-rpc=NAME` is the clients' call for it alone (`--rpc` for the rest), so a streamed
run and a unary one alternate under one load: `--config='' --config='--bench-rpc=unary'`. `--rpc http` calls
the server's OpenAI API (streamed /v1/completions) instead of gRPC.

A configuration may also serve a bundle of its own (`--bench-bundle=DIR`, `--bundle` for the rest) and spread
its requests over LoRA adapters (`--bench-models=a,b,c,d`, `--models` for the rest: round-robin, each request
naming one; an empty name is the base model), so a LoRA bundle serving adapters alternates with a bundle
without slots: `--bundle plain --config='' --config='--bench-bundle=lora --lora a=DIR,b=DIR
--bench-models=a,b'`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from bench.cpus import engine_cpus_flag
from bench.loadgen import RPC_NAMES, LoadConfig, Rpc, benchmark, model_names
from bench.proc import CpuMeter, descendants, main_thread_cpu_seconds
from bench.report import RESULTS, write_json
from bench.rounds import in_turn, median_ratio
from bench.servers import ROOT, free_port, server_process, textgen_command
from serve.process import beside

ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")


BENCH = "--bench-"  # a configuration's own benchmark settings: --bench-NAME=value, NAME one of BENCH_NAMES
BENCH_NAMES = ("rpc", "bundle", "models")
CLIENT_RPCS: dict[str, Rpc] = {"stream": "stream", "unary": "unary", "http": "http"}  # --bench-rpc's choices
CPU_PARTS = ("front_end", "event_loop", "engine", "load_generator")  # Figures.cpu_us_per_token's keys


@dataclass(frozen=True)
class Figures:
    tokens_per_second: float
    itl_p50_ms: float
    itl_p99_ms: float
    cpu_us_per_token: dict[str, float]  # by CPU_PARTS


def bench_settings(flags: list[str]) -> tuple[dict[str, str], list[str]]:
    """A configuration's own benchmark settings (`--bench-NAME=value`, the last of each wins) and its
    server flags."""
    settings: dict[str, str] = {}
    rest = []
    for flag in flags:
        if not flag.startswith(BENCH):
            rest.append(flag)
            continue
        name, equals, value = flag.removeprefix(BENCH).partition("=")
        if name not in BENCH_NAMES or not equals:
            raise ValueError(
                f"{flag!r}: a configuration's own settings are --bench-{{{','.join(BENCH_NAMES)}}}=..."
            )
        settings[name] = value
    return settings, rest


def client_rpc(flags: list[str], default: Rpc) -> tuple[Rpc, list[str]]:
    """A configuration's own client call (`--bench-rpc=stream|unary|http`, else `default`) and the flags
    without it."""
    settings, _ = bench_settings(flags)
    rest = [f for f in flags if not f.startswith(f"{BENCH}rpc=")]
    rpc = settings.get("rpc")
    if rpc is None:
        return default, rest
    if rpc in CLIENT_RPCS:
        return CLIENT_RPCS[rpc], rest
    raise ValueError(f"--bench-rpc is one of {', '.join(CLIENT_RPCS)}, got {rpc!r}")


@dataclass(frozen=True)
class Served:
    """What one configuration serves and sends: its bundle, its clients' call, the adapters they name."""

    bundle: Path
    rpc: Rpc
    models: tuple[str, ...]
    flags: list[str]  # the server's


def served(flags: list[str], args: argparse.Namespace) -> Served:
    rpc, flags = client_rpc(flags, args.rpc)
    settings, flags = bench_settings(flags)
    models = model_names(settings["models"]) if "models" in settings else args.models
    return Served(Path(settings.get("bundle", args.bundle)), rpc, models, flags)


def split_config(config: str) -> tuple[dict[str, str], list[str]]:
    """A configuration's leading NAME=value words (the server's environment) and its flags."""
    words = shlex.split(config)
    env: dict[str, str] = {}
    while words and ENV_WORD.fullmatch(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return env, words


def measure(config: str, args: argparse.Namespace, log: Path) -> Figures:
    port = free_port()
    env, words = split_config(config)
    setup = served(words, args)
    rpc, flags = setup.rpc, setup.flags
    http_port = free_port() if rpc == "http" else 0  # the HTTP API only where the clients call it
    engine_cpus = engine_cpus_flag(flags)
    command = textgen_command(
        setup.bundle.resolve(),
        *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--http-port", str(http_port)),
        *("--max-batch-size", str(args.clients), "--log-level", "WARNING"),
        *(("--threads", str(args.threads)) if args.threads else ()),
        *flags,
    )
    load = LoadConfig(
        target=f"127.0.0.1:{port}",
        concurrency=args.clients,
        num_requests=args.clients * 2,
        input_len=args.input_len,
        dataset=args.dataset,
        max_new_tokens=args.new_tokens,
        ignore_eos=True,
        percentiles=(50.0, 99.0),
        progress=False,
        rpc=rpc,
        cpus=None if engine_cpus is None else beside(engine_cpus),  # off them, as the server's process
        http_target=f"127.0.0.1:{http_port}" if http_port else None,
        models=setup.models,
    )
    cwd = Path(env.get("PYTHONPATH", ROOT))
    with server_process(command, log, load.target, env, cwd=cwd) as server:
        asyncio.run(benchmark(load))  # warm-up
        engine_pids = descendants(server.pid)  # the engine process (and multiprocessing's resource tracker)
        with CpuMeter([os.getpid(), server.pid, *engine_pids]) as meter:
            loop_before = main_thread_cpu_seconds(server.pid)
            summary = asyncio.run(benchmark(replace(load, num_requests=args.requests))).summary
            event_loop = main_thread_cpu_seconds(server.pid) - loop_before
    itl: dict[str, float] = summary["itl_ms"]  # type: ignore[assignment]
    rate = float(summary["output_throughput"])  # type: ignore[arg-type]
    tokens = args.requests * args.new_tokens
    seconds = {
        "front_end": meter.cpu[server.pid],
        "event_loop": event_loop,
        "engine": sum(meter.cpu[p] for p in engine_pids),
        "load_generator": meter.cpu[os.getpid()],
    }
    return Figures(rate, itl["median"], itl["p99"], {k: v / tokens * 1e6 for k, v in seconds.items()})


def summary(runs: dict[str, list[Figures]]) -> list[str]:
    """A line a configuration: its medians over the rounds, and its tok/s ÷ the first configuration's as the
    median of the rounds' ratios (a drift of the machine between rounds cancels out of each)."""
    first = [f.tokens_per_second for f in next(iter(runs.values()))]
    lines = []
    for config, figures in runs.items():
        rate = statistics.median(f.tokens_per_second for f in figures)
        ratio = median_ratio([f.tokens_per_second for f in figures], first)
        p50 = statistics.median(f.itl_p50_ms for f in figures)
        p99 = statistics.median(f.itl_p99_ms for f in figures)
        cpu = {k: statistics.median(f.cpu_us_per_token[k] for f in figures) for k in CPU_PARTS}
        lines.append(
            f"  [{config or 'defaults'}] {rate:.0f} tok/s ({ratio:.2f}x the first, median of the rounds' "
            f"ratios), ITL p50 {p50:.1f} p99 {p99:.1f} ms; CPU µs a token: front end "
            f"{cpu['front_end']:.0f} ({cpu['event_loop']:.0f}), engine {cpu['engine']:.0f}, "
            f"load generator {cpu['load_generator']:.0f}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True, help="model bundle (a --bench-bundle= replaces it)")
    p.add_argument(
        "--config",
        action="append",
        required=True,
        help="textgen-serve flags of one configuration (repeat: two or more; '' for the defaults)",
    )
    p.add_argument("--rounds", type=int, default=4, help="rounds; each runs every configuration once")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients (and --max-batch-size)")
    p.add_argument("--requests", type=int, default=256, help="timed requests per run")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument(
        "--dataset",
        choices=("synthetic", "corpus"),
        default="synthetic",
        help="prompts: random token ids, or windows of the Python standard library's sources",
    )
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument("--threads", type=int, default=None, help="textgen-serve --threads")
    p.add_argument("--rpc", choices=tuple(RPC_NAMES), default="stream", help="the clients' call")
    p.add_argument(
        "--models",
        type=model_names,
        default=(),
        help="LoRA adapters the requests name in turn, comma-separated ('' : the base model; a "
        "configuration's --bench-models= replaces it)",
    )
    p.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = p.parse_args(argv)
    if len(args.config) < 2:
        p.error("give at least two --config")
    log = RESULTS / "serve_ab.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Figures]] = {config: [] for config in args.config}
    for round_ in range(1, args.rounds + 1):
        for config in in_turn(args.config, round_ - 1):
            runs[config].append(measure(config, args, log))
        cells = "  ".join(f"[{c or 'defaults'}] {runs[c][-1].tokens_per_second:.0f}" for c in args.config)
        print(f"round {round_}: {cells} tok/s", flush=True)
    print(f"medians over {args.rounds} rounds ({args.rpc}, {args.clients} clients, {args.bundle}):")
    print("\n".join(summary(runs)))
    if args.json is not None:
        write_json(args.json, {c: [asdict(f) for f in fs] for c, fs in runs.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
