"""C-llama: a Llama of a real small model's size, made locally for the served benchmarks
(served-peers, served-memory, lora).

Qwen2.5-0.5B's transformer shape as a Llama: hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864,
vocab 8192, untied head; 373M parameters, 1.49 GB in fp32. Its weights are far larger than a CPU's
last-level cache at every precision, so a decode step is bound by reading them, as a real model's is.
Random weights (seed 1234), saved as transformers writes them, with a SentencePiece BPE tokenizer trained on
the Python standard library's sources: llama.cpp's GGUF converter and `textgen-export hf` both need one; the
benchmark itself sends token ids.

    textgen-bench c-llama OUT_DIR
    textgen-bench c-llama DRAFT_DIR --draft-of OUT_DIR --draft-layers 2   # its first 2 layers, a draft
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEED = 1234
TOKENIZER_PIECES = 4000
SHAPE: dict[str, Any] = {
    "vocab_size": 8192,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
}
SPECIALS: dict[str, Any] = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def stdlib_lines(limit: int = 200_000) -> Iterator[str]:
    """Non-empty lines of the standard library's sources, in a fixed order."""
    from bench.loadgen import stdlib_texts

    count = 0
    for text in stdlib_texts():
        for line in text.splitlines():
            if line.strip():
                yield line
                count += 1
                if count >= limit:
                    return


def make_tokenizer(out: Path) -> None:
    """tokenizer.model (SentencePiece BPE with byte fallback: any text encodes) and its transformers files."""
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=stdlib_lines(),
        model_writer=model,
        vocab_size=TOKENIZER_PIECES,
        model_type="bpe",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=2,
    )
    (out / "tokenizer.model").write_bytes(model.getvalue())
    # from the folder, not vocab_file=: transformers 5 then converts the SentencePiece model to tokenizer.json
    tokenizer = LlamaTokenizer.from_pretrained(out, legacy=False, add_bos_token=True)
    tokenizer.save_pretrained(out)


def make_c_llama(out: Path) -> Path:
    """Write C-llama to `out` (created); returns `out`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return save_random(out, lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, **SPECIALS)))


def save_random(out: Path, make: Any) -> Path:
    """`make()`'s model (seeded), its generation config and the stdlib tokenizer, saved in `out` as
    transformers writes them; returns `out`."""
    import torch
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    make().eval().save_pretrained(out, safe_serialization=True)
    GenerationConfig(**SPECIALS).save_pretrained(out)
    make_tokenizer(out)
    return out


def make_draft(source: Path, out: Path, layers: int) -> Path:
    """Write to `out` the first `layers` layers of the Llama in `source` with its embedding, final norm, head
    and tokenizer: a draft model for speculative decoding that shares the model's vocabulary."""
    import shutil

    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if not 1 <= layers < model.config.num_hidden_layers:
        raise SystemExit(f"--draft-layers must be in 1..{model.config.num_hidden_layers - 1}, got {layers}")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != "config.json":
            shutil.copy(path, out / path.name)  # the tokenizer and generation config
    model.save_pretrained(out, safe_serialization=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--draft-of", type=Path, help="instead: a draft model, the first layers of the Llama in this folder"
    )
    parser.add_argument("--draft-layers", type=int, default=2, help="with --draft-of: its layers")
    args = parser.parse_args(argv)
    if args.draft_of is not None:
        make_draft(args.draft_of, args.out, args.draft_layers)
    else:
        make_c_llama(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
