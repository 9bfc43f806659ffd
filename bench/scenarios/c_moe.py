"""C-moe: a Qwen3-MoE of a real small mixture's shape, made locally for the served benchmarks against
llama-server (`textgen-bench served-peers --model-dir DIR`: llama.cpp's converter reads Qwen3-MoE too).

Hidden 768, 12 layers, 12 heads of 64, 4 KV heads, vocab 8192, untied head; every layer sparse: 32 experts
of width 640, top 4, norm_topk_prob. 0.60B parameters in total, 0.10B read per token: a decode step reads
about a sixth of the weights, so it should run like a 0.1B dense model while the whole model does not fit a
CPU's last-level cache. Random weights (seed 1234), saved as transformers writes them, with C-llama's
SentencePiece tokenizer (trained on the Python standard library's sources).

    textgen-bench c-moe OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.scenarios.c_llama import SPECIALS, save_random

SHAPE: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 768,
    "intermediate_size": 2048,  # of a dense layer: none here (every layer sparse)
    "moe_intermediate_size": 640,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}


def make_c_moe(out: Path) -> Path:
    """Write C-moe to `out` (created); returns `out`."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return save_random(out, lambda: Qwen3MoeForCausalLM(Qwen3MoeConfig(**SHAPE, **SPECIALS)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    make_c_moe(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
