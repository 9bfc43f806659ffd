"""textgen-client against a real server with TLS and token auth on a loopback port."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from running_server import RunningServer, loopback_settings
from server_tools import LoopThread, Pki, make_pki

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve.api.client import build_parser, generate_request, main

TOKEN = "client-test-token"


@pytest.fixture(scope="module")
def pki_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pki: Pki = make_pki()
    return pki.write(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def server(tiny_bundle: Path, pki_files: dict[str, Path]) -> Iterator[RunningServer]:
    loop = LoopThread()
    settings = loopback_settings(
        tiny_bundle,
        tls_cert=pki_files["server_cert"],
        tls_key=pki_files["server_key"],
        auth_token=TOKEN,
        max_new_tokens=16,
        default_max_new_tokens=8,
    )
    running = RunningServer(loop, settings)
    yield running
    running.stop()
    loop.close()


def run(
    server: RunningServer, pki_files: dict[str, Path], *args: str, token: str = TOKEN
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    command, *rest = args
    connection = [
        "--target",
        server.target,
        "--tls-ca",
        str(pki_files["ca"]),
        "--tls-server-name",
        "localhost",
        "--token",
        token,
        "--timeout",
        "30",
    ]
    code = main([command, *rest, *connection], out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_generate_plain_and_streamed_print_the_same_text(
    server: RunningServer, pki_files: dict[str, Path]
) -> None:
    options = ("--max-new-tokens", "8", "--ignore-eos")
    code, plain, _ = run(server, pki_files, "generate", "hello there", *options)
    assert code == 0 and plain.endswith("\n")
    code, streamed, usage = run(
        server, pki_files, "generate", "hello there", "--stream", "--verbose", *options
    )
    assert code == 0 and streamed == plain
    assert "finish_reason=FINISH_REASON_LENGTH" in usage and "completion_tokens=8" in usage


def test_verbose_generate_reports_usage_and_timings(
    server: RunningServer, pki_files: dict[str, Path]
) -> None:
    code, _, usage = run(
        server,
        pki_files,
        "generate",
        "hi",
        "--max-new-tokens",
        "3",
        "--ignore-eos",
        "--verbose",
        "--request-id",
        "c1",
    )
    assert code == 0
    for field in ("request_id=c1", "completion_tokens=3", "ttft_s=", "total_s="):
        assert field in usage


def test_verbose_generate_reports_the_prompts_score(
    server: RunningServer, pki_files: dict[str, Path]
) -> None:
    for stream in ([], ["--stream"]):
        flags = ["--max-new-tokens", "2", "--prompt-top-logprobs", "1", "--verbose", *stream]
        code, _, report = run(server, pki_files, "generate", "the quick brown fox", *flags)
        assert code == 0
        fields = dict(item.split("=", 1) for item in report.split() if "=" in item)
        assert float(fields["prompt_logprob"]) < 0 and float(fields["prompt_perplexity"]) > 1
        greedy, scored = map(int, fields["prompt_greedy"].split("/"))
        assert 0 <= greedy <= scored and scored == int(fields["prompt_tokens"]) - 1


def test_every_sampling_and_stopping_flag_reaches_the_request() -> None:
    flags = (
        "generate hi --temperature 0.7 --top-k 5 --top-p 0.9 --min-p 0.05 --repetition-penalty 1.1 "
        "--frequency-penalty 0.5 --presence-penalty -0.5 --logit-bias 5=-100 --logit-bias 9=2.5 --seed 3 "
        "--max-new-tokens 9 --min-new-tokens 2 --truncate-prompt-tokens 30 "
        "--stop-token-id 7 --stop-token-id 11 --stop END --include-stop-str --ignore-eos --top-logprobs 4 "
        "--prompt-logprobs --prompt-top-logprobs 2 --num-speculative-tokens 0 --priority -2 --adapter sql"
    )
    args = build_parser().parse_args(flags.split(" "))
    request = generate_request(args)
    sampling, stopping = request.sampling, request.stopping
    assert (sampling.top_k, sampling.seed) == (5, 3)
    assert sampling.min_p == pytest.approx(0.05) and sampling.frequency_penalty == 0.5
    assert sampling.presence_penalty == -0.5 and sampling.repetition_penalty == pytest.approx(1.1)
    assert dict(sampling.logit_bias) == {5: -100.0, 9: 2.5}
    assert (stopping.max_new_tokens, stopping.min_new_tokens, list(stopping.stop_token_ids)) == (
        9,
        2,
        [7, 11],
    )
    assert list(stopping.stop) == ["END"] and stopping.ignore_eos and stopping.include_stop_str_in_output
    assert request.include_logprobs and request.top_logprobs == 4  # top logprobs imply logprobs
    assert request.truncate_prompt_tokens == 30 and request.include_prompt_logprobs
    assert request.prompt_top_logprobs == 2
    assert request.HasField("num_speculative_tokens") and request.num_speculative_tokens == 0
    assert request.priority == -2 and request.adapter == "sql"
    assert not generate_request(build_parser().parse_args(["generate", "hi"])).HasField(
        "num_speculative_tokens"
    )


@pytest.mark.parametrize("bad", ["5", "x=1", "5=high", "-3=1"])
def test_a_malformed_logit_bias_flag_is_refused(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", f"--logit-bias={bad}"])
    assert "expected TOKEN_ID=BIAS" in capsys.readouterr().err


@pytest.mark.parametrize("stream", [False, True])
def test_verbose_generate_prints_each_token_with_its_logprob_and_alternatives(
    server: RunningServer, pki_files: dict[str, Path], stream: bool
) -> None:
    options = ["--max-new-tokens", "3", "--ignore-eos", "--verbose", "--top-logprobs", "2"]
    code, _, report = run(server, pki_files, "generate", "hi", *options, *(["--stream"] if stream else []))
    assert code == 0
    lines = [line for line in report.splitlines() if " | " in line]
    assert len(lines) == 3
    for line in lines:
        token, _, rest = line.partition(" ")
        assert token.isdigit() and rest.count(", ") >= 1  # its text and logprob, then two alternatives
    code, _, plain = run(server, pki_files, "generate", "hi", "--max-new-tokens", "3", "--verbose")
    assert code == 0 and " | " not in plain  # no logprobs asked for: no token lines


def test_info_and_health(server: RunningServer, pki_files: dict[str, Path]) -> None:
    code, out, _ = run(server, pki_files, "info")
    info = json.loads(out)
    assert code == 0 and info["model_name"] == server.model.bundle.manifest.model_name
    assert info["max_new_tokens_limit"] == 16
    assert info["eos_token_id"] == server.model.info.eos_token_id  # printed even when 0
    code, out, _ = run(server, pki_files, "health")
    assert (code, out.strip()) == (0, "SERVING")


def test_wrong_token_is_refused(server: RunningServer, pki_files: dict[str, Path]) -> None:
    code, out, err = run(server, pki_files, "generate", "hi", token="wrong")
    assert code == 1 and out == ""
    assert err.startswith("error: UNAUTHENTICATED: invalid bearer token")
    scrape = server.server.metrics.exposition()
    assert 'textgen_requests_total{code="UNAUTHENTICATED",rpc="Generate"}' in scrape


def test_server_errors_are_printed_with_their_status(
    server: RunningServer, pki_files: dict[str, Path]
) -> None:
    code, _, err = run(server, pki_files, "generate", "hi", "--max-new-tokens", "500")
    assert code == 1 and "INVALID_ARGUMENT: prompt (" in err and "+ max_new_tokens (500) = " in err


def test_round_robin_over_a_list_of_addresses(server: RunningServer, pki_files: dict[str, Path]) -> None:
    out, err = io.StringIO(), io.StringIO()
    target = f"ipv4:{server.target},{server.target}"
    argv = ["health", "--target", target, "--lb", "round_robin", "--tls-ca", str(pki_files["ca"])]
    code = main([*argv, "--tls-server-name", "localhost"], out=out, err=err)
    assert (code, out.getvalue().strip()) == (0, "SERVING"), err.getvalue()


def test_tls_client_options_are_checked() -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["info", "--tls-cert", "cert.pem"], out=io.StringIO(), err=io.StringIO())
    assert exit_info.value.code == 2


def test_each_constraint_flag_reaches_the_request(tmp_path: Path) -> None:
    schema = {"type": "array", "items": {"type": "integer"}}
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(schema))
    grammar_file = tmp_path / "g.lark"
    grammar_file.write_text('start: "x"')

    def constraint(*flags: str) -> pb.Constraint:
        return generate_request(build_parser().parse_args(["generate", "hi", *flags])).constraint

    assert json.loads(constraint("--json-schema", str(schema_file)).json_schema) == schema
    assert constraint("--json-schema", '{"type": "string"}').json_schema == '{"type": "string"}'
    assert constraint("--json-object").json_object
    assert constraint("--regex", "[a-z]+").regex == "[a-z]+"
    assert constraint("--grammar", str(grammar_file)).grammar == 'start: "x"'
    assert constraint("--grammar", 'start: "y"').grammar == 'start: "y"'
    assert list(constraint("--choice", "yes", "--choice", "no").choice.choices) == ["yes", "no"]
    assert not generate_request(build_parser().parse_args(["generate", "hi"])).HasField("constraint")


@pytest.mark.parametrize(
    "flags",
    [["--regex", "a", "--choice", "b"], ["--json-schema", "{not json"], ["--json-object", "--regex", "a"]],
)
def test_conflicting_or_malformed_constraint_flags_are_refused(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["generate", "hi", *flags])
    assert exit_info.value.code == 2
    assert "--" in capsys.readouterr().err
