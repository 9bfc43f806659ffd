"""`textgen-export inspect --checkpoint CKPT --text "..." --out DIR`: pictures and tables of what a checkpoint
does with a text, gathered in DIR/index.html. `--checkpoint demo` means the demo checkpoint (built first if
missing). The exit status is 0 when the inspection ran, even if it flagged something (the page and the
printed lines say what); user errors print one line and exit 1, like the other subcommands.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer
from torch import Tensor

from export.checkpoint import Checkpoint, CheckpointError, load_checkpoint
from export.inspection.attention import (
    InspectionError,
    TextBatch,
    encode_texts,
    recompute_errors,
    record_attention,
    weight_on_padding,
)
from export.inspection.diversity import (
    DEFAULT_MIN_JSD,
    HeadStats,
    LayerDiversity,
    head_stats,
    layer_diversity,
)
from export.inspection.embeddings import nearest_neighbours, probe_tokens
from export.inspection.layers import DEFAULT_JUMP, LayerStats, residual_stats
from export.inspection.report import Findings, Images, write_index

# Beyond ~40 tokens the tick labels of a heatmap stop being readable.
DEFAULT_MAX_TOKENS = 40
NEIGHBOURS_PER_TOKEN = 5


@dataclass(frozen=True)
class Options:
    max_tokens: int = DEFAULT_MAX_TOKENS
    min_jsd: float = DEFAULT_MIN_JSD
    jump: float = DEFAULT_JUMP
    probes: int = 8  # tokens of the text whose embedding neighbours are listed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint file, or 'demo' for the demo checkpoint (trained first if missing)",
    )
    parser.add_argument("--text", required=True, help="the text whose attention is drawn (at least 2 tokens)")
    parser.add_argument(
        "--padded-text",
        default=None,
        help="a second text run in the same batch, left-padded to the first; "
        "default: the first half of --text",
    )
    parser.add_argument("--out", required=True, type=Path, help="directory for index.html and the PNGs")
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help=f"cut each text to this many tokens (default {DEFAULT_MAX_TOKENS})",
    )
    parser.add_argument(
        "--min-jsd",
        type=float,
        default=DEFAULT_MIN_JSD,
        help="flag a layer whose most different heads diverge less than this, in bits "
        f"(default {DEFAULT_MIN_JSD})",
    )
    parser.add_argument(
        "--jump",
        type=float,
        default=DEFAULT_JUMP,
        help=f"flag a layer whose residual std changes by more than this factor (default {DEFAULT_JUMP})",
    )
    parser.add_argument(
        "--probes",
        type=int,
        default=Options.probes,
        help="how many distinct tokens of the text get embedding neighbours (default 8)",
    )


def run(args: argparse.Namespace) -> int:
    options = Options(args.max_tokens, args.min_jsd, args.jump, args.probes)
    try:
        checkpoint, source = load(args.checkpoint)
        findings = inspect_checkpoint(checkpoint, source, args.text, args.padded_text, args.out, options)
    except ModuleNotFoundError as exc:
        if exc.name != "matplotlib":
            raise
        print(
            "textgen-export inspect: matplotlib is missing; install the extra: pip install -e '.[inspect]'",
            file=sys.stderr,
        )
        return 1
    except (CheckpointError, InspectionError, OSError) as exc:
        print(f"textgen-export inspect: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.out / 'index.html'}")
    for problem in findings.problems():
        print(f"flagged: {problem}")
    return 0


def load(spec: str) -> tuple[Checkpoint, str]:
    """The checkpoint named on the command line, and how to name it on the page."""
    if spec == "demo":
        # Imported here: the demo module pulls in the trainer, which only this case needs.
        from export.demo import ensure_demo_checkpoint

        path = ensure_demo_checkpoint()
    else:
        path = Path(spec)
    return load_checkpoint(path), str(path)


def _check(options: Options, context_length: int) -> None:
    if not 2 <= options.max_tokens <= context_length:
        raise InspectionError(
            f"--max-tokens must lie in [2, {context_length}] (the model's context), got {options.max_tokens}"
        )
    if options.min_jsd < 0:
        raise InspectionError(f"--min-jsd must be >= 0, got {options.min_jsd}")
    if options.jump <= 1:
        raise InspectionError(f"--jump must be above 1, got {options.jump}")
    if options.probes < 0:
        raise InspectionError(f"--probes must be >= 0, got {options.probes}")


def texts_to_inspect(tokenizer: Tokenizer, text: str, padded_text: str | None, max_tokens: int) -> list[str]:
    """The text and the one to pad in the same batch: by default the first half of what is shown of the
    text, so the second row is padded however long the text is."""
    ids = tokenizer.encode(text).ids
    if len(ids) < 2:
        raise InspectionError(f"--text must hold at least 2 tokens, got {len(ids)}: {text!r}")
    if padded_text is None:
        padded_text = tokenizer.decode(ids[: min(len(ids), max_tokens) // 2])
    return [text, padded_text]


def _draw(
    weights: Tensor,
    batch: TextBatch,
    padding_weight: float,
    diversity: list[LayerDiversity],
    heads: list[HeadStats],
    layers: list[LayerStats],
    options: Options,
    out: Path,
) -> Images:
    """Heatmaps per layer of the first text, every layer of the most padded text, the two summaries."""
    # Imported here: matplotlib is the `inspect` extra; without it `textgen-export` must still start.
    from export.inspection import plots

    allowed = batch.allowed()
    attention = [
        plots.layer_heatmaps(w[0], allowed[0], batch.labels[0], layer, out / f"attention_layer{layer}.png")
        for layer, w in enumerate(weights)
    ]
    row = batch.lengths.index(min(batch.lengths))
    padded = plots.padding_heatmaps(
        weights[:, row], allowed[row], batch.labels[row], padding_weight, out / "attention_padded.png"
    )
    summary = plots.diversity_summary(diversity, heads, options.min_jsd, out / "diversity.png")
    return Images(attention, padded, summary, plots.layer_stats_plot(layers, out / "layers.png"))


def inspect_checkpoint(
    checkpoint: Checkpoint, source: str, text: str, padded_text: str | None, out: Path, options: Options
) -> Findings:
    """Compute everything, draw the pictures and write out/index.html."""
    _check(options, checkpoint.config.context_length)
    model, tokenizer = checkpoint.model, checkpoint.tokenizer
    texts = texts_to_inspect(tokenizer, text, padded_text, options.max_tokens)
    batch = encode_texts(tokenizer, texts, options.max_tokens)
    weights = record_attention(model, batch)  # [L,B,H,S,S]
    diversity = layer_diversity(weights, batch, options.min_jsd)
    heads = head_stats(weights, batch)
    layers = residual_stats(model, batch, options.jump)
    padding_weight = weight_on_padding(weights, batch)
    out.mkdir(parents=True, exist_ok=True)
    images = _draw(weights, batch, padding_weight, diversity, heads, layers, options, out)
    first_text = batch.input_ids[0, batch.attention_mask[0].bool()].tolist()
    findings = Findings(
        source=source,
        texts=texts,
        truncated=batch.truncated,
        recompute=recompute_errors(model, batch),
        padding_weight=padding_weight,
        diversity=diversity,
        min_jsd=options.min_jsd,
        heads=heads,
        layers=layers,
        jump=options.jump,
        neighbours=nearest_neighbours(
            model, tokenizer, probe_tokens(first_text, tokenizer, options.probes), NEIGHBOURS_PER_TOKEN
        ),
        images=images,
    )
    write_index(findings, out)
    return findings
