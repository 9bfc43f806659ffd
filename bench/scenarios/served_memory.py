"""Memory and start-up, served against served: `textgen-serve` against llama.cpp's `llama-server` on the same
weights (fp32 / int8 / int4 against GGUF f32 / q8_0 / q4_0) and the same KV capacity, each server alone.

    textgen-bench served-memory --work DIR [--model-dir DIR] [--contexts 256,2048] [--rounds 1]
    textgen-bench served-memory --bundle fp32=DIR --gguf f32=FILE --bin-dir DIR ...  # assets of your own
    textgen-bench served-memory --report bench/results/served-memory-*.json  # the table of saved runs

The assets are bench.scenarios.served_peers' (prepared in WORK, each only when missing), unless `--bundle
PRECISION=DIR`, `--gguf QUANT=FILE` and `--bin-dir` (llama-server's folder) name them all.

A cell: one server started alone with 16 rows of C positions each (served_peers.Workload), C one of
`--contexts` (textgen: `--max-batch-size 16 --max-model-len C --prefix-cache-rows 0 --compiled-cache` one
of the run's own per precision, empty at its first start; llama-server: `-np 16
-c 16 x C`, its KV cache in its default f16), then `--requests` requests at once over HTTP
(bench.scenarios.served_peers' client, random 32-token prompts, `--new-tokens` each). It reports:
- ready: seconds from starting the process to GET /health answering 200 (asked every 50 ms; both servers
  answer 503 while they load). Noisy on a shared machine: the table shows the median over `--rounds`;
- steady: VmRSS of every process of the server (textgen: the front end and the engine process it starts)
  after the requests, summed, and how much of it is pages of mapped files (RssFile);
- peak: VmHWM of each process (its resident high-water mark), summed: an upper bound of the whole server's
  peak, which is what a container's memory limit must cover.
Memory hardly depends on the machine's load, but what start-up leaves resident can differ from one start to
the next: the table shows the lowest and the highest over `--rounds`.
The table is of later starts (textgen maps the graph it prepared before, as a restarted replica does); a
second one puts each precision's first start (preparing the graph) beside them.

`--textgen-flag` and `--llama-flag` add a flag to every cell of that server (a KV cache type, say); the KV
columns and the formula's figures still take textgen's cache in the bundle's dtype, llama-server's in f16.

Beside each textgen cell: what the pod sizing formula (serve.api.sizing.pod_memory, docs/deploy.md) gives
for it, and after the table the weight factor each precision asks of the formula, so new figures for
serve/api/sizing.py are one run away when the engine's memory changes.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench.proc import tree_status_mib
from bench.report import finish_record, machine, print_reports, record_path, table, write_json
from bench.scenarios.peers import PRECISIONS
from bench.scenarios.served_peers import (
    Prepared,
    Workload,
    add_server_options,
    llama_command,
    load,
    prepare,
    textgen_command,
)
from bench.servers import free_port, http_answers, server_process
from serve.api.sizing import FIXED_BYTES, ITEMSIZE, WEIGHT_FACTORS, PodMemory, pod_memory, size_kv_cache
from serve.bundle import read_manifest

SERVERS = ("textgen", "llama-server")
FIRST, LATER = "first", "later"  # a start that prepares textgen's graph, and one that maps the prepared graph
LLAMA_KV_ITEMSIZE = 2  # llama-server's default KV cache type, f16
MB = 1e6
MIB = 2**20
Cell = dict[str, Any]


@dataclass(frozen=True)
class Memory:
    """A server's processes after its requests, in MiB: each one's VmRSS and VmHWM by pid (the first, the
    process started: textgen's front end)."""

    rss: dict[int, float]
    hwm: dict[int, float]
    anon: dict[int, float]  # of rss: what the process wrote (heap, arenas, copies of weights)
    file: dict[int, float]  # of rss: pages of mapped files (libraries, mmapped weights), which can be dropped

    @property
    def steady(self) -> float:
        return sum(self.rss.values())

    @property
    def peak(self) -> float:
        return sum(self.hwm.values())

    @property
    def front_end(self) -> float:
        return next(iter(self.rss.values()))


def read_memory(pid: int) -> Memory:
    fields = ("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return Memory(*(tree_status_mib(pid, field) for field in fields))


def run_cell(command: list[str], port: int, log: Path, work: Workload, requests: int, seed: int) -> Cell:
    """Start the server, time it to /health 200, send `requests` requests at once, read its memory."""
    answers = functools.partial(http_answers, port, "/health")
    start = time.perf_counter()
    with server_process(command, log, f"127.0.0.1:{port}", answers=answers, interval=0.05) as process:
        ready = time.perf_counter() - start
        summary = load(port, requests, work, seed)
        time.sleep(1.0)  # let freed memory settle before the reading
        memory = read_memory(process.pid)
    return {
        "ready_s": ready,
        "steady_mib": memory.steady,
        "peak_mib": memory.peak,
        "front_end_mib": memory.front_end,
        "anon_mib": sum(memory.anon.values()),
        "file_mib": sum(memory.file.values()),
        "processes": {
            str(pid): {
                "rss_mib": memory.rss[pid],
                "hwm_mib": memory.hwm.get(pid),
                "anon_mib": memory.anon.get(pid),
                "file_mib": memory.file.get(pid),
            }
            for pid in memory.rss
        },
        "failed": summary["failed_requests"],
    }


def predicted(bundle: Path, work: Workload) -> Cell:
    """The sizing formula's figures for textgen's cell (no prefix-cache rows, as served here)."""
    manifest = read_manifest(bundle)
    kv = size_kv_cache(manifest, work.ctx_per_slot, None, work.slots, 0)
    pod = pod_memory(bundle, manifest, kv)
    return {
        "request_mib": pod.request_mib,
        "limit_mib": pod.limit_mib,
        "weights_mib": pod.weight_bytes / MIB,
        "quantization": manifest.quantization,
    }


def kv_mib(bundle: Path, work: Workload) -> dict[str, float]:
    """Each server's KV cache for the cell: textgen's in the bundle's dtype, llama-server's in f16."""
    manifest = read_manifest(bundle)
    arch, tokens = manifest.architecture, work.slots * work.ctx_per_slot
    ours = arch.kv_bytes_per_token(ITEMSIZE[manifest.dtype]) * tokens
    return {"textgen": ours / MIB, "llama-server": arch.kv_bytes_per_token(LLAMA_KV_ITEMSIZE) * tokens / MIB}


def command_of(
    server: str, ready: Prepared, precision: str, port: int, work: Workload, args: argparse.Namespace
) -> list[str]:
    """The server's command for the cell, with the run's own flags for it (--textgen-flag, --llama-flag)."""
    if server == "textgen":
        flags = ["--prefix-cache-rows", "0", *args.textgen_flag]
        return textgen_command(ready.bundles[precision], port, work, flags)
    gguf = ready.ggufs[PRECISIONS[precision].llamacpp]
    return llama_command(ready.bin_dir, gguf, port, work, args.llama_flag)


def measure(ready: Prepared, args: argparse.Namespace, base: Workload, result: Cell, output: Path) -> None:
    """Every cell into result["records"], the record written to `output` after each (a run cut short keeps
    what it measured; `--report` reads it).

    textgen's prepared graph is kept in a compiled cache of the run's own, one per precision: the first
    textgen cell of each precision starts with it empty (a first start, which prepares the graph), and is
    followed by the same cell started again; every other cell is a later start, as a replica's restart is."""
    logs = output.with_suffix("")
    records = result["records"]

    def run(server: str, precision: str, work: Workload, round_no: int, start: str) -> None:
        port, cache = free_port(), logs / f"compiled-{precision}"
        log = logs / f"{server}-{precision}-{work.ctx_per_slot}-{round_no}-{start}.log"
        command = command_of(server, ready, precision, port, work, args)
        if server == "textgen":
            command += ["--compiled-cache", str(cache)]
        cell = run_cell(command, port, log, work, args.requests, seed=1000 * (round_no + 1))
        record = {"round": round_no, "context": work.ctx_per_slot, "precision": precision, "server": server}
        records.append(record | cell | {"start": start})
        write_json(output, result)
        print(json.dumps(records[-1]), flush=True)

    for round_no in range(args.rounds):
        for context in args.contexts:
            work = replace(base, ctx_per_slot=context)
            for precision in args.precisions:
                if round_no == 0 and context == args.contexts[0]:
                    shutil.rmtree(logs / f"compiled-{precision}", ignore_errors=True)
                    run("textgen", precision, work, round_no, FIRST)
                for server in SERVERS:
                    run(server, precision, work, round_no, LATER)


def assets(args: argparse.Namespace) -> Prepared:
    """The bundles, GGUFs and llama-server named on the command line, else the served-peers scenario's."""
    quants = [PRECISIONS[p].llamacpp for p in args.precisions]
    named = dict(args.bundle)
    if (
        all(p in named for p in args.precisions)
        and all(q in dict(args.gguf) for q in quants)
        and args.bin_dir
    ):
        return Prepared(Path(), args.bin_dir, dict(args.gguf), named)
    return prepare(args.work, args.model_dir, args.precisions)


# --- the report --------------------------------------------------------------------------------------------


def _median(records: list[Cell], key: str) -> float:
    return statistics.median(r[key] for r in records) if records else float("nan")


def _pick(records: list[Cell], server: str, precision: str, context: int, start: str = LATER) -> list[Cell]:
    """The cells of a server, precision and context; of later starts unless `start` says otherwise."""
    return [
        r
        for r in records
        if r["server"] == server
        and r["precision"] == precision
        and r["context"] == context
        and r.get("start", LATER) == start
    ]


def formula(result: Cell, precision: str, context: int) -> PodMemory:
    """The sizing formula's figures for textgen's cell as serve/api/sizing.py gives them now (the record keeps
    those of its own run too), so a refitted formula can be checked against earlier records."""
    given = result["predicted"][precision][str(context)]
    kv = result["kv_mib"][precision][str(context)]["textgen"]
    return PodMemory(
        round(given["weights_mib"] * MIB), round(kv * MIB), WEIGHT_FACTORS[given["quantization"]]
    )


def _span(values: list[float], scale: float = 1.0, digits: int = 0) -> str:
    """The lowest and the highest of `values` / `scale` ("a" when they round the same): memory after start-up
    differs from start to start by what the allocator kept of the graph it parsed."""
    low, high = (f"{v / scale:,.{digits}f}" for v in (min(values), max(values)))
    return low if low == high else f"{low}–{high}"


def memory_table(result: Cell) -> list[str]:
    slots, records = result["slots"], result["records"]
    header = [
        *(
            "model",
            "KV capacity (textgen fp32; llama-server f16 cache)",
            "textgen steady (front end + engine)",
        ),
        *("textgen peak", "llama-server steady / peak", "textgen ÷ llama-server steady"),
        "of steady, mapped files (textgen; llama-server)",
        "ready after start, median (textgen; llama-server)",
        "sizing formula request / limit",
    ]
    rows = []
    for context in result["contexts"]:
        for precision in result["precisions"]:
            ours, theirs = (_pick(records, s, precision, context) for s in SERVERS)
            if not ours or not theirs:
                continue
            steady, front = [r["steady_mib"] for r in ours], [r["front_end_mib"] for r in ours]
            engine = [total - part for total, part in zip(steady, front, strict=True)]
            their_steady = [r["steady_mib"] for r in theirs]
            kv = result["kv_mib"][precision][str(context)]
            pod = formula(result, precision, context)
            rows.append(
                [
                    f"{precision} / {PRECISIONS[precision].llamacpp}",
                    f"{slots} x {context} ({kv['textgen']:,.0f}; {kv['llama-server']:,.0f} MiB)",
                    f"{_span(front)} + {_span(engine)} MiB",
                    f"{_span([r['peak_mib'] for r in ours])} MiB",
                    f"{_span(their_steady)} / {_span([r['peak_mib'] for r in theirs])} MiB",
                    f"**{_span(steady, statistics.median(their_steady), 2)}**",
                    f"{_median(ours, 'file_mib'):,.0f}; {_median(theirs, 'file_mib'):,.0f} MiB",
                    f"{_median(ours, 'ready_s'):.1f} s; {_median(theirs, 'ready_s'):.1f} s",
                    f"{pod.request_mib:,} / {pod.limit_mib:,} MiB",
                ]
            )
    return table(header, rows)


def first_start_table(result: Cell) -> list[str]:
    """textgen's first start (it prepares the graph into an empty compiled cache) beside its later starts
    (they map it), at the first context: the ready time and the peak a new node's first replica pays."""
    context, records = result["contexts"][0], result["records"]
    header = ["precision", "first start: ready, peak", "later starts: ready (median), peak"]
    rows = []
    for precision in result["precisions"]:
        first, later = (_pick(records, "textgen", precision, context, s) for s in (FIRST, LATER))
        if not first or not later:
            continue
        rows.append(
            [
                precision,
                f"{_median(first, 'ready_s'):.1f} s, {_span([r['peak_mib'] for r in first])} MiB",
                f"{_median(later, 'ready_s'):.1f} s, {_span([r['peak_mib'] for r in later])} MiB",
            ]
        )
    return table(header, rows) if rows else []


def factor_table(result: Cell) -> list[str]:
    """The weight factors these cells ask of the sizing formula: (textgen's memory - its KV cache - the
    formula's fixed part) / the serving graph's bytes, the largest over the contexts and rounds, beside the
    formula's."""
    header = [
        *("precision", "weights", f"factor measured, steady / peak (fixed part {FIXED_BYTES // MIB} MiB)"),
        "the formula's (serve/api/sizing.py)",
    ]
    rows = []
    for precision in result["precisions"]:
        fits: dict[str, list[float]] = {"steady_mib": [], "peak_mib": []}
        for context in result["contexts"]:
            ours = _pick(result["records"], "textgen", precision, context)
            given = result["predicted"][precision][str(context)]
            kv = result["kv_mib"][precision][str(context)]["textgen"]
            for key, fit in fits.items():
                fit += [(r[key] - kv - FIXED_BYTES / MIB) / given["weights_mib"] for r in ours]
        factor = WEIGHT_FACTORS[given["quantization"]]
        rows.append(
            [
                *(precision, f"{given['weights_mib']:,.1f} MiB"),
                f"{max(fits['steady_mib']):.2f} / {max(fits['peak_mib']):.2f}",
                f"{factor.steady:.2f} / {factor.peak:.2f}",
            ]
        )
    return table(header, rows)


def report(result: Cell) -> str:
    lost = [r for r in result["records"] if r["failed"]]
    m = result["machine"]
    machine_line = f"{m['cpu']}, {m['cores']} cores, onnxruntime {m['onnxruntime']}; {result['started']}"
    lines = [f"`{result['command']}` ({machine_line})", "", *memory_table(result), "", *factor_table(result)]
    if first := first_start_table(result):
        lines += ["", *first]
    if lost:
        lines += ["", f"{len(lost)} cells lost requests: {lost}"]
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------------------


def named_path(text: str) -> tuple[str, Path]:
    """NAME=PATH, as --bundle and --gguf take them."""
    name, equals, path = text.partition("=")
    if not equals:
        raise argparse.ArgumentTypeError(f"{text!r}: give NAME=PATH")
    return name, Path(path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv_ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    p.add_argument(
        "--bundle", type=named_path, action="append", default=[], help="PRECISION=DIR (repeatable)"
    )
    p.add_argument(
        "--gguf", type=named_path, action="append", default=[], help="QUANT=FILE, e.g. q8_0=... (repeatable)"
    )
    p.add_argument("--bin-dir", type=Path, help="the folder of llama-server")
    p.add_argument("--precisions", type=lambda t: t.split(","), default=list(PRECISIONS))
    p.add_argument("--contexts", type=csv_ints, default=[256, 2048], help="positions per row, one cell each")
    p.add_argument("--requests", type=int, default=4, help="sent at once before memory is read")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    add_server_options(p, "served-memory")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print_reports(args.report, report)
        return 0
    output = record_path(args.output, "served-memory")
    output.with_suffix("").mkdir(parents=True, exist_ok=True)  # the servers' logs
    ready = assets(args)
    work = Workload(max_tokens=args.new_tokens)
    result: Cell = {
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["textgen-bench served-memory", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(),
        "slots": work.slots,
        "contexts": args.contexts,
        "precisions": args.precisions,
        "kv_mib": {
            p: {str(c): kv_mib(ready.bundles[p], replace(work, ctx_per_slot=c)) for c in args.contexts}
            for p in args.precisions
        },
        "predicted": {
            p: {str(c): predicted(ready.bundles[p], replace(work, ctx_per_slot=c)) for c in args.contexts}
            for p in args.precisions
        },
        "workload": asdict(work) | {"requests": args.requests},
        "records": [],
    }
    measure(ready, args, work, result, output)
    return finish_record(result, output, report)


if __name__ == "__main__":
    sys.exit(main())
