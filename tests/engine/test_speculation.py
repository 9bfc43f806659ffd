"""Prompt-lookup speculation: what it proposes, the graph it verifies with, and that a request's tokens are
the ones it gets without it (greedy and seeded sampling, penalties, logprobs, stops, batching)."""

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

from serve.bundle import ROW_PAD_PREFIX, load_bundle
from serve.engine.engine import Engine
from serve.engine.runtime import SessionConfig
from serve.engine.sampling import SamplingParams
from serve.engine.speculation import Pace, propose
from serve.engine.types import Constraint, EngineSettings, NewSequence, SpeculationSettings, TokenOut
from serve.engine.verify_graph import PICK_INDEX, verification_graph
from serve.errors import BundleError
from serve.scheduling.offline import generate
from serve.scheduling.request import Completion

SETTINGS = EngineSettings(max_batch_size=4, session=SessionConfig(threads=2, spinning=False))
SPECULATING = replace(SETTINGS, speculation=SpeculationSettings(num_tokens=5))
SAMPLED = SamplingParams(temperature=0.8, top_k=40, seed=11)
PENALIZED = SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, seed=3)
# How far the demo's logits from a verification run may be from a decode step's (measured: under 1e-5).
LOGIT_SUMS = 1e-4


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


def test_the_verification_graph_picks_flat_positions(tiny_bundle: Path) -> None:
    graph = onnx.load_from_string(verification_graph(load_bundle(tiny_bundle).inplace_graph).model)  # type: ignore[arg-type]
    inputs = {value.name for value in graph.graph.input}
    assert PICK_INDEX in inputs and "last_index" not in inputs
    assert not [node for node in graph.graph.node if node.op_type == "GatherND"]


def test_a_graph_with_row_pads_or_without_the_gather_is_refused(tiny_bundle: Path, tmp_path: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    assert bundle.inplace_graph is not None
    padded = onnx.load(str(bundle.inplace_graph))
    padded.graph.node.append(
        helper.make_node("Identity", ["input_ids"], ["copy"], name=f"{ROW_PAD_PREFIX}_x")
    )
    onnx.save(padded, str(tmp_path / "padded.onnx"))
    with pytest.raises(BundleError, match="without row pads"):
        verification_graph(tmp_path / "padded.onnx")
    with pytest.raises(BundleError, match="does not feed one gather"):
        verification_graph(bundle.standard_graph)


def test_an_engine_without_the_verification_graph_cannot_speculate(tiny_bundle: Path) -> None:
    bundle = load_bundle(tiny_bundle)
    engine = Engine.from_bundle(bundle, SETTINGS)
    with pytest.raises(ValueError, match="verification graph"):
        Engine(str(bundle.inplace_graph), bundle.tokenizer, engine.spec, SPECULATING)


# --- the same tokens ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(demo_bundle: Path) -> tuple[Engine, Engine]:
    bundle = load_bundle(demo_bundle)
    return Engine.from_bundle(bundle, SETTINGS), Engine.from_bundle(bundle, SPECULATING)


@pytest.fixture(scope="module")
def prompts(engines: tuple[Engine, Engine]) -> list[list[int]]:
    """Pieces of the standard library's source: code repeats its own names, which lookups find."""
    text = inspect.getsource(json.encoder) + inspect.getsource(json.decoder)
    tokens = engines[0].tokenizer.encode(text).ids
    return [tokens[start : start + 96] for start in range(0, 8 * 400, 400)]


def decode_alone(engine: Engine, seq: NewSequence, n: int) -> list[TokenOut]:
    """`n` tokens of one sequence running alone (a speculating step may give a few more)."""
    outs = engine.prefill([seq])
    while len(outs) < n:
        outs += engine.decode()
    engine.release([seq.seq_id])
    return outs


@pytest.mark.parametrize(
    "sampling", [SamplingParams(), SAMPLED, PENALIZED], ids=["greedy", "seeded", "penalized"]
)
def test_a_sequence_gets_the_same_tokens_with_speculation(
    engines: tuple[Engine, Engine], prompts: list[list[int]], sampling: SamplingParams
) -> None:
    plain, speculating = engines
    accepted = 0
    for i, prompt in enumerate(prompts):
        seq = NewSequence(f"s{i}", prompt, sampling, logprobs=True, top_logprobs=2)
        want = decode_alone(plain, seq, 100)
        got = decode_alone(speculating, seq, 100)[:100]
        same = until_near_tie(want) if sampling.greedy else len(want)
        assert [o.token_id for o in got[:same]] == [o.token_id for o in want[:same]]
        np.testing.assert_allclose(
            [o.logprob for o in got[:same]], [o.logprob for o in want[:same]], atol=LOGIT_SUMS
        )
        for g, w in zip(got[:same], want[:same], strict=True):
            assert g.top is not None and w.top is not None and g.top.token_ids == w.top.token_ids
        accepted += sum(o.accepted for o in got)
        assert all(o.proposed == 0 for o in want)
    assert accepted > 0, "no proposed token was ever accepted: the test saw no speculation"


def until_near_tie(outs: list[TokenOut]) -> int:
    """How many greedy tokens come before the first whose top two logits are closer than a verification run's
    sums may differ from a decode step's (ONNX Runtime's attention adds in another order for several query
    tokens than for one): those are the tokens both must agree on. All of them, but on rare positions."""
    for position, out in enumerate(outs):
        assert out.top is not None
        if out.top.logprobs[0] - out.top.logprobs[1] < 10 * LOGIT_SUMS:
            return position
    return len(outs)


def test_a_step_emits_the_accepted_tokens_then_one_of_its_own(
    engines: tuple[Engine, Engine], prompts: list[list[int]]
) -> None:
    _, speculating = engines
    outs = decode_alone(speculating, NewSequence("s", prompts[0], SamplingParams()), 100)
    steps = [o for o in outs if o.proposed]
    assert steps and all(0 <= o.accepted <= o.proposed <= 5 for o in steps)
    # Each speculating step's TokenOuts: its first (carrying the counts) and one per accepted token.
    position = 0
    while position < len(outs):
        out = outs[position]
        position += 1 + out.accepted
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
    engines: tuple[Engine, Engine], prompts: list[list[int]], demo_bundle: Path
) -> None:
    """The demo as its own draft: its greedy proposals are the target's own picks, but near-ties."""
    plain, _ = engines
    settings = replace(SETTINGS, speculation=SpeculationSettings(num_tokens=4, draft_bundle=str(demo_bundle)))
    drafted = Engine.from_bundle(load_bundle(demo_bundle), settings)
    assert drafted.info.speculation.method == "draft"
    proposed = accepted = 0
    for sampling in (SamplingParams(), SAMPLED):
        for prompt in prompts[:3]:
            seq = NewSequence("s", prompt, sampling, top_logprobs=2)
            want = decode_alone(plain, seq, 60)
            got = decode_alone(drafted, seq, 60)[:60]
            same = until_near_tie(want) if sampling.greedy else len(want)
            assert [o.token_id for o in got[:same]] == [o.token_id for o in want[:same]]
            proposed += sum(o.proposed for o in got)
            accepted += sum(o.accepted for o in got if o.proposed)
    assert proposed > 0 and accepted / proposed > 0.5  # greedy proposals of the model itself: mostly taken


def test_a_draft_with_another_vocabulary_is_refused(demo_bundle: Path, tiny_bundle: Path) -> None:
    settings = replace(SETTINGS, speculation=SpeculationSettings(num_tokens=4, draft_bundle=str(tiny_bundle)))
    with pytest.raises(BundleError, match=r"vocabulary .* same tokenizer"):
        Engine.from_bundle(load_bundle(demo_bundle), settings)
