"""Checks run on every export (and by `textgen-export verify`): parity, batch invariance, no NaN.

Reference: a `Reference` when one is given (transformers, for a model imported from Hugging Face:
export/hf_verify.py), else the PyTorch model when a checkpoint is at hand, else the bundle's own standard
graph (then only the serving graph is compared against it). Each check drives a greedy generation over a
fixed, left-padded prompt set: a prefill, then `DECODE_STEPS` decode steps.

Tolerance (float32): 1e-4 on the logits while they stay within +-`TOLERANCE_LOGIT_SCALE`; beyond that (large
models, whose logits and rounding grow together) 1e-4 x max|logit| / `TOLERANCE_LOGIT_SCALE`: float32
rounding is relative. The report records the reference's largest logit and the tolerance applied.

- Standard graph: our own ONNX Runtime loop with concatenated caches, teacher-forced on the reference's
  tokens so every step compares logits of the same inputs; max |logits diff| over real (non-padding)
  positions, greedy tokens identical, all outputs finite (padded rows included), and batch invariance
  (each prompt generated alone gives the tokens it got in the batch).
- Serving graph: through the serving `Engine` (right-padded slots, in-place cache); `last_logits` of each
  step against the reference, while the engine's own greedy tokens still agree with it; and batch
  invariance (each prompt alone in the engine gets the tokens it got in the batch).

Batch invariance is required of every bundle whose weight format ONNX Runtime computes row by row (float,
MatMulNBits, odd row counts padded past export.quantize.INVARIANT_MAX_BLOCK) on the graph the server
runs (the standard graph's too for float bundles); for dynamic INT8 it is measured and reported, and the
manifest's `batch_invariant` says false. Quantized bundles are judged on accuracy against the fp32 model
(held-out perplexity within 2% for 8 bits; reported only for 4 bits).
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch

from export.generation import (
    DECODE_STEPS,
    Generation,
    Shape,
    StepFn,
    agreement_prefix,
    encode_prompts,
    greedy,
    session_step,
    torch_step,
)
from export.model import Decoder
from export.quantize import (
    MAX_PERPLEXITY_RATIO,
    batch_invariant_scheme,
    count_quantized_gathers,
    count_weight_matmuls,
    quantized_accuracy,
)
from serve.bundle import Bundle
from serve.engine.engine import Engine
from serve.engine.runtime import create_session
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence, SessionConfig

FP32_TOLERANCE = 1e-4
FP16_TOLERANCE = 5e-2
TOLERANCE_LOGIT_SCALE = 50.0  # logits up to this size get the fixed tolerance; larger ones a relative one
VERIFY_THREADS = 2


@dataclass(frozen=True)
class Reference:
    """What a bundle is checked against, other than our own PyTorch decoder: `generate(prompts, pad_id)`
    gives the reference's greedy `Generation` of the prompt set (left-padded layout, DECODE_STEPS tokens)."""

    name: str
    generate: Callable[[Sequence[Sequence[int]], int], Generation]


class VerificationFailed(Exception):
    """The exported graphs do not match the model; the report says which check failed."""

    def __init__(self, report: dict[str, Any]) -> None:
        failed = ", ".join(report.get("failed", [])) or "unknown"
        super().__init__(f"verification failed: {failed}")
        self.report = report


def max_logit_diff(ref: Generation, cand: Generation) -> float:
    """Max |diff| over the real (non-padding) prompt positions and every decode step."""
    real = ref.prompt_mask.astype(bool)
    prefill = float(np.abs(ref.logits[0][real] - cand.logits[0][real]).max())
    steps = zip(ref.logits[1:], cand.logits[1:], strict=True)
    return max([prefill] + [float(np.abs(r - c).max()) for r, c in steps])


def batch_invariant(
    step: StepFn, prompts: Sequence[Sequence[int]], pad_id: int, shape: Shape, dtype: type = np.float32
) -> bool:
    together = greedy(step, prompts, pad_id, shape, dtype=dtype).tokens
    alone = [greedy(step, [p], pad_id, shape, dtype=dtype).tokens[0] for p in prompts]
    return bool(np.array_equal(together, np.stack(alone)))


def check_standard(
    session: ort.InferenceSession,
    reference: Generation,
    prompts: Sequence[Sequence[int]],
    pad_id: int,
    shape: Shape,
    dtype: type = np.float32,
) -> dict[str, Any]:
    step = session_step(session)
    cand = greedy(step, prompts, pad_id, shape, forced=reference.tokens, dtype=dtype)
    return {
        "max_abs_logits_diff": max_logit_diff(reference, cand),
        "greedy_identical": bool(np.array_equal(cand.own, reference.tokens)),
        "greedy_token_agreement": float((cand.own == reference.tokens).mean()),
        "finite": cand.finite,
        "batch_invariant": batch_invariant(step, prompts, pad_id, shape, dtype),
    }


def engine_greedy(
    engine: Engine, prompts: Sequence[Sequence[int]], steps: int
) -> tuple[np.ndarray, list[np.ndarray]]:
    """The engine's greedy tokens [B, 1 + steps] of `prompts` batched together, and each step's logits."""
    ids = [f"verify-{i}" for i in range(len(prompts))]
    outs = engine.prefill([NewSequence(i, p, SamplingParams()) for i, p in zip(ids, prompts, strict=True)])
    logits = [engine.last_logits.copy()]
    tokens = [[o.token_id for o in outs]]
    for _ in range(steps):
        outs = engine.decode()
        logits.append(engine.last_logits.copy())
        tokens.append([o.token_id for o in outs])
    engine.release(ids)
    return np.array(tokens).T, logits


def check_engine(bundle: Bundle, reference: Generation, prompts: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The serving graph through the engine: right-padded slots, in-place cache, the engine's own greedy."""
    # KV rows as long as the check needs, not the model's context: the engine zero-fills every row, and at
    # 32k tokens five rows of a 0.5B model are 4 GB.
    needed = max(len(p) for p in prompts) + len(reference.logits) + 1
    settings = EngineSettings(
        max_batch_size=len(prompts),
        capacity=max(2, min(needed, bundle.manifest.architecture.context_length)),
        session=SessionConfig(providers=("cpu",), threads=VERIFY_THREADS),
    )
    engine = Engine.from_bundle(bundle, settings)
    steps = len(reference.logits) - 1
    own, logits = engine_greedy(engine, prompts, steps)
    alone = np.concatenate([engine_greedy(engine, [p], steps)[0] for p in prompts])
    agree = agreement_prefix(reference.tokens, own)
    # Compare a step's logits only while the row has been fed the reference's tokens so far.
    fed_same = np.concatenate([np.ones((len(prompts), 1), bool), agree[:, :-1]], axis=1)
    diffs = [np.abs(reference.logits[0][:, -1] - logits[0]).max()] + [
        np.abs(reference.logits[t][fed_same[:, t]] - logits[t][fed_same[:, t]]).max(initial=0.0)
        for t in range(1, len(logits))
    ]
    return {
        "max_abs_logits_diff": float(max(diffs)),
        "greedy_identical": bool(np.array_equal(own, reference.tokens)),
        "greedy_token_agreement": float((own == reference.tokens).mean()),
        "finite": bool(all(np.isfinite(x).all() for x in logits)),
        "batch_invariant": bool(np.array_equal(own, alone)),
        "providers": engine.providers,
    }


def versions() -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnx": version("onnx"),
        "onnxruntime": ort.__version__,
        "tokenizers": version("tokenizers"),
        "transformers": version("transformers"),
        "textgen-serving": version("textgen-serving"),
    }


def tolerance_for(base: float, logit_scale: float) -> float:
    """`base`, scaled up for logits larger than TOLERANCE_LOGIT_SCALE (float rounding is relative)."""
    return base * max(1.0, logit_scale / TOLERANCE_LOGIT_SCALE)


def logit_scale(reference: Generation) -> float:
    """The largest |logit| of the reference over real prompt positions and decode steps."""
    real = reference.prompt_mask.astype(bool)
    steps = [float(np.abs(x).max()) for x in reference.logits[1:]]
    return max([float(np.abs(reference.logits[0][real]).max()), *steps])


def invariance_judged(report: dict[str, Any], quantization: str) -> list[str]:
    """The graphs whose batch invariance counts: both for float bundles, the serving graph of a quantized one.
    The standard graph left-pads, so a row alone has another padded length and its float rounding differs at
    1e-5; quantizing activations per row amplifies that to 1e-2 (`textgen-bench batch-invariance` measures the
    serving graph, whose rows are computed alike whatever the batch): exact there, reported here."""
    graphs: list[str] = [g for g in ("standard", "inplace") if g in report]
    return ["inplace"] if quantization != "none" and "inplace" in graphs else graphs


def _failures(report: dict[str, Any], quantization: str) -> list[str]:
    failed: list[str] = []
    tolerance = report["tolerance"]
    for graph in ("standard", "inplace"):
        r = report.get(graph)
        if r is None:
            continue
        failed += [f"{graph}: NaN/Inf in outputs"] * (not r["finite"])
        if report["batch_invariance_required"] and graph in invariance_judged(report, quantization):
            failed += [f"{graph}: batch invariance"] * (not r.get("batch_invariant", True))
        if tolerance is not None:  # quantized bundles are judged on accuracy instead
            if r["max_abs_logits_diff"] > tolerance:
                failed.append(f"{graph}: max |logits diff| {r['max_abs_logits_diff']:.2e} > {tolerance:.1e}")
            failed += [f"{graph}: greedy tokens differ from the reference"] * (not r["greedy_identical"])
    quant = report.get(quantization, {})
    limit = quant.get("max_perplexity_ratio")
    if limit is not None and quant.get("perplexity_ratio", 0.0) > limit:
        failed.append(f"{quantization}: perplexity {quant['perplexity_ratio']:.3f}x fp32 > {limit}x")
    if quant.get("float_weight_matmuls"):
        failed.append(f"{quantization}: {quant['float_weight_matmuls']} weight MatMul(s) left unquantized")
    return failed


def _quantized_report(
    bundle: Bundle,
    session: ort.InferenceSession,
    model: Decoder | None,
    shape: Shape,
    eval_text: str | None,
) -> dict[str, Any]:
    graphs = {
        role: onnx.load(str(path), load_external_data=False)
        for role, path in (("standard", bundle.standard_graph), ("inplace", bundle.inplace_graph))
        if path is not None
    }
    counts = {role: count_weight_matmuls(graph) for role, graph in graphs.items()}
    m = bundle.manifest
    report: dict[str, Any] = {
        "block_size": m.quantization_block_size,  # None: dynamic INT8
        "weight_matmuls": counts,
        "quantized_embeddings": {role: count_quantized_gathers(graph) for role, graph in graphs.items()},
        "float_weight_matmuls": sum(c["float"] for c in counts.values()),
        # 8 bits must keep the model's quality; 4 bits trades some for size and speed: reported only.
        "max_perplexity_ratio": MAX_PERPLEXITY_RATIO if m.quantization == "int8" else None,
    }
    if model is None:
        report["accuracy"] = "not measured: needs the fp32 model (--checkpoint or --hf-model)"
        return report
    return report | quantized_accuracy(
        torch_step(model),
        session_step(session),
        bundle.tokenizer,
        shape,
        m.pad_token_id,
        m.architecture.context_length,
        eval_text,
    )


def verify_bundle(
    bundle: Bundle,
    model: Decoder | None = None,
    against: Reference | None = None,
    eval_text: str | None = None,
) -> dict[str, Any]:
    """Run the checks on `bundle` against `against`, else `model`, else its own standard graph, and return
    the report. `model` (the fp32 decoder) is what a quantized bundle's accuracy is measured against, on
    `eval_text` (default: the stdlib's held-out split)."""
    m = bundle.manifest
    arch = m.architecture
    shape = Shape(arch.n_layers, arch.n_kv_heads, arch.head_dim)
    prompts = encode_prompts(bundle.tokenizer, arch.context_length)
    np_dtype = np.float16 if m.dtype == "float16" else np.float32
    if model is not None:
        model = model.eval()
    if against is not None:
        reference_name = against.name
        reference = against.generate(prompts, m.pad_token_id)  # before the sessions: its model is freed
    elif model is not None:
        reference_name = "pytorch"
        reference = greedy(torch_step(model), prompts, m.pad_token_id, shape)
    session = create_session(bundle.standard_graph, SessionConfig(providers=("cpu",), threads=VERIFY_THREADS))
    if against is None and model is None:
        reference_name = "standard graph"
        reference = greedy(session_step(session), prompts, m.pad_token_id, shape, dtype=np_dtype)
    scale = logit_scale(reference)
    base = {"float32": FP32_TOLERANCE, "float16": FP16_TOLERANCE}[m.dtype]
    report: dict[str, Any] = {
        "reference": reference_name,
        "prompts": len(prompts),
        "decode_steps": DECODE_STEPS,
        "reference_max_abs_logit": scale,
        "tolerance": tolerance_for(base, scale) if m.quantization == "none" else None,
        "standard": check_standard(session, reference, prompts, m.pad_token_id, shape, np_dtype),
    }
    bits = {"int8": 8, "int4": 4}.get(m.quantization)
    if bits is not None:
        report[m.quantization] = _quantized_report(bundle, session, model, shape, eval_text)
    del session  # one graph's weights in memory at a time: the engine loads the serving graph's
    if bundle.inplace_graph is not None and m.dtype == "float32":
        report["inplace"] = check_engine(bundle, reference, prompts)
    elif bundle.inplace_graph is not None:
        # A float16 serving graph targets CUDA; ONNX Runtime's CPU kernels are not what it is checked for.
        report["notes"] = [
            "float16 serving graph not run on CPU: check it with textgen-bench gpu-check on a GPU"
        ]
    report["batch_invariance_required"] = batch_invariant_scheme(bits, m.quantization_block_size)
    judged = report["batch_invariance_judged"] = invariance_judged(report, m.quantization)
    report["batch_invariant"] = all(report[g]["batch_invariant"] for g in judged)
    report["failed"] = _failures(report, m.quantization)
    report["passed"] = not report["failed"]
    report["versions"] = versions()
    report["files"] = {name: bundle.path(name).stat().st_size for name in m.files()}
    report["opset"] = m.graphs.standard.opset
    return report


def _graph_line(label: str, r: dict[str, Any], judged: bool = True) -> str:
    agreement = r["greedy_token_agreement"]
    marks = [
        f"max |logits diff| {r['max_abs_logits_diff']:.1e}",
        "greedy identical" if r["greedy_identical"] else f"greedy agreement {agreement:.0%}",
        "finite" if r["finite"] else "NaN/Inf!",
    ]
    if "batch_invariant" in r:
        unjudged = " (reported only: this graph left-pads, docs/architecture.md)" * (not judged)
        marks.append("batch invariant" if r["batch_invariant"] else "NOT batch invariant" + unjudged)
    if "providers" in r:
        marks.append("/".join(r["providers"]))
    return f"  {label:<15}" + ", ".join(marks)


def _quantized_lines(name: str, r: dict[str, Any]) -> list[str]:
    counts = ", ".join(
        f"{role} {c['quantized']}/{c['quantized'] + c['float']}" for role, c in r["weight_matmuls"].items()
    )
    scheme = f"MatMulNBits, block {r['block_size']}" if r.get("block_size") else "dynamic"
    embeddings = ", ".join(f"{role} {n}" for role, n in r.get("quantized_embeddings", {}).items())
    lines = [f"  {name:<15}weight MatMuls quantized ({scheme}): {counts}; embeddings quantized: {embeddings}"]
    if "perplexity_ratio" not in r:
        return [*lines, f"  {name + ' accuracy':<15}{r['accuracy']}"]
    limit = r["max_perplexity_ratio"]
    return [
        *lines,
        f"  {name + ' accuracy':<15}perplexity fp32 {r['fp32_perplexity']:.3f} {name} "
        f"{r['quantized_perplexity']:.3f} (x{r['perplexity_ratio']:.4f}, "
        f"{f'limit x{limit}' if limit is not None else 'reported, no limit'}) on {r['heldout_tokens']} "
        f"tokens of {r['heldout_text']}; max |logits diff| {r['max_abs_logits_diff']:.2f}; top-1 agreement "
        f"{r['top1_agreement']:.1%}; greedy: {r['greedy_identical_prompts']}/{r['greedy_prompts']} prompts "
        f"identical over {r['greedy_steps']} tokens, prefix agreement {r['greedy_prefix_agreement']:.1%}",
    ]


def format_report(report: dict[str, Any]) -> str:
    """The report as a few readable lines (the full figures are in the manifest)."""
    verdict = "PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failed"])
    tolerance = report["tolerance"]
    judged = f"max |logits diff| <= {tolerance:.1e}" if tolerance is not None else "judged on accuracy"
    if tolerance is not None and "reference_max_abs_logit" in report:
        judged += f" (logits up to {report['reference_max_abs_logit']:.1f})"
    lines = [
        f"verification against {report['reference']} ({report['prompts']} left-padded prompts, prefill + "
        f"{report['decode_steps']} decode steps, {judged}): {verdict}",
        _graph_line(
            "standard graph",
            report["standard"],
            "standard" in report.get("batch_invariance_judged", ["standard"]),
        ),
    ]
    if "inplace" in report:
        lines.append(_graph_line("serving graph", report["inplace"]))
    lines += [
        line for name in ("int8", "int4") if name in report for line in _quantized_lines(name, report[name])
    ]
    if "batch_invariance_required" in report and not report["batch_invariance_required"]:
        lines.append(
            "  note           batch invariance not guaranteed by this weight format (reported, not "
            "required): a request's tokens may depend on what it is batched with"
        )
    lines += [f"  note           {note}" for note in report.get("notes", [])]
    files = ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in report["files"].items())
    v = report["versions"]
    lines += [
        f"  files          {files}",
        f"  versions       opset {report['opset']}, torch {v['torch']}, onnx {v['onnx']}, "
        f"onnxruntime {v['onnxruntime']}, python {v['python']}",
    ]
    return "\n".join(lines)
