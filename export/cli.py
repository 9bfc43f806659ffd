"""`textgen-export`: checkpoint -> verified, servable bundle, and the tools around it.

    textgen-export onnx --checkpoint CKPT --out DIR [PRECISION] [--opset N] [--name NAME]
                   [--chat-template FILE]        a Jinja chat template (transformers') for chat requests
    textgen-export hf --model DIR|HUB_ID --out DIR [PRECISION] [--opset N] [--name NAME]
                                                     a Hugging Face model, verified against transformers
    textgen-export demo [--out DIR]                  train the demo model if missing, then export it
    textgen-export verify DIR [--checkpoint CKPT | --hf-model DIR|HUB_ID] [--eval-text FILE]
                                                     rerun the checks on a bundle, print the report
    textgen-export random --preset bench-a --out DIR [PRECISION]
                                                     random weights, for speed benchmarks
    textgen-export inspect ...                       attention heatmaps etc. (export.inspection)

PRECISION: one of --int8 (8-bit MatMulNBits, batch invariant), --int4 (4-bit, embedding and head too),
--int8-dynamic (dynamic INT8: fastest at large batches, not batch invariant), --fp16 (CUDA/TensorRT; not
for random); --block-size N for --int8/--int4 (weights per scale); --eval-text FILE: the held-out text
a quantized bundle's perplexity is measured on (default: the stdlib files the demo model never saw).

A user error (missing file, wrong checkpoint, bad option, failed verification) prints one line saying what
was wrong and what to do, and exits 1; argparse usage errors exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from pathlib import Path

from export.checkpoint import CheckpointError, load_checkpoint
from export.demo import demo_bundle_path
from export.hf_import import SUPPORTED_ARCHITECTURES, HFImportError, decoder_config, load_model, locate_model
from export.lora import LoraOptions
from export.model import Decoder, DecoderConfig
from export.onnx_standard import DEFAULT_OPSET, MIN_OPSET
from export.pipeline import (
    PRESETS,
    ExportOptions,
    Precision,
    PrecisionKind,
    checkpoint_source,
    ensure_demo_bundle,
    export_checkpoint,
    export_hf,
    random_bundle,
)
from export.verify import Reference, VerificationFailed, format_report, verify_bundle
from serve.bundle import Bundle, load_bundle
from serve.errors import BundleError

USER_ERRORS = (CheckpointError, HFImportError, BundleError, FileExistsError, FileNotFoundError, ValueError)


def _print_result(bundle: Bundle) -> None:
    print(format_report(bundle.manifest.verification))
    print(f"bundle written to {bundle.root} (serve it with: textgen-serve --bundle {bundle.root})")


PRECISION_FLAGS: dict[str, PrecisionKind] = {
    "int8": "int8",
    "int8_dynamic": "int8-dynamic",
    "int4": "int4",
    "fp16": "fp16",
}


def _precision(args: argparse.Namespace) -> Precision:
    """The one precision flag given (ValueError naming them if several: each is a bundle of its own)."""
    chosen = [kind for flag, kind in PRECISION_FLAGS.items() if getattr(args, flag, False)]
    if len(chosen) > 1:
        flags = " and ".join(f"--{kind}" for kind in chosen)
        raise ValueError(
            f"{flags} each make a bundle of their own (quantized for the CPU, fp16 for the GPU); choose one"
        )
    return Precision(chosen[0] if chosen else "fp32", args.block_size)


def _lora(args: argparse.Namespace) -> LoraOptions | None:
    if not args.lora_slots:
        if args.max_lora_rank is not None or args.lora_target_modules:
            raise ValueError("--max-lora-rank and --lora-target-modules need --lora-slots")
        return None
    if args.max_lora_rank is None:
        raise ValueError("--lora-slots needs --max-lora-rank: the largest adapter rank a slot holds")
    targets = tuple(t for t in (args.lora_target_modules or "").split(",") if t)
    return LoraOptions(args.lora_slots, args.max_lora_rank, targets)


def _add_lora(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("LoRA slots (serve any mix of adapters in one batch)")
    group.add_argument("--lora-slots", type=int, default=0, help="adapters resident at once (default: none)")
    group.add_argument("--max-lora-rank", type=int, help="the largest adapter rank a slot holds")
    group.add_argument(
        "--lora-target-modules",
        help="comma-separated module names that get a branch (q_proj,v_proj,...; default: every projection)",
    )


def _eval_text(args: argparse.Namespace) -> str | None:
    return args.eval_text.read_text(encoding="utf-8") if args.eval_text else None


def cmd_onnx(args: argparse.Namespace) -> int:
    options = ExportOptions(
        model_name=args.name or args.checkpoint.stem,
        opset=args.opset,
        precision=_precision(args),
        source=checkpoint_source(args.checkpoint) if args.checkpoint.is_file() else None,
        chat_template=args.chat_template.read_text(encoding="utf-8") if args.chat_template else None,
        eval_text=_eval_text(args),
        lora=_lora(args),
    )
    _print_result(export_checkpoint(args.checkpoint, args.out, options))
    return 0


def cmd_hf(args: argparse.Namespace) -> int:
    bundle = export_hf(
        args.model,
        args.out,
        name=args.name,
        precision=_precision(args),
        opset=args.opset,
        eval_text=_eval_text(args),
        lora=_lora(args),
    )
    _print_result(bundle)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    bundle, exported = ensure_demo_bundle(args.out)
    if exported:
        _print_result(bundle)
    else:
        print(f"demo bundle at {bundle.root} is up to date with its checkpoint; nothing to do")
    return 0


def _mismatch(config: DecoderConfig, bundle: Bundle) -> str | None:
    """How `config` differs from the bundle's architecture ("n_layers 3 vs 2, ..."), None if it does not."""
    arch = bundle.manifest.architecture.model_dump()
    # The config's derived sizes (n_kv_heads 0: as many as the heads), as the manifest records them.
    fields = {**config.to_dict(), "n_kv_heads": config.kv_heads, "head_dim": config.head_dim}
    mismatched = {k: (v, arch[k]) for k, v in fields.items() if k in arch and arch[k] != v}
    return ", ".join(f"{k} {c} vs {b}" for k, (c, b) in mismatched.items()) or None


def _checkpoint_model(checkpoint: Path, bundle: Bundle) -> Decoder:
    ckpt = load_checkpoint(checkpoint)
    detail = _mismatch(ckpt.config, bundle)
    if detail:
        raise CheckpointError(checkpoint, f"does not match the bundle at {bundle.root} ({detail})")
    return ckpt.model


def _hf_reference(spec: str, bundle: Bundle) -> tuple[Decoder | None, Reference]:
    """transformers' model of the folder as the reference, as `textgen-export hf` verifies at write time; our
    fp32 decoder of it only for a quantized bundle, whose accuracy is measured against it."""
    from export.hf_verify import transformers_reference

    folder = locate_model(spec)
    _, config = decoder_config(folder)
    detail = _mismatch(config, bundle)
    if detail:
        raise HFImportError(folder, f"does not match the bundle at {bundle.root} ({detail})")
    model = load_model(folder)[1] if bundle.manifest.quantization != "none" else None
    return model, transformers_reference(folder)


def cmd_verify(args: argparse.Namespace) -> int:
    bundle = load_bundle(args.bundle)
    bundle.check_files()  # every file, the graphs included, before any check runs
    model, against = None, None
    if args.checkpoint:
        model = _checkpoint_model(args.checkpoint, bundle)
    elif args.hf_model:
        model, against = _hf_reference(args.hf_model, bundle)
    report = verify_bundle(bundle, model, against, eval_text=_eval_text(args))
    print(format_report(report))
    if not report["passed"]:
        print(f"textgen-export verify: {args.bundle} FAILED verification", file=sys.stderr)
        return 1
    return 0


def cmd_random(args: argparse.Namespace) -> int:
    precision = _precision(args)
    bundle = random_bundle(
        args.preset, args.out, args.seed, precision, eval_text=_eval_text(args), lora=_lora(args)
    )
    _print_result(bundle)
    return 0


def _add_inspect(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # The inspection package is optional (its own extra, matplotlib); register it only when present.
    if importlib.util.find_spec("export.inspection.cli") is None:
        return
    inspection = importlib.import_module("export.inspection.cli")
    parser = sub.add_parser("inspect", help="attention heatmaps, head diversity and layer statistics")
    inspection.add_arguments(parser)
    parser.set_defaults(handler=inspection.run)


def _opset(text: str) -> int:
    value = int(text)
    if value < MIN_OPSET:
        raise argparse.ArgumentTypeError(f"opset must be >= {MIN_OPSET} (the dynamo exporter's minimum)")
    return value


def _block_size(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def _add_precision(parser: argparse.ArgumentParser, fp16: bool = True) -> None:
    group = parser.add_argument_group("precision (one of; default float32)")
    group.add_argument(
        "--int8", action="store_true", help="8-bit weights, MatMulNBits (CPU; batch invariant)"
    )
    group.add_argument(
        "--int4",
        action="store_true",
        help="4-bit weights, MatMulNBits + a 4-bit embedding (CPU; batch invariant)",
    )
    group.add_argument(
        "--int8-dynamic",
        action="store_true",
        help="dynamic INT8 (CPU; fastest at large batches, NOT batch invariant)",
    )
    if fp16:
        group.add_argument("--fp16", action="store_true", help="float16 graphs (CUDA/TensorRT)")
    group.add_argument(
        "--block-size",
        type=_block_size,
        help="weights per scale for --int8/--int4, a power of two >= 16 (default: 64 for --int8, 32 for "
        "--int4; larger is smaller; past 64 (--int8) and 16 (--int4) odd row counts are padded to even, "
        "which keeps the bundle batch invariant)",
    )
    _add_eval_text(parser)


def _add_eval_text(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--eval-text",
        type=Path,
        help="a text file to measure a quantized bundle's perplexity on (default: the stdlib's held-out "
        "files)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="textgen-export", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    onnx = sub.add_parser("onnx", help="export a checkpoint to a verified bundle")
    onnx.add_argument("--checkpoint", type=Path, required=True, help="checkpoint file (textgen-checkpoint)")
    onnx.add_argument("--out", type=Path, required=True, help="bundle directory to write")
    _add_precision(onnx)
    _add_lora(onnx)
    onnx.add_argument("--opset", type=_opset, default=DEFAULT_OPSET, help=f"default {DEFAULT_OPSET}")
    onnx.add_argument("--name", help="model name in the manifest (default: the checkpoint's file name)")
    onnx.add_argument(
        "--chat-template",
        type=Path,
        help="a file with the Jinja chat template chat requests are rendered with (default: none, no chat)",
    )
    onnx.set_defaults(handler=cmd_onnx)

    hf = sub.add_parser(
        "hf",
        help="export a Hugging Face model (local folder or cached hub id) to a bundle verified against "
        "transformers",
        description=f"Supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}. Nothing is downloaded: "
        "a hub id must be in the local Hugging Face cache (huggingface-cli download ID).",
    )
    hf.add_argument(
        "--model", required=True, help="folder with config.json + safetensors, or a cached hub id"
    )
    hf.add_argument("--out", type=Path, required=True, help="bundle directory to write")
    _add_precision(hf)
    _add_lora(hf)
    hf.add_argument("--opset", type=_opset, default=DEFAULT_OPSET, help=f"default {DEFAULT_OPSET}")
    hf.add_argument("--name", help="model name in the manifest (default: the folder's name or the hub id)")
    hf.set_defaults(handler=cmd_hf)

    demo = sub.add_parser("demo", help="build the demo checkpoint if missing, then export it")
    demo.add_argument("--out", type=Path, default=demo_bundle_path(), help="default: %(default)s")
    demo.set_defaults(handler=cmd_demo)

    verify = sub.add_parser("verify", help="rerun parity, batch-invariance and NaN checks on a bundle")
    verify.add_argument("bundle", type=Path)
    against = verify.add_mutually_exclusive_group()
    against.add_argument("--checkpoint", type=Path, help="compare against this checkpoint's PyTorch model")
    against.add_argument(
        "--hf-model",
        help="compare against transformers' model of this Hugging Face folder (or cached hub id), as "
        "`textgen-export hf` does when it writes the bundle",
    )
    _add_eval_text(verify)
    verify.set_defaults(handler=cmd_verify)

    rand = sub.add_parser("random", help="a bundle with random weights, for speed benchmarks")
    rand.add_argument("--preset", choices=sorted(PRESETS), required=True)
    rand.add_argument("--out", type=Path, required=True)
    _add_precision(rand, fp16=False)
    _add_lora(rand)
    rand.add_argument("--seed", type=int, default=0)
    rand.set_defaults(handler=cmd_random)

    _add_inspect(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except VerificationFailed as exc:
        print(format_report(exc.report))
        print(f"textgen-export: {exc}; the bundle was not written", file=sys.stderr)
    except USER_ERRORS as exc:
        # One line: some causes (torch.load's) append paragraphs of advice that bury the point.
        print(f"textgen-export {args.command}: {str(exc).splitlines()[0]}", file=sys.stderr)
    return 1
