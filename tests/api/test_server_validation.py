"""Request validation: every INVALID_ARGUMENT case names the field and the allowed range."""

from __future__ import annotations

import dataclasses
import math

import pytest

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve.api.grpc_requests import generation_request, prompt_ids, reject_unknown_fields
from serve.api.validation import (
    MAX_CONSTRAINT_CHARS,
    MESSAGES_FIELDS,
    OPENAI_FIELDS,
    RESPONSES_FIELDS,
    Fields,
    RequestLimits,
    check_request_id,
    header_priority,
    max_new_tokens,
)
from serve.engine.types import Constraint, ConstraintKind
from serve.errors import InvalidRequest
from serve.scheduling.request import GenerationRequest

LIMITS = RequestLimits(
    vocab_size=100,
    context_length=64,
    max_prompt_tokens=63,
    default_max_new_tokens=16,
    max_new_tokens=32,
    max_stop_strings=2,
    max_stop_length=5,
)


def _encode(text: str) -> list[int]:
    return [ord(c) % 100 for c in text]


def _build(request: pb.GenerateRequest) -> GenerationRequest:
    prompt = prompt_ids(request, _encode, LIMITS.vocab_size)
    return generation_request(request, request_id="r1", prompt=prompt, limits=LIMITS, deadline=None)


def test_valid_request_maps_every_field() -> None:
    request = pb.GenerateRequest(
        text="hello",
        sampling=pb.SamplingParams(
            temperature=0.5,
            top_k=5,
            top_p=0.9,
            repetition_penalty=1.1,
            seed=7,
            min_p=0.05,
            frequency_penalty=0.5,
            presence_penalty=-0.25,
        ),
        stopping=pb.StoppingCriteria(
            max_new_tokens=10, stop=["\n"], ignore_eos=True, min_new_tokens=4, stop_token_ids=[7, 99]
        ),
        include_logprobs=True,
    )
    generation = generation_request(
        request, request_id="r1", prompt=prompt_ids(request, _encode, 100), limits=LIMITS, deadline=12.5
    )
    assert generation.prompt_ids == _encode("hello")
    assert generation.max_new_tokens == 10 and generation.stop == ("\n",)
    assert generation.ignore_eos and generation.include_logprobs and generation.deadline == 12.5
    assert generation.sampling.seed == 7 and generation.sampling.top_k == 5
    assert generation.sampling.temperature == pytest.approx(0.5)
    assert generation.sampling.min_p == pytest.approx(0.05)
    assert generation.sampling.frequency_penalty == 0.5 and generation.sampling.presence_penalty == -0.25
    assert generation.min_new_tokens == 4 and generation.stop_token_ids == (7, 99)


def test_priority_is_carried_and_defaults_to_zero() -> None:
    assert _build(pb.GenerateRequest(text="hi", priority=-4)).priority == -4
    assert _build(pb.GenerateRequest(text="hi")).priority == 0


@pytest.mark.parametrize(
    ("header", "value"), [("3", 3), (" -12 ", -12), ("+0", 0), ("2147483647", 2**31 - 1)]
)
def test_a_priority_header_is_a_decimal_int32(header: str, value: int) -> None:
    assert header_priority(header) == value


@pytest.mark.parametrize("header", ["", "1.5", "high", "0x10", "1_0", "2147483648", "-2147483649"])
def test_a_priority_header_that_is_not_an_int32_is_refused(header: str) -> None:
    with pytest.raises(InvalidRequest, match=r"X-Request-Priority is .*; give an integer"):
        header_priority(header)


def test_unset_seed_is_none_and_zero_seed_is_kept() -> None:
    unset = _build(pb.GenerateRequest(text="a"))
    zero = _build(pb.GenerateRequest(text="a", sampling=pb.SamplingParams(seed=0)))
    assert unset.sampling.seed is None
    assert zero.sampling.seed == 0


def test_token_ids_input_is_taken_as_is() -> None:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 99]))
    assert prompt_ids(request, _encode, 100) == [1, 2, 99]


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (pb.GenerateRequest(), "input is required: set either text or token_ids"),
        (pb.GenerateRequest(text=""), "text is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 100])), r"token_ids\[1\] = 100 .* allowed 0\.\.99"),
    ],
)
def test_bad_input(request_: pb.GenerateRequest, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        prompt_ids(request_, _encode, 100)


def test_text_that_encodes_to_nothing() -> None:
    with pytest.raises(InvalidRequest, match="encodes to no tokens"):
        prompt_ids(pb.GenerateRequest(text="x"), lambda _text: [], 100)


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (pb.SamplingParams(temperature=-0.1), r"temperature must be a finite number >= 0 \(0 = greedy\)"),
        (pb.SamplingParams(temperature=math.nan), "temperature .* got nan"),
        (pb.SamplingParams(temperature=math.inf), "temperature .* got inf"),
        (pb.SamplingParams(top_p=1.5), r"top_p must be in \[0, 1\]"),
        (pb.SamplingParams(top_p=-0.5), r"top_p must be in \[0, 1\]"),
        (pb.SamplingParams(top_p=math.nan), r"top_p must be in \[0, 1\]"),
        (pb.SamplingParams(repetition_penalty=-1), "repetition_penalty must be 0 .* or a finite number > 0"),
        (pb.SamplingParams(repetition_penalty=math.inf), "repetition_penalty"),
        (pb.SamplingParams(min_p=1.5), r"min_p must be in \[0, 1\]"),
        (
            pb.SamplingParams(frequency_penalty=-3),
            r"frequency_penalty must be in \[-2, 2\] \(0 = off\), got -3",
        ),
        (pb.SamplingParams(presence_penalty=math.nan), r"presence_penalty must be in \[-2, 2\]"),
    ],
)
def test_bad_sampling(sampling: pb.SamplingParams, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        _build(pb.GenerateRequest(text="a", sampling=sampling))


@pytest.mark.parametrize(
    ("stop", "message"),
    [
        (["a", "b", "c"], "3 stop strings given; at most 2 are allowed"),
        (["toolong"], r"stop\[0\] has 7 characters; allowed 1\.\.5"),
        (["ok", ""], r"stop\[1\] is empty"),
    ],
)
def test_bad_stop_strings(stop: list[str], message: str) -> None:
    with pytest.raises(InvalidRequest, match=message):
        _build(pb.GenerateRequest(text="a", stopping=pb.StoppingCriteria(stop=stop)))


def test_stop_token_ids_are_capped() -> None:
    # Their range is validate_request's, tested in test_scheduler and test_server.
    with pytest.raises(InvalidRequest, match="65 stop token ids given; at most 64"):
        _build(pb.GenerateRequest(text="a", stopping=pb.StoppingCriteria(stop_token_ids=list(range(65)))))


def test_max_new_tokens_default_cap_and_context() -> None:
    assert max_new_tokens(0, prompt_tokens=10, limits=LIMITS) == 16  # the server's default
    assert max_new_tokens(0, prompt_tokens=60, limits=LIMITS) == 4  # the default, shortened to the context
    assert max_new_tokens(32, prompt_tokens=32, limits=LIMITS) == 32  # exactly fills the context
    assert max_new_tokens(40, prompt_tokens=1, limits=LIMITS) == 32  # above the cap: lowered to it
    with pytest.raises(
        InvalidRequest,
        match=r"= 65 exceeds the context length 64: allowed max_new_tokens 1\.\.4 for this prompt "
        r"\(0: the server's default\)$",
    ):
        max_new_tokens(5, prompt_tokens=60, limits=LIMITS)
    with pytest.raises(InvalidRequest, match=r"prompt has 64 tokens; allowed 1\.\.63 \(the context holds 64"):
        max_new_tokens(0, prompt_tokens=64, limits=LIMITS)


def test_without_a_default_or_a_cap_a_request_may_fill_its_context() -> None:
    # vLLM's way, and the server's defaults: no max_new_tokens generates until the context is full, and
    # only a max_new_tokens the context cannot hold is refused.
    limits = dataclasses.replace(LIMITS, default_max_new_tokens=None, max_new_tokens=None)
    assert max_new_tokens(0, prompt_tokens=10, limits=limits) == 54
    assert max_new_tokens(54, prompt_tokens=10, limits=limits) == 54
    assert limits.largest_new_tokens == 63 and LIMITS.largest_new_tokens == 32
    with pytest.raises(InvalidRequest, match=r"= 65 exceeds the context length 64"):
        max_new_tokens(55, prompt_tokens=10, limits=limits)


def test_a_messages_max_tokens_beyond_the_context_runs_until_it_is_full() -> None:
    # Anthropic's way: its clients must send max_tokens, and send large ones (langchain-anthropic 4096).
    limits = dataclasses.replace(LIMITS, max_new_tokens=None)
    assert max_new_tokens(4096, prompt_tokens=60, limits=limits, fields=MESSAGES_FIELDS) == 4
    assert max_new_tokens(4096, prompt_tokens=10, limits=LIMITS, fields=MESSAGES_FIELDS) == 32  # the cap


@pytest.mark.parametrize(
    ("fields", "hint"),
    [
        (OPENAI_FIELDS, "allowed max_tokens 1..4 for this prompt (or leave it out for the server's default)"),
        (
            RESPONSES_FIELDS,
            "allowed max_output_tokens 1..4 for this prompt (or leave it out for the server's",
        ),
    ],
    ids=["chat", "responses"],
)
def test_the_refusal_says_how_each_endpoint_asks_for_the_default(fields: Fields, hint: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        max_new_tokens(5, prompt_tokens=60, limits=LIMITS, fields=fields)
    message = str(refused.value)
    assert hint in message and "0" not in message.split("for this prompt")[1]


def test_truncate_prompt_tokens_keeps_the_prompts_end() -> None:
    long = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(range(1, 81))), truncate_prompt_tokens=40)
    assert _build(long).prompt_ids == list(range(41, 81))
    short = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]), truncate_prompt_tokens=40)
    assert _build(short).prompt_ids == [1, 2, 3]
    with pytest.raises(InvalidRequest, match=r"truncate_prompt_tokens = 64; allowed 0\.\.63 \(0 = off\)"):
        _build(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), truncate_prompt_tokens=64))
    # The kept tokens still leave room for max_new_tokens, or the request is refused as any other.
    with pytest.raises(InvalidRequest, match="exceeds the context length 64"):
        _build(
            pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=list(range(80))),
                truncate_prompt_tokens=60,
                stopping=pb.StoppingCriteria(max_new_tokens=10),
            )
        )


def test_prompt_longer_than_context_is_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"prompt has 70 tokens; allowed 1\.\.63"):
        _build(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 70)))


def test_max_prompt_tokens_below_the_context() -> None:
    limits = dataclasses.replace(LIMITS, max_prompt_tokens=10)
    assert max_new_tokens(0, prompt_tokens=10, limits=limits) == 16
    with pytest.raises(InvalidRequest, match=r"prompt has 11 tokens; allowed 1\.\.10"):
        max_new_tokens(0, prompt_tokens=11, limits=limits)


def test_request_id_length() -> None:
    assert check_request_id("abc") == "abc"
    with pytest.raises(InvalidRequest, match="request_id has 129 characters; at most 128"):
        check_request_id("x" * 129)


def test_unknown_fields_are_refused_at_any_depth() -> None:
    top = pb.GenerateRequest.FromString(pb.GenerateRequest(text="a").SerializeToString() + b"\x78\x05")
    with pytest.raises(InvalidRequest, match=r"GenerateRequest has unknown field number\(s\) \[15\]"):
        reject_unknown_fields(top)
    nested = pb.GenerateRequest(text="a")
    nested.sampling.MergeFromString(b"\x78\x01")  # field 15 of SamplingParams does not exist
    with pytest.raises(InvalidRequest, match=r"SamplingParams has unknown field number\(s\) \[15\]"):
        reject_unknown_fields(nested)
    reject_unknown_fields(pb.GenerateRequest(text="a", sampling=pb.SamplingParams(temperature=1)))


def _constraint_of(message: pb.Constraint) -> object:
    return _build(pb.GenerateRequest(text="hello", constraint=message)).constraint


def test_each_kind_of_constraint_maps_to_its_protocol_neutral_value() -> None:
    assert _build(pb.GenerateRequest(text="hello")).constraint is None
    schema = '{"type": "object", "properties": {"b": {}, "a": {}}}'
    assert _constraint_of(pb.Constraint(json_schema=schema)) == Constraint.json_schema(schema)  # as sent
    assert _constraint_of(pb.Constraint(json_object=True)) == Constraint.json_object()
    assert _constraint_of(pb.Constraint(regex="[a-z]+")) == Constraint.regex("[a-z]+")
    assert _constraint_of(pb.Constraint(grammar='start: "x"')) == Constraint.grammar('start: "x"')
    choice = pb.Constraint(choice=pb.ChoiceList(choices=["b", "a"]))
    assert _constraint_of(choice) == Constraint(ConstraintKind.CHOICE, choices=("b", "a"))


@pytest.mark.parametrize(
    ("message", "error"),
    [
        (pb.Constraint(json_schema=""), r"constraint.json_schema is empty"),
        (pb.Constraint(json_schema="{"), r"constraint.json_schema is not JSON: "),
        (pb.Constraint(json_schema="[1]"), r"constraint.json_schema must be a JSON object"),
        (pb.Constraint(json_object=False), r"constraint.json_object must be true when set"),
        (pb.Constraint(regex=""), r"constraint.regex is empty"),
        (pb.Constraint(grammar="x" * (MAX_CONSTRAINT_CHARS + 1)), r"constraint.grammar has 65537 characters"),
        (pb.Constraint(choice=pb.ChoiceList()), r"constraint.choice has 0 strings; allowed 1\.\.256"),
        (pb.Constraint(choice=pb.ChoiceList(choices=["a", ""])), r"constraint.choice.choices\[1\] is empty"),
        (pb.Constraint(choice=pb.ChoiceList(choices=["a"] * 257)), r"constraint.choice has 257 strings"),
    ],
)
def test_malformed_constraints_are_refused_naming_the_field(message: pb.Constraint, error: str) -> None:
    with pytest.raises(InvalidRequest, match=error):
        _constraint_of(message)


def test_prompt_logprobs_are_refused_where_the_server_does_not_score_prompts() -> None:
    """--no-prompt-logprobs: the pod is sized without the scoring session, so no request may make one."""
    request = pb.GenerateRequest(text="hello world", include_prompt_logprobs=True)
    prompt = prompt_ids(request, _encode, LIMITS.vocab_size)
    off = dataclasses.replace(LIMITS, prompt_logprobs=False)
    with pytest.raises(InvalidRequest, match="--no-prompt-logprobs"):
        generation_request(request, request_id="r1", prompt=prompt, limits=off, deadline=None)
    assert _build(request).prompt_logprobs  # served where the server scores prompts
