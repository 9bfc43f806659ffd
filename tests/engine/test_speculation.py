"""Speculation: what prompt lookup proposes, the graph it verifies with, and that a request's tokens and
logprobs are bit-identical to the ones it gets without it (greedy and seeded sampling, penalties, stops,
batching), on the trained demo and on a rotary GQA bundle at fp32, int8 and int4."""

from __future__ import annotations

import inspect
import json.decoder
import json.encoder
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper
from proposers import Oracle
from quantized_bundles import rotary_gqa_bundle

from export.pipeline import Precision
from serve.bundle import ROW_PAD_PREFIX, load_bundle
from serve.engine.engine import Engine
from serve.engine.runtime import SessionConfig
from serve.engine.sampling import SamplingParams
from serve.engine.speculation import DraftModel, Pace, propose
from serve.engine.types import Constraint, EngineSettings, NewSequence, SpeculationSettings, TokenOut
from serve.engine.verify_graph import PICK_INDEX, chained_present_outputs, verification_graph
from serve.errors import BundleError
from serve.scheduling.offline import generate
from serve.scheduling.request import Completion

SETTINGS = EngineSettings(max_batch_size=4, session=SessionConfig(threads=2, spinning=False))
SPECULATING = replace(SETTINGS, speculation=SpeculationSettings(num_tokens=5))
SAMPLED = SamplingParams(temperature=0.8, top_k=40, seed=11)
PENALIZED = SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=3)


# --- what prompt lookup proposes ----------------------------------------------------------------------------


def ids(*tokens: int) -> np.ndarray:
    return np.array(tokens, np.int64)


def test_lookup_proposes_what_followed_the_last_ngram_before() -> None:
    context = ids(1, 2, 3, 4, 5, 9, 1, 2, 3)
    assert propose(context, 2, 3, 4).tolist() == [4, 5, 9, 1]
    assert propose(context, 2, 3, 2).tolist() == [4, 5]  # at most k


def test_lookup_prefers_the_longest_ngram_then_the_latest_occurrence() -> None:
    # "3" alone last occurred before 8; "2 3" before 4: the longer match wins.
    assert propose(ids(2, 3, 4, 3, 8, 2, 3), 1, 2, 1).tolist() == [4]
    # "2 3" occurred twice: the latest occurrence's continuation is proposed.
    assert propose(ids(2, 3, 4, 2, 3, 7, 2, 3), 2, 2, 1).tolist() == [7]


def test_lookup_proposes_nothing_without_an_earlier_ngram() -> None:
    assert propose(ids(1, 2, 3, 4, 5), 2, 4, 5).size == 0
    assert propose(ids(1, 2, 3, 1), 2, 4, 5).size == 0  # "3 1" never occurred before: 1 alone is too short
    assert propose(ids(1, 2, 3, 1), 1, 4, 5).tolist() == [2, 3, 1]
    assert propose(ids(7), 1, 4, 5).size == 0
    assert propose(ids(1, 2, 1, 2), 2, 2, 0).size == 0


def test_pace_waits_longer_after_each_wholly_rejected_proposal() -> None:
    pace = Pace(limit=3, longest=4)
    waits = []
    for _ in range(4):
        assert pace.ready()
        pace.record(proposed=3, accepted=0)
        skipped = 0
        while not pace.ready():
            skipped += 1
        waits.append(skipped)
    assert waits == [1, 2, 4, 4]
    pace.record(proposed=1, accepted=1)  # an accepted token ends the wait
    assert pace.ready() and pace.next_wait == 1


def test_pace_lengthens_accepted_proposals_and_shortens_rejected_ones() -> None:
    pace = Pace(limit=6)
    lengths = []
    for accepted in (2, 1, 0, 9, 9, 9):  # of proposals of pace.tokens tokens each (9: all)
        pace.record(pace.tokens, min(accepted, pace.tokens))
        lengths.append(pace.tokens)
    assert lengths == [5, 4, 3, 5, 6, 6]
    for _ in range(8):
        pace.record(pace.tokens, 0)
    assert pace.tokens == 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (SpeculationSettings(num_tokens=-1), "must be >= 0"),
        (SpeculationSettings(num_tokens=3, ngram_min=3, ngram_max=2), "min <= max"),
        (SpeculationSettings(num_tokens=3, ngram_min=0), "min <= max"),
    ],
)
def test_bad_speculation_settings_are_refused(settings: SpeculationSettings, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings.validate()


# --- the verification graph ---------------------------------------------------------------------------------


def test_the_verification_graph_picks_flat_positions_and_attends_one_position_at_a_time(
    tiny_bundle: Path,
) -> None:
    path = load_bundle(tiny_bundle).inplace_graph
    assert path is not None
    graph = onnx.load_from_string(verification_graph(path, positions=4).model)
    inputs = {value.name for value in graph.graph.input}
    assert PICK_INDEX in inputs and "last_index" not in inputs
    assert not [node for node in graph.graph.node if node.op_type == "GatherND"]
    layers = len(onnx.load(str(path)).graph.output) // 2  # logits, then K and V per layer
    attention = [node for node in graph.graph.node if node.op_type == "GroupQueryAttention"]
    assert len(attention) == 4 * layers
    outputs = {value.name for value in graph.graph.output}
    # Each position's keys and values go to a present output of its own, bound to the same KV row.
    assert {f"present_key.0{suffix}" for suffix in chained_present_outputs(4)} <= outputs
    assert all(node.output[1] in outputs for node in attention)


def test_a_graph_with_row_pads_or_without_the_gather_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    assert bundle.inplace_graph is not None
    padded = onnx.load(str(bundle.inplace_graph))
    padded.graph.node.append(
        helper.make_node("Identity", ["input_ids"], ["copy"], name=f"{ROW_PAD_PREFIX}_x")
    )
    onnx.save(padded, str(tmp_path / "padded.onnx"))
    with pytest.raises(BundleError, match="without row pads"):
        verification_graph(tmp_path / "padded.onnx", 3)
    with pytest.raises(BundleError, match="does not feed one gather"):
        verification_graph(bundle.standard_graph, 3)


def test_an_engine_without_the_verification_graph_cannot_speculate(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    engine = Engine.from_bundle(bundle, SETTINGS)
    with pytest.raises(ValueError, match="verification graph"):
        Engine(str(bundle.inplace_graph), bundle.tokenizer, engine.spec, SPECULATING)


# --- the same tokens ----------------------------------------------------------------------------------------


# int4 at block 16: its rows are computed alike alone and in a batch on every CPU, with no row pads.
PRECISIONS = {"int8": Precision("int8"), "int4": Precision("int4", block_size=16), "fp32": Precision()}


@pytest.fixture(scope="module")
def gqa_bundles(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the rotary GQA bundles are written, the fp32 one shared by all."""
    return tmp_path_factory.mktemp("gqa")


@pytest.fixture(scope="module", params=["demo", "fp32", "int8", "int4", "fp32-fp16-cache"])
def pair(
    request: pytest.FixtureRequest, tiny_bundle: Path, gqa_bundles: Path
) -> tuple[Engine, Engine, Oracle]:
    """A plain engine and a speculating one proposing with an `Oracle`, of the trained demo model or of the
    rotary GQA bundle at a precision (fp32-fp16-cache: fp32 served with --kv-cache-dtype fp16)."""
    precision, _, cache = request.param.partition("-")
    if precision == "demo":
        path = request.getfixturevalue("demo_bundle")
    else:
        path = rotary_gqa_bundle(tiny_bundle, gqa_bundles, PRECISIONS[precision])
    bundle = load_bundle(path)
    dtype = "fp16" if cache == "fp16-cache" else "auto"
    plain, speculating = (
        Engine.from_bundle(bundle, replace(settings, kv_cache_dtype=dtype))
        for settings in (SETTINGS, SPECULATING)
    )
    oracle = Oracle(plain.vocab_size)
    speculating.proposer = oracle
    return plain, speculating, oracle


def prompts_of(engine: Engine, count: int, length: int) -> list[list[int]]:
    """Pieces of the standard library's source, `length` tokens each."""
    text = inspect.getsource(json.encoder) + inspect.getsource(json.decoder)
    tokens = engine.tokenizer.encode(text).ids
    return [tokens[start : start + length] for start in range(0, count * 200, 200)]


def decode_alone(engine: Engine, seq: NewSequence, n: int) -> list[TokenOut]:
    """The first `n` tokens of one sequence running alone (a speculating step may give a few more)."""
    outs = engine.prefill([seq])
    while len(outs) < n:
        outs += engine.decode()
    engine.release([seq.seq_id])
    return outs[:n]


def same_outputs(got: list[TokenOut], want: list[TokenOut]) -> None:
    assert len(got) == len(want) >= 40
    assert [o.token_id for o in got] == [o.token_id for o in want]
    assert [o.logprob for o in got] == [o.logprob for o in want]  # bit-identical, not merely close
    assert [o.top for o in got] == [o.top for o in want]


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SAMPLED, PENALIZED], ids=["greedy", "seeded", "penalized"]
)
def test_a_sequence_gets_the_same_tokens_and_logprobs_with_speculation(
    pair: tuple[Engine, Engine, Oracle], sampling: SamplingParams
) -> None:
    plain, speculating, oracle = pair
    proposed = accepted = 0
    for i, prompt in enumerate(prompts_of(plain, 3, 48)):
        seq = NewSequence(f"s{i}", prompt, sampling, logprobs=True, top_logprobs=2)
        want = decode_alone(plain, seq, 60)
        oracle.references[tuple(prompt)] = [o.token_id for o in want]
        got = decode_alone(speculating, seq, 60)
        same_outputs(got, want)
        proposed += sum(o.proposed for o in got)
        accepted += sum(o.accepted for o in got)
        assert all(o.proposed == 0 for o in want)
    assert 0 < accepted < proposed  # right guesses were taken and wrong ones refused


def test_a_request_gets_the_same_tokens_alone_speculating_and_batched_with_others(
    pair: tuple[Engine, Engine, Oracle],
) -> None:
    """Speculation runs while a sequence decodes alone; the same request among others decodes plainly. Both
    give the tokens it gets alone without speculation."""
    plain, speculating, oracle = pair
    prompts = prompts_of(plain, 6, 40)
    seeded = [replace(SAMPLED, seed=seed) for seed in range(len(prompts))]
    for sampling in ([SamplingParams()] * len(prompts), seeded):
        alone = [
            generate(plain, [p], s, max_new_tokens=48, ignore_eos=True)[0]
            for p, s in zip(prompts, sampling, strict=True)
        ]
        for prompt, completion in zip(prompts, alone, strict=True):
            oracle.references[tuple(prompt)] = completion.token_ids
        before = oracle.calls
        speculated = [
            generate(speculating, [p], s, max_new_tokens=48, ignore_eos=True)[0]
            for p, s in zip(prompts, sampling, strict=True)
        ]
        assert oracle.calls > before
        batched = generate(speculating, prompts, sampling, max_new_tokens=48, ignore_eos=True)
        assert [c.token_ids for c in speculated] == [c.token_ids for c in alone]
        assert [c.token_ids for c in batched] == [c.token_ids for c in alone]


def one(engine: Engine, prompt: list[int], sampling: SamplingParams) -> Completion:
    return generate(engine, [prompt], sampling, max_new_tokens=48, ignore_eos=True)[0]


@pytest.fixture(scope="module")
def engines(demo_bundle: Path) -> tuple[Engine, Engine]:
    bundle = load_bundle(demo_bundle)
    return Engine.from_bundle(bundle, SETTINGS), Engine.from_bundle(bundle, SPECULATING)


@pytest.fixture(scope="module")
def prompts(engines: tuple[Engine, Engine]) -> list[list[int]]:
    """Pieces of the standard library's source: code repeats its own names, which lookups find."""
    return prompts_of(engines[0], 8, 96)


def test_a_step_emits_the_accepted_tokens_then_one_of_its_own(
    pair: tuple[Engine, Engine, Oracle],
) -> None:
    plain, speculating, oracle = pair
    prompt = prompts_of(plain, 1, 48)[0]
    oracle.references[tuple(prompt)] = [
        o.token_id for o in decode_alone(plain, NewSequence("s", prompt, SamplingParams()), 80)
    ]
    outs = speculating.prefill([NewSequence("s", prompt, SamplingParams())])
    while len(outs) < 80:  # whole steps: decode_alone would cut the last one
        outs += speculating.decode()
    speculating.release(["s"])
    steps = [o for o in outs if o.proposed]
    assert steps and all(0 <= o.accepted <= o.proposed <= 5 for o in steps)
    # Each speculating step's TokenOuts: its first (carrying the counts) and one per accepted token.
    position = 0
    while position < len(outs):
        position += 1 + outs[position].accepted
    assert position == len(outs)


def test_a_request_may_ask_for_fewer_proposed_tokens_or_none(
    engines: tuple[Engine, Engine], prompts: list[list[int]]
) -> None:
    _, speculating = engines
    none = decode_alone(speculating, NewSequence("s", prompts[0], SamplingParams(), speculative_tokens=0), 60)
    assert all(o.proposed == 0 for o in none)
    two = decode_alone(speculating, NewSequence("s", prompts[0], SamplingParams(), speculative_tokens=2), 60)
    assert max(o.proposed for o in two) == 2
    many = decode_alone(
        speculating, NewSequence("s", prompts[0], SamplingParams(), speculative_tokens=99), 60
    )
    assert max(o.proposed for o in many) <= 5  # no more than the engine's limit


def test_a_constrained_sequence_does_not_speculate(
    engines: tuple[Engine, Engine], prompts: list[list[int]]
) -> None:
    plain, speculating = engines
    constraint = speculating.constraint_compiler.compile(Constraint.regex("(ab|cd)+"))
    seq = NewSequence("s", prompts[0], SamplingParams(), constraint=constraint)
    got = decode_alone(speculating, seq, 20)
    assert all(o.proposed == 0 for o in got)
    fresh = replace(seq, constraint=plain.constraint_compiler.compile(Constraint.regex("(ab|cd)+")))
    assert [o.token_id for o in got] == [o.token_id for o in decode_alone(plain, fresh, 20)]


def test_requests_get_the_same_completions_batched_stopped_and_at_the_context_limit(
    engines: tuple[Engine, Engine], prompts: list[list[int]]
) -> None:
    plain, speculating = engines
    tokenizer = plain.tokenizer
    stop = tokenizer.decode(prompts[1][40:43])  # text the prompt holds: likely to be quoted
    near_end = prompts[2] * 2  # 192 of the demo's 256 tokens: generation runs into the context limit
    cases = [
        {"prompts": prompts[:3], "max_new_tokens": 40},  # three at once: batched steps do not speculate
        {"prompts": prompts[:1], "max_new_tokens": 7},
        {"prompts": prompts[1:2], "max_new_tokens": 80, "stop": (stop,)},
        {"prompts": [near_end], "max_new_tokens": 100, "ignore_eos": True},
        {"prompts": prompts[3:4], "max_new_tokens": 50, "min_new_tokens": 30},
    ]
    for case in cases:
        batch = case.pop("prompts")
        want = generate(plain, batch, **case)  # type: ignore[arg-type]
        got = generate(speculating, batch, **case)  # type: ignore[arg-type]
        assert [outcome(c) for c in got] == [outcome(c) for c in want], case
        assert all(c.finish is not None for c in got)


def outcome(completion: Completion) -> tuple[list[int], str, str]:
    assert completion.finish is not None
    return completion.token_ids, completion.text, completion.finish.finish_reason


# --- a draft model ------------------------------------------------------------------------------------------


def test_a_draft_model_proposes_and_changes_no_token(
    engines: tuple[Engine, Engine],
    prompts: list[list[int]],
    demo_bundle: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The demo as its own draft: its greedy proposals are mostly the target's own picks. Its row stays
    resident: after a request's first proposal, each one feeds the draft only what the sequence gained."""
    plain, _ = engines
    settings = replace(SETTINGS, speculation=SpeculationSettings(num_tokens=4, draft_bundle=str(demo_bundle)))
    drafted = Engine.from_bundle(load_bundle(demo_bundle), settings)
    assert drafted.info.speculation.method == "draft" and isinstance(drafted.proposer, DraftModel)
    draft = drafted.proposer.engine
    starts: list[int] = []
    greedy_next = draft.greedy_next

    def counted(ids: list[int], start: int) -> int:
        starts.append(start)
        return greedy_next(ids, start)

    monkeypatch.setattr(draft, "greedy_next", counted)
    proposed = accepted = 0
    for sampling in (SamplingParams(), SAMPLED):
        for prompt in prompts[:3]:
            seq = NewSequence("s", prompt, sampling, logprobs=True, top_logprobs=2)
            want = decode_alone(plain, seq, 60)
            starts.clear()
            got = decode_alone(drafted, seq, 60)
            same_outputs(got, want)
            assert starts[0] < len(prompt) + 1 and all(start >= len(prompt) for start in starts[1:])
            proposed += sum(o.proposed for o in got)
            accepted += sum(o.accepted for o in got if o.proposed)
    assert proposed > 0 and accepted / proposed > 0.5  # greedy proposals of the model itself: mostly taken


def test_a_draft_with_another_vocabulary_is_refused(demo_bundle: Path, tiny_bundle: Path) -> None:
    settings = replace(SETTINGS, speculation=SpeculationSettings(num_tokens=4, draft_bundle=str(tiny_bundle)))
    with pytest.raises(BundleError, match=r"vocabulary .* same tokenizer"):
        Engine.from_bundle(load_bundle(demo_bundle), settings)
