"""`textgen-export`: checkpoint -> verified, servable bundle, and the tools around it.

    textgen-export onnx --checkpoint CKPT --out DIR [--int8 | --fp16] [--opset N] [--name NAME]
                   [--chat-template FILE]        a Jinja chat template (transformers') for chat requests
    textgen-export hf --model DIR|HUB_ID --out DIR [--int8 | --fp16] [--opset N] [--name NAME]
                                                     a Hugging Face model, verified against transformers
    textgen-export demo [--out DIR]                  train the demo model if missing, then export it
    textgen-export verify DIR [--checkpoint CKPT | --hf-model DIR|HUB_ID]
                                                     rerun the checks on a bundle, print the report
    textgen-export random --preset bench-a --out DIR random weights, for speed benchmarks
    textgen-export inspect ...                       attention heatmaps etc. (export.inspection)

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
from export.model import Decoder, DecoderConfig
from export.onnx_standard import DEFAULT_OPSET, MIN_OPSET
from export.pipeline import (
    PRESETS,
    ExportOptions,
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


def cmd_onnx(args: argparse.Namespace) -> int:
    options = ExportOptions(
        model_name=args.name or args.checkpoint.stem,
        opset=args.opset,
        int8=args.int8,
        fp16=args.fp16,
        source=checkpoint_source(args.checkpoint) if args.checkpoint.is_file() else None,
        chat_template=args.chat_template.read_text(encoding="utf-8") if args.chat_template else None,
    )
    _print_result(export_checkpoint(args.checkpoint, args.out, options))
    return 0


def cmd_hf(args: argparse.Namespace) -> int:
    bundle = export_hf(args.model, args.out, name=args.name, int8=args.int8, fp16=args.fp16, opset=args.opset)
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
    fp32 decoder of it only for an INT8 bundle, whose accuracy is measured against it."""
    from export.hf_verify import transformers_reference

    folder = locate_model(spec)
    _, config = decoder_config(folder)
    detail = _mismatch(config, bundle)
    if detail:
        raise HFImportError(folder, f"does not match the bundle at {bundle.root} ({detail})")
    model = load_model(folder)[1] if bundle.manifest.quantization == "int8" else None
    return model, transformers_reference(folder)


def cmd_verify(args: argparse.Namespace) -> int:
    bundle = load_bundle(args.bundle)
    model, against = None, None
    if args.checkpoint:
        model = _checkpoint_model(args.checkpoint, bundle)
    elif args.hf_model:
        model, against = _hf_reference(args.hf_model, bundle)
    report = verify_bundle(bundle, model, against)
    print(format_report(report))
    if not report["passed"]:
        print(f"textgen-export verify: {args.bundle} FAILED verification", file=sys.stderr)
        return 1
    return 0


def cmd_random(args: argparse.Namespace) -> int:
    _print_result(random_bundle(args.preset, args.out, seed=args.seed, int8=args.int8))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="textgen-export", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    onnx = sub.add_parser("onnx", help="export a checkpoint to a verified bundle")
    onnx.add_argument("--checkpoint", type=Path, required=True, help="checkpoint file (textgen-checkpoint)")
    onnx.add_argument("--out", type=Path, required=True, help="bundle directory to write")
    precision = onnx.add_mutually_exclusive_group()
    precision.add_argument("--int8", action="store_true", help="dynamic INT8 weights (CPU serving)")
    precision.add_argument("--fp16", action="store_true", help="float16 graphs (CUDA/TensorRT)")
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
    hf_precision = hf.add_mutually_exclusive_group()
    hf_precision.add_argument("--int8", action="store_true", help="dynamic INT8 weights (CPU serving)")
    hf_precision.add_argument("--fp16", action="store_true", help="float16 graphs (CUDA/TensorRT)")
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
    verify.set_defaults(handler=cmd_verify)

    rand = sub.add_parser("random", help="a bundle with random weights, for speed benchmarks")
    rand.add_argument("--preset", choices=sorted(PRESETS), required=True)
    rand.add_argument("--out", type=Path, required=True)
    rand.add_argument("--int8", action="store_true")
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
