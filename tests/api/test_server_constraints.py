"""Structured output over gRPC: `GenerateRequest.constraint` end to end, on the tiny bundle, for both shapes
of the server (the constraint compiles in the engine process, or beside the engine thread)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import pytest
from engine_faults import InjectedFaults
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, rpc_error

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

PROMPT = "the quick brown fox"
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3},
    },
    "required": ["id", "tags"],
    "additionalProperties": False,
}
ENDLESS = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 100})


@pytest.fixture(scope="module", params=[True, False], ids=["engine process", "engine thread"])
def server(loop: LoopThread, tiny_bundle: Path, request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    """Requests whose id starts with "slow-" make every decode step slow while they run."""
    settings = loopback_settings(
        tiny_bundle, max_new_tokens=100, default_max_new_tokens=60, engine_process=request.param
    )
    running = RunningServer(loop, settings, InjectedFaults())
    yield running
    running.stop()


@pytest.fixture(scope="module")
def stub(server: RunningServer) -> Iterator[pb_grpc.TextGenerationStub]:
    with grpc.insecure_channel(server.target) as channel:
        yield pb_grpc.TextGenerationStub(channel)


def constrained(constraint: pb.Constraint, max_new_tokens: int = 60, **fields: object) -> pb.GenerateRequest:
    stopping = pb.StoppingCriteria(max_new_tokens=max_new_tokens)
    return pb.GenerateRequest(text=PROMPT, stopping=stopping, constraint=constraint, **fields)


def test_a_json_schema_constrains_generate_and_stream_alike(stub: pb_grpc.TextGenerationStub) -> None:
    request = constrained(pb.Constraint(json_schema=json.dumps(SCHEMA)))
    whole = stub.Generate(request)
    jsonschema.validate(json.loads(whole.text), SCHEMA)
    assert whole.finish_reason == pb.FINISH_REASON_STOP and not whole.constraint_incomplete
    parts = list(stub.GenerateStream(request))
    assert "".join(p.text for p in parts) == whole.text
    assert parts[-1].finish_reason == pb.FINISH_REASON_STOP and not parts[-1].constraint_incomplete


def test_regex_choice_and_grammar(stub: pb_grpc.TextGenerationStub) -> None:
    regex = stub.Generate(constrained(pb.Constraint(regex="[A-Z][a-z]{3}-[0-9]{2}")))
    assert re.fullmatch("[A-Z][a-z]{3}-[0-9]{2}", regex.text)
    choice = stub.Generate(constrained(pb.Constraint(choice=pb.ChoiceList(choices=["left", "right"]))))
    assert choice.text in {"left", "right"} and choice.finish_reason == pb.FINISH_REASON_STOP
    lark = 'start: "x=" DIGIT DIGIT ";"\nDIGIT: /[0-9]/\n'
    grammar = stub.Generate(constrained(pb.Constraint(grammar=lark)))
    assert re.fullmatch("x=[0-9]{2};", grammar.text)


def test_max_new_tokens_reports_an_incomplete_output(stub: pb_grpc.TextGenerationStub) -> None:
    request = constrained(pb.Constraint(json_schema=ENDLESS), max_new_tokens=6)
    whole = stub.Generate(request)
    assert whole.finish_reason == pb.FINISH_REASON_LENGTH and whole.constraint_incomplete
    assert whole.text.startswith("[") and len(whole.token_ids) == 6
    last = list(stub.GenerateStream(request))[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH and last.constraint_incomplete


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        (pb.Constraint(json_schema='{"type": "nope"}'), "constraint.json_schema is not valid: "),
        (pb.Constraint(json_schema="{not json"), "constraint.json_schema is not JSON"),
        (pb.Constraint(regex="(unclosed"), "constraint.regex is not valid: "),
        (pb.Constraint(grammar="start: undefined_rule"), "constraint.grammar is not valid: "),
        (pb.Constraint(choice=pb.ChoiceList()), "constraint.choice has 0 strings"),
        (pb.Constraint(json_object=False), "constraint.json_object must be true"),
    ],
    ids=["schema", "not json", "regex", "grammar", "no choices", "json_object false"],
)
def test_a_bad_constraint_is_invalid_argument_and_running_streams_go_on(
    stub: pb_grpc.TextGenerationStub, constraint: pb.Constraint, message: str
) -> None:
    plain = pb.GenerateRequest(text=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=12, ignore_eos=True))
    alone = stub.Generate(plain)
    plain.request_id = "slow-beside-a-bad-constraint"
    running = stub.GenerateStream(plain)
    first = next(running)  # it is running
    error = rpc_error(lambda: stub.Generate(constrained(constraint)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in (error.details() or "")
    rest = list(running)
    assert [t for m in [first, *rest] for t in m.token_ids] == list(alone.token_ids)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH


def test_no_allowed_token_fails_that_request_clearly(stub: pb_grpc.TextGenerationStub) -> None:
    vocab = list(stub.Detokenize(pb.DetokenizeRequest(ids=list(range(320)))).tokens)
    openers = [i for i, token in enumerate(vocab) if token and "yes".startswith(token)]
    sampling = pb.SamplingParams(logit_bias={i: -100.0 for i in openers})
    request = constrained(pb.Constraint(choice=pb.ChoiceList(choices=["yes"])), sampling=sampling)
    error = rpc_error(lambda: stub.Generate(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "at output token 1, no token is allowed" in (error.details() or "")


def test_a_cancelled_constrained_stream_frees_its_row(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    cancelled = server.snapshot().outcomes.get("cancelled", 0)
    call = stub.GenerateStream(constrained(pb.Constraint(json_schema=ENDLESS), 90, request_id="slow-cancel"))
    next(call), next(call)
    call.cancel()
    snapshot = server.wait_idle(5.0)
    assert snapshot.running == 0 and snapshot.kv_slots_used == 0
    assert snapshot.outcomes.get("cancelled", 0) == cancelled + 1
    engine = getattr(server.model.scheduler, "_engine", None)  # the engine thread's: here to look at
    if engine is not None:
        assert engine.constrained_rows == 0


def test_constrained_and_plain_requests_batched_together(stub: pb_grpc.TextGenerationStub) -> None:
    plain = pb.GenerateRequest(text=PROMPT, stopping=pb.StoppingCriteria(max_new_tokens=20, ignore_eos=True))
    alone = stub.Generate(plain)
    results: dict[str, pb.GenerateResponse] = {}

    def call(name: str, request: pb.GenerateRequest) -> None:
        results[name] = stub.Generate(request)

    requests = {
        "plain-1": plain,
        "schema": constrained(pb.Constraint(json_schema=json.dumps(SCHEMA))),
        "plain-2": plain,
        "regex": constrained(pb.Constraint(regex="[a-z]{15}")),
    }
    threads = [threading.Thread(target=call, args=item) for item in requests.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert results["plain-1"].token_ids == results["plain-2"].token_ids == alone.token_ids
    jsonschema.validate(json.loads(results["schema"].text), SCHEMA)
    assert re.fullmatch("[a-z]{15}", results["regex"].text)


def test_constrained_requests_and_mask_costs_reach_the_metrics(
    stub: pb_grpc.TextGenerationStub, server: RunningServer
) -> None:
    sample = server.metric
    regexes, masks = (
        sample("textgen_constrained_requests_total", kind="regex"),
        sample("textgen_constraint_masks_total"),
    )
    reply = stub.Generate(constrained(pb.Constraint(regex="[a-z]{6}")))
    assert sample("textgen_constrained_requests_total", kind="regex") == regexes + 1
    # A step's metric calls are recorded before its outcomes are delivered (an engine process sends them in
    # the same message, replayed first): the reply's steps are counted by now.
    assert sample("textgen_constraint_masks_total") >= masks + reply.usage.completion_tokens
    assert sample("textgen_constraint_compile_seconds_count") >= 1
