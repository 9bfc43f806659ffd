"""Regenerate the serving part of docs/benchmarks.md: the gRPC server against its baselines, with plots.

    .venv/bin/textgen-bench serving            # the full run (`make bench`), ~12 minutes on 2 cores
    .venv/bin/textgen-bench serving --quick    # 1, 4 and 16 clients, one pass: ~2 minutes

In one run, on one machine, with one workload (prompt of `--input-len` random token ids, exactly
`--new-tokens` new tokens, greedy):
1. the engine offline (`serve.scheduling.offline.generate`, no server) at batch = clients: the ceiling;
2. `textgen-serve` under closed-loop `textgen-bench` clients at each concurrency level, its Prometheus figures
   checked against the client's;
3. the naive server (`bench/naive_server.py`: one request at a time) under the same load;
4. HF transformers + PyTorch `generate` offline at the same batch sizes, in its own venv (bench/.venv-hf,
   created on first use with `pip install torch==2.13.0 transformers`), on a random GPT2LMHeadModel of the
   bundle's shape.
Steps 1 and 4 run while no server is up, so each measurement has the machine to itself (the load generator
shares it with the server it drives, as a co-located client would). Raw records go to bench/results/serving/.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.bundles import bench_a
from bench.cpus import resolve_engine_cpus
from bench.loadgen import (
    RPC_NAMES,
    BenchmarkOutput,
    LoadConfig,
    Rpc,
    benchmark,
    synthetic_ids,
    usage_checked,
)
from bench.proc import run_logged
from bench.report import DOC, RESULTS, machine, write_json
from bench.scenarios.serving_report import cdf_level, plot_all, update_doc
from bench.servers import BIN, ROOT, free_port, naive_command, server_process
from serve.api.config import ServerSettings
from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine
from serve.engine.types import EngineSettings, SessionConfig
from serve.process import beside, format_cpu_list
from serve.scheduling.offline import OFFLINE_LIMITS, generate

PERCENTILES = (50.0, 90.0, 99.0)
# The steady-arrivals run: Poisson arrivals at this share of the streamed closed-loop request rate at 16
# clients, max_new_tokens spread uniformly by this fraction, so requests keep joining a running batch.
ARRIVALS_LOAD = 0.8
ARRIVALS_OUTPUT_SPREAD = 0.5


@dataclass(frozen=True)
class Plan:
    levels: tuple[int, ...]
    requests_per_client: int  # the server's closed-loop requests at each level: clients x this
    naive_requests: int  # the naive server's at least (its throughput does not change with clients)
    repeats: int  # timed passes of the offline measurements (median)
    input_len: int
    new_tokens: int
    rpc: Rpc = "stream"  # of the closed-loop levels; the steady-arrivals run always streams (it measures ITL)
    pairs: int = 0  # served runs at the target level, each between offline passes
    offline_seconds: float = 0.0  # offline passes go on until they have run this long
    # textgen-serve --engine-cpus; the load generator then runs on the other CPUs, like the server's process
    engine_cpus: tuple[int, ...] | None = None

    @property
    def client_cpus(self) -> tuple[int, ...] | None:
        return None if self.engine_cpus is None else beside(frozenset(self.engine_cpus))


def plan_from_args(args: argparse.Namespace) -> Plan:
    levels: tuple[int, ...] = (1, 4, 16) if args.quick else (1, 2, 4, 8, 16, 32)
    if args.levels:
        levels = tuple(int(c) for c in args.levels.split(","))
    return Plan(
        levels=levels,
        requests_per_client=args.requests_per_client or (2 if args.quick else 4),
        naive_requests=4 if args.quick else 8,
        repeats=args.repeats or (1 if args.quick else 3),
        input_len=args.input_len,
        new_tokens=args.new_tokens,
        rpc=args.rpc,
        pairs=args.pairs if args.pairs is not None else (2 if args.quick else 3),
        offline_seconds=args.offline_seconds,
        engine_cpus=args.engine_cpus,
    )


def pinned_engine(flag: str | None) -> tuple[int, ...] | None:
    """`--engine-cpus` resolved as the server will ("auto" on one CPU: no pinning)."""
    cpus = None if flag is None else resolve_engine_cpus(flag)
    return None if cpus is None else tuple(sorted(cpus))


# --- the model ---------------------------------------------------------------------------------------------


# --- offline measurements ----------------------------------------------------------------------------------


def prompts(count: int, input_len: int, bundle: Bundle, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    arch = bundle.manifest.architecture
    return [
        list(synthetic_ids(input_len, arch.vocab_size, bundle.manifest.eos_token_id, rng))
        for _ in range(count)
    ]


def offline_engine(engine: Engine, bundle: Bundle, plan: Plan) -> dict[int, float]:
    """Output tokens/s of the offline `generate` at batch = each level (prefill included), median."""
    rates = {}
    for batch in plan.levels:
        rate = offline_rate(engine, bundle, plan, batch)
        rate(1)  # warm-up
        rates[batch] = rate(plan.repeats)
        print(f"offline engine b={batch}: {rates[batch]:.0f} tok/s", flush=True)
    return rates


def offline_rate(engine: Engine, bundle: Bundle, plan: Plan, batch: int) -> Callable[[int], float]:
    """A function that generates for `batch` prompts at once, `passes` times and for `plan.offline_seconds`
    at least, and returns the output tokens/s of the median pass.

    Three passes of the demo model take ~0.5 s, one moment of a machine whose speed doubles or halves within
    a minute (offline passes at 7179 and 15352 tok/s a minute apart): the served run beside them lasts ~6 s.
    """
    work = prompts(batch, plan.input_len, bundle)
    limits = OFFLINE_LIMITS.model_copy(update={"max_batch_size": min(batch, engine.max_batch_size)})

    def rate(passes: int) -> float:
        seconds: list[float] = []
        while len(seconds) < passes or sum(seconds) < plan.offline_seconds:
            start = time.perf_counter()
            generate(engine, work, max_new_tokens=plan.new_tokens, ignore_eos=True, limits=limits)
            seconds.append(time.perf_counter() - start)
        return batch * plan.new_tokens / statistics.median(seconds)

    return rate


def ensure_hf_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        # The interpreter the project's venv was made from, so the local torch CPU wheel fits.
        run_logged([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)])
        run_logged([str(venv / "bin" / "pip"), "install", "torch==2.13.0", "transformers"])
    return python


def hf_generate(bundle: Bundle, plan: Plan, threads: int, venv: Path) -> dict[str, object]:
    arch = bundle.manifest.architecture
    command = [
        str(ensure_hf_venv(venv)),
        str(ROOT / "bench" / "hf_generate.py"),
        *("--vocab", str(arch.vocab_size), "--context", str(arch.context_length)),
        *("--d-model", str(arch.d_model), "--layers", str(arch.n_layers), "--heads", str(arch.n_heads)),
        *(
            "--d-ff",
            str(arch.d_ff),
            "--activation",
            arch.activation,
            "--eos",
            str(bundle.manifest.eos_token_id),
        ),
        *("--prompt-len", str(plan.input_len), "--new-tokens", str(plan.new_tokens)),
        *("--batches", ",".join(map(str, plan.levels)), "--repeats", str(plan.repeats)),
        *("--threads", str(threads)),
    ]
    print(f"$ {shlex.join(command)}", flush=True)
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["command"] = shown(command)
    return result


# --- servers under load ------------------------------------------------------------------------------------


def measure(name: str, config: LoadConfig, results: Path, metrics_url: str | None = None) -> BenchmarkOutput:
    """One load-generator run; its records go to `results/name.json`."""
    output = asyncio.run(benchmark(config, metrics_url))
    write_json(results / f"{name}.json", output.to_json())
    s = output.summary
    print(
        f"{name}: {s['output_throughput']:.0f} tok/s, {s['successful_requests']} ok, "
        f"{s['failed_requests']} failed, TTFT p50 {s['ttft_ms']['median']:.0f} ms",  # type: ignore[index]
        flush=True,
    )
    return output


def closed_loop(
    target: str, clients: int, requests: int, plan: Plan, cpus: tuple[int, ...] | None = None
) -> LoadConfig:
    return LoadConfig(
        target=target,
        concurrency=clients,
        num_requests=requests,
        input_len=plan.input_len,
        max_new_tokens=plan.new_tokens,
        ignore_eos=True,
        percentiles=PERCENTILES,
        progress=False,
        rpc=plan.rpc,
        cpus=cpus,
    )


def streamed_reference(closed: LoadConfig) -> LoadConfig | None:
    """The closed loop whose request rate sets the arrivals' when `closed` is unary (None: `closed` streams).
    The arrivals stream, which costs the server more than a unary call: at 80% of the demo's unary rate
    (57 requests/s, where a streamed closed loop served 44) they queued for seconds and their ITL was an
    overloaded server's."""
    return None if closed.rpc == "stream" else dataclasses.replace(closed, rpc="stream")


def steady_arrivals(target: str, rate: float, plan: Plan, clients: int) -> LoadConfig:
    """Poisson arrivals with spread output lengths: requests join and leave a running batch all the time."""
    return LoadConfig(
        target=target,
        request_rate=rate,
        num_requests=clients * plan.requests_per_client,
        input_len=plan.input_len,
        max_new_tokens=plan.new_tokens,
        output_len_spread=ARRIVALS_OUTPUT_SPREAD,
        ignore_eos=True,
        percentiles=PERCENTILES,
        progress=False,
        seed=1,
        cpus=plan.client_cpus,
    )


def shown(command: list[str]) -> str:
    """`command` as a user would type it in the repository root."""
    return shlex.join(command).replace(f"{ROOT}/", "")


def as_command(config: LoadConfig, target: str, metrics: bool) -> str:
    """The `textgen-bench load` command line that runs `config` against `target`."""
    flags = [
        ("--target", target),
        ("--concurrency", config.concurrency),
        ("--request-rate", None if config.request_rate is None else f"{config.request_rate:.2f}"),
        ("--num-requests", config.num_requests),
        ("--input-len", config.input_len),
        ("--max-new-tokens", config.max_new_tokens),
        ("--output-len-spread", config.output_len_spread or None),
        ("--seed", config.seed or None),
        ("--percentiles", ",".join(f"{p:g}" for p in config.percentiles)),
        ("--metrics-url", "http://127.0.0.1:M/metrics" if metrics else None),
        ("--rpc", None if config.rpc == "stream" else config.rpc),
        ("--cpus", None if config.cpus is None else format_cpu_list(config.cpus)),
    ]
    words = ["textgen-bench", "load"] + [f"{flag} {value}" for flag, value in flags if value is not None]
    return " ".join([*words, "--ignore-eos"] if config.ignore_eos else words)


# --- the run -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pair:
    """Tokens/s at cdf_level clients: offline passes, a served run, offline passes, back to back."""

    before: float
    served: float
    after: float

    @property
    def offline(self) -> float:
        return (self.before + self.after) / 2

    @property
    def ratio(self) -> float:
        """Served ÷ the offline passes on either side: a steady drift of the machine cancels out."""
        return self.served / self.offline


@dataclass
class Results:
    plan: Plan
    machine: dict[str, str]
    bundle: Path
    results_dir: Path
    model: dict[str, object]
    threads: int
    spinning: bool
    max_batch: int
    offline: dict[int, float]
    server: dict[int, BenchmarkOutput]
    naive: dict[int, BenchmarkOutput]
    arrivals: BenchmarkOutput  # open loop at ARRIVALS_LOAD of the server's capacity at cdf_level clients
    hf: dict[str, object] | None
    commands: list[str]
    seconds: float
    pairs: list[Pair] = field(default_factory=list)


def run(args: argparse.Namespace) -> Results:
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    plan = plan_from_args(args)
    results_dir: Path = args.results
    results_dir.mkdir(parents=True, exist_ok=True)
    bundle_dir = args.bundle or bench_a()
    bundle = load_bundle(bundle_dir)
    threads = args.threads or os.cpu_count() or 1
    max_batch = max(plan.levels)

    # The servers' session settings, so the ceiling differs from them only in what serving adds.
    between = ServerSettings.model_fields["spin_between_steps"].default
    session = SessionConfig(threads=threads, spinning=args.spinning, spin_between_runs=between)
    engine = Engine.from_bundle(bundle, EngineSettings(max_batch_size=max_batch, session=session))
    offline = offline_engine(engine, bundle, plan)
    hf = None if args.skip_hf else hf_generate(bundle, plan, threads, args.hf_venv)

    spin_flag = "--spinning" if args.spinning else "--no-spinning"
    process_flag = "--engine-process" if args.engine_process else "--no-engine-process"
    port, metrics_port = free_port(), free_port()
    serve_cmd = [
        str(BIN / "textgen-serve"),
        *("--bundle", str(bundle_dir), "--host", "127.0.0.1", "--port", str(port)),
        *("--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port), "--http-port", "0"),
        *("--max-batch-size", str(max_batch), "--threads", str(threads), "--log-level", "WARNING"),
        *("--stream-interval-ms", f"{args.stream_interval_ms:g}"),
        *("--prefill-chunk-tokens", str(args.prefill_chunk_tokens)),
        "--prefill-beside-decode" if args.prefill_beside_decode else "--no-prefill-beside-decode",
        spin_flag,
        process_flag,
        *(() if plan.engine_cpus is None else ("--engine-cpus", format_cpu_list(plan.engine_cpus))),
    ]
    server_loads = {
        c: closed_loop(f"127.0.0.1:{port}", c, c * plan.requests_per_client, plan, plan.client_cpus)
        for c in plan.levels
    }
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    with server_process(serve_cmd, results_dir / "server.log", f"127.0.0.1:{port}"):
        server = {
            c: measure(f"server-c{c}", load, results_dir, metrics_url) for c, load in server_loads.items()
        }
        reference = cdf_level(plan.levels)
        streamed = streamed_reference(server_loads[reference])
        capacity = (
            server[reference]
            if streamed is None
            else measure(f"server-c{reference}-stream", streamed, results_dir, metrics_url)
        )
        rate = ARRIVALS_LOAD * float(capacity.summary["request_throughput"])  # type: ignore[arg-type]
        arrivals_load = steady_arrivals(f"127.0.0.1:{port}", rate, plan, reference)
        arrivals = measure("server-arrivals", arrivals_load, results_dir, metrics_url)
        pairs = alternate(engine, bundle, plan, server_loads[reference], results_dir)

    naive_port = free_port()
    naive_cmd = naive_command(
        bundle_dir, *("--host", "127.0.0.1", "--port", str(naive_port), "--threads", str(threads), spin_flag)
    )
    naive_loads = {
        c: closed_loop(f"127.0.0.1:{naive_port}", c, max(c, plan.naive_requests), plan) for c in plan.levels
    }
    with server_process(naive_cmd, results_dir / "naive.log", f"127.0.0.1:{naive_port}"):
        naive = {c: measure(f"naive-c{c}", load, results_dir) for c, load in naive_loads.items()}

    closed_loops = [*server_loads.values(), *([] if streamed is None else [streamed])]
    commands = [
        shown(serve_cmd).replace(str(port), "P").replace(str(metrics_port), "M"),
        *(as_command(load, "127.0.0.1:P", metrics=True) for load in closed_loops),
        as_command(arrivals_load, "127.0.0.1:P", metrics=True),
        shown(naive_cmd).replace(str(naive_port), "N"),
        *(as_command(load, "127.0.0.1:N", metrics=False) for load in naive_loads.values()),
    ]
    model = {
        "name": bundle.manifest.model_name,
        "dtype": bundle.manifest.dtype,
        "quantization": bundle.manifest.quantization,
        **bundle.manifest.architecture.model_dump(),
    }
    return Results(
        plan=plan,
        machine=machine()
        | {"load_1min": f"{load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end"},
        bundle=bundle_dir,
        results_dir=results_dir,
        model=model,
        threads=threads,
        spinning=args.spinning,
        max_batch=max_batch,
        offline=offline,
        server=server,
        naive=naive,
        arrivals=arrivals,
        hf=hf,
        commands=commands,
        seconds=time.monotonic() - started,
        pairs=pairs,
    )


def alternate(engine: Engine, bundle: Bundle, plan: Plan, load: LoadConfig, results: Path) -> list[Pair]:
    """`plan.pairs` served runs at the same batch as offline passes (median of `plan.repeats`) run just before
    and just after each of them.

    The table's offline and served cells are minutes apart, and this machine's speed drifts by ±15% over
    minutes (by up to half within a minute, seen on the demo model); a served run compared with the mean of
    the offline passes on either side of it does not carry a steady drift. The idle server waits meanwhile
    (its ONNX Runtime threads stop spinning when a step returns).
    """
    assert load.concurrency is not None
    rate = offline_rate(engine, bundle, plan, load.concurrency)
    offline = [rate(plan.repeats)]
    pairs = []
    for round_no in range(plan.pairs):
        output = measure(f"server-pair{round_no}", load, results)
        offline.append(rate(plan.repeats))
        pair = Pair(offline[-2], float(output.summary["output_throughput"]), offline[-1])  # type: ignore[arg-type]
        print(
            f"pair {round_no}: offline {pair.before:.0f}, served {pair.served:.0f}, offline {pair.after:.0f} "
            f"tok/s: {pair.ratio:.2f}",
            flush=True,
        )
        pairs.append(pair)
    return pairs


# --- the record --------------------------------------------------------------------------------------------


def save_summary(results: Results, path: Path) -> None:
    data = {
        "machine": results.machine,
        "model": results.model,
        "plan": results.plan.__dict__,
        "offline_tok_s": results.offline,
        "hf": results.hf,
        "server": {c: o.summary for c, o in results.server.items()},
        "server_checks": {c: [check.__dict__ for check in o.checks] for c, o in results.server.items()},
        "server_steps": {c: o.steps_json() for c, o in results.server.items()},
        "naive": {c: o.summary for c, o in results.naive.items()},
        "arrivals": {"config": results.arrivals.config.__dict__, "summary": results.arrivals.summary},
        "seconds": results.seconds,
        "pairs": [dataclasses.asdict(pair) for pair in results.pairs],
    }
    write_json(path, data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1, 4 and 16 clients, one pass: a couple of minutes")
    p.add_argument("--levels", default=None, help="comma-separated client counts (default 1,2,4,8,16,32)")
    p.add_argument(
        "--bundle",
        type=Path,
        default=None,
        help="model bundle (default: models/bench/bench-a-fp32, exported once)",
    )
    p.add_argument(
        "--requests-per-client",
        type=int,
        default=None,
        help="closed-loop requests per client at each level (default 4, --quick 2): more for a fast model, "
        "whose runs are otherwise too short to measure",
    )
    p.add_argument(
        "--repeats", type=int, default=None, help="timed offline passes, median (default 3, --quick 1)"
    )
    p.add_argument(
        "--offline-seconds",
        type=float,
        default=2.0,
        help="offline passes go on past --repeats until they have run this long: a fast model's few passes "
        "see one moment of the machine's speed (default 2)",
    )
    p.add_argument(
        "--pairs",
        type=int,
        default=None,
        help="served runs at 16 clients, each between offline passes, for the served ÷ offline target "
        "(default 3, --quick 2; 0: none)",
    )
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per request")
    p.add_argument(
        "--threads", type=int, default=None, help="ONNX Runtime / torch threads (default: all cores)"
    )
    p.add_argument(
        "--spinning",
        action=argparse.BooleanOptionalAction,
        default=ServerSettings.model_fields["spinning"].default,
        help="ONNX Runtime threads busy-wait within a step, in the servers and the offline engine (default: "
        "the server's)",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=ServerSettings.model_fields["stream_interval_ms"].default,
        help="textgen-serve --stream-interval-ms (default: the server's)",
    )
    p.add_argument(
        "--prefill-chunk-tokens",
        type=int,
        default=ServerSettings.model_fields["prefill_chunk_tokens"].default,
        help="textgen-serve --prefill-chunk-tokens (default: the server's)",
    )
    p.add_argument(
        "--prefill-beside-decode",
        action=argparse.BooleanOptionalAction,
        default=ServerSettings.model_fields["prefill_beside_decode"].default,
        help="textgen-serve --prefill-beside-decode (default: the server's)",
    )
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=ServerSettings.model_fields["engine_process"].default,
        help="textgen-serve --engine-process: the engine in a process of its own (default: the server's)",
    )
    p.add_argument(
        "--engine-cpus",
        type=usage_checked(pinned_engine),
        default=None,
        help="textgen-serve --engine-cpus (auto, or a Linux CPU list); the load generator runs on the other "
        "CPUs",
    )
    p.add_argument(
        "--rpc",
        choices=tuple(RPC_NAMES),
        default="stream",
        help="the closed-loop clients' call: GenerateStream (per-token latency) or unary Generate (one reply "
        "per request: what a batch client pays, no per-message cost)",
    )
    p.add_argument("--skip-hf", action="store_true", help="leave out HF transformers")
    p.add_argument(
        "--hf-venv", type=Path, default=ROOT / "bench" / ".venv-hf", help="venv for HF transformers"
    )
    p.add_argument("--results", type=Path, default=RESULTS / "serving", help="raw records")
    p.add_argument("--doc", type=Path, default=DOC, help="markdown to update")
    p.add_argument("--images", type=Path, default=ROOT / "docs" / "images", help="where the plots go")
    args = p.parse_args(argv)
    results = run(args)
    save_summary(results, args.results / "summary.json")
    images = plot_all(results, args.images)
    update_doc(results, images, args.doc, argv_used=sys.argv[1:] if argv is None else argv)
    print(f"wrote {args.doc} and {len(images)} plots in {results.seconds / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
