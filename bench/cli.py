"""`textgen-bench <scenario> [flags]` (or `python -m bench <scenario>`): every benchmark of the project, one
command. A scenario is a module of bench/scenarios/ with `main(argv) -> int` and a line in SCENARIOS;
`textgen-bench <scenario> --help` shows its flags. Scenarios share their parts: servers started and stopped
(bench.servers), rounds alternated (bench.rounds), load generation (bench.loadgen), records and
docs/benchmarks.md sections (bench.report)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable

# A scenario's module: bench.scenarios.<name with underscores>, but for the load generator, which the other
# scenarios drive too. Imported only when run: some need matplotlib, torch or onnxruntime-gpu.
MODULES = {"load": "bench.loadgen"}
SCENARIOS: dict[str, str] = {
    "load": "load against a running server (gRPC or HTTP), like `vllm bench serve`",
    "serving": "textgen-serve against the naive server, the offline engine and HF (`make bench`)",
    "soak": "rounds of mixed load; fails when RSS grows or gauges stay up (`make soak`)",
    "serve-ab": "textgen-serve configurations alternated round by round",
    "http-ab": "one server through HTTP and gRPC, alternated",
    "priority": "an urgent request on a saturated server: fcfs against priority",
    "served-peers": "textgen-serve against llama-server on the same weights",
    "served-memory": "memory and start-up against llama-server",
    "prepared-memory": "the engine's memory and start with and without the prepared graph",
    "peers": "same weights as ONNX Runtime GenAI and llama.cpp, offline and served",
    "engine": "the engine offline on bench-a, beside the peer stacks",
    "step-profile": "one batched step's time by owner: operators, engine Python, front end",
    "kv-design": "the in-place KV-cache graph against the concatenating one",
    "kv-dtype": "an fp16 KV cache against fp32: memory, step speed, accuracy",
    "beside": "prefill between decode steps against beside them (engine)",
    "prefix": "what the prefix cache saves and costs (engine)",
    "constrained": "what structured output costs (engine)",
    "sampling": "per-step cost of SamplingBatch.sample",
    "scoring": "prompt logprobs against a plain prefill (engine)",
    "speculation": "speculative decoding at one sequence (engine)",
    "lora": "LoRA: slots' and adapters' costs, load time, against llama-server",
    "batch-invariance": "which weight formats a row computes alone as batched",
    "hf": "a Qwen2.5-0.5B-shaped Hugging Face folder, exported and served",
    "c-llama": "make C-llama (373M, random weights), the served benchmarks' model",
    "c-moe": "make C-moe (Qwen3-MoE, 0.60B of which 0.10B active, random weights), for served-peers",
    "c-gemma3": "make C-gemma3 (Gemma-3-1B-shaped, random weights), for served-peers",
    "gpu-check": "TensorRT and CUDA sessions against CPU (needs a GPU)",
}


def module_of(name: str) -> str:
    return MODULES.get(name, f"bench.scenarios.{name.replace('-', '_')}")


def usage() -> str:
    width = max(map(len, SCENARIOS))
    lines = [f"  {name:<{width}}  {summary}" for name, summary in SCENARIOS.items()]
    head = "usage: textgen-bench <scenario> [flags]   (textgen-bench <scenario> --help for its flags)"
    return "\n".join([head, "", "scenarios:", *lines])


def scenario_main(name: str) -> Callable[[list[str]], int]:
    main: Callable[[list[str]], int] = importlib.import_module(module_of(name)).main
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
    return scenario_main(name)(rest)
