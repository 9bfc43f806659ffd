"""The engine's start-up memory: a bundle whose weights outweigh the process's fixed cost, and, run as a
script, a process that opens a bundle's engine as the engine process does and reports its memory.

    python tests/support/startup_memory.py BUNDLE [strip|keep]   # one line of JSON

`strip` or `keep` answers the engine's question whether this CPU computes a lone row as in a batch
(serve/engine/row_pad.py probes the CPU): the engine then takes a padded graph's row pads out (the start-up
path that rewrites the graph) or keeps them, on every machine alike.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# A padded INT4 serving graph of ~24 MB in one layer: its weights, not the process's fixed ~100 MB, must
# decide what holding them once or several times costs.
WIDE = {"d_model": 1024, "n_layers": 1, "n_heads": 8, "d_ff": 16384}


def wide_int4_bundle(tiny: Path, out: Path) -> Path:
    """A padded INT4 bundle (block 32, odd rows padded as export pads them) of a wide one-layer decoder with
    random weights and the tiny bundle's tokenizer and vocabulary, written in seconds: neither traced nor
    verified. Its standard graph is a copy of the serving graph (the engine opens only the serving graph
    at start); the memory it takes to start is what is tested, not its tokens."""
    import torch
    from tokenizers import Tokenizer

    from export.bundle_writer import BundleStage
    from export.model import Decoder, DecoderConfig
    from export.onnx_inplace import OPSET, build_inplace_graph
    from export.pipeline import INPLACE_FILE, STANDARD_FILE, ExportOptions, Precision, _manifest_fields
    from export.quantize import quantize_nbits
    from export.tokenizer import tokenizer_to_json
    from serve.bundle import load_bundle

    tiny_cfg = load_bundle(tiny).manifest.architecture
    cfg = DecoderConfig(vocab_size=tiny_cfg.vocab_size, context_length=tiny_cfg.context_length, **WIDE)
    torch.manual_seed(0)
    options = ExportOptions("wide-int4", precision=Precision("int4"), progress=False)
    assert options.precision.block is not None
    graph, _ = quantize_nbits(build_inplace_graph(Decoder(cfg).eval(), None), 4, options.precision.block)
    with BundleStage(out) as stage:
        specs = {
            "standard": stage.add_graph(STANDARD_FILE, graph, OPSET),
            "inplace": stage.add_graph(INPLACE_FILE, graph, OPSET),
        }
        stage.add_tokenizer(tokenizer_to_json(Tokenizer.from_file(str(tiny / "tokenizer.json"))))
        stage.write_manifest(_manifest_fields(cfg, options, dict(specs)))
        stage.commit()
    return out


def main(bundle: Path, row_pads: str | None) -> dict[str, float]:
    """Open the bundle's engine (warmed up) as the engine process does; the resident memory before, once
    ready, and at the peak (VmHWM), in MiB, and the KV cache's MiB."""
    from serve.bundle import load_bundle
    from serve.engine import row_pad
    from serve.engine.engine import open_engine
    from serve.engine.runtime import onnxruntime
    from serve.engine.types import EngineSettings, SessionConfig
    from serve.process import resident_memory

    if row_pads is not None:
        row_pad.lone_row_exact = lambda shape, config, seed=0: row_pads == "strip"  # type: ignore[assignment]
    onnxruntime()  # imported by the engine process before its engine too
    loaded = load_bundle(bundle)
    before = resident_memory()[0]
    engine = open_engine(loaded, EngineSettings(max_batch_size=4, session=SessionConfig(threads=1)))
    ready, peak = resident_memory()
    mib = 2**20
    return {"before": before / mib, "ready": ready / mib, "peak": peak / mib, "kv": engine.kv_bytes / mib}


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else None)))
