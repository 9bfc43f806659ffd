"""A Qwen2.5-0.5B-shaped model from Hugging Face folder to served tokens: export time and memory, serving.

    textgen-bench hf --workdir /tmp/hf-bench [--concurrency 1,16] [--requests 32] [--output F.json]

Nothing is downloaded: the model is Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocabulary 151,936, tied embeddings, 32k context, rope theta 1e6) with random weights
(seed 0), saved in bfloat16 with `save_pretrained` beside a byte-level BPE tokenizer trained on the standard
library, its vocabulary filled to 151,643 with tokens no merge produces and Qwen's special tokens after it
(<|endoftext|> 151643, <|im_start|> 151644, <|im_end|> 151645: EOS), with a ChatML template. Each step is a
process of its own, timed, its peak RSS read by GNU time:
1. make the folder (not part of the export's figures);
2. `python -m export hf --model DIR --out BUNDLE` (verified against transformers);
3. `python -m serve --bundle BUNDLE`: RSS of the server and its engine process once warm, then
   `bench.loadgen` at each concurrency (TTFT, output tok/s);
4. `SamplingBatch.sample` on 16 x 151,936 logits (greedy, top-k, top-p; peaked and flat logits).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.proc import tree_rss_mib
from bench.servers import ROOT, free_port, server_process, textgen_command

QWEN25_05B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
REGULAR_TOKENS = 151643
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer() -> Any:
    """Byte-level BPE of the stdlib, filled to Qwen's regular vocabulary, then Qwen's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from export.train import load_corpus

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=REGULAR_TOKENS,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(load_corpus(12_000_000, heldout_percent=5).train, trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), REGULAR_TOKENS):  # decodable, never produced: no merge makes them
        vocab[f"<filler_{i}>"] = i
    filled = Tokenizer.from_str(json.dumps(data))
    filled.add_special_tokens(list(SPECIALS))
    assert filled.token_to_id("<|im_end|>") == 151645
    return filled


def make_model(folder: Path) -> None:
    import torch
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    started = time.perf_counter()
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).bfloat16().eval()
    model.save_pretrained(folder)
    del model
    hf = PreTrainedTokenizerFast(
        tokenizer_object=make_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHATML,
    )
    hf.save_pretrained(folder)
    print(f"made {folder} in {time.perf_counter() - started:.1f} s")


def timed(command: list[str], log: Path) -> dict[str, float]:
    """Run `command` under GNU time; its wall seconds and peak RSS (MiB). Output goes to `log`."""
    with log.open("w") as out:
        done = subprocess.run(
            ["/usr/bin/time", "-f", "TIMED %e %M", *command], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT
        )
    text = log.read_text()
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}); see {log}:\n{text[-3000:]}")
    seconds, kib = re.findall(r"TIMED ([\d.]+) (\d+)", text)[-1]
    return {"seconds": float(seconds), "peak_rss_mib": int(kib) / 1024}


def model_info(port: int) -> dict[str, Any]:
    import grpc

    from serve._proto.textgen.v1 import textgen_pb2 as pb
    from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        info = pb_grpc.TextGenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    return {
        "max_model_len": info.max_model_len,
        "max_batch_size": info.max_batch_size,
        "kv_cache_mib": info.kv_cache_bytes / 2**20,
        "eos_token_ids": list(info.eos_token_ids),
    }


def serve_and_load(bundle: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    port, metrics = free_port(), free_port()
    command = textgen_command(
        bundle,
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--metrics-host", "127.0.0.1", "--metrics-port", str(metrics)),
        *args.serve_args.split(),
    )
    started = time.perf_counter()
    with server_process(command, work / "serve.log", f"127.0.0.1:{port}", timeout=600) as server:
        result: dict[str, Any] = {"start_seconds": time.perf_counter() - started, "info": model_info(port)}
        result["rss_idle_mib"] = tree_rss_mib(server.pid)
        runs = {}
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            out = work / f"load-c{concurrency}.json"
            load = [sys.executable, "-m", "bench.loadgen", "--target", f"127.0.0.1:{port}"]
            requests = max(args.requests, concurrency)
            load += ["--concurrency", str(concurrency), "--num-requests", str(requests)]
            load += ["--input-len", "32", "--max-new-tokens", str(args.max_new_tokens), "--ignore-eos"]
            load += ["--no-progress", "--output", str(out)]
            subprocess.run(load, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
            summary = json.loads(out.read_text())["summary"]
            runs[concurrency] = {
                "output_tok_s": summary["output_throughput"],
                "ttft_ms_median": summary["ttft_ms"]["median"],
                "ttft_ms_p99": summary["ttft_ms"].get("p99"),
                "tpot_ms_median": summary["tpot_ms"]["median"],
                "requests": summary["successful_requests"],
                "failed": summary["failed_requests"],
            }
            print(f"concurrency {concurrency}: {runs[concurrency]}")
        result["load"] = runs
        result["rss_after_load_mib"] = tree_rss_mib(server.pid)
        return result


def sampling_costs() -> dict[str, dict[str, float]]:
    import numpy as np

    from bench.scenarios.sampling import logits_like, per_step_ms
    from serve.engine.sampling import SamplingParams

    cases = {
        "greedy": SamplingParams(),
        "top-k 50, T 0.8": SamplingParams(temperature=0.8, top_k=50),
        "top-p 0.9, T 0.8": SamplingParams(temperature=0.8, top_p=0.9),
        "greedy + rep. penalty 1.2": SamplingParams(repetition_penalty=1.2),
    }
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, float]] = {}
    for kind in ("peaked", "flat"):
        logits = logits_like(kind, 16, QWEN25_05B["vocab_size"], rng)
        for name, params in cases.items():
            wall, cpu = per_step_ms(params, logits, steps=20, repeats=5)
            out[f"{kind}: {name}"] = {"wall_ms": wall, "cpu_ms": cpu}
            print(f"sampling 16 x 151936, {kind}, {name}: {wall:.2f} ms wall, {cpu:.2f} ms cpu")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    make = sub.add_parser("make", help="only make the model folder (run as its own process by the bench)")
    make.add_argument("folder", type=Path)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/hf-bench"))
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="", help="extra textgen-serve flags, e.g. '--threads 2'")
    parser.add_argument("--skip-make", action="store_true", help="reuse WORKDIR/model")
    parser.add_argument("--skip-export", action="store_true", help="reuse WORKDIR/bundle")
    parser.add_argument("--output", type=Path, default=None, help="JSON of every figure")
    args = parser.parse_args(argv)
    if args.command == "make":
        make_model(args.folder)
        return 0
    work: Path = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    folder, bundle = work / "model", work / "bundle"
    figures: dict[str, Any] = {"load_average_before": os.getloadavg()}
    if not args.skip_make:
        make_command = [sys.executable, "-m", "bench.scenarios.hf", "make", str(folder)]
        figures["make"] = timed(make_command, work / "make.log")
        print(f"make: {figures['make']}")
    if not args.skip_export:
        export = [sys.executable, "-m", "export", "hf", "--model", str(folder), "--out", str(bundle)]
        figures["export"] = timed(export, work / "export.log")
        print(f"export: {figures['export']}")
    weights = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    files = {f.name: f.stat().st_size for f in bundle.iterdir()}
    figures["checkpoint_bytes"], figures["bundle_files"] = weights, files
    manifest = json.loads((bundle / "manifest.json").read_text())
    figures["verification"] = {
        k: manifest["verification"].get(k) for k in ("passed", "tolerance", "reference_max_abs_logit")
    } | {
        graph: {k: manifest["verification"][graph][k] for k in ("max_abs_logits_diff", "greedy_identical")}
        for graph in ("standard", "inplace")
    }
    figures["verification"]["export"] = manifest["verification"]["export"]
    print(f"bundle: {files}; verification {figures['verification']}")
    figures["serve"] = serve_and_load(bundle, work, args)
    figures["sampling"] = sampling_costs()
    figures["load_average_after"] = os.getloadavg()
    text = json.dumps(figures, indent=1)
    print(text)
    if args.output is not None:
        args.output.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
