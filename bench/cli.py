"""`textgen-bench <scenario> [flags]` (or `python -m bench <scenario>`): every benchmark of the project, one
command. A scenario is a module with `main(argv) -> int`; `textgen-bench <scenario> --help` shows its flags.
Scenarios share their parts: servers started and stopped (bench.servers), rounds alternated
(bench.rounds), load generation (bench.loadgen), records and docs/benchmarks.md sections (bench.report)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Scenario:
    module: str
    summary: str


# Imported only when run: some need matplotlib, torch or onnxruntime-gpu, which others do without.
SCENARIOS: dict[str, Scenario] = {
    "load": Scenario(
        "bench.loadgen", "load against a running server (gRPC or HTTP), like `vllm bench serve`"
    ),
    "serving": Scenario(
        "bench.serving_bench",
        "textgen-serve against the naive server, the offline engine and HF (`make bench`)",
    ),
    "soak": Scenario(
        "bench.soak", "rounds of mixed load; fails when RSS grows or gauges stay up (`make soak`)"
    ),
    "serve-ab": Scenario("bench.serve_ab", "textgen-serve configurations alternated round by round"),
    "http-ab": Scenario("bench.http_ab", "one server through HTTP and gRPC, alternated"),
    "priority": Scenario(
        "bench.priority_bench", "an urgent request on a saturated server: fcfs against priority"
    ),
    "served-peers": Scenario("bench.served_peers", "textgen-serve against llama-server on the same weights"),
    "served-memory": Scenario("bench.served_memory", "memory and start-up against llama-server"),
    "peers": Scenario(
        "bench.peers_bench", "same weights as ONNX Runtime GenAI and llama.cpp, offline and served"
    ),
    "engine": Scenario("bench.engine_bench", "the engine offline on bench-a, beside the peer stacks"),
    "kv-design": Scenario(
        "bench.kv_design_bench", "the in-place KV-cache graph against the concatenating one"
    ),
    "kv-dtype": Scenario(
        "bench.kv_dtype_bench", "an fp16 KV cache against fp32: memory, step speed, accuracy"
    ),
    "beside": Scenario("bench.beside_bench", "prefill between decode steps against beside them (engine)"),
    "prefix": Scenario("bench.prefix_bench", "what the prefix cache saves and costs (engine)"),
    "constrained": Scenario("bench.constrained_bench", "what structured output costs (engine)"),
    "sampling": Scenario("bench.sampling_bench", "per-step cost of SamplingBatch.sample"),
    "scoring": Scenario("bench.scoring_bench", "prompt logprobs against a plain prefill (engine)"),
    "speculation": Scenario("bench.speculation_bench", "speculative decoding at one sequence (engine)"),
    "lora": Scenario("bench.lora_bench", "LoRA: slots' and adapters' costs, load time, against llama-server"),
    "batch-invariance": Scenario(
        "bench.batch_invariance", "which weight formats a row computes alone as batched"
    ),
    "hf": Scenario("bench.hf_bench", "a Qwen2.5-0.5B-shaped Hugging Face folder, exported and served"),
    "c-llama": Scenario("bench.c_llama", "make C-llama (373M, random weights), the served benchmarks' model"),
    "gpu-check": Scenario("bench.gpu_check", "TensorRT and CUDA sessions against CPU (needs a GPU)"),
}


def usage() -> str:
    width = max(map(len, SCENARIOS))
    lines = [f"  {name:<{width}}  {s.summary}" for name, s in SCENARIOS.items()]
    head = "usage: textgen-bench <scenario> [flags]   (textgen-bench <scenario> --help for its flags)"
    return "\n".join([head, "", "scenarios:", *lines])


def scenario_main(name: str) -> Callable[[list[str]], int | None]:
    main: Callable[[list[str]], int | None] = importlib.import_module(SCENARIOS[name].module).main
    return main


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in SCENARIOS:
        print(f"textgen-bench: no scenario {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    # argparse names the program after argv[0]: a scenario's --help and errors then read as typed.
    sys.argv = [f"textgen-bench {name}", *rest]
    return scenario_main(name)(rest) or 0
