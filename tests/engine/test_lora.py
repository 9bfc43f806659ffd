"""LoRA slots: a bundle exported with them serves peft adapters as peft computes them in PyTorch, any mix of
adapters and the base model in one batch with each request's tokens bit-identical to its tokens alone (fp32,
int8, int4 with its row pads), base requests exactly as without slots, and bad adapters refused by name."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from peft import LoraConfig, get_peft_model
from proposers import Oracle
from pydantic import ValidationError
from quantized_bundles import quantized_graphs

from export.lora import LoraOptions
from export.model import Decoder, DecoderConfig
from export.pipeline import ExportOptions, Precision, export_bundle, write_verified_bundle
from serve.bundle import MANIFEST_FILE, ROW_PAD_PREFIX, Manifest, load_bundle, sha256_file
from serve.engine.engine import Engine
from serve.engine.lora import (
    AdapterError,
    check_graph_inputs,
    read_adapter,
    token_slots,
)
from serve.engine.runtime import SessionConfig
from serve.engine.sampling import SamplingParams
from serve.engine.types import Constraint, EngineSettings, NewSequence, SpeculationSettings, TokenOut
from serve.errors import BundleError
from serve.lora_layout import LORA_POSITIONS_INPUT, LORA_ROWS_INPUT, LORA_TOKENS_INPUT

CONFIG = DecoderConfig(
    vocab_size=320, context_length=128, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=1024,
    positions="rotary", activation="swiglu", norm="rms", qkv_bias=False, out_bias=False, mlp_bias=False,
)  # fmt: skip
SLOTS, RANK = 3, 16
ALL = ["qkv", "out", "up", "down"]
# name -> peft config: ranks, scalings (rsLoRA too) and module sets that differ
ADAPTERS = {
    "a1": LoraConfig(r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False),
    "a2": LoraConfig(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["qkv", "down"], init_lora_weights=False
    ),
    "a3": LoraConfig(r=2, lora_alpha=4, target_modules=["up", "out"], init_lora_weights=False),
}
SESSION = SessionConfig(threads=2, spinning=False)
PRECISIONS = {"fp32": Precision(), "int8": Precision("int8"), "int4": Precision("int4")}  # int4: block 32


@pytest.fixture(scope="module")
def base_model() -> Decoder:
    torch.manual_seed(0)
    return Decoder(CONFIG).eval()


def peft_model(base: Decoder, config: LoraConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return get_peft_model(copy.deepcopy(base), copy.deepcopy(config)).eval()


@pytest.fixture(scope="module")
def adapters(
    base_model: Decoder, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, torch.nn.Module]]:
    """Each of ADAPTERS with random A and B, saved by peft, and its PyTorch model."""
    folder = tmp_path_factory.mktemp("adapters")
    made = {}
    for seed, (name, config) in enumerate(ADAPTERS.items(), start=1):
        model = peft_model(base_model, config, seed)
        model.save_pretrained(folder / name)
        made[name] = (folder / name, model)
    return made


@pytest.fixture(scope="module")
def fp32_bundles(
    base_model: Decoder, tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """The model exported with LoRA slots and without."""
    out = tmp_path_factory.mktemp("lora")
    tokenizer = load_bundle(tiny_bundle).tokenizer
    options = ExportOptions(model_name="lora", progress=False, lora=LoraOptions(SLOTS, RANK))
    lora = export_bundle(base_model, tokenizer, out / "lora-fp32", options).root
    plain = export_bundle(base_model, tokenizer, out / "plain-fp32", replace(options, lora=None)).root
    return lora, plain


def quantized(fp32: Path, base: Decoder, kind: str, out: Path) -> Path:
    bundle = load_bundle(fp32)
    lora = bundle.manifest.lora
    options = ExportOptions(
        model_name=kind,
        progress=False,
        precision=PRECISIONS[kind],
        lora=None if lora is None else LoraOptions(lora.slots, lora.max_rank),
    )
    graphs = quantized_graphs(fp32, PRECISIONS[kind])
    return write_verified_bundle(base, bundle.tokenizer, graphs, out / f"{fp32.name}-{kind}", options).root


@pytest.fixture(scope="module", params=list(PRECISIONS))
def bundles(
    request: pytest.FixtureRequest,
    fp32_bundles: tuple[Path, Path],
    base_model: Decoder,
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, Path]:
    """(with slots, without) at each precision."""
    if request.param == "fp32":
        return fp32_bundles
    out = tmp_path_factory.mktemp(request.param)
    return tuple(quantized(path, base_model, request.param, out) for path in fp32_bundles)  # type: ignore[return-value]


def engine_for(path: Path, adapters: dict[str, tuple[Path, torch.nn.Module]], **settings: object) -> Engine:
    named = tuple((name, str(folder)) for name, (folder, _) in adapters.items())
    return Engine.from_bundle(
        load_bundle(path),
        EngineSettings(max_batch_size=16, session=SESSION, adapters=named, **settings),  # type: ignore[arg-type]
    )


def prompts(count: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(3, CONFIG.vocab_size, size=int(rng.integers(5, 30))).tolist() for _ in range(count)]


def run(engine: Engine, seqs: list[NewSequence], steps: int) -> dict[str, list[TokenOut]]:
    """Every sequence's first `steps` tokens, all of them in one batch."""
    outs: dict[str, list[TokenOut]] = {s.seq_id: [] for s in seqs}
    for out in engine.prefill(seqs):
        outs[out.seq_id].append(out)
    for _ in range(steps - 1):
        for out in engine.decode():
            outs[out.seq_id].append(out)
    engine.release(list(outs))
    return outs


def test_adapters_compute_what_peft_computes(
    fp32_bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]], base_model: Decoder
) -> None:
    engine = engine_for(fp32_bundles[0], adapters)
    references = {name: model for name, (_, model) in adapters.items()} | {"": base_model}
    for prompt in prompts(4):
        ids = torch.tensor([prompt])
        for name, reference in references.items():
            engine.prefill([NewSequence("s", prompt, SamplingParams(), adapter=name)])
            got = engine.last_logits[0].copy()
            engine.release(["s"])
            with torch.no_grad():
                want = reference(ids, torch.ones_like(ids), torch.arange(len(prompt))[None])[0][0, -1].numpy()
            assert np.abs(got - want).max() < 1e-4, name
            if name:  # the adapter does change the model
                assert (
                    np.abs(
                        got
                        - references[""](ids, torch.ones_like(ids), torch.arange(len(prompt))[None])[0][0, -1]
                        .detach()
                        .numpy()
                    ).max()
                    > 1e-2
                )


def test_greedy_decoding_follows_peft(
    fp32_bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    """Decode steps (the KV cache) with an adapter give the logits peft gives over the whole sequence."""
    engine = engine_for(fp32_bundles[0], adapters)
    prompt = prompts(1)[0]
    for name, (_, reference) in adapters.items():
        seq = NewSequence("s", prompt, SamplingParams(), adapter=name)
        tokens = [o.token_id for o in run(engine, [seq], 12)["s"]]
        with torch.no_grad():
            for k in range(1, len(tokens)):
                ids = torch.tensor([prompt + tokens[:k]])
                logits = reference(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])[0][0, -1]
                top2 = torch.topk(logits, 2).values
                if float(top2[0] - top2[1]) > 1e-3:  # a near tie may go either way within the tolerance
                    assert int(logits.argmax()) == tokens[k], (name, k)


def test_each_request_gets_its_tokens_alone_and_in_any_mix_of_adapters(
    bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    """15 requests over the base and three adapters: greedy and seeded tokens and logprobs bit-identical
    alone, among requests of their own adapter, and all mixed together."""
    engine = engine_for(bundles[0], adapters)
    names = ["", *adapters]
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=5)):
        seqs = [
            NewSequence(
                f"r{i}",
                p,
                replace(sampling, seed=sampling.seed and sampling.seed + i),
                logprobs=True,
                adapter=names[i % 4],
            )
            for i, p in enumerate(prompts(15))
        ]
        alone = {s.seq_id: run(engine, [s], 16)[s.seq_id] for s in seqs}
        mixed = run(engine, seqs, 16)
        by_adapter = {}
        for name in names:
            by_adapter |= run(engine, [s for s in seqs if s.adapter == name], 16)
        for seq in seqs:
            want = [(o.token_id, o.logprob) for o in alone[seq.seq_id]]
            assert [(o.token_id, o.logprob) for o in mixed[seq.seq_id]] == want, seq.seq_id
            assert [(o.token_id, o.logprob) for o in by_adapter[seq.seq_id]] == want, seq.seq_id
        outputs = {name: [alone[s.seq_id][-1].token_id for s in seqs if s.adapter == name] for name in names}
        assert len({tuple(v) for v in outputs.values()}) > 1  # the adapters do differ


def test_base_requests_are_what_the_bundle_without_slots_gives(
    bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    with_slots, plain = engine_for(bundles[0], adapters), engine_for(bundles[1], {})
    seqs = [NewSequence(f"r{i}", p, SamplingParams(), logprobs=True) for i, p in enumerate(prompts(5))]
    mixed = [*seqs, NewSequence("other", prompts(6)[5], SamplingParams(), adapter="a1")]
    got, want = run(with_slots, mixed, 16), run(plain, seqs, 16)
    for seq in seqs:
        assert [(o.token_id, o.logprob) for o in got[seq.seq_id]] == [
            (o.token_id, o.logprob) for o in want[seq.seq_id]
        ]


def test_base_only_steps_run_the_branch_free_graph_bit_for_bit_as_steps_beside_adapters(
    bundles: tuple[Path, Path],
    adapters: dict[str, tuple[Path, torch.nn.Module]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """From the prepared graph, a step with no adapter row runs the serving graph without branches: request
    A's tokens and logprobs are the same whether its steps ran there (alone), on the graph with branches
    (beside a request on an adapter, which joins after A's 4th token and leaves after its 8th) or on the
    bundle without slots; the branch-free graph's weights and packed copies are stored once."""
    cache = tmp_path / "compiled"
    engine = engine_for(bundles[0], adapters, compiled_cache=cache)
    assert engine._branch_free is not None
    assert engine_for(bundles[0], adapters)._branch_free is None  # from the bundle: one session
    plain = engine_for(bundles[1], {}, compiled_cache=cache)
    branch_free_runs = []
    run_branch_free = engine._branch_free.run_with_iobinding
    monkeypatch.setattr(
        engine._branch_free, "run_with_iobinding", lambda b: branch_free_runs.append(1) or run_branch_free(b)
    )
    prompt, other = prompts(2)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.9, top_k=50, seed=5)):
        a = NewSequence("a", prompt, sampling, logprobs=True)
        want = [(o.token_id, o.logprob) for o in run(plain, [a], 16)["a"]]
        runs = len(branch_free_runs)
        assert [(o.token_id, o.logprob) for o in run(engine, [a], 16)["a"]] == want
        assert len(branch_free_runs) - runs == 16  # its prefill and 15 decode steps
        got = [(o.token_id, o.logprob) for o in engine.prefill([a])]
        got += [(o.token_id, o.logprob) for _ in range(3) for o in engine.decode()]
        runs = len(branch_free_runs)
        engine.prefill([NewSequence("b", other, sampling, adapter="a1")])
        got += [(o.token_id, o.logprob) for _ in range(4) for o in engine.decode() if o.seq_id == "a"]
        assert len(branch_free_runs) == runs  # steps beside an adapter row ran the graph with branches
        engine.release(["b"])
        got += [(o.token_id, o.logprob) for _ in range(8) for o in engine.decode()]
        assert len(branch_free_runs) - runs == 8
        engine.release(["a"])
        assert got == want
    data = [entry / "weights.data" for entry in cache.iterdir()]
    lora, without_slots = sorted(data, key=lambda path: len(list(path.parent.iterdir())), reverse=True)
    assert (lora.parent / "serving_base.onnx").exists()
    # Each of the branch-free graph's tensors and packed copies is the serving graph's: the entry holds the
    # weights as the bundle without slots' does (plus the float32 constants of the branches).
    assert lora.stat().st_size < 1.05 * without_slots.stat().st_size
    # So does the bundle's data file: the three graphs reference each weight where it lies.
    shared = [(path / "weights.data").stat().st_size for path in bundles]
    assert shared[0] < 1.05 * shared[1]


def test_a_lora_bundle_exported_without_the_branch_free_graph_runs_every_step_with_branches(
    fp32_bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]], tmp_path: Path
) -> None:
    old = Path(shutil.copytree(fp32_bundles[0], tmp_path / "old"))
    raw = json.loads((old / MANIFEST_FILE).read_text())
    base = raw["graphs"].pop("inplace_base")
    (old / base["file"]).unlink()
    del raw["checksums"][base["file"]]
    (old / MANIFEST_FILE).write_text(json.dumps(raw))
    cache = tmp_path / "compiled"
    engine = engine_for(old, adapters, compiled_cache=cache)
    assert engine._branch_free is None
    seq = NewSequence("a", prompts(1)[0], SamplingParams(), logprobs=True)
    assert run(engine, [seq], 8) == run(engine_for(fp32_bundles[0], adapters, compiled_cache=cache), [seq], 8)
    plain = json.loads((fp32_bundles[1] / MANIFEST_FILE).read_text())
    plain["graphs"]["inplace_base"] = base
    with pytest.raises(ValidationError, match=r"it needs lora and graphs\.inplace"):
        Manifest.model_validate(plain)


def test_an_int4_bundle_with_slots_cuts_its_padded_rows_around_each_branch_at_most_once(
    fp32_bundles: tuple[Path, Path], base_model: Decoder, tmp_path: Path
) -> None:
    """Where the quantizer pads rows (4 bits past block 16), a branch's products run on the real rows (they
    take the rows as one axis, which the row pad does not follow): each branch costs at most one Pad and one
    Slice more than the graph without slots."""
    import onnx

    bundles = [quantized(path, base_model, "int4", tmp_path) for path in fp32_bundles]
    assert load_bundle(bundles[0]).manifest.odd_rows_padded

    def graph(path: Path) -> onnx.GraphProto:
        inplace = load_bundle(path).inplace_graph
        assert inplace is not None
        return onnx.load(str(inplace)).graph

    lora, plain = graph(bundles[0]), graph(bundles[1])
    branches = [n for n in lora.node if n.name.endswith("/lora/a")]
    assert len(branches) == 4 * CONFIG.n_layers
    products = [n for n in lora.node if "/lora/" in n.name and n.op_type == "FusedMatMul"]
    assert len(products) > len(branches)  # a and each part's b
    assert not any(ROW_PAD_PREFIX in name for n in products for name in [*n.input, *n.output])
    for op in ("Pad", "Slice"):
        extra = sum(n.op_type == op for n in lora.node) - sum(n.op_type == op for n in plain.node)
        assert 0 <= extra <= len(branches), op


def test_the_prefix_cache_never_serves_one_adapters_rows_to_another(
    fp32_bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    engine = engine_for(fp32_bundles[0], adapters, prefix_cache_rows=2, prefix_cache_min_tokens=4)
    fresh = engine_for(fp32_bundles[0], adapters)
    prompt = prompts(1)[0] * 2
    run(engine, [NewSequence("first", prompt, SamplingParams(), adapter="a1")], 4)
    assert engine.cached_tokens(prompt, "a1") > 0
    assert engine.cached_tokens(prompt, "a2") == engine.cached_tokens(prompt) == 0
    for name in ("a2", ""):
        seq = NewSequence("again", prompt, SamplingParams(), logprobs=True, adapter=name)
        got, want = run(engine, [seq], 8)["again"], run(fresh, [seq], 8)["again"]
        assert [(o.token_id, o.logprob) for o in got] == [(o.token_id, o.logprob) for o in want]


# --- refusals -------------------------------------------------------------------------------------------


def broken(adapters: dict[str, tuple[Path, torch.nn.Module]], tmp_path: Path, edit: str) -> Path:
    """A copy of adapter a1 with one thing wrong."""
    folder = tmp_path / edit
    shutil.copytree(adapters["a1"][0], folder)
    config_path = folder / "adapter_config.json"
    config = json.loads(config_path.read_text())
    if edit == "no-config":
        config_path.unlink()
    elif edit == "corrupt-weights":
        (folder / "adapter_model.safetensors").write_bytes(b"not safetensors")
    elif edit == "dora":
        config_path.write_text(json.dumps(config | {"use_dora": True}))
    return folder


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ("no-config", "adapter_config.json: not found"),
        ("corrupt-weights", "not a readable safetensors file"),
        ("dora", "DoRA adapters are not served"),
    ],
)
def test_broken_adapter_folders_are_refused_by_name(
    fp32_bundles: tuple[Path, Path],
    adapters: dict[str, tuple[Path, torch.nn.Module]],
    tmp_path: Path,
    edit: str,
    message: str,
) -> None:
    layout = load_bundle(fp32_bundles[0]).manifest.lora
    assert layout is not None
    with pytest.raises(AdapterError, match=message):
        read_adapter(broken(adapters, tmp_path, edit), layout)


def test_adapters_that_do_not_fit_the_bundle_are_refused_saying_what_differs(
    fp32_bundles: tuple[Path, Path], base_model: Decoder, tmp_path: Path, tiny_bundle: Path
) -> None:
    layout = load_bundle(fp32_bundles[0]).manifest.lora
    assert layout is not None
    too_big = peft_model(
        base_model, LoraConfig(r=RANK * 2, target_modules=["qkv"], init_lora_weights=False), 1
    )
    too_big.save_pretrained(tmp_path / "rank")
    with pytest.raises(AdapterError, match=f"rank {RANK * 2}, above the bundle's --max-lora-rank {RANK}"):
        read_adapter(tmp_path / "rank", layout)
    other = peft_model(Decoder(replace(CONFIG, d_model=32, n_heads=2, n_kv_heads=1)), ADAPTERS["a1"], 1)
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(AdapterError, match="an adapter of another base model"):
        read_adapter(tmp_path / "other", layout)
    narrow = ExportOptions(model_name="narrow", progress=False, lora=LoraOptions(1, RANK, ("qkv",)))
    narrow_bundle = export_bundle(base_model, load_bundle(tiny_bundle).tokenizer, tmp_path / "narrow", narrow)
    assert narrow_bundle.manifest.lora is not None
    peft_model(base_model, ADAPTERS["a3"], 1).save_pretrained(tmp_path / "a3")
    with pytest.raises(
        AdapterError, match=r"targets blocks\.0\.attn\.out, for which the bundle has no LoRA branch"
    ):
        read_adapter(tmp_path / "a3", narrow_bundle.manifest.lora)


def test_engines_refuse_adapters_they_cannot_serve(
    fp32_bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    with pytest.raises(BundleError, match="has no LoRA slots"):
        engine_for(fp32_bundles[1], {"a1": adapters["a1"]})
    engine = engine_for(fp32_bundles[0], adapters)
    layout = load_bundle(fp32_bundles[0]).manifest.lora
    assert layout is not None
    with pytest.raises(ValueError, match="already loaded"):
        engine.register_adapter("a1", read_adapter(adapters["a1"][0], layout))
    engine.register_adapter("a4", read_adapter(adapters["a1"][0], layout))  # waits for a slot
    seqs = [NewSequence(f"s{i}", [5, 6, 7], SamplingParams(), adapter=f"a{i}") for i in range(1, 5)]
    engine.prefill(seqs[:3])
    with pytest.raises(ValueError, match="every one of the 3 LoRA slots holds an adapter a running request"):
        engine.prefill(seqs[3:])
    with pytest.raises(ValueError, match="'a1' is in use by running requests"):
        engine.unregister_adapter("a1")
    engine.release(["s1", "s2", "s3"])
    with pytest.raises(ValueError, match="no adapter named 'nope'"):
        engine.prefill([NewSequence("s", [5, 6, 7], SamplingParams(), adapter="nope")])
    with pytest.raises(ValueError, match="prompt logprobs are scored by the base model"):
        engine.prefill([NewSequence("s", [5, 6, 7], SamplingParams(), adapter="a1", prompt_logprobs=True)])
    assert engine.batch_size == 0
    assert engine.info.adapters == ("a1", "a2", "a3", "a4") and engine.info.lora_slots == SLOTS


def old_layout_bundle(bundle: Path, out: Path) -> str:
    """A copy of `bundle` whose serving graph takes its first LoRA a input as a bundle exported before the
    grouped layout did, [in, columns], and regroups it inside: a consistent graph that ONNX Runtime loads.
    Returns the input's name."""
    root = Path(shutil.copytree(bundle, out))
    manifest = load_bundle(root).manifest
    assert manifest.lora is not None and manifest.graphs.inplace is not None
    layout, file = manifest.lora, manifest.graphs.inplace.file
    branch = layout.branches[0]
    name, grouped = branch.a_input, f"{branch.a_input}.grouped"
    model = onnx.load(str(root / file))
    for node in model.graph.node:
        for k, i in enumerate(node.input):
            if i == name:
                node.input[k] = grouped
    shape = helper.make_tensor(
        f"{name}.shape", TensorProto.INT64, [3], [branch.in_features, -1, layout.group]
    )
    model.graph.initializer.append(shape)
    by_slot = helper.make_tensor(
        f"{name}.by_slot",
        TensorProto.INT64,
        [4],
        [-1, layout.width(branch) // layout.group, branch.in_features, layout.group],
    )
    model.graph.initializer.append(by_slot)
    regroup = [
        helper.make_node("Reshape", [name, shape.name], [f"{name}.split"]),
        helper.make_node("Transpose", [f"{name}.split"], [f"{name}.groups"], perm=[1, 0, 2]),
        helper.make_node("Reshape", [f"{name}.groups", by_slot.name], [grouped]),
    ]
    nodes = [*regroup, *model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    graph_input = next(i for i in model.graph.input if i.name == name)
    graph_input.CopyFrom(
        helper.make_tensor_value_info(name, TensorProto.FLOAT, [branch.in_features, "lora_columns"])
    )
    onnx.save(model, str(root / file))
    raw = json.loads((root / MANIFEST_FILE).read_text())
    raw["checksums"][file] = sha256_file(root / file)
    (root / MANIFEST_FILE).write_text(json.dumps(raw))
    return name


def test_a_bundle_of_an_older_lora_layout_is_refused_at_start_saying_to_re_export(
    fp32_bundles: tuple[Path, Path], tmp_path: Path
) -> None:
    """Before the grouped layout a was [in, columns]: such a bundle's session loads, and only its first run
    would fail, with ONNX Runtime's bare shape error. The engine refuses it at start, naming the input."""
    name = old_layout_bundle(fp32_bundles[0], tmp_path / "old")
    with pytest.raises(BundleError) as refused:
        engine_for(tmp_path / "old", {})
    message = str(refused.value)
    assert f"LoRA input {name} is [{CONFIG.d_model}, 'lora_columns'] in" in message
    layout = load_bundle(fp32_bundles[0]).manifest.lora
    assert layout is not None
    assert f"binds {layout.input_shapes()[name]} (named axes change from run to run)" in message
    assert f"`textgen-export ... --lora-slots {SLOTS} --max-lora-rank {RANK}`" in message


def test_a_graph_routing_tokens_by_id_as_before_is_refused(fp32_bundles: tuple[Path, Path]) -> None:
    """A graph of the masked layout took each token's slot as lora_ids [batch, seq], not lora_rows."""
    layout = load_bundle(fp32_bundles[0]).manifest.lora
    assert layout is not None
    shapes = layout.input_shapes()
    inputs = {name: [3 if isinstance(s, str) else s for s in shape] for name, shape in shapes.items()}
    check_graph_inputs(layout, inputs, "g")  # what the engine binds passes
    del inputs[LORA_ROWS_INPUT]
    missing = f"g: LoRA input {LORA_ROWS_INPUT} is missing from the serving graph"
    with pytest.raises(BundleError, match=missing):
        check_graph_inputs(layout, {**inputs, "lora_ids": ["batch", "seq"]}, "g")


def test_more_adapters_than_slots_take_turns_in_them(
    fp32_bundles: tuple[Path, Path],
    adapters: dict[str, tuple[Path, torch.nn.Module]],
    base_model: Decoder,
    tmp_path: Path,
) -> None:
    """Four adapters, three slots: each request gets the tokens it gets where its adapter always has a
    slot; the least recently used idle adapter gives its slot up, and its prefix-cache rows go with it."""
    peft_model(base_model, ADAPTERS["a1"], 9).save_pretrained(tmp_path / "a4")
    four = {**adapters, "a4": (tmp_path / "a4", adapters["a1"][1])}
    engine = engine_for(fp32_bundles[0], four, prefix_cache_rows=2, prefix_cache_min_tokens=4)
    assert engine.adapter_counts == (3, 0)  # three took a free slot at start; a4 waits
    prompt = prompts(1)[0] * 2
    resident = {
        name: run(
            engine_for(fp32_bundles[0], {name: four[name]}),
            [NewSequence("s", prompt, SamplingParams(), logprobs=True, adapter=name)],
            8,
        )["s"]
        for name in four
    }
    for name in ("a1", "a4", "a2", "a1", "a3", "a4"):
        seq = NewSequence("s", prompt, SamplingParams(), logprobs=True, adapter=name)
        got = run(engine, [seq], 8)["s"]
        assert [(o.token_id, o.logprob) for o in got] == [(o.token_id, o.logprob) for o in resident[name]], (
            name
        )
    loads, evictions = engine.adapter_counts
    assert evictions >= 2 and loads == 3 + evictions
    engine.unregister_adapter("a4")
    assert "a4" not in engine.info.adapters and engine.cached_tokens(prompt, "a4") == 0
    with pytest.raises(ValueError, match="no adapter named 'a4'"):
        engine.prefill([NewSequence("s", prompt, SamplingParams(), adapter="a4")])


@pytest.mark.parametrize("kind", ["fp32", "int8"])  # int4 past block 16 keeps row pads: no speculation
def test_speculation_and_constraints_keep_a_requests_adapter(
    kind: str,
    fp32_bundles: tuple[Path, Path],
    adapters: dict[str, tuple[Path, torch.nn.Module]],
    base_model: Decoder,
    tmp_path: Path,
) -> None:
    """With an adapter, a speculating engine (the verification graph) gives the plain engine's tokens and
    logprobs bit for bit, and a constrained request's tokens follow its adapter."""
    bundle = fp32_bundles[0] if kind == "fp32" else quantized(fp32_bundles[0], base_model, kind, tmp_path)
    plain = engine_for(bundle, adapters)
    speculating = engine_for(bundle, adapters, speculation=SpeculationSettings(num_tokens=4))
    prompt = prompts(1)[0]
    for name in adapters:
        seq = NewSequence("s", prompt, SamplingParams(), logprobs=True, adapter=name)
        want = run(plain, [seq], 24)["s"]
        oracle = Oracle(CONFIG.vocab_size)
        oracle.references[tuple(prompt)] = [o.token_id for o in want]
        speculating.proposer = oracle
        outs = speculating.prefill([seq])
        while len(outs) < 24:
            outs += speculating.decode()
        speculating.release(["s"])
        assert [(o.token_id, o.logprob) for o in outs[:24]] == [(o.token_id, o.logprob) for o in want]
        assert 0 < sum(o.accepted for o in outs) < sum(o.proposed for o in outs)
    words = Constraint.regex("[a-z ]{1,30}")
    texts = set()
    for name in ["", *adapters]:
        compiled = plain.constraint_compiler.compile(words)
        seq = NewSequence("c", prompt, SamplingParams(), adapter=name, constraint=compiled)
        tokens = [o.token_id for o in run(plain, [seq], 10)["c"] if o.error is None]
        text = plain.tokenizer.decode(tokens)
        assert all(c in "abcdefghijklmnopqrstuvwxyz " for c in text)
        texts.add(text)
    assert len(texts) > 1  # the constrained requests still follow their adapters


def test_a_preempted_request_resumes_with_its_adapter_even_after_it_left_its_slot(
    fp32_bundles: tuple[Path, Path],
    adapters: dict[str, tuple[Path, torch.nn.Module]],
    base_model: Decoder,
    tmp_path: Path,
) -> None:
    peft_model(base_model, ADAPTERS["a1"], 9).save_pretrained(tmp_path / "a4")
    engine = engine_for(fp32_bundles[0], {**adapters, "a4": (tmp_path / "a4", adapters["a1"][1])})
    prompt = prompts(1)[0]
    seq = NewSequence("s", prompt, SamplingParams(temperature=0.9, seed=4), logprobs=True, adapter="a1")
    want = [(o.token_id, o.logprob) for o in run(engine, [seq], 20)["s"]]
    outs = engine.prefill([seq])
    for _ in range(7):
        outs += engine.decode()
    engine.swap_out(["s"])
    with pytest.raises(ValueError, match="in use by running requests"):
        engine.unregister_adapter("a1")  # it resumes with it
    others = [NewSequence(f"o{i}", prompt, SamplingParams(), adapter=f"a{i}") for i in (2, 3, 4)]
    run(engine, others, 4)  # a4 takes a1's slot
    assert engine.adapter_counts[1] == 1  # a1, the only adapter no running request held
    engine.swap_in(["s"])
    while len(outs) < 20:
        outs += engine.decode()
    engine.release(["s"])
    assert [(o.token_id, o.logprob) for o in outs] == want


def test_a_span_of_slots_is_those_slots_weights_read_in_place(
    fp32_bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    """A run is given the inputs of the slots its rows use, first to last: views of the slots' arrays (an
    adapter written later is read), each part's b over its own output features."""
    from serve.engine.lora import LoraSlots

    layout = load_bundle(fp32_bundles[0]).manifest.lora
    assert layout is not None
    slots = LoraSlots(layout)
    span = slots.span(2, 3)
    slots.write(2, read_adapter(adapters["a1"][0], layout))
    for branch in layout.branches:
        a = span[branch.a_input]
        assert a.shape == layout.a_shape(branch, 2)
        assert np.abs(a[0]).sum() > 0 and not a[1].any()
        features = [layout.features(branch, j) for j in range(len(branch.parts))]
        assert [f[0] for f in features] == [0] + [f[1] for f in features[:-1]]
        assert features[-1][1] == branch.out_features  # the parts' outputs side by side are the projection's
        for j, (start, stop) in enumerate(features):
            b = span[branch.b_input(j)]
            assert b.shape == layout.b_shape(branch, j, 2) == (2, layout.max_rank, stop - start)
            assert np.abs(b[0]).sum() > 0 and not b[1].any()


def test_a_runs_tokens_are_routed_to_their_slots_in_order() -> None:
    """Rows of slots 3, 0, 5, 3 over the span 3..5, two positions each: slot 3's four tokens in one row, slot
    4's none, slot 5's two (padded), and each token with an adapter finds itself there."""
    routes = token_slots(np.array([3, 0, 5, 3]), 2, (3, 5))
    rows, positions, tokens = (
        routes[LORA_ROWS_INPUT],
        routes[LORA_POSITIONS_INPUT],
        routes[LORA_TOKENS_INPUT],
    )
    assert rows.shape == (3, 1, 4, 2)
    assert rows[0, 0].tolist() == [[0, 0], [0, 1], [3, 0], [3, 1]]  # (row, position)
    assert rows[2, 0, :2].tolist() == [[2, 0], [2, 1]]
    assert tokens.tolist() == [[0, 0], [0, 1], [2, 0], [2, 1], [3, 0], [3, 1]]
    assert (rows[positions[:, 0], 0, positions[:, 1]] == tokens).all()
    none = token_slots(np.array([0, 0]), 3, (0, 0))
    assert [none[name].shape for name in (LORA_ROWS_INPUT, LORA_POSITIONS_INPUT, LORA_TOKENS_INPUT)] == [
        (0, 1, 0, 2),
        (0, 2),
        (0, 2),
    ]


def test_adapters_mix_alike_with_an_fp16_kv_cache(
    fp32_bundles: tuple[Path, Path], adapters: dict[str, tuple[Path, torch.nn.Module]]
) -> None:
    """--kv-cache-dtype fp16 rewrites the attention, not the branches: requests of any adapter still get
    their tokens alone and mixed, bit for bit."""
    engine = engine_for(fp32_bundles[0], adapters, kv_cache_dtype="fp16")
    assert engine.kv_dtype == "float16"
    names = ["", *adapters]
    seqs = [
        NewSequence(f"r{i}", p, SamplingParams(), logprobs=True, adapter=names[i % 4])
        for i, p in enumerate(prompts(8))
    ]
    alone = {s.seq_id: run(engine, [s], 16)[s.seq_id] for s in seqs}
    mixed = run(engine, seqs, 16)
    for seq in seqs:
        want = [(o.token_id, o.logprob) for o in alone[seq.seq_id]]
        assert [(o.token_id, o.logprob) for o in mixed[seq.seq_id]] == want, seq.seq_id
