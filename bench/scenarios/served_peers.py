"""Served against served: `textgen-serve` against llama.cpp's `llama-server` on the same weights of a model of
real size, at every precision (fp32 / int8 / int4 against f32 / q8_0 / q4_0), with the engines offline beside.

    textgen-bench served-peers [--work DIR] [--rounds 4] [--clients 1,4,16] [--precisions fp32,int8,int4]
    textgen-bench served-peers --report bench/results/served-peers-*.json   # the tables of saved runs

What it prepares in WORK (default models/served-peers; each step only when its output is missing):
1. C-llama (the c-llama scenario): a 373M-parameter Llama with random weights, or `--model-dir` a Llama folder
   of your own;
2. llama.cpp's llama-server, llama-batched-bench and llama-quantize, built from the source in the
   llama-cpp-python sdist (bench.llama_cpp; one pip download, ~25 minutes of compile on 2 cores);
3. the model as GGUF f32 / q8_0 / q4_0 (llama.cpp's converter and quantizer);
4. textgen bundles of the model at fp32 / `--int8` / `--int4` (`textgen-export hf`, which verifies
   each against transformers; its report is in the bundle's manifest).

Served (the figure users compare): each server alone on the machine, with the same 16 slots of 256
positions and 2 threads, driven over HTTP by the same OpenAI `/v1/completions` client (bench.loadgen's,
streamed, `ignore_eos`, greedy): C closed-loop clients, `--requests` requests each, a distinct prompt of 32
random token ids per request (no prefix reuse; the same prompts for both servers in a round), 128 new tokens.
`--dataset corpus` sends the token ids of windows of the standard library's sources instead (text a
speculating server can look up: `--textgen-flag=--speculative --textgen-flag=ngram --llama-flag=--spec-type
--llama-flag=ngram-simple`).
One warm-up of C short requests before each client count. Per round and precision the two servers run one
after the other, the first flipping every round. A cell: output tok/s over the run, TTFT p50/p90, ITL p50.
The summary is the median over rounds, and textgen ÷ llama-server as the median of the rounds' ratios.

Offline (`--offline`, once before the served rounds): textgen's engine (`bench.scenarios.engine --cell`) and
`llama-batched-bench -npp 32 -ntg 128 -npl 1,4,16` on the same model, both as 128 x batch new tokens over
the whole run's wall, prefill included; and the weights a textgen decode step reads against the machine's
read bandwidth (the b1 tok/s that memory allows).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bench import llama_cpp, servers
from bench.loadgen import (
    AdapterField,
    LoadConfig,
    Prompt,
    corpus_window,
    run_load,
    stdlib_texts,
    summarize,
    synthetic_ids,
)
from bench.proc import run_logged
from bench.report import add_record_options, finish_record, print_reports, record_path, table, write_json
from bench.rounds import in_turn, median_ratio
from bench.scenarios.engine import cell_in_subprocess, machine_roofline
from bench.scenarios.peers import PRECISIONS, import_bundle, weight_bytes
from bench.servers import ROOT, free_port, http_answers, server_process

SERVERS = ("textgen", "llama-server")
Cell = dict[str, Any]


@dataclass(frozen=True)
class Workload:
    slots: int = 16  # both servers' parallel sequences (textgen --max-batch-size, llama-server -np)
    ctx_per_slot: int = 256  # positions per sequence (textgen --max-model-len; llama-server -c slots x this)
    threads: int = 2
    prompt_len: int = 32
    max_tokens: int = 128
    requests: int = 1  # per client
    vocab: int = 8192
    eos_token_id: int = 2
    # "corpus": windows of the Python standard library's sources, tokenized by this tokenizer.json (the
    # bundle's) and sent as token ids, so both servers get the same ids; "synthetic": random ids
    dataset: str = "synthetic"
    tokenizer: str | None = None
    # LoRA adapters the requests name in turn, and where (bench.loadgen.LoadConfig's fields; lora scenario)
    models: tuple[str, ...] = ()
    adapter_field: AdapterField = "model"


def textgen_command(bundle: Path, port: int, work: Workload, flags: list[str]) -> list[str]:
    """textgen-serve over HTTP only, with `work`'s rows, positions and threads (as llama-server gets them)."""
    return servers.textgen_command(
        bundle,
        *("--http-host", "127.0.0.1", "--http-port", str(port), "--port", "0", "--metrics-port", "0"),
        *("--max-batch-size", str(work.slots), "--max-model-len", str(work.ctx_per_slot)),
        *("--threads", str(work.threads), *flags),
    )


def llama_command(bin_dir: Path, gguf: Path, port: int, work: Workload, flags: list[str]) -> list[str]:
    """llama-server with `work`'s slots, positions and threads."""
    command = servers.llama_server_command(bin_dir, gguf, port, work.slots, work.ctx_per_slot, work.threads)
    return [*command, *flags]


def prompts(work: Workload, count: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    if work.dataset == "corpus":
        return [Prompt(None, ids, work.max_tokens) for ids in corpus_ids(work, count, rng)]
    return [
        Prompt(None, synthetic_ids(work.prompt_len, work.vocab, work.eos_token_id, rng), work.max_tokens)
        for _ in range(count)
    ]


def corpus_ids(work: Workload, count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """`count` windows of the standard library's sources, each its first `prompt_len` token ids."""
    from tokenizers import Tokenizer

    if work.tokenizer is None:
        raise SystemExit("--dataset corpus needs the bundle's tokenizer")
    tokenizer = Tokenizer.from_file(work.tokenizer)
    texts = stdlib_texts()
    windows = [corpus_window(texts, work.prompt_len * 8, rng) for _ in range(count)]
    return [tuple(tokenizer.encode(window).ids[: work.prompt_len]) for window in windows]


def load(port: int, clients: int, work: Workload, seed: int) -> Cell:
    """`clients` closed-loop clients over HTTP; the load generator's summary."""
    count = clients * work.requests
    shown = prompts(work, count, seed)
    config = LoadConfig(
        target="",
        concurrency=clients,
        num_requests=count,
        input_len=work.prompt_len,
        max_new_tokens=work.max_tokens,
        ignore_eos=True,
        seed=seed,
        percentiles=(90.0,),
        progress=False,
        rpc="http",
        http_target=f"127.0.0.1:{port}",
        models=work.models,
        adapter_field=work.adapter_field,
    )
    return summarize(asyncio.run(run_load(config, None, shown)), config.percentiles)


def served_cell(summary: Cell, clients: int, work: Workload) -> Cell:
    ttft: dict[str, float] = summary["ttft_ms"]
    expected = clients * work.requests * work.max_tokens
    return {
        "tok_s": summary["output_throughput"],
        "ttft_p50_ms": ttft["median"],
        "ttft_p90_ms": ttft["p90"],
        "itl_p50_ms": summary["itl_ms"]["median"],
        "failed": summary["failed_requests"],
        "tokens": summary["total_output_tokens"],
        "complete": summary["failed_requests"] == 0 and summary["total_output_tokens"] == expected,
    }


def serve_and_load(
    command: list[str], port: int, log: Path, clients: list[int], work: Workload, seed: int
) -> dict:
    cells = {}
    with server_process(command, log, f"127.0.0.1:{port}", answers=functools.partial(http_answers, port)):
        for count in clients:
            # prompts of their own for each count and the warm-up: no server reuses a cached prefix
            load(port, count, replace(work, max_tokens=8), seed + 500 + count)  # warm-up at this concurrency
            cells[count] = served_cell(load(port, count, work, seed + count), count, work)
    return cells


def order(round_no: int, index: int) -> tuple[str, str]:
    """Which server runs first: flips every round, and from precision to precision within one."""
    first, second = in_turn(SERVERS, round_no + index)
    return first, second


# --- preparation -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    model_dir: Path
    bin_dir: Path
    ggufs: dict[str, Path]  # llama.cpp's precision name -> file
    bundles: dict[str, Path]  # textgen's precision name -> bundle


def prepare(work_dir: Path, model_dir: Path | None, precisions: list[str]) -> Prepared:
    work_dir.mkdir(parents=True, exist_ok=True)
    if model_dir is None:
        model_dir = work_dir / "c-llama"
        if not (model_dir / "model.safetensors").is_file():
            shutil.rmtree(model_dir, ignore_errors=True)
            run_logged([sys.executable, "-m", "bench.scenarios.c_llama", str(model_dir)])
    bin_dir = llama_cpp.binaries(work_dir)
    ggufs = llama_cpp.ggufs(work_dir, model_dir)
    bundles = {}
    for precision in precisions:
        out = work_dir / "bundles" / f"{model_dir.name}-{precision}"
        print(f"textgen-export hf {precision} -> {out}", flush=True)
        bundles[precision] = import_bundle(model_dir, out, precision)
    return Prepared(model_dir, bin_dir, ggufs, bundles)


# --- the runs ----------------------------------------------------------------------------------------------


def offline(ready: Prepared, precisions: list[str], batches: list[int], work: Workload) -> Cell:
    machine = machine_roofline(work.threads)
    cells: Cell = {"machine": machine, "textgen": {}, "llama": {}, "weights": {}}
    for precision in precisions:
        quant = PRECISIONS[precision].llamacpp
        rows = llama_cpp.batched_bench(
            ready.bin_dir, ready.ggufs[quant], work.prompt_len, work.max_tokens, batches, work.threads
        )
        cells["llama"][precision] = {str(r.batch): r.tok_s for r in rows}
        bundle = ready.bundles[precision]
        cells["textgen"][precision] = {
            str(b): cell_in_subprocess(bundle, b, work.threads, 3)["tok_s"] for b in batches
        }
        cells["weights"][precision] = {
            "textgen": asdict(weight_bytes(bundle / "model_inplace.onnx")),
            "gguf_file": ready.ggufs[quant].stat().st_size,
        }
        print(json.dumps({"offline": precision, **{k: cells[k][precision] for k in ("textgen", "llama")}}))
    return cells


def served(ready: Prepared, args: argparse.Namespace, work: Workload, logs: Path) -> list[Cell]:
    records = []
    for round_no in range(args.rounds):
        for index, precision in enumerate(args.precisions):
            for server in order(round_no, index):
                port = free_port()
                log = logs / f"{server}-{precision}-{round_no}.log"
                if server == "textgen":
                    command = textgen_command(ready.bundles[precision], port, work, args.textgen_flag)
                else:
                    gguf = ready.ggufs[PRECISIONS[precision].llamacpp]
                    command = llama_command(ready.bin_dir, gguf, port, work, args.llama_flag)
                cells = serve_and_load(command, port, log, args.clients, work, seed=1000 * (round_no + 1))
                for clients, cell in cells.items():
                    record = {"round": round_no, "precision": precision, "server": server, "clients": clients}
                    records.append(record | cell)
                    print(json.dumps(records[-1]), flush=True)
    return records


# --- the report --------------------------------------------------------------------------------------------


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _pick(records: list[Cell], server: str, precision: str, clients: int) -> dict[int, Cell]:
    return {
        r["round"]: r
        for r in records
        if r["server"] == server and r["precision"] == precision and r["clients"] == clients
    }


def ratio_median(records: list[Cell], precision: str, clients: int) -> float:
    """textgen ÷ llama-server tok/s: the median over rounds of each round's ratio."""
    ours, theirs = (
        _pick(records, "textgen", precision, clients),
        _pick(records, "llama-server", precision, clients),
    )
    paired = sorted(ours.keys() & theirs.keys())
    return median_ratio([ours[r]["tok_s"] for r in paired], [theirs[r]["tok_s"] for r in paired])


def median_of(records: list[Cell], server: str, precision: str, clients: int, key: str) -> float:
    return _median([r[key] for r in _pick(records, server, precision, clients).values()])


def served_table(records: list[Cell], precisions: list[str], clients: list[int]) -> list[str]:
    header = [
        *("precision", "clients", "textgen tok/s", "llama-server tok/s", "textgen ÷ llama-server"),
        *("TTFT p50 / p90 ms (textgen; llama-server)", "ITL p50 ms (textgen; llama-server)"),
    ]
    rows = []
    for precision in precisions:
        theirs = PRECISIONS[precision].llamacpp
        for count in clients:

            def fig(server: str, key: str, count: int = count, precision: str = precision) -> float:
                return median_of(records, server, precision, count, key)

            rows.append(
                [
                    *(f"{precision} ÷ {theirs}", str(count)),
                    *(f"{fig('textgen', 'tok_s'):.1f}", f"{fig('llama-server', 'tok_s'):.1f}"),
                    f"**{ratio_median(records, precision, count):.2f}**",
                    f"{fig('textgen', 'ttft_p50_ms'):.0f} / {fig('textgen', 'ttft_p90_ms'):.0f}; "
                    f"{fig('llama-server', 'ttft_p50_ms'):.0f} / {fig('llama-server', 'ttft_p90_ms'):.0f}",
                    f"{fig('textgen', 'itl_p50_ms'):.1f}; {fig('llama-server', 'itl_p50_ms'):.1f}",
                ]
            )
    return table(header, rows)


def fastest_table(records: list[Cell], precisions: list[str], clients: list[int]) -> list[str]:
    """Each server's fastest precision (by median tok/s) per client count, and the ratio of the two."""
    rows = []
    for count in clients:
        best = {}
        for server in SERVERS:
            rates = {p: median_of(records, server, p, count, "tok_s") for p in precisions}
            best[server] = max(rates.items(), key=lambda item: item[1])
        (ours, ours_rate), (theirs, theirs_rate) = best["textgen"], best["llama-server"]
        rows.append(
            [
                *(str(count), f"{ours} {ours_rate:.1f}", f"{PRECISIONS[theirs].llamacpp} {theirs_rate:.1f}"),
                f"**{ours_rate / theirs_rate:.2f}**",
            ]
        )
    return table(["clients", "textgen fastest", "llama-server fastest", "ratio"], rows)


def offline_table(cells: Cell, precisions: list[str]) -> list[str]:
    batches = list(next(iter(cells["textgen"].values())))
    rows = []
    for precision in precisions:
        ours, theirs = cells["textgen"][precision], cells["llama"][precision]
        row = [
            f"{ours[b]:.1f} / {theirs[b]:.1f} ({ours[b] / theirs[b]:.2f})" if theirs.get(b) else "—"
            for b in batches
        ]
        rows.append([f"{precision} ÷ {PRECISIONS[precision].llamacpp}", *row])
    return table(["precision", *(f"b{b} textgen / llama.cpp (ratio)" for b in batches)], rows)


def memory_table(cells: Cell, precisions: list[str]) -> list[str]:
    """The bytes a textgen decode step reads ÷ the read bandwidth: the b1 ceiling, and how near b1 comes."""
    machine = cells["machine"]
    bandwidth = max(machine["read_gbps"], machine["read_gbps_threads"])
    header = [
        *("precision", "textgen weights a step reads", "GGUF file", "b1 ceiling tok/s"),
        *("textgen b1 (of ceiling)", "llama.cpp b1 (of ceiling)"),
    ]
    rows = []
    for precision in precisions:
        weights = cells["weights"][precision]
        ceiling = bandwidth * 1e9 / weights["textgen"]["streamed"]
        ours, theirs = cells["textgen"][precision].get("1"), cells["llama"][precision].get("1")
        streamed, gguf = weights["textgen"]["streamed"] / 1e6, weights["gguf_file"] / 1e6
        rows.append(
            [
                *(precision, f"{streamed:.0f} MB", f"{gguf:.0f} MB", f"{ceiling:.1f}"),
                *(_of(ours, ceiling), _of(theirs, ceiling)),
            ]
        )
    bandwidth_line = f"read bandwidth {bandwidth:.1f} GB/s (numpy sums over 256 MB, best of 5)"
    return [bandwidth_line, "", *table(header, rows)]


def accuracy(bundles: dict[str, Path]) -> Cell:
    """Each bundle's verification against transformers, as its export wrote it in the manifest."""
    out = {}
    for precision, bundle in bundles.items():
        report = json.loads((bundle / "manifest.json").read_text())["verification"]
        serving, quantized = report.get("inplace", {}), report.get(precision, {})
        out[precision] = {
            "passed": report.get("passed"),
            "max_abs_logits_diff": serving.get("max_abs_logits_diff"),
            "batch_invariant": report.get("batch_invariant"),
            "perplexity_ratio": quantized.get("perplexity_ratio"),
            "top1_agreement": quantized.get("top1_agreement"),
        }
    return out


def accuracy_table(cells: Cell) -> list[str]:
    header = [
        *("precision", "verified", "serving graph max abs logit diff", "batch invariant"),
        *("perplexity ÷ fp32", "top-1 agreement with fp32"),
    ]
    rows = []
    for precision, a in cells.items():
        ratio, top1 = a["perplexity_ratio"], a["top1_agreement"]
        rows.append(
            [
                *(precision, "passed" if a["passed"] else "FAILED", f"{a['max_abs_logits_diff']:.2g}"),
                *(str(a["batch_invariant"]), "—" if ratio is None else f"{ratio:.3f}"),
                "—" if top1 is None else f"{top1:.2f}",
            ]
        )
    return table(header, rows)


def _of(rate: float | None, ceiling: float) -> str:
    return "—" if rate is None else f"{rate:.1f} ({rate / ceiling:.2f})"


def report(result: Cell) -> str:
    precisions, clients = result["precisions"], result["clients"]
    parts = []
    if result.get("served"):
        incomplete = [r for r in result["served"] if not r["complete"]]
        parts += [
            "Served (median over rounds):",
            "",
            *served_table(result["served"], precisions, clients),
            "",
        ]
        parts += ["Fastest precision of each:", "", *fastest_table(result["served"], precisions, clients), ""]
        if incomplete:
            parts += [f"{len(incomplete)} served cells lost requests or tokens: {incomplete}", ""]
    if result.get("offline"):
        parts += ["Offline engines (tok/s):", "", *offline_table(result["offline"], precisions), ""]
        parts += [*memory_table(result["offline"], precisions), ""]
    if result.get("accuracy"):
        parts += ["Against transformers (each bundle's export verification):", ""]
        parts += accuracy_table(result["accuracy"])
    return "\n".join(parts)


# --- the command -------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv_ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    p.add_argument("--precisions", type=lambda t: t.split(","), default=list(PRECISIONS))
    p.add_argument("--clients", type=csv_ints, default=[1, 4, 16])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--requests", type=int, default=1, help="per client and cell")
    p.add_argument(
        "--dataset",
        choices=("synthetic", "corpus"),
        default="synthetic",
        help="prompts: random token ids, or the token ids of stdlib source windows (text to look up)",
    )
    p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--served", action=argparse.BooleanOptionalAction, default=True)
    add_server_options(p, "served-peers")
    return p


def add_server_options(p: argparse.ArgumentParser, record: str) -> None:
    """What every served-against-served benchmark takes: where its assets are prepared, flags for each
    server, its record, its reports."""
    p.add_argument("--work", type=Path, default=ROOT / "models" / "served-peers")
    p.add_argument("--model-dir", type=Path, help="a Llama folder (default: C-llama, made in WORK)")
    p.add_argument("--textgen-flag", action="append", default=[], help="a textgen-serve flag (repeatable)")
    p.add_argument("--llama-flag", action="append", default=[], help="a llama-server flag (repeatable)")
    add_record_options(p, record)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.report:
        print_reports(args.report, report)
        return 0
    unknown = sorted(set(args.precisions) - set(PRECISIONS))
    if unknown:
        raise SystemExit(f"unknown precisions {unknown}; choose from {sorted(PRECISIONS)}")
    output = record_path(args.output, "served-peers")
    logs = output.with_suffix("")
    logs.mkdir(parents=True, exist_ok=True)
    ready = prepare(args.work, args.model_dir, args.precisions)
    tokenizer = str(ready.bundles[args.precisions[0]] / "tokenizer.json")
    work = Workload(requests=args.requests, dataset=args.dataset, tokenizer=tokenizer)
    result: Cell = {
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["textgen-bench served-peers", *(argv if argv is not None else sys.argv[1:])]),
        "workload": asdict(work),
        "precisions": args.precisions,
        "clients": args.clients,
        "accuracy": accuracy(ready.bundles),
    }
    if args.offline:
        result["offline"] = offline(ready, args.precisions, args.clients, work)
        write_json(output, result)
    if args.served:
        result["served"] = served(ready, args, work, logs)
    return finish_record(result, output, report)


if __name__ == "__main__":
    sys.exit(main())
