"""Same weights as the peers: textgen, offline and served over gRPC, beside ONNX Runtime GenAI and llama.cpp
on one Llama folder, cell by cell in one run.

    textgen-bench peers --anchors-dir DIR [--anchors-work WORK] [--model-dir FOLDER] \\
        [--precisions fp32,int8,int4] [--batches 1,4,16] [--passes 1]

DIR holds the peer stacks' scripts (run.sh), WORK the folder they were prepared in (venv, models, ONNX and
GGUF artifacts; default $ANCHOR_WORK or /tmp/textgen-anchors). FOLDER (default WORK/models/llama-30m, the
peers' B-llama: 34.1 M parameters, random weights) is imported with `textgen-export hf` at fp32, `--int8`
and `--int4` into `--bundles`; its weights must be the peers' own (same model.safetensors).

Every cell runs the peers' workload: their 32 prompt token ids per row, exactly 128 new tokens, greedy, EOS
ignored, 2 threads, one untimed warm-up, then 3 timed runs, median; tok/s = 128 x batch / wall of the
whole generation, prefill included. For each batch and precision, in turn (the first of the four rotating
from group to group, so none always runs first):
- textgen engine: `bench.scenarios.engine --cell` on the bundle (the engine offline, no server);
- textgen served: `textgen-serve` on the bundle (`--max-batch-size` = batch, prefix cache off so the
  repeated prompts are prefilled each time, defaults otherwise, plus `--serve-flags`) and `batch`
  concurrent GenerateStream calls of the same prompts: wall from sending them to the last token of all,
  TTFT to the last of their first streamed tokens (when every row has one, as the offline cells' prefill);
- ONNX Runtime GenAI fp32 / int8 / int4 and llama.cpp f32 / q8_0 / q4_0, run by the peers' run.sh in a
  work folder of this run (linked to WORK's venv, models and artifacts; WORK's results stay as they are).
Each cell is a process of its own (a served cell's is its load generator, beside the server's two
processes), and its peak RSS is its processes' own (VmHWM). Each cell records the share of the cores other
processes took during its timed runs and the load average before it. The peers' transformers cell runs
once first: the fp32 cells' first 16 greedy tokens of row 0 must equal its tokens. The run also reports the
weights a decode step reads (the bundle's initializers, lookup-only tables apart) against the machine's
read bandwidth, and a served cell's CPU per token in the server's process (the front end), its engine
process and the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import onnx
from onnx import numpy_helper

from bench.loadgen import LoadConfig, Prompt, RequestRecord, send
from bench.proc import CpuMeter, descendants, main_thread_cpu_seconds, peak_rss_mib
from bench.report import RESULTS, table, write_json
from bench.scenarios.engine import (
    CHECKED_TOKENS,
    NEW_TOKENS,
    PROMPT_LEN,
    cell_in_subprocess,
    machine_roofline,
    prepared_anchors,
    prompt_rows,
    rates,
    run_anchors,
)
from bench.servers import ROOT, free_port, server_process, textgen_command
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

MODEL = "B-llama"  # the peers' name of the folder's model
REQUEST_TIMEOUT = 300.0
STACKS = ("textgen engine", "textgen served", "ort-genai", "llama.cpp")
Cell = dict[str, Any]  # one cell's figures, as JSON keeps them


@dataclass(frozen=True)
class Precision:
    export_flags: tuple[str, ...]  # textgen-export hf
    genai: str  # the peers' variant names
    llamacpp: str


PRECISIONS = {
    "fp32": Precision((), "fp32", "f32"),
    "int8": Precision(("--int8",), "int8", "q8_0"),
    "int4": Precision(("--int4",), "int4", "q4_0"),
}


@dataclass(frozen=True)
class PeerCell:
    """A peer cell as the peers' run_all.py names it (`label`, what its --only matches) and as its result
    file does (`tool`, `variant`)."""

    tool: str
    variant: str
    batch: int
    label: str

    @property
    def file(self) -> str:
        return f"{self.tool}__{self.variant}__{MODEL}__b{self.batch}.json"


def peer_cell(stack: str, precision: str, batch: int) -> PeerCell:
    if stack == "ort-genai":
        variant = PRECISIONS[precision].genai
        return PeerCell(stack, variant, batch, f"ortgenai {MODEL} {variant} b{batch}")
    variant = PRECISIONS[precision].llamacpp
    return PeerCell(stack, variant, batch, f"llamacpp {MODEL} {variant} b{batch}")


TRANSFORMERS = PeerCell("torch-hf", "fp32-kvcache", 1, f"torch {MODEL} b1")  # generate(), KV cache


# --- the plan ----------------------------------------------------------------------------------------------


def plan(batches: list[int], precisions: list[str]) -> Iterator[tuple[str, str, int]]:
    """(stack, precision, batch) in run order: batch by batch, precision by precision, the four stacks of
    each group in turn, the first rotating from group to group."""
    group = 0
    for batch in batches:
        for precision in precisions:
            shift = group % len(STACKS)
            for stack in STACKS[shift:] + STACKS[:shift]:
                yield stack, precision, batch
            group += 1


# --- textgen's bundles -------------------------------------------------------------------------------------


def import_bundle(model_dir: Path, out: Path, precision: str) -> Path:
    """`textgen-export hf` of the folder at `precision` into `out` (kept when there already)."""
    if not (out / "manifest.json").exists():
        command = [sys.executable, "-m", "export", "hf", "--model", str(model_dir), "--out", str(out)]
        done = subprocess.run(
            command + list(PRECISIONS[precision].export_flags), capture_output=True, text=True
        )
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"textgen-export hf {precision} exited {done.returncode}: {last[0]}")
    return out


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_same_weights(model_dir: Path, peers_dir: Path) -> None:
    ours, theirs = model_dir / "model.safetensors", peers_dir / "model.safetensors"
    if sha256(ours) != sha256(theirs):
        raise SystemExit(f"{ours} is not the peers' {theirs}: the comparison needs the same weights")


@dataclass(frozen=True)
class WeightBytes:
    streamed: int  # initializers a decode step reads whole (MatMul weights, their scales, norms, biases)
    lookup: int  # tables a token only looks a row up in (the input embedding)


LOOKUP_OPS = ("Gather", "GatherBlockQuantized")


def weight_bytes(graph_path: Path) -> WeightBytes:
    """The initializers of an ONNX graph, split into those every step streams and lookup-only tables (an
    initializer read only as the data of a Gather: one row a token)."""
    model = onnx.load(str(graph_path), load_external_data=False)
    uses: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            uses.setdefault(name, []).append((node.op_type, index))
    streamed = lookup = 0
    for tensor in model.graph.initializer:
        size = _tensor_bytes(tensor)
        if uses.get(tensor.name) and all(op in LOOKUP_OPS and i != 1 for op, i in uses[tensor.name]):
            lookup += size
        else:
            streamed += size
    return WeightBytes(streamed, lookup)


def _tensor_bytes(tensor: onnx.TensorProto) -> int:
    external = {e.key: e.value for e in tensor.external_data}
    if "length" in external:
        return int(external["length"])
    if tensor.raw_data:
        return len(tensor.raw_data)
    return int(numpy_helper.to_array(tensor).nbytes)


# --- a served cell (its own process) -----------------------------------------------------------------------


def serve_command(bundle: Path, batch: int, port: int, flags: list[str]) -> list[str]:
    return textgen_command(
        bundle.resolve(),
        *("--log-level", "WARNING"),
        *("--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--http-port", "0"),
        *("--max-batch-size", str(batch), "--max-model-len", str(PROMPT_LEN + NEW_TOKENS)),
        *("--prefix-cache-rows", "0"),
        *flags,
    )


async def concurrent_streams(stub: pb_grpc.TextGenerationStub, batch: int, run: int) -> Cell:
    """The peers' prompts as `batch` GenerateStream calls sent at once: wall to the last token of all, TTFT to
    the last first token."""
    config = LoadConfig(target="", ignore_eos=True, max_new_tokens=NEW_TOKENS)
    rows = prompt_rows(batch)
    messages = [
        Prompt(None, tuple(r.tolist()), NEW_TOKENS).message(f"{run}-{i}", config) for i, r in enumerate(rows)
    ]
    origin = time.perf_counter()
    records: list[RequestRecord] = await asyncio.gather(
        *(send(stub, m, origin, origin, REQUEST_TIMEOUT) for m in messages)
    )
    wrong = [r for r in records if not r.success or r.output_tokens != NEW_TOKENS or r.ttft is None]
    if wrong:
        raise RuntimeError(
            f"request {wrong[0].request_id}: {wrong[0].error or wrong[0].output_tokens} tokens"
        )
    return {
        "wall": max(r.latency for r in records),
        "ttft": max(r.ttft for r in records if r.ttft is not None),
        "first_row_tokens": records[0].token_ids[:CHECKED_TOKENS],
    }


async def served_runs(target: str, batch: int, repeats: int, server_pid: int) -> Cell:
    engine_pids = descendants(server_pid)  # the engine process (and multiprocessing's resource tracker)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.TextGenerationStub(channel)
        await concurrent_streams(stub, batch, 0)  # warm-up
        with CpuMeter([os.getpid(), server_pid, *engine_pids]) as meter:
            loop_before = main_thread_cpu_seconds(server_pid)  # inside the meter's window: never above it
            runs = [await concurrent_streams(stub, batch, run) for run in range(1, repeats + 1)]
            event_loop = main_thread_cpu_seconds(server_pid) - loop_before
    tokens = repeats * batch * NEW_TOKENS
    engine_cpu = sum(meter.cpu[p] for p in engine_pids)
    return rates(batch, [r["wall"] for r in runs], [r["ttft"] for r in runs]) | {
        "server_rss_mb": peak_rss_mib(server_pid),
        "engine_rss_mb": sum(peak_rss_mib(p) for p in engine_pids),
        "first_row_tokens": runs[-1]["first_row_tokens"],
        "other_load": meter.other_load,
        "us_per_token": {
            "front_end": 1e6 * meter.cpu[server_pid] / tokens,
            "event_loop": 1e6 * event_loop / tokens,  # of the front end's: the rest is gRPC's and the pipe's
            "engine": 1e6 * engine_cpu / tokens,
            "load_generator": 1e6 * meter.cpu[os.getpid()] / tokens,
        },
        "cores_busy": {"front_end": meter.cpu[server_pid] / meter.wall, "engine": engine_cpu / meter.wall},
    }


def served_cell(bundle: Path, batch: int, repeats: int, flags: list[str], log: Path) -> Cell:
    port = free_port()
    target = f"127.0.0.1:{port}"
    with server_process(serve_command(bundle, batch, port, flags), log, target) as server:
        cell = asyncio.run(served_runs(target, batch, repeats, server.pid))
    cell["peak_rss_mb"] = float(cell["server_rss_mb"]) + float(cell["engine_rss_mb"])
    return cell


def served_in_subprocess(bundle: Path, batch: int, args: argparse.Namespace) -> Cell:
    cmd = [sys.executable, "-m", "bench.scenarios.peers", "--served-cell", str(bundle), "--batch", str(batch)]
    cmd += ["--repeats", str(args.repeats), "--serve-flags", args.serve_flags]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


# --- the peers ---------------------------------------------------------------------------------------------


def peers_env(prepared: Path, scratch: Path) -> dict[str, str]:
    """The peers' run.sh in a work folder of this run: its results, logs and results.md go there, while its
    venv, models and artifacts are the prepared folder's (linked). No waiting for an idle machine and no
    reruns of a disturbed cell: textgen's cells get neither, and each cell's other load is recorded."""
    prepared, scratch = prepared.resolve(), scratch.resolve()  # run.sh cds: relative paths would break
    scratch.mkdir(parents=True, exist_ok=True)
    for name in ("models", "artifacts"):
        link = scratch / name
        if not link.exists():
            link.symlink_to(prepared / name)
    return {
        "ANCHOR_WORK": str(scratch),
        "ANCHOR_VENV": str(prepared / "venv"),
        "ANCHOR_RESULTS": str(scratch / "results"),
        "ANCHOR_IDLE_WAIT": "0",
        "ANCHOR_ATTEMPTS": "1",
    }


def run_peer(anchors: Path, cell: PeerCell, env: dict[str, str]) -> Cell:
    result = Path(env["ANCHOR_RESULTS"]) / "pass1" / cell.file
    result.unlink(missing_ok=True)
    run_anchors(anchors, [cell.label], 1, env)
    record = json.loads(result.read_text()) if result.exists() else {"status": "missing"}
    if record.get("status") != "ok":
        return {"error": f"{cell.label}: {record.get('status')} {record.get('error', '')}".strip()}
    ttft = record.get("ttft_s_median")
    return {
        "batch": cell.batch,
        "walls": record["walls_s"],
        "tok_s": record["tok_per_s"],
        "decode_tok_s": record.get("decode_only_tok_per_s"),
        "ttft_s": ttft,
        "peak_rss_mb": record["peak_rss_mb"],
        "first_row_tokens": record.get("first_row_tokens"),
        "other_load": record.get("foreign_cpu_frac"),
    }


# --- the run -----------------------------------------------------------------------------------------------


def run_cell(
    stack: str,
    precision: str,
    batch: int,
    bundles: dict[str, Path | str],
    args: argparse.Namespace,
    env: dict[str, str],
) -> Cell:
    if stack in ("ort-genai", "llama.cpp"):
        return run_peer(args.anchors_dir, peer_cell(stack, precision, batch), env)
    bundle = bundles[precision]
    if isinstance(bundle, str):  # the import failed: its message
        return {"error": bundle}
    if stack == "textgen engine":
        return cell_in_subprocess(bundle, batch, args.threads, args.repeats)
    return served_in_subprocess(bundle, batch, args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchors-dir", type=Path, help="the peer stacks' scripts (their run.sh)")
    p.add_argument("--anchors-work", type=Path, default=None, help="where the peers were prepared")
    p.add_argument("--model-dir", type=Path, default=None, help="the Llama folder (default: the peers')")
    p.add_argument("--precisions", default="fp32,int8,int4")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--passes", type=int, default=1, help="runs of the whole interleaved plan (median)")
    p.add_argument("--threads", type=int, default=2, help="the engine cells' ONNX Runtime threads")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--idle-wait", type=float, default=10.0, help="seconds a cell waits for a quieter machine")
    p.add_argument("--attempts", type=int, default=2, help="tries of a cell disturbed by other processes")
    p.add_argument(
        "--max-other-load", type=float, default=0.25, help="share of the cores other processes may take"
    )
    p.add_argument("--serve-flags", default="", help="more textgen-serve flags for the served cells")
    p.add_argument("--bundles", type=Path, default=ROOT / "models" / "peers")
    p.add_argument("--output", type=Path, default=RESULTS / "peers.json")
    p.add_argument("--report", type=Path, nargs="+", help="only report these runs' --output files, merged")
    p.add_argument("--served-cell", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.served_cell:
        log = args.output.parent / f"peers-serve-b{args.batch}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        flags = args.serve_flags.split()
        print(json.dumps(served_cell(args.served_cell, args.batch, args.repeats, flags, log)))
        return 0
    precisions = args.precisions.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    if args.report:
        print(report(merged([json.loads(path.read_text()) for path in args.report]), precisions, batches))
        return 0
    if args.anchors_dir is None:
        p.error("--anchors-dir is required")
    prepared = args.anchors_work or prepared_anchors()
    model_dir = args.model_dir or prepared / "models" / "llama-30m"
    check_same_weights(model_dir, prepared / "models" / "llama-30m")
    record = run(args, prepared, model_dir, precisions, batches)
    write_json(args.output, record)
    print(report(record, precisions, batches))
    print(f"wrote {args.output}")
    return 0


def run(
    args: argparse.Namespace, prepared: Path, model_dir: Path, precisions: list[str], batches: list[int]
) -> Cell:
    bundles: dict[str, Path | str] = {}
    weights: dict[str, dict[str, int]] = {}
    for precision in precisions:
        try:
            bundle = import_bundle(model_dir, args.bundles / f"{model_dir.name}-{precision}", precision)
        except RuntimeError as exc:
            bundles[precision] = str(exc)
            print(exc, flush=True)
            continue
        bundles[precision] = bundle
        sizes = weight_bytes(bundle / "model_inplace.onnx")
        weights[precision] = {"streamed": sizes.streamed, "lookup": sizes.lookup}
    env = peers_env(prepared, args.output.parent / "peers-work")
    record: Cell = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "load_average_before": os.getloadavg(),
        "machine": machine_roofline(args.threads),
        "weights": weights,
        "serve_flags": args.serve_flags,
        "reference": run_peer(args.anchors_dir, TRANSFORMERS, env),
    }
    cells: dict[str, list[Cell]] = {}
    record["cells"] = cells
    for pass_no in range(1, args.passes + 1):
        for stack, precision, batch in plan(batches, precisions):
            measure = functools.partial(run_cell, stack, precision, batch, bundles, args, env)
            cell = least_disturbed(measure, args)
            cell["pass"] = pass_no
            cells.setdefault(cell_key(stack, precision, batch), []).append(cell)
            print(cell_line(stack, precision, batch, cell), flush=True)
            write_json(args.output, record)  # kept as it goes: a long run
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    record["load_average_after"] = os.getloadavg()
    return record


def wait_for_quiet(max_wait: float, threshold: float) -> float:
    """Wait (at most `max_wait` s) until other processes take under `threshold` of the cores over a second;
    the seconds waited."""
    start = time.perf_counter()
    while time.perf_counter() - start < max_wait:
        with CpuMeter([os.getpid()]) as meter:
            time.sleep(1.0)
        if meter.other_load < threshold:
            break
    return time.perf_counter() - start


def least_disturbed(measure: Callable[[], Cell], args: argparse.Namespace) -> Cell:
    """A cell measured after waiting for a quieter machine, and measured again (up to `--attempts` times)
    while other processes took more than `--max-other-load` of the cores during its timed runs; the least
    disturbed attempt is kept. Every stack's cells get the same treatment."""
    best: Cell | None = None
    for attempt in range(1, args.attempts + 1):
        waited = wait_for_quiet(args.idle_wait, args.max_other_load)
        load = os.getloadavg()[0]
        cell = measure() | {"load_average": load, "waited_s": waited, "attempt": attempt}
        if "error" in cell:
            return cell
        if best is None or cell["other_load"] < best["other_load"]:
            best = cell
        if best["other_load"] <= args.max_other_load:
            break
    assert best is not None
    return best


def cell_key(stack: str, precision: str, batch: int) -> str:
    return f"{stack} {precision} b{batch}"


def cell_line(stack: str, precision: str, batch: int, cell: Cell) -> str:
    name = f"{cell_key(stack, precision, batch):26s}"
    if "error" in cell:
        return f"{name} {cell['error']}"
    ttft = 1000 * float(cell["ttft_s"] or float("nan"))
    return (
        f"{name} {cell['tok_s']:7.0f} tok/s  TTFT {ttft:6.1f} ms  RSS {cell['peak_rss_mb']:4.0f} MB  "
        f"other load {100 * float(cell['other_load'] or 0):3.0f}%  load avg {cell['load_average']:.2f}"
    )


# --- the report --------------------------------------------------------------------------------------------


QUIET_MARGIN = 0.05  # passes whose other load is this close to the least are as quiet as it


def quietest_cell(runs: list[Cell]) -> Cell | None:
    """Of a cell's passes, the one other processes disturbed least (as the peers keep the least disturbed
    attempt of a cell), the fastest of those about as quiet (the host's own noise, which /proc cannot
    see, only slows a cell down); None if none ran."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return None
    least = min(float(r["other_load"] or 0) for r in ok)
    quiet = [r for r in ok if float(r["other_load"] or 0) <= least + QUIET_MARGIN]
    return max(quiet, key=lambda r: float(r["tok_s"]))


def merged(records: list[Cell]) -> Cell:
    """Several runs' records as one: every cell's passes together, the first run's weights, and of the
    machine's figures the best any run measured (what the machine can do when nothing else runs)."""
    cells: dict[str, list[Cell]] = {}
    for record in records:
        for key, runs in record["cells"].items():
            cells.setdefault(key, []).extend(runs)
    machine = {key: max(r["machine"].get(key, 0.0) for r in records) for key in records[-1]["machine"]}
    runs = [(r["started"], r.get("finished")) for r in records]
    return records[0] | {"cells": cells, "machine": machine, "runs": runs}


def agreement(tokens: object, reference: object) -> str:
    """How many of the first tokens equal the reference's, as "n/16"."""
    if not isinstance(tokens, list) or not isinstance(reference, list):
        return "—"
    same = sum(a == b for a, b in zip(tokens, reference, strict=False))
    return f"{same}/{len(reference)}"


def report(record: Cell, precisions: list[str], batches: list[int]) -> str:
    cells: dict[str, list[Cell]] = record["cells"]
    medians = {key: quietest_cell(runs) for key, runs in cells.items()}  # a cell's figures: its quietest pass
    reference = record["reference"].get("first_row_tokens")
    header = [
        *("stack", "precision", *(f"b{b} tok/s" for b in batches), *(f"b{b} TTFT ms" for b in batches)),
        *(f"peak RSS MB b{batches[0]} / b{batches[-1]}", "other load", "tokens = transformers'"),
    ]
    rows = []
    for precision in precisions:
        for stack in STACKS:
            row = [medians.get(cell_key(stack, precision, b)) for b in batches]
            variant = precision if stack.startswith("textgen") else _peer_variant(stack, precision)
            rates = [f"{c['tok_s']:.0f}" if c else "—" for c in row]
            ttfts = [f"{1000 * float(c['ttft_s']):.1f}" if c and c["ttft_s"] else "—" for c in row]
            rss = " / ".join(f"{c['peak_rss_mb']:.0f}" if c else "—" for c in (row[0], row[-1]))
            loads = [float(c["other_load"] or 0) for c in row if c]
            other = f"≤ {100 * max(loads):.0f}%" if loads else "—"
            same = agreement(row[0]["first_row_tokens"] if row[0] else None, reference)
            rows.append([stack, variant, *rates, *ttfts, rss, other, same])
    lines = [
        *table(header, rows),
        "",
        *ratios(medians, precisions, batches),
        "",
        *tax(medians, precisions, batches),
    ]
    lines += ["", *roofline(record, precisions)]
    return "\n".join(lines)


def _peer_variant(stack: str, precision: str) -> str:
    return peer_cell(stack, precision, 1).variant


def _rate(medians: dict[str, Cell | None], key: str) -> float | None:
    cell = medians.get(key)
    return float(cell["tok_s"]) if cell else None


def ratios(medians: dict[str, Cell | None], precisions: list[str], batches: list[int]) -> list[str]:
    """textgen (engine, served) over the faster peer at each precision and batch."""
    rows = []
    for precision in precisions:
        for stack in ("textgen engine", "textgen served"):
            cells = []
            for batch in batches:
                ours = _rate(medians, cell_key(stack, precision, batch))
                peers = [r for s in STACKS[2:] if (r := _rate(medians, cell_key(s, precision, batch)))]
                best = max(peers, default=None)
                cells.append(f"{ours / best:.2f}" if ours and best else "—")
            rows.append([f"{stack.removeprefix('textgen ')} {precision}", *cells])
    return table(["textgen ÷ best peer", *(f"b{b}" for b in batches)], rows)


def tax(medians: dict[str, Cell | None], precisions: list[str], batches: list[int]) -> list[str]:
    """Served ÷ engine at each batch, and where a served token's CPU went."""
    header = [
        *("served", *(f"÷ engine b{b}" for b in batches)),
        "CPU µs/token: front end (its event loop), engine, load generator (smallest; largest batch)",
    ]
    rows = []
    for precision in precisions:
        cells = []
        for batch in batches:
            served = _rate(medians, cell_key("textgen served", precision, batch))
            engine = _rate(medians, cell_key("textgen engine", precision, batch))
            cells.append(f"{served / engine:.2f}" if served and engine else "—")
        cpu = []
        for batch in dict.fromkeys((batches[0], batches[-1])):  # the smallest and largest, once each
            cell = medians.get(cell_key("textgen served", precision, batch))
            if cell:
                us: dict[str, float] = cell["us_per_token"]
                front = f"{us['front_end']:.0f} ({us['event_loop']:.0f})"
                cpu.append(f"{front}, {us['engine']:.0f}, {us['load_generator']:.0f}")
        rows.append([precision, *cells, "; ".join(cpu) or "—"])
    return table(header, rows)


def roofline(record: Cell, precisions: list[str]) -> list[str]:
    """Weights a decode step reads against the read bandwidth: the b1 tok/s that bandwidth allows."""
    machine: dict[str, float] = record["machine"]
    weights: dict[str, dict[str, int]] = record["weights"]
    cells: dict[str, list[Cell]] = record["cells"]
    threads = machine.get("read_gbps_threads", 0.0)
    bandwidth = max(machine["read_gbps"], threads)  # the faster of the two reads
    rows = []
    for precision in precisions:
        if precision not in weights:
            continue
        streamed = weights[precision]["streamed"]
        ceiling = bandwidth * 1e9 / streamed
        engine = quietest_cell(cells.get(cell_key("textgen engine", precision, 1), []))
        measured = f"{engine['tok_s']:.0f} ({float(engine['tok_s']) / ceiling:.2f} of it)" if engine else "—"
        lookup = weights[precision]["lookup"]
        rows.append(
            [precision, f"{streamed / 1e6:.1f} MB", f"{lookup / 1e6:.1f} MB", f"{ceiling:.0f}", measured]
        )
    header = ["textgen", "weights read a step", "lookup-only", "b1 ceiling tok/s", "b1 measured (engine)"]
    return [
        f"read bandwidth {bandwidth:.1f} GB/s (numpy sums over 256 MB, best of 5: {machine['read_gbps']:.1f} "
        f"on one thread, {threads:.1f} on all the cell's)",
        "",
        *table(header, rows),
    ]


if __name__ == "__main__":
    sys.exit(main())
