"""HF transformers + PyTorch `generate`, offline: the baseline most users would try first.

Runs in the benchmark's own venv (bench/.venv-hf, made by the serving scenario), never in the project's: it
imports only torch and transformers. The model is a GPT2LMHeadModel with random weights (seeded) in the shape
given on the command line; speed does not depend on the weights. Greedy, KV cache on, exactly `--new-tokens`
per row (EOS cannot stop it: min_new_tokens), one untimed warm-up per batch size, median of `--repeats`.
Prints one JSON object: {"transformers": version, "torch": version, "results": [{batch, seconds, tok_s}]}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel


def model_from_args(args: argparse.Namespace) -> GPT2LMHeadModel:
    config = GPT2Config(
        vocab_size=args.vocab,
        n_positions=args.context,
        n_embd=args.d_model,
        n_layer=args.layers,
        n_head=args.heads,
        n_inner=args.d_ff,
        activation_function=args.activation,
        layer_norm_epsilon=args.eps,
        tie_word_embeddings=True,
        bos_token_id=args.eos,
        eos_token_id=args.eos,
    )
    torch.manual_seed(args.seed)
    return GPT2LMHeadModel(config).eval()


def generate_seconds(model: GPT2LMHeadModel, ids: torch.Tensor, new_tokens: int, eos: int) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_beams=1,
            use_cache=True,
            pad_token_id=eos,
            eos_token_id=eos,
        )
    seconds = time.perf_counter() - start
    if out.shape[1] - ids.shape[1] != new_tokens:
        raise RuntimeError(f"generate made {out.shape[1] - ids.shape[1]} tokens, not {new_tokens}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name in ("vocab", "context", "d-model", "layers", "heads", "d-ff", "eos"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument(
        "--activation", default="gelu", help="transformers' name: gelu (erf), gelu_new (tanh), relu"
    )
    p.add_argument("--eps", type=float, default=1e-5)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,4,16", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    model = model_from_args(args)
    generator = torch.Generator().manual_seed(args.seed)
    results = []
    for batch in (int(b) for b in args.batches.split(",")):
        # Ids from 2 up: 0 and 1 are the special tokens in textgen's tokenizers.
        ids = torch.randint(2, args.vocab, (batch, args.prompt_len), generator=generator)
        generate_seconds(model, ids, args.new_tokens, args.eos)  # warm-up
        seconds = statistics.median(
            generate_seconds(model, ids, args.new_tokens, args.eos) for _ in range(args.repeats)
        )
        results.append({"batch": batch, "seconds": seconds, "tok_s": batch * args.new_tokens / seconds})
    print(
        json.dumps({"transformers": transformers.__version__, "torch": torch.__version__, "results": results})
    )


if __name__ == "__main__":
    main()
