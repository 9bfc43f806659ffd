"""HTTP ÷ gRPC: served tokens/s and TTFT of one server through either front end, alternated, in one run.

    .venv/bin/textgen-bench http-ab --bundle models/demo/bundle --clients 1,16 --rounds 3

One `textgen-serve` (defaults, the HTTP API on a free port) serves both: for each client count, each round
runs a closed loop of streamed requests through gRPC (GenerateStream) and through the OpenAI API (streamed
/v1/completions, textgen-bench's lean HTTP client), in turn, the first of them alternating from round to
round (this machine's speed drifts within minutes: docs/benchmarks.md). Exactly `--new-tokens` tokens a
request, greedy, random token-id prompts of `--input-len`. Besides the rates, each run records the CPU time
per generated token of the server's own process (the front ends; the engine runs in a process of its own)
and of the load generator, from /proc and getrusage: what each front end costs, whatever else the machine
runs. Prints a line per run and the medians' ratios, as a Markdown table; `--json` keeps every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from bench.loadgen import LoadConfig, Rpc, benchmark
from bench.proc import cpu_seconds, own_cpu_seconds
from bench.report import RESULTS, table, write_json
from bench.rounds import in_turn
from bench.servers import free_port, server_process, textgen_command


def run(load: LoadConfig, rpc: Rpc, http_target: str, server_pid: int) -> dict[str, float]:
    config = replace(load, rpc=rpc, http_target=http_target if rpc == "http" else None)
    server_before, client_before = cpu_seconds(server_pid), own_cpu_seconds()
    summary = asyncio.run(benchmark(config)).summary
    server_cpu, client_cpu = cpu_seconds(server_pid) - server_before, own_cpu_seconds() - client_before
    tokens = int(summary["total_output_tokens"])  # type: ignore[call-overload]
    ttft: dict[str, float] = summary["ttft_ms"]  # type: ignore[assignment]
    itl: dict[str, float] = summary["itl_ms"]  # type: ignore[assignment]
    failed = int(summary["failed_requests"])  # type: ignore[call-overload]
    if failed:
        raise RuntimeError(f"{failed} requests failed ({rpc})")
    return {
        "tok_s": float(summary["output_throughput"]),  # type: ignore[arg-type]
        "ttft_p50_ms": ttft["median"],
        "ttft_mean_ms": ttft["mean"],
        "itl_p50_ms": itl["median"],
        "server_us_per_token": 1e6 * server_cpu / tokens,
        "client_us_per_token": 1e6 * client_cpu / tokens,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--clients", default="1,16", help="comma-separated closed-loop client counts")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests-per-client", type=int, default=4, help="timed requests per client in a run")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("serve_flags", nargs="*", help="more textgen-serve flags (after --)")
    args = p.parse_args(argv)
    port, http_port = free_port(), free_port()
    command = textgen_command(
        args.bundle.resolve(),
        *("--log-level", "WARNING", "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0"),
        *("--http-host", "127.0.0.1", "--http-port", str(http_port)),
        *args.serve_flags,
    )
    log = RESULTS / "http_ab.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    http_target = f"127.0.0.1:{http_port}"
    figures: dict[str, dict[str, list[dict[str, float]]]] = {}
    with server_process(command, log, f"127.0.0.1:{port}") as server:
        for clients in (int(c) for c in args.clients.split(",")):
            load = LoadConfig(
                target=f"127.0.0.1:{port}",
                concurrency=clients,
                num_requests=clients * args.requests_per_client,
                input_len=args.input_len,
                max_new_tokens=args.new_tokens,
                ignore_eos=True,
                percentiles=(50.0, 99.0),
                progress=False,
            )
            warm = replace(load, num_requests=clients)
            run(warm, "stream", http_target, server.pid)
            run(warm, "http", http_target, server.pid)
            runs: dict[str, list[dict[str, float]]] = {"stream": [], "http": []}
            for round_ in range(args.rounds):
                rpcs: tuple[Rpc, ...] = ("stream", "http")
                for rpc in in_turn(rpcs, round_):
                    runs[rpc].append(run(load, rpc, http_target, server.pid))
                cells = "  ".join(
                    f"{rpc} {r['tok_s']:.0f} tok/s TTFT p50 {r['ttft_p50_ms']:.1f} ms, CPU/token server "
                    f"{r['server_us_per_token']:.0f} us client {r['client_us_per_token']:.0f} us"
                    for rpc, r in ((rpc, runs[rpc][-1]) for rpc in ("stream", "http"))
                )
                print(f"{clients} clients, round {round_ + 1}: {cells}", flush=True)
            figures[str(clients)] = runs
    print(
        f"\n{args.bundle}, {args.input_len} prompt + {args.new_tokens} new tokens, medians of {args.rounds}:"
    )
    header = [
        *("clients", "gRPC tok/s", "HTTP tok/s", "HTTP ÷ gRPC tok/s", "gRPC TTFT p50", "HTTP TTFT p50"),
        *("HTTP ÷ gRPC TTFT", "server CPU µs/token gRPC, HTTP", "client CPU µs/token gRPC, HTTP"),
    ]
    rows = []
    for level, runs in figures.items():
        med = {rpc: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for rpc, rs in runs.items()}
        g, h = med["stream"], med["http"]
        rows.append(
            [
                *(level, f"{g['tok_s']:.0f}", f"{h['tok_s']:.0f}", f"{h['tok_s'] / g['tok_s']:.2f}"),
                *(f"{g['ttft_p50_ms']:.1f} ms", f"{h['ttft_p50_ms']:.1f} ms"),
                f"{h['ttft_p50_ms'] / g['ttft_p50_ms']:.2f}",
                f"{g['server_us_per_token']:.0f}, {h['server_us_per_token']:.0f}",
                f"{g['client_us_per_token']:.0f}, {h['client_us_per_token']:.0f}",
            ]
        )
    print("\n".join(table(header, rows)))
    if args.json is not None:
        write_json(args.json, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
