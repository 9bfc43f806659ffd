"""LoRA adapters served: what slots cost a base request, what adapters cost, how fast an adapter loads, and
textgen against llama-server on the same adapters.

    textgen-bench lora adapters MODEL_DIR OUT_DIR [--count 4 --rank 16]
    textgen-bench lora load LORA_BUNDLE ADAPTER_DIR... [--repeats 3 --starts 3]
    textgen-bench lora steps --plain BUNDLE --lora LORA_BUNDLE ADAPTER_DIR... [--batches 1,16]
        [--compiled-cache DIR]
    textgen-bench lora peers --bundle LORA_BUNDLE --gguf MODEL.gguf --llama-cpp LLAMA_CPP_DIR \\
        --model-dir MODEL_DIR ADAPTER_DIR... [--clients 16 --rounds 2]

`adapters` makes peft adapters of a Hugging Face model: rank R on all seven projections of a Llama (q, k, v,
o, gate, up, down), random A and B from a seed per adapter (peft's `init_lora_weights=False`), B scaled down
so that the model's outputs move without blowing up, saved with `save_pretrained` as training would.

`load` times what makes an adapter servable: reading the peft folder (`read_adapter`: checks, safetensors,
scale folded in) and writing it into a slot (`LoraSlots.write`, laid out in the slot's columns); prints the
bytes one slot's arrays take; and times `textgen-serve` from its start to its first answer, with the
adapters (`--lora`) and without, alternated.

`steps` times engine decode steps in-process, alternated round by round: the bundle without slots, the LoRA
bundle serving base requests, and the LoRA bundle with every row on an adapter (spread over the adapters):
where a served difference comes from. Engines are built as the server builds them, from the prepared graph
(`--compiled-cache`), where a LoRA bundle's base-only steps run its graph without branches; the two base
cases are timed from the bundles' graphs too (as `--no-prepared-graph` serves them), where every step of
the LoRA bundle runs its branches.

`peers` serves the same adapters from textgen (`--lora`, the OpenAI `model` field) and from llama.cpp's
llama-server (each adapter converted with its convert_lora_to_gguf.py, loaded at start with scale 0 by
`--lora-scaled`, picked by the per-request `lora` field), one server at a time, the first flipping every
round, as the served-peers scenario runs them; C clients over HTTP with requests spread round-robin over
the adapters, and the same clients on the base model.

The served figures of textgen alone (tok/s through `textgen-serve`, bundle against bundle) come from
bench.scenarios.serve_ab with `--models` and a configuration's own `--bench-bundle=` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.loadgen import AdapterField
from bench.proc import run_logged
from bench.report import RESULTS, write_json
from bench.rounds import in_turn, median_ratio
from bench.scenarios.served_peers import Workload, llama_command, load, served_cell, textgen_command
from bench.servers import free_port, http_answers, server_process
from serve.engine.lora import LoraSlots, read_adapter
from serve.engine.types import default_compiled_cache
from serve.lora_layout import LoraLayout

SEED = 4321
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
B_SCALE = 0.05  # peft's random B has entries of O(1/sqrt(r)): this keeps each update a small change
PROMPT_LEN = 32
Cell = dict[str, Any]


# --- adapters ----------------------------------------------------------------------------------------------


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` peft adapters of the model at `model_dir`, in out/lora-0 ..., one seed each."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(SEED + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(
            r=rank, lora_alpha=rank, target_modules=list(ALL_PROJECTIONS), init_lora_weights=False
        )
        model = get_peft_model(base, config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.mul_(B_SCALE)
        path = out / f"lora-{i}"
        model.save_pretrained(str(path))
        paths.append(path)
        print(f"wrote {path}", flush=True)
    return paths


def adapter_names(adapters: list[Path]) -> list[str]:
    return [path.name for path in adapters]


def lora_flag(adapters: list[Path]) -> list[str]:
    """textgen-serve's `--lora NAME=DIR,...` for the adapters, each named by its folder."""
    return ["--lora", ",".join(f"{path.name}={path.resolve()}" for path in adapters)]


# --- load time and memory ----------------------------------------------------------------------------------


def bundle_layout(bundle: Path) -> LoraLayout:
    from serve.bundle import read_manifest

    layout = read_manifest(bundle).lora
    if layout is None:
        raise SystemExit(f"{bundle}: the bundle has no LoRA slots (export it with --lora-slots)")
    return layout


def slot_bytes(slots: LoraSlots) -> int:
    """The bytes one slot's columns and rows take in the graph's LoRA inputs (every slot takes the same)."""
    return slots.weight_bytes // slots.layout.slots


def adapter_load(bundle: Path, adapters: list[Path], repeats: int) -> Cell:
    """Median seconds to read an adapter for the bundle's layout and to write it into a slot."""
    layout = bundle_layout(bundle)
    slots = LoraSlots(layout)
    reads, writes = [], []
    for _ in range(repeats):
        for slot, path in enumerate(adapters, start=1):
            start = time.perf_counter()
            adapter = read_adapter(path, layout)
            read = time.perf_counter()
            slots.write(slot, adapter)
            reads.append(read - start)
            writes.append(time.perf_counter() - read)
    return {
        "read_s": statistics.median(reads),
        "write_s": statistics.median(writes),
        "slot_bytes": slot_bytes(slots),
        "peft_file_bytes": statistics.median(
            p.joinpath("adapter_model.safetensors").stat().st_size for p in adapters
        ),
    }


def server_start(bundle: Path, flags: list[str], log: Path) -> float:
    """Seconds from starting textgen-serve to its first answer on /v1/models."""
    port = free_port()
    command = textgen_command(bundle.resolve(), port, Workload(), flags)
    start = time.perf_counter()
    with server_process(command, log, f"127.0.0.1:{port}", answers=functools.partial(http_answers, port)):
        return time.perf_counter() - start


def server_starts(bundle: Path, adapters: list[Path], starts: int, log: Path) -> Cell:
    """Median start seconds without adapters and with them, alternated (the first flipping every start)."""
    kinds = {"without": [], "with": lora_flag(adapters)}
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_no in range(starts):
        for kind in in_turn(list(kinds), round_no):
            seconds[kind].append(server_start(bundle, kinds[kind], log))
    return {f"start_{kind}_s": statistics.median(values) for kind, values in seconds.items()}


def bytes_a_step(plain: Path, lora: Path) -> dict[str, int]:
    """What a decode step reads: the base weights (of the bundle without slots) and, with slots, every slot's
    LoRA arrays (a step whose rows use every slot reads them all)."""
    from bench.scenarios.peers import weight_bytes

    slots = LoraSlots(bundle_layout(lora))
    return {
        "base_weights": weight_bytes(plain / "model_inplace.onnx").streamed,
        "lora_arrays": slots.weight_bytes,
    }


# --- decode steps in-process -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepCase:
    name: str
    bundle: Path
    adapters: tuple[str, ...]  # what the rows name in turn; ("",): the base model
    prepared: bool = True  # from the prepared graph; False: from the bundle's graph


def step_cases(plain: Path, lora: Path, adapters: list[Path]) -> list[StepCase]:
    return [
        StepCase("no slots", plain, ("",)),
        StepCase("slots, base rows", lora, ("",)),
        StepCase("slots, adapter rows", lora, tuple(adapter_names(adapters))),
        StepCase("no slots, bundle graph", plain, ("",), prepared=False),
        StepCase("slots, base rows, bundle graph", lora, ("",), prepared=False),
    ]


def decode_ms(engine: Any, case: StepCase, batch: int, steps: int) -> float:
    """Median milliseconds of `steps` decode steps of `batch` rows, their adapters `case.adapters` in turn."""
    from serve.engine.sampling import SamplingParams
    from serve.engine.types import NewSequence

    rng = np.random.default_rng(SEED)
    rows = rng.integers(3, 8000, size=(batch, PROMPT_LEN)).tolist()
    names = case.adapters
    seqs = [
        NewSequence(str(i), rows[i], SamplingParams(), adapter=names[i % len(names)]) for i in range(batch)
    ]
    engine.prefill(seqs)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.decode()
        times.append(time.perf_counter() - start)
    engine.release(s.seq_id for s in seqs)
    return statistics.median(times) * 1e3


def step_engines(
    cases: list[StepCase], adapters: list[Path], batch: int, capacity: int, cache: Path
) -> dict[tuple[Path, bool], Any]:
    """One engine per bundle and graph (prepared under `cache`, or the bundle's), the adapters loaded into
    those with slots."""
    from serve.bundle import load_bundle
    from serve.engine.engine import Engine
    from serve.engine.types import EngineSettings, SessionConfig

    engines = {}
    for bundle, prepared in dict.fromkeys((case.bundle, case.prepared) for case in cases):
        lora = load_bundle(bundle)
        loaded = tuple((path.name, str(path)) for path in adapters) if lora.manifest.lora else ()
        settings = EngineSettings(
            max_batch_size=batch,
            capacity=capacity,
            session=SessionConfig(threads=2),
            adapters=loaded,
            compiled_cache=cache if prepared else None,
        )
        engines[bundle, prepared] = Engine.from_bundle(lora, settings)
    return engines


def step_times(
    cases: list[StepCase], adapters: list[Path], batches: list[int], steps: int, rounds: int, cache: Path
) -> dict[str, dict[str, float]]:
    """Median decode step ms per case and batch over rounds, each round running every case in turn."""
    engines = step_engines(cases, adapters, max(batches), PROMPT_LEN + steps + 8, cache)
    times: dict[str, dict[int, list[float]]] = {c.name: {b: [] for b in batches} for c in cases}
    for round_no in range(rounds):
        for case in in_turn(cases, round_no):
            for batch in batches:
                engine = engines[case.bundle, case.prepared]
                times[case.name][batch].append(decode_ms(engine, case, batch, steps))
        latest = {name: {b: ms[-1] for b, ms in cells.items()} for name, cells in times.items()}
        print(json.dumps({"round": round_no, **latest}), flush=True)
    return {name: {str(b): statistics.median(v) for b, v in t.items()} for name, t in times.items()}


# --- against llama-server ----------------------------------------------------------------------------------


def lora_ggufs(llama_cpp_dir: Path, model_dir: Path, adapters: list[Path], out: Path) -> list[Path]:
    """Each adapter as a GGUF LoRA (llama.cpp's convert_lora_to_gguf.py, f32), converted on first use."""
    converter = llama_cpp_dir / "convert_lora_to_gguf.py"
    files = []
    for adapter in adapters:
        gguf = out / f"{adapter.name}.gguf"
        if not gguf.is_file():
            out.mkdir(parents=True, exist_ok=True)
            command = [sys.executable, str(converter), str(adapter), "--base", str(model_dir)]
            run_logged(
                [*command, "--outtype", "f32", "--outfile", str(gguf)],
                env={"PYTHONPATH": str(llama_cpp_dir / "gguf-py")},
            )
        files.append(gguf)
    return files


@dataclass(frozen=True)
class PeerServer:
    name: str
    command: list[str]
    models: tuple[str, ...]  # what the requests name in turn to spread over the adapters
    field: AdapterField  # where: "model" (OpenAI) or "lora" (llama-server's per-request list)


def peer_servers(
    args: argparse.Namespace, port: int, work: Workload, ggufs: list[Path]
) -> dict[str, PeerServer]:
    textgen = textgen_command(args.bundle.resolve(), port, work, lora_flag(args.adapters))
    # scale 0 by default: a request that lists no adapter gets none (with `--lora` it would get all of them)
    scaled = ["--lora-scaled", ",".join(f"{g}:0" for g in ggufs)]
    llama = llama_command(args.llama_cpp / "build" / "bin", args.gguf, port, work, scaled)
    return {
        "textgen": PeerServer("textgen", textgen, tuple(adapter_names(args.adapters)), "model"),
        "llama-server": PeerServer("llama-server", llama, tuple(str(i) for i in range(len(ggufs))), "lora"),
    }


def peer_cells(server: PeerServer, port: int, log: Path, clients: int, work: Workload, seed: int) -> Cell:
    """One server's cells: the clients on the base model, then spread over the adapters."""
    spreads = {"base": work, "adapters": replace(work, models=server.models, adapter_field=server.field)}
    cells = {}
    with server_process(
        server.command, log, f"127.0.0.1:{port}", answers=functools.partial(http_answers, port)
    ):
        for spread, spread_work in spreads.items():
            load(port, clients, replace(spread_work, max_tokens=8), seed + 500)  # warm-up
            cells[spread] = served_cell(load(port, clients, spread_work, seed), clients, spread_work)
    return cells


def peers(args: argparse.Namespace) -> list[Cell]:
    ggufs = lora_ggufs(args.llama_cpp, args.model_dir, args.adapters, args.out / "gguf-lora")
    work = Workload(max_tokens=args.new_tokens, requests=args.requests)
    records = []
    for round_no in range(args.rounds):
        for name in in_turn(("textgen", "llama-server"), round_no):
            port = free_port()
            server = peer_servers(args, port, work, ggufs)[name]
            log = args.out / f"{name}-{round_no}.log"
            cells = peer_cells(server, port, log, args.clients, work, seed=1000 * (round_no + 1))
            for spread, cell in cells.items():
                records.append({"round": round_no, "server": name, "spread": spread} | cell)
                print(json.dumps(records[-1]), flush=True)
    return records


def peers_summary(records: list[Cell]) -> str:
    """textgen ÷ llama-server per spread (the median of the rounds' ratios), each server's median tok/s."""
    lines = []
    for spread in ("base", "adapters"):
        rates: dict[str, dict[int, float]] = {"textgen": {}, "llama-server": {}}
        for r in records:
            if r["spread"] == spread:
                rates[r["server"]][r["round"]] = r["tok_s"]
        ours, theirs = rates["textgen"], rates["llama-server"]
        paired = sorted(ours.keys() & theirs.keys())
        ratio = median_ratio([ours[k] for k in paired], [theirs[k] for k in paired])
        lines.append(
            f"{spread}: textgen {statistics.median(ours.values()):.1f} tok/s, llama-server "
            f"{statistics.median(theirs.values()):.1f} tok/s, textgen ÷ llama-server {ratio:.2f}"
        )
    return "\n".join(lines)


# --- the command -------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    csv_ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("adapters", help="make peft adapters of a Hugging Face model")
    a.add_argument("model", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--count", type=int, default=4)
    a.add_argument("--rank", type=int, default=16)
    ld = sub.add_parser("load", help="adapter load time, bytes per slot, server start with and without")
    ld.add_argument("bundle", type=Path, help="a bundle exported with --lora-slots")
    ld.add_argument("adapters", type=Path, nargs="+")
    ld.add_argument("--repeats", type=int, default=3)
    ld.add_argument("--starts", type=int, default=3, help="server starts of each kind (0: none)")
    st = sub.add_parser("steps", help="decode step times in-process: no slots, base rows, adapter rows")
    st.add_argument("--plain", type=Path, required=True, help="the bundle exported without slots")
    st.add_argument("--lora", type=Path, required=True, help="the same model exported with slots")
    st.add_argument("adapters", type=Path, nargs="+")
    st.add_argument("--batches", type=csv_ints, default=[1, 16])
    st.add_argument("--steps", type=int, default=16, help="decode steps timed per cell")
    st.add_argument("--rounds", type=int, default=3)
    st.add_argument(
        "--compiled-cache", type=Path, default=None, help="prepared graphs (default: textgen-serve's)"
    )
    pe = sub.add_parser("peers", help="textgen against llama-server on the same adapters")
    pe.add_argument("--bundle", type=Path, required=True, help="a bundle exported with --lora-slots")
    pe.add_argument("--gguf", type=Path, required=True, help="the same weights as GGUF (e.g. q4_0)")
    pe.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source with build/bin")
    pe.add_argument("--model-dir", type=Path, required=True, help="the adapters' base model (Hugging Face)")
    pe.add_argument("adapters", type=Path, nargs="+")
    pe.add_argument("--clients", type=int, default=16)
    pe.add_argument("--requests", type=int, default=1, help="per client and cell")
    pe.add_argument("--new-tokens", type=int, default=128)
    pe.add_argument("--rounds", type=int, default=2)
    pe.add_argument("--out", type=Path, default=RESULTS / "lora-peers", help="GGUFs and logs")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "adapters":
        make_adapters(args.model, args.out, args.count, args.rank)
    elif args.command == "load":
        log = RESULTS / "lora-load.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cell = adapter_load(args.bundle, args.adapters, args.repeats)
        if args.starts:
            cell |= server_starts(args.bundle, args.adapters, args.starts, log)
        print(json.dumps(cell))
    elif args.command == "steps":
        print(json.dumps(bytes_a_step(args.plain, args.lora)))
        cases = step_cases(args.plain, args.lora, args.adapters)
        cache = args.compiled_cache or default_compiled_cache()
        print(json.dumps(step_times(cases, args.adapters, args.batches, args.steps, args.rounds, cache)))
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        records = peers(args)
        write_json(args.out / "records.json", records)
        print(peers_summary(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
