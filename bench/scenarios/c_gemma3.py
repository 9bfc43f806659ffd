"""C-gemma3: a Gemma 3 of Gemma-3-1B's shape, made locally for the served benchmarks against llama-server
(`textgen-bench served-peers --model-dir DIR`: llama.cpp's converter reads Gemma 3 too).

Hidden 1152, 26 layers, 4 heads of 256, one KV head, MLP width 6912 (GeGLU), Gemma 3's vocabulary of 262,144
(tied head); layers five local to one global: the local ones attend within 512 positions with RoPE base
10,000, the global ones everything with base 1,000,000; query_pre_attn_scalar 256. About 1.0B parameters, a
third of them the embedding. Random weights (seed 1234), saved as transformers writes them, with C-llama's
SentencePiece tokenizer (trained on the Python standard library's sources; its 8192 ids are the first of
the vocabulary, the rest are never produced by it but cost the head all the same).

    textgen-bench c-gemma3 OUT_DIR
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.scenarios.c_llama import SPECIALS, save_random

SHAPE: dict[str, Any] = {
    "vocab_size": 262144,
    "hidden_size": 1152,
    "intermediate_size": 6912,
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "layer_types": ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(26)],
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-6,
}


def make_c_gemma3(out: Path) -> Path:
    """Write C-gemma3 to `out` (created); returns `out`."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    return save_random(out, lambda: Gemma3ForCausalLM(Gemma3TextConfig(**SHAPE, **SPECIALS)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    make_c_gemma3(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
