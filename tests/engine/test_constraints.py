"""Structured output: constraints compiled with llguidance and enforced token by token.

The random `tiny` bundle produces garbage, which is exactly what a constraint must tame: every output of a
bounded constraint (a finite language) must come out complete and valid, whatever the weights. Where a
language is unbounded (a number's digits), a +100 logit bias on a closing token makes the model take it as
soon as the constraint allows it, so the test ends without relying on what random weights prefer.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import apply_token_bitmask_inplace
from scheduler_fakes import fake, hold_compiles, letter_tokenizer

from serve.bundle import Bundle, load_bundle
from serve.engine import constraints
from serve.engine.constraints import ConstraintCompiler
from serve.engine.engine import Engine
from serve.engine.logits_processors import apply_token_bitmask
from serve.engine.runtime import SessionConfig
from serve.engine.sampling import SamplingBatch, SamplingParams
from serve.engine.types import Constraint, ConstraintState, EngineSettings, closed_schema
from serve.errors import Cancelled, InvalidRequest, TextgenError
from serve.scheduling.limits import SchedulerLimits
from serve.scheduling.offline import OFFLINE_LIMITS, generate
from serve.scheduling.request import Completion, GenerationRequest, RequestTracker
from serve.scheduling.runner import BatchRunner

SESSION = SessionConfig(threads=1, spinning=False)
GREEDY = SamplingParams()
PROMPT = "the quick brown fox"

# Finite languages: each completes within the token budget whatever the model prefers.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                    "name": {"type": "string", "minLength": 2, "maxLength": 6},
                },
                "required": ["id", "name"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "bounded array": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"const": "L"}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "strings with lengths and patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "note": {"type": "string", "minLength": 3, "maxLength": 5},
        },
        "required": ["code", "note"],
        "additionalProperties": False,
    },
    "nullable fields": {
        "type": "object",
        "properties": {
            "a": {"type": ["integer", "null"], "minimum": 0, "maximum": 99},
            "b": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "null"}]},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    "anyOf": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "circle"},
                    "r": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["kind", "r"],
                "additionalProperties": False,
            },
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        ]
    },
}
# Unbounded digits: "}" is taken as soon as a number may end.
NUMBER_SCHEMA = {
    "type": "object",
    "properties": {
        "x": {"type": "number", "minimum": 0.25, "maximum": 0.75},
        "n": {"type": "integer", "minimum": -20, "maximum": -10},
    },
    "required": ["x", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> Bundle:
    return load_bundle(tiny_bundle)


def new_engine(bundle: Bundle, max_batch_size: int = 8) -> Engine:
    return Engine.from_bundle(bundle, EngineSettings(max_batch_size=max_batch_size, session=SESSION))


@pytest.fixture(scope="module")
def engine(bundle: Bundle) -> Engine:
    return new_engine(bundle)


def forcing(bundle: Bundle, *texts: str) -> SamplingParams:
    """Greedy, with +100 on the tokens of `texts`: each is taken wherever the constraint allows it."""
    ids = {bundle.tokenizer.token_to_id(text) for text in texts}
    assert None not in ids
    return SamplingParams(logit_bias=tuple(sorted((i, 100.0) for i in ids if i is not None)))


def completions(
    engine: Engine, constraints: Sequence[Constraint | None], sampling: Any = GREEDY, **kw: Any
) -> list[Completion]:
    kw.setdefault("max_new_tokens", 100)
    return generate(engine, [PROMPT] * len(constraints), sampling, constraint=list(constraints), **kw)


def drive(runner: BatchRunner, requests: Sequence[GenerationRequest]) -> dict[str, Completion | TextgenError]:
    """Run requests through a runner to the end; each one's completion, or the error it ended with."""
    results: dict[str, Completion | TextgenError] = {}
    for request in requests:
        runner.enqueue(runner.track(request))
        results[request.request_id] = Completion(request.request_id)
    deadline = time.monotonic() + 30
    while not runner.idle:
        assert time.monotonic() < deadline, "the runner did not finish"
        runner.wait_for_work(lambda: False)
        for tracker, item in runner.step():
            done = results[tracker.request_id]
            if isinstance(item, TextgenError):
                results[tracker.request_id] = item
            elif isinstance(done, Completion):
                done.add(item)
    return results


def constrained(rid: str, engine: Engine, constraint: Constraint | None, **kw: Any) -> GenerationRequest:
    kw.setdefault("max_new_tokens", 40)
    sampling = kw.pop("sampling", SamplingParams())
    prompt = engine.tokenizer.encode(PROMPT).ids
    return GenerationRequest(rid, prompt, sampling, constraint=constraint, stream=False, **kw)


# --- masks and sampling, no model ---------------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [32, 45, 320])
def test_the_bitmask_processor_agrees_with_llguidances_own(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    bits = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    logits = rng.normal(size=(5, vocab)).astype(np.float32)
    rows = np.array([0, 2, 4])
    ours = logits.copy()
    apply_token_bitmask(ours, rows, bits)
    theirs = logits[rows].copy()
    apply_token_bitmask_inplace(theirs, bits)
    np.testing.assert_array_equal(ours[rows], theirs)
    np.testing.assert_array_equal(ours[[1, 3]], logits[[1, 3]])  # unmasked rows untouched


def test_a_row_left_without_any_token_is_refused_and_the_others_are_sampled() -> None:
    batch = SamplingBatch()
    batch.append(SamplingParams(logit_bias=((2, -100.0), (5, -100.0))), (1,))  # bans what its mask allows
    batch.append(SamplingParams(logit_bias=((2, -100.0),)), (1,))  # -100 is a ban, not a mere -100
    batch.append(SamplingParams(temperature=1.0, seed=3), (1,))
    logits = np.zeros((3, 40), dtype=np.float32)
    logits[:, 2] = 50.0
    allowed = np.zeros((2, 2), dtype=np.int32)
    allowed[0, 0] = (1 << 2) | (1 << 5)  # row 0 may take tokens 2 and 5 only
    allowed[1, 0] = 1 << 2  # row 2 may take token 2 only
    tokens, logprobs = batch.sample(logits, (np.array([0, 2]), allowed))
    assert batch.refused.tolist() == [0] and tokens[0] == -1 and np.isnan(logprobs[0])
    assert tokens[1] != 2 and tokens[2] == 2
    batch.sample(logits)  # no mask: nothing refused
    assert batch.refused.size == 0


# --- compiling ----------------------------------------------------------------------------------------------


def test_the_same_constraint_compiles_once_and_refusals_carry_the_librarys_message() -> None:
    compiler = ConstraintCompiler(letter_tokenizer(), 300, [0])
    schema = {"type": "array", "items": {"type": "integer"}}
    futures = [compiler.submit(Constraint.json_schema(schema)) for _ in range(4)]  # at once, and again
    assert len({id(f.result()) for f in futures}) == 1 and compiler.compiles == 1
    compiled = futures[0].result()
    assert compiled.matcher() is not compiled.template and compiled.constraint.text == json.dumps(schema)
    with pytest.raises(InvalidRequest, match=r"(?s)constraint.json_schema is not valid: .*foo"):
        compiler.compile(Constraint.json_schema('{"type": "foo"}'))
    with pytest.raises(InvalidRequest, match=r"(?s)constraint.regex is not valid: .*unclosed group"):
        compiler.compile(Constraint.regex("a(b"))
    with pytest.raises(InvalidRequest, match=r"(?s)constraint.grammar is not valid: .*unknown name"):
        compiler.compile(Constraint.grammar("start: missing_rule"))
    assert compiler.compiles == 4
    with pytest.raises(InvalidRequest):  # a refusal is cached too: it does not compile again
        compiler.compile(Constraint.regex("a(b"))
    assert compiler.compiles == 4


def test_the_same_schema_from_two_fields_compiles_once_and_each_refusal_names_its_field() -> None:
    compiler = ConstraintCompiler(letter_tokenizer(), 300, [0])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    tool = compiler.compile(replace(Constraint.json_schema(schema), source="tools[0].function.parameters"))
    response = compiler.compile(replace(Constraint.json_schema(schema), source="response_format"))
    assert response is tool and compiler.compiles == 1
    bad = Constraint.json_schema('{"type": "foo"}')
    for source in ("tools[1].function.parameters", "response_format.json_schema.schema"):
        with pytest.raises(InvalidRequest, match=rf"^{re.escape(source)} is not valid: .*foo"):
            compiler.compile(replace(bad, source=source))
    assert compiler.compiles == 2


def test_unread_compile_times_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server without metrics never takes the compile times: they must not pile up."""
    monkeypatch.setattr(constraints, "MAX_UNREAD_COMPILE_TIMES", 2)
    compiler = ConstraintCompiler(letter_tokenizer(), 300, [0])
    for pattern in ("a", "b", "c"):
        compiler.compile(Constraint.regex(pattern))
    taken = compiler.take_compile_seconds()
    assert len(taken) == 2 and all(seconds > 0 for seconds in taken)
    assert compiler.take_compile_seconds() == []


# --- outputs that parse and validate ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def schema_outputs(engine: Engine, bundle: Bundle) -> dict[str, Completion]:
    """Every schema's completion, all in one batch (and the number schema with "}" forced)."""
    names = [*SCHEMAS, "numbers with ranges"]
    schemas = [*SCHEMAS.values(), NUMBER_SCHEMA]
    sampling = [SamplingParams()] * len(SCHEMAS) + [forcing(bundle, "}", ",")]
    outs = completions(engine, [Constraint.json_schema(s) for s in schemas], sampling, max_new_tokens=110)
    return dict(zip(names, outs, strict=True))


@pytest.mark.parametrize("name", [*SCHEMAS, "numbers with ranges"])
def test_json_schema_outputs_parse_and_validate(name: str, schema_outputs: dict[str, Completion]) -> None:
    out = schema_outputs[name]
    schema = SCHEMAS.get(name, NUMBER_SCHEMA)
    assert out.finish_reason == "stop", out.text
    assert out.finish is not None and not out.finish.constraint_incomplete
    jsonschema.validate(json.loads(out.text), schema)


def test_json_object_regex_grammar_and_choice(engine: Engine, bundle: Bundle) -> None:
    grammar = 'start: greeting " " NAME "!"\ngreeting: "hello" | "hi"\nNAME: /[a-z]{2,5}/\n'
    kinds = [
        Constraint.json_object(),
        Constraint.regex(r"[0-9]{3}-[a-z]{2,4}"),
        Constraint.regex(r"(yes|no|maybe)\.[A-Z]"),
        Constraint.grammar(grammar),
        Constraint.choice(["red wine", "white wine", "water"]),
    ]
    sampling = [forcing(bundle, "}"), *[SamplingParams()] * 4]
    obj, digits, word, greeting, drink = completions(engine, kinds, sampling)
    assert isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", digits.text)
    assert re.fullmatch(r"(yes|no|maybe)\.[A-Z]", word.text)
    assert re.fullmatch(r"(hello|hi) [a-z]{2,5}!", greeting.text)
    assert drink.text in {"red wine", "white wine", "water"}
    for out in (obj, digits, word, greeting, drink):
        assert out.finish_reason == "stop" and out.finish is not None and not out.finish.constraint_incomplete


def test_unconstrained_rows_keep_their_solo_greedy_tokens(bundle: Bundle) -> None:
    solo = generate(new_engine(bundle, 1), [PROMPT], max_new_tokens=30, ignore_eos=True)[0]
    engine = new_engine(bundle)
    mixed = [None, Constraint.json_schema(SCHEMAS["enums"]), None, Constraint.regex("[a-z ]{10,40}"), None]
    outs = completions(engine, mixed, max_new_tokens=30, ignore_eos=True)
    for out in outs[0::2]:
        assert out.token_ids == solo.token_ids
    assert outs[1].text == '{"color":"' + json.loads(outs[1].text)["color"] + '","size":"L"}'
    assert re.fullmatch("[a-z ]{10,40}", outs[3].text)
    assert engine.mask_stats.rows > 0 and engine.constrained_rows == 0  # every matcher freed


def test_unconstrained_batches_do_no_mask_work(bundle: Bundle) -> None:
    engine = new_engine(bundle)
    completions(engine, [None, None], max_new_tokens=10, ignore_eos=True)
    assert engine.mask_stats.fills == 0 and engine.mask_stats.rows == 0


class _TimedSession:
    """The engine's ONNX Runtime session, recording when each run starts and ends."""

    def __init__(self, session: Any) -> None:
        self._session = session
        self.runs: list[tuple[float, float]] = []

    def run_with_iobinding(self, binding: Any) -> None:
        start = time.perf_counter()
        self._session.run_with_iobinding(binding)
        self.runs.append((start, time.perf_counter()))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)


def test_masks_are_computed_on_their_own_thread_while_the_step_runs(
    bundle: Bundle, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = new_engine(bundle)
    timed = _TimedSession(engine.session)
    engine.session = timed
    fills: list[tuple[str, float]] = []  # the thread of each fill, and when it ended
    real_fill = llguidance.numpy.fill_next_token_bitmask_par

    def slow_fill(*args: Any) -> None:
        time.sleep(0.003)  # slower than the tiny model's run: had the run waited for it, it would start later
        real_fill(*args)
        fills.append((threading.current_thread().name, time.perf_counter()))

    monkeypatch.setattr("serve.engine.constraints.fill_next_token_bitmask_par", slow_fill)
    out = completions(engine, [Constraint.regex("[a-z]{20}")], max_new_tokens=25)[0]
    assert re.fullmatch("[a-z]{20}", out.text)
    assert len(fills) == len(timed.runs) == len(out.token_ids)  # one fill per step, prefill included
    assert {name for name, _ in fills} == {"textgen-masks_0"}
    for (_, filled), (started, _) in zip(fills, timed.runs, strict=True):
        assert started < filled  # each step's run began while its masks were still being computed
    assert engine.mask_stats.fill_seconds >= 0.002 * len(fills)


def test_chunked_and_beside_decode_prefills_join_with_their_masks(bundle: Bundle) -> None:
    schema = Constraint.json_schema(SCHEMAS["nested objects"])
    long_prompt = " ".join([PROMPT] * 4)
    expected = generate(new_engine(bundle), [long_prompt, PROMPT], constraint=schema, max_new_tokens=60)
    for limits in (
        OFFLINE_LIMITS.model_copy(update={"prefill_chunk_tokens": 8}),
        OFFLINE_LIMITS.model_copy(update={"prefill_beside_decode": True}),
    ):
        engine = new_engine(bundle)
        # The short prompt decodes while the long one is prefilled in pieces or beside it.
        outs = generate(engine, [PROMPT, long_prompt], constraint=schema, max_new_tokens=60, limits=limits)
        assert [o.text for o in outs] == [expected[1].text, expected[0].text]
        jsonschema.validate(json.loads(outs[1].text), SCHEMAS["nested objects"])


# --- when a constrained request ends ------------------------------------------------------------------------


def test_eos_is_allowed_only_where_the_constraint_may_end(engine: Engine, bundle: Bundle) -> None:
    eos = bundle.tokenizer.id_to_token(engine.eos_token_id)
    assert eos is not None
    wants_eos = forcing(bundle, eos)  # the model would end at once if it could
    regex = [Constraint.regex("[0-9]{2}[a-z]+")]
    plain = completions(engine, regex, wants_eos)[0]
    ignoring = completions(engine, regex, wants_eos, ignore_eos=True)[0]
    late = completions(engine, regex, wants_eos, min_new_tokens=6)[0]
    for out in (plain, ignoring, late):  # ended by EOS, at a point where the output matches
        assert out.finish_reason == "eos" and re.fullmatch("[0-9]{2}[a-z]+", out.text), out.text
        assert out.finish is not None and not out.finish.constraint_incomplete
    assert len(late.token_ids) >= 6 > len(plain.token_ids)  # min_new_tokens banned EOS until then


def test_a_complete_constraint_ends_the_request_before_min_new_tokens(engine: Engine) -> None:
    out = completions(engine, [Constraint.choice(["yes", "no"])], min_new_tokens=10, ignore_eos=True)[0]
    assert out.text in {"yes", "no"} and out.finish_reason == "stop" and len(out.token_ids) < 10


def test_max_new_tokens_says_whether_the_output_is_complete(engine: Engine) -> None:
    many = Constraint.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 50})
    cut, matching = completions(engine, [many, Constraint.regex("[a-z]+")], max_new_tokens=8)
    assert cut.finish_reason == matching.finish_reason == "length"
    assert cut.finish is not None and cut.finish.constraint_incomplete and cut.text.startswith("[")
    assert matching.finish is not None and not matching.finish.constraint_incomplete


def test_stop_strings_still_apply(engine: Engine) -> None:
    regex = Constraint.regex("[a-z]{12}")
    whole = completions(engine, [regex])[0].text
    stop = whole[5:7]
    cut = completions(engine, [regex], stop=(stop,))[0]
    assert cut.text == whole[: whole.index(stop)] and cut.finish_reason == "stop"
    assert cut.finish is not None and cut.finish.constraint_incomplete


# --- failures of one request --------------------------------------------------------------------------------


def test_a_step_with_no_allowed_token_fails_that_request_only(engine: Engine, bundle: Bundle) -> None:
    choices = ["yes", "no"]
    vocab = bundle.tokenizer.get_vocab()
    openers = sorted(i for text, i in vocab.items() if any(c.startswith(text) for c in choices))
    banned = SamplingParams(logit_bias=tuple((i, -100.0) for i in openers))
    runner = BatchRunner(engine, OFFLINE_LIMITS.resolve(engine))
    results = drive(
        runner,
        [
            constrained("banned", engine, Constraint.choice(choices), sampling=banned),
            constrained("fine", engine, Constraint.choice(choices)),
            constrained("plain", engine, None, ignore_eos=True, max_new_tokens=5),
        ],
    )
    error = results["banned"]
    assert isinstance(error, InvalidRequest)
    assert "request banned: at output token 1, no token is allowed" in str(error)
    fine, plain = results["fine"], results["plain"]
    assert isinstance(fine, Completion) and fine.text in choices
    assert isinstance(plain, Completion) and len(plain.token_ids) == 5
    assert engine.constrained_rows == 0 and engine.batch_size == 0


def test_a_rejected_constraint_is_refused_without_disturbing_others(engine: Engine) -> None:
    runner = BatchRunner(engine, OFFLINE_LIMITS.resolve(engine))
    bad = {
        "schema": Constraint.json_schema('{"type": "object", "properties": {"a": {"type": "nope"}}}'),
        "regex": Constraint.regex("[a-"),
        "grammar": Constraint.grammar("start: x y"),
    }
    plain = constrained("plain", engine, None, ignore_eos=True, max_new_tokens=12)
    results = drive(runner, [plain, *(constrained(k, engine, c) for k, c in bad.items())])
    for kind in bad:
        error = results[kind]
        assert isinstance(error, InvalidRequest) and str(error).startswith(f"request {kind}: constraint."), (
            error
        )
    solo = generate(engine, [plain.prompt_ids], max_new_tokens=12, ignore_eos=True)[0]
    done = results["plain"]
    assert isinstance(done, Completion) and done.token_ids == solo.token_ids
    assert runner.snapshot().outcomes == {"finished": 1, "rejected": 3}


def test_a_cancelled_constrained_request_frees_its_row_and_matcher(engine: Engine) -> None:
    runner = BatchRunner(engine, OFFLINE_LIMITS.resolve(engine))
    endless = Constraint.json_schema({"type": "array", "items": {"type": "integer"}, "minItems": 50})
    for rid in ("victim", "other"):
        runner.enqueue(runner.track(constrained(rid, engine, endless, max_new_tokens=60)))
    for _ in range(5):  # admitted, then a few tokens each (handed over only at the end: not streamed)
        runner.wait_for_work(lambda: False)
        assert runner.step() == []
    assert engine.constrained_rows == 2
    runner.request_cancel("victim")
    outcomes = runner.step()
    assert [(t.request_id, type(e)) for t, e in outcomes if isinstance(e, TextgenError)] == [
        ("victim", Cancelled)
    ]
    assert engine.constrained_rows == 1 and engine.running_ids == ["other"]
    runner.request_cancel("other")
    runner.step()
    assert engine.constrained_rows == 0 and engine.batch_size == 0 and runner.idle


# --- the scheduler's side, on a fake engine (it ignores masks: only the bookkeeping is tested) --------------


def test_requests_wait_beside_the_queue_while_their_constraint_compiles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = threading.Event()
    hold_compiles(monkeypatch, gate)
    engine = fake(letter_tokenizer(), 0.0, max_batch_size=4)
    runner = BatchRunner(engine, SchedulerLimits(max_wait_seconds=0.0, max_queue=2).resolve(engine))
    prompt = [40, 41, 42]
    waiting = GenerationRequest("c", prompt, SamplingParams(), 4, constraint=Constraint.regex("[a-c]+"))
    runner.enqueue(runner.track(waiting))
    runner.enqueue(runner.track(GenerationRequest("p", prompt, SamplingParams(), 4, ignore_eos=True)))
    assert runner.snapshot().waiting == 2 and not runner.idle
    with pytest.raises(TextgenError, match="queue is full"):  # a compiling request counts against the bound
        runner.enqueue(runner.track(GenerationRequest("x", prompt, SamplingParams(), 4)))
    runner.step()
    assert engine.running_ids == ["p"]  # the plain one went ahead
    gate.set()
    deadline = time.monotonic() + 10
    while "c" not in engine.running_ids and not runner.idle:
        assert time.monotonic() < deadline
        runner.wait_for_work(lambda: False)
        runner.step()
    assert "c" in engine.running_ids


def test_a_request_cancelled_while_its_constraint_compiles_never_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = threading.Event()
    hold_compiles(monkeypatch, gate)
    engine = fake(letter_tokenizer(), 0.0)
    runner = BatchRunner(engine, SchedulerLimits(max_wait_seconds=0.0).resolve(engine))
    runner.enqueue(
        runner.track(GenerationRequest("c", [40, 41], SamplingParams(), 4, constraint=Constraint.regex("a+")))
    )
    runner.request_cancel("c")
    outcomes = runner.step()
    assert [(t.request_id, type(e)) for t, e in outcomes] == [("c", Cancelled)] and runner.idle
    gate.set()
    time.sleep(0.05)  # the compile ends: the cancelled request stays out of the queue
    assert runner.idle and not engine.calls


def test_the_tracker_ends_a_constrained_request_where_its_constraint_says(engine: Engine) -> None:
    tokenizer = engine.tokenizer
    a = tokenizer.encode("a").ids[0]

    def tracker(**kw: Any) -> RequestTracker:
        request = GenerationRequest("t", [5], SamplingParams(), 3, constraint=Constraint.regex("a+"), **kw)
        tracker = RequestTracker(request, tokenizer, engine.eos_token_id, 64, arrival=0.0)
        tracker.admit(0.0)
        return tracker

    complete = tracker().accept(a, 0.0, 1.0, constraint=ConstraintState.COMPLETE)[1]
    assert complete is not None and complete.finish_reason == "stop" and not complete.constraint_incomplete
    eos = tracker(ignore_eos=True).accept(engine.eos_token_id, 0.0, 1.0)[1]
    assert eos is not None and eos.finish_reason == "eos" and not eos.constraint_incomplete
    partial = tracker()
    for _ in range(2):
        assert partial.accept(a, 0.0, 1.0, constraint=ConstraintState.ACCEPTING)[1] is None
    cut = partial.accept(a, 0.0, 1.0, constraint=ConstraintState.PARTIAL)[1]
    assert cut is not None and cut.finish_reason == "length" and cut.constraint_incomplete
    matching = tracker()
    for _ in range(2):
        matching.accept(a, 0.0, 1.0, constraint=ConstraintState.PARTIAL)
    last = matching.accept(a, 0.0, 1.0, constraint=ConstraintState.ACCEPTING)[1]
    assert last is not None and last.finish_reason == "length" and not last.constraint_incomplete
    assert tracker(ignore_eos=True, min_new_tokens=2).new_sequence().banned[0] == engine.eos_token_id


# --- object schemas that say nothing of other keys ----------------------------------------------------------


def _opened(schema: Any) -> Any:
    """The schema without any `additionalProperties`: as frameworks send their default schemas."""
    if isinstance(schema, dict):
        return {k: _opened(v) for k, v in schema.items() if k != "additionalProperties"}
    return [_opened(item) for item in schema] if isinstance(schema, list) else schema


def test_objects_that_list_their_properties_allow_no_other_key(engine: Engine, bundle: Bundle) -> None:
    """With "," favoured, a model under an open schema writes `,"":0` again and again until max_new_tokens;
    closed, each object ends after its own properties, and the output validates against the schema with
    `additionalProperties: false` everywhere (no extra key)."""
    outs = completions(
        engine,
        [Constraint.json_schema(_opened(s)) for s in SCHEMAS.values()],
        forcing(bundle, ","),
        max_new_tokens=110,
    )
    for schema, out in zip(SCHEMAS.values(), outs, strict=True):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_explicit_additional_properties_are_honoured(engine: Engine, bundle: Bundle) -> None:
    schema = {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}
    open_keys = {**schema, "additionalProperties": {"type": "integer"}}
    (closed, opened) = completions(
        engine, [Constraint.json_schema(schema), Constraint.json_schema(open_keys)], forcing(bundle, ",")
    )
    assert closed.text == '{"a":1}'
    assert opened.text.startswith('{"a":1,"'), opened.text  # "," was allowed, and taken


def test_closed_schema_closes_listed_properties_only() -> None:
    inner: dict[str, Any] = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "inner": inner,
            "free": {"type": "object"},
            "items": {"type": "array", "items": inner},
        },
        "$defs": {"d": inner},
        "anyOf": [inner],
        "allOf": [{"properties": {"a": inner}}],
    }
    closed = closed_schema(schema)
    shut = {**inner, "additionalProperties": False}
    assert closed["additionalProperties"] is False
    assert closed["properties"] == {
        "inner": shut,
        "free": {"type": "object"},
        "items": {"type": "array", "items": shut},
    }
    assert closed["$defs"] == {"d": shut} and closed["anyOf"] == [shut]
    assert closed["allOf"] == [{"properties": {"a": shut}}]  # an allOf member itself stays open
    kept: dict[str, Any]
    for kept in (
        {"additionalProperties": True},
        {"patternProperties": {"^x": {}}},
        {"unevaluatedProperties": False},
    ):
        assert closed_schema({**inner, **kept}) == {**inner, **kept}
    assert schema["properties"]["inner"] == inner  # the caller's schema is left as it was
