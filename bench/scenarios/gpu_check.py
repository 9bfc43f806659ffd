"""GPU checks of bundles in one go: TensorRT and CUDA sessions against CPU, and decode timing. Prints JSON.

Needs a machine with a GPU and onnxruntime-gpu (the `gpu` extra, not `cpu`):

    textgen-export onnx --checkpoint CKPT --out b32            # or: textgen-export demo --out b32
    textgen-export onnx --checkpoint CKPT --out b16 --fp16
    textgen-bench gpu-check b32 b16 [--steps 64] [--batches 1 8]

For each bundle and each GPU provider (TensorRT with the bundle's profile, engine cache and precision flags;
CUDA) it runs the standard graph on the fixed prompt set (export.generation, left-padded, prefill + decode)
and compares logits and greedy tokens with the fp32 CPU run of the first bundle; then times greedy decode at
each batch size. The fp32 bundle's in-place serving graph also runs through the engine on CUDA, which must
keep its KV cache in CUDA memory (every KV OrtValue reports device "cuda") and move a released row's cache
on the device (the last row's K/V land bit for bit in the freed row); the exit status is 1 when that check
fails. Not run in CI (no GPU there).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from export.generation import Generation, Shape, encode_prompts, greedy, session_step
from export.verify import max_logit_diff
from serve.bundle import Bundle, load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence, SessionConfig

GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def _session(bundle: Bundle, provider: str, cache_root: Path) -> ort.InferenceSession:
    chain: list[str | tuple[str, dict[str, str]]] = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if provider == "TensorrtExecutionProvider":
        chain.insert(0, (provider, bundle.tensorrt_options(cache_root)))
    return ort.InferenceSession(str(bundle.standard_graph), providers=chain)


def _shape(bundle: Bundle) -> Shape:
    arch = bundle.manifest.architecture
    return Shape(arch.n_layers, arch.n_heads, arch.head_dim)


def _dtype(bundle: Bundle) -> type:
    return np.float16 if bundle.manifest.dtype == "float16" else np.float32


def _parity(reference: Generation, candidate: Generation) -> dict[str, Any]:
    return {
        "max_abs_logits_diff": max_logit_diff(reference, candidate),
        "greedy_token_agreement": float((reference.own == candidate.own).mean()),
        "finite": candidate.finite,
    }


def _decode_tokens_per_second(bundle: Bundle, session: ort.InferenceSession, batch: int, steps: int) -> float:
    context = bundle.manifest.architecture.context_length
    prompts = [encode_prompts(bundle.tokenizer, context, steps)[0]] * batch
    step = session_step(session)
    greedy(step, prompts, bundle.manifest.pad_token_id, _shape(bundle), 2, dtype=_dtype(bundle))  # warm-up
    started = time.perf_counter()
    greedy(step, prompts, bundle.manifest.pad_token_id, _shape(bundle), steps, dtype=_dtype(bundle))
    return round(batch * steps / (time.perf_counter() - started), 1)


def _engine_check(bundle: Bundle, reference: Generation, prompts: list[list[int]]) -> dict[str, Any]:
    settings = EngineSettings(max_batch_size=len(prompts), session=SessionConfig(providers=("cuda",)))
    engine = Engine.from_bundle(bundle, settings)
    outs = engine.prefill([NewSequence(f"g{i}", p, SamplingParams()) for i, p in enumerate(prompts)])
    tokens = [[o.token_id for o in outs]]
    for _ in range(len(reference.logits) - 1):
        tokens.append([o.token_id for o in engine.decode()])
    own = np.array(tokens).T
    devices = sorted(set(engine.kv_buffer_devices()))
    assert devices == ["cuda"], f"the engine's KV cache is not in CUDA memory: {devices}"
    n_layers = bundle.manifest.architecture.n_layers
    layers = [(layer, kind) for layer in range(n_layers) for kind in ("key", "value")]
    last = {lk: engine.kv_host(*lk)[-1] for lk in layers}
    engine.release(["g0"])  # swap-remove: the last row's cache is copied into row 0 on the device
    moved = len(prompts) > 1 and all(np.array_equal(engine.kv_host(*lk)[0], last[lk]) for lk in layers)
    assert moved or len(prompts) == 1, "release() did not move the last row's KV cache into the freed row"
    return {
        "providers": engine.providers,
        "kv_devices": devices,
        "release_moved_kv": moved,
        "greedy_token_agreement": float((own == reference.own).mean()),
    }


def check(bundles: list[Bundle], steps: int, batches: list[int], cache_root: Path) -> dict[str, Any]:
    first = bundles[0]
    prompts = encode_prompts(first.tokenizer, first.manifest.architecture.context_length)
    pad = first.manifest.pad_token_id
    cpu = ort.InferenceSession(str(first.standard_graph), providers=["CPUExecutionProvider"])
    reference = greedy(session_step(cpu), prompts, pad, _shape(first))
    summary: dict[str, Any] = {"onnxruntime": ort.__version__, "available": ort.get_available_providers()}
    for bundle in bundles:
        name = f"{bundle.root.name} ({bundle.manifest.dtype}, {bundle.manifest.quantization})"
        results: dict[str, Any] = {}
        for provider in GPU_PROVIDERS:
            try:
                session = _session(bundle, provider, cache_root)
                gen = greedy(session_step(session), prompts, pad, _shape(bundle), dtype=_dtype(bundle))
                speed = {str(b): _decode_tokens_per_second(bundle, session, b, steps) for b in batches}
                results[provider] = {
                    "session_providers": session.get_providers(),
                    **_parity(reference, gen),
                    "decode_tokens_per_second": speed,
                }
            except Exception as exc:  # report every provider's outcome, not just the first failure
                results[provider] = {"error": f"{type(exc).__name__}: {exc}"}
        if bundle.manifest.dtype == "float32" and bundle.inplace_graph is not None:
            try:
                results["engine_cuda"] = _engine_check(bundle, reference, prompts)
            except Exception as exc:
                results["engine_cuda"] = {"error": f"{type(exc).__name__}: {exc}"}
        summary[name] = results
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bundles", nargs="+", type=Path, help="bundle dirs; the first is the fp32 reference")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--engine-cache", type=Path, help="TensorRT engine cache root (default: a temp dir)")
    args = parser.parse_args(argv)
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        print(json.dumps({"error": "no CUDAExecutionProvider: install onnxruntime-gpu on a GPU machine"}))
        return 1
    bundles = [load_bundle(b) for b in args.bundles]
    with tempfile.TemporaryDirectory() as tmp:
        summary = check(bundles, args.steps, args.batches, args.engine_cache or Path(tmp))
    json.dump(summary, sys.stdout, indent=2)
    print()
    engine_failed = any("error" in r.get("engine_cuda", {}) for r in summary.values() if isinstance(r, dict))
    return 1 if engine_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
