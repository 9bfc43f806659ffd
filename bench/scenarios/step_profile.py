"""Where one batched step's time goes, by owner: ONNX Runtime's operators (by op type), the engine's Python
around them, and, served, the time between steps and the front end's CPU; llama.cpp's batched bench on the
same weights beside.

    textgen-bench step-profile --bundle DIR [--batch 16] [--gguf F --llama-bin DIR] [--served]

Offline (in this process): `--batch` prompts of `--prompt-len` random ids prefilled as one call of the
engine, then `--new-tokens` - 1 decode steps, as the engine bench runs them (2 threads, spinning), after one
untimed pass. Twice: once timed (each session run timed on its own: the engine's Python is the step's wall
minus its runs), once under ONNX Runtime's profiler (its per-operator times, summed by op type; the profiler
adds a little to each operator, so its total is a little above the timed pass's).
`--gguf`: `llama-batched-bench -npp P -ntg N -npl B` on the GGUF beside (its prefill and decode times).
`--served`: `textgen-serve` (as served-peers starts it) under `--batch` closed-loop HTTP clients of
`--requests` requests each: its engine steps from its metrics (mean decode step, the time between steps),
and the CPU seconds of the front-end process and of the engine process.
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench import llama_cpp
from bench.loadgen import engine_steps, scrape, scrape_after
from bench.proc import CpuMeter, descendants
from bench.report import add_record_options, finish_record, machine, print_reports, record_path, table
from bench.scenarios.served_peers import Workload, load, served_cell, textgen_command
from bench.servers import free_port, http_answers, server_process

Record = dict[str, Any]
SEED = 1234


class TimedSession:
    """An ONNX Runtime session whose IOBinding runs are timed; everything else is the session's."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self.seconds = 0.0
        self.runs = 0

    def run_with_iobinding(self, binding: Any, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._session.run_with_iobinding(binding, *args)
        finally:
            self.seconds += time.perf_counter() - start
            self.runs += 1

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


@dataclass(frozen=True)
class Phase:
    """One phase of the offline pass: its wall time, the part ONNX Runtime's runs took, how many runs."""

    wall_s: float
    runtime_s: float
    runs: int

    def as_record(self, steps: int) -> Record:
        return {
            "steps": steps,
            "runs": self.runs,
            "wall_ms": self.wall_s / steps * 1e3,
            "onnxruntime_ms": self.runtime_s / steps * 1e3,
            "python_ms": (self.wall_s - self.runtime_s) / steps * 1e3,
        }


def engine(bundle: Path, batch: int, work: Workload, profile_prefix: str = "") -> Any:
    from serve.bundle import load_bundle
    from serve.engine.engine import Engine
    from serve.engine.types import EngineSettings, SessionConfig

    settings = EngineSettings(
        max_batch_size=batch,
        capacity=work.prompt_len + work.max_tokens,
        session=SessionConfig(threads=work.threads, profile_prefix=profile_prefix),
    )
    return Engine.from_bundle(load_bundle(bundle), settings)


def one_pass(eng: Any, prompts: np.ndarray, new_tokens: int) -> tuple[Phase, Phase]:
    """Prefill every prompt in one call, then decode to `new_tokens`: the two phases (the session runs
    counted where the engine's session is a TimedSession)."""
    from serve.engine.sampling import SamplingParams
    from serve.engine.types import NewSequence

    timed = eng.session if isinstance(eng.session, TimedSession) else None
    seqs = [NewSequence(str(i), row.tolist(), SamplingParams()) for i, row in enumerate(prompts)]

    def phase(work: Callable[[], object]) -> Phase:
        seconds, runs = (timed.seconds, timed.runs) if timed else (0.0, 0)
        start = time.perf_counter()
        work()
        wall = time.perf_counter() - start
        return Phase(wall, timed.seconds - seconds, timed.runs - runs) if timed else Phase(wall, 0.0, 0)

    prefill = phase(lambda: eng.prefill(seqs))
    decode = phase(lambda: [eng.decode() for _ in range(new_tokens - 1)])
    eng.release(s.seq_id for s in seqs)
    return prefill, decode


def offline(bundle: Path, batch: int, work: Workload) -> Record:
    rng = np.random.default_rng(SEED)
    prompts = rng.integers(3, work.vocab, size=(batch, work.prompt_len), dtype=np.int64)
    eng = engine(bundle, batch, work)
    one_pass(eng, prompts, work.max_tokens)  # warm-up
    eng.session = TimedSession(eng.session)
    prefill, decode = one_pass(eng, prompts, work.max_tokens)
    steps = work.max_tokens - 1
    with tempfile.TemporaryDirectory() as tmp:
        eng = engine(bundle, batch, work, profile_prefix=f"{tmp}/ort")
        for _ in range(2):  # the second pass is the one read
            one_pass(eng, prompts, work.max_tokens)
        trace = json.loads(Path(eng.session.end_profiling()).read_text())
    by_op = ops_by_phase(trace, prefill.runs, decode.runs)
    return {
        "prefill": prefill.as_record(1) | {"ops_ms": by_op["prefill"]},
        "decode": decode.as_record(steps) | {"ops_ms": {k: v / steps for k, v in by_op["decode"].items()}},
    }


def ops_by_phase(trace: list[Record], prefill_runs: int, decode_runs: int) -> dict[str, dict[str, float]]:
    """Milliseconds per op type in the last pass's prefill runs and decode runs, from ONNX Runtime's trace:
    the pass's runs are the last `model_run` events, and a run's operators are the node events within it."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in trace if e.get("name") == "model_run")
    last = runs[len(runs) - prefill_runs - decode_runs :]
    spans = [("prefill" if i < prefill_runs else "decode", *span) for i, span in enumerate(last)]
    phases: dict[str, dict[str, float]] = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    for event in trace:
        if event.get("cat") != "Node" or not str(event.get("name", "")).endswith("_kernel_time"):
            continue
        for name, start, end in spans:
            if start <= event["ts"] <= end:
                phases[name][event["args"]["op_name"]] += event["dur"] / 1e3
                break
    return {k: dict(sorted(v.items(), key=lambda kv: -kv[1])) for k, v in phases.items()}


def llama_batched(bin_dir: Path, gguf: Path, batch: int, work: Workload) -> Record:
    (row,) = llama_cpp.batched_bench(bin_dir, gguf, work.prompt_len, work.max_tokens, [batch], work.threads)
    return {"prefill_ms": row.prefill_s * 1e3, "decode_ms": row.decode_s / row.new * 1e3, "tok_s": row.tok_s}


def served(bundle: Path, batch: int, work: Workload, logs: Path) -> Record:
    """textgen-serve under `batch` clients: its engine steps (from its metrics) and its processes' CPU."""
    port, metrics_port = free_port(), free_port()
    command = textgen_command(bundle, port, work, ["--metrics-port", str(metrics_port)])
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    ready = functools.partial(http_answers, port)
    with server_process(command, logs / "textgen.log", "", answers=ready) as proc:
        load(port, batch, replace(work, max_tokens=8), SEED + 500)  # warm-up
        before = scrape(url, "http")
        engine_pids = descendants(proc.pid)
        with CpuMeter([proc.pid, *engine_pids]) as meter:
            cell = served_cell(load(port, batch, work, SEED), batch, work)
        after = scrape_after(url, "http", before, batch * work.requests)
    steps = engine_steps(before, after, meter.wall)
    tokens = cell["tokens"] or 1
    return cell | {
        "decode_steps": steps.decode_steps,
        "decode_step_ms": steps.decode_ms,
        "decode_rows": steps.decode_rows,
        "prefill_steps": steps.prefill_steps,
        "prefill_step_ms": steps.prefill_ms,
        "between_steps_ms": steps.between_ms,
        "engine_busy": steps.busy,
        "front_end_cpu_ms_per_token": meter.cpu[proc.pid] / tokens * 1e3,
        "engine_cpu_ms_per_token": sum(meter.cpu[p] for p in engine_pids) / tokens * 1e3,
        "other_load": meter.other_load,
    }


def report(result: Record) -> str:
    lines = [f"{result['bundle']}, batch {result['batch']} ({result['machine'].get('cpu', '')})", ""]
    rows = []
    for name in ("prefill", "decode"):
        cell = result["offline"][name]
        top = ", ".join(f"{op} {ms:.2f}" for op, ms in list(cell["ops_ms"].items())[:6])
        llama = result.get("llama", {}).get(f"{name}_ms")
        rows.append(
            [
                name,
                f"{cell['wall_ms']:.2f}",
                f"{cell['onnxruntime_ms']:.2f}",
                f"{cell['python_ms']:.2f}",
                f"{sum(cell['ops_ms'].values()):.2f}",
                top,
                "" if llama is None else f"{llama:.2f}",
            ]
        )
    head = ["phase (per step)", "wall ms", "ONNX Runtime ms", "engine Python ms", "operators ms (profiled)"]
    lines += table([*head, "largest op types ms", "llama-batched-bench ms"], rows)
    if "served" in result:
        s = result["served"]
        figures = [
            ("output tok/s", f"{s['tok_s']:.1f}"),
            ("decode step ms (mean rows)", f"{s['decode_step_ms']:.2f} ({s['decode_rows']:.1f})"),
            ("prefill steps, ms each", f"{s['prefill_steps']}, {s['prefill_step_ms']:.1f}"),
            ("ms between steps", f"{s['between_steps_ms']:.2f}"),
            ("engine busy (share of the run in steps)", f"{s['engine_busy']:.2f}"),
            ("CPU ms per token: front end", f"{s['front_end_cpu_ms_per_token']:.2f}"),
            ("CPU ms per token: engine process", f"{s['engine_cpu_ms_per_token']:.2f}"),
            ("other processes' load (cores)", f"{s['other_load']:.2f}"),
        ]
        lines += ["", *table(["served", "figure"], figures)]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--requests", type=int, default=2, help="per client, with --served")
    p.add_argument("--gguf", type=Path, help="the same weights for llama-batched-bench")
    p.add_argument("--llama-bin", type=Path, help="llama.cpp's binaries (bench.llama_cpp)")
    p.add_argument("--served", action="store_true")
    add_record_options(p, "step-profile")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print_reports(args.report, report)
        return 0
    if args.bundle is None:
        raise SystemExit("step-profile needs --bundle")
    from serve.bundle import load_bundle

    manifest = load_bundle(args.bundle).manifest
    work = Workload(
        prompt_len=args.prompt_len,
        max_tokens=args.new_tokens,
        threads=args.threads,
        requests=args.requests,
        vocab=manifest.architecture.vocab_size,
        eos_token_id=manifest.eos_token_id,
    )
    result: Record = {"bundle": str(args.bundle), "batch": args.batch, "machine": machine()}
    result["offline"] = offline(args.bundle, args.batch, work)
    if args.gguf is not None:
        if args.llama_bin is None:
            raise SystemExit("--gguf needs --llama-bin")
        result["llama"] = llama_batched(args.llama_bin, args.gguf, args.batch, work)
    if args.served:
        with tempfile.TemporaryDirectory() as logs:
            result["served"] = served(args.bundle, args.batch, work, Path(logs))
    return finish_record(result, record_path(args.output, "step-profile"), report)
