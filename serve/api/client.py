"""`textgen-client`: call a textgen server from the command line.

    textgen-client generate "Once upon a time" --stream --max-new-tokens 64 --verbose
    textgen-client generate "A user:" --json-schema user.schema.json    # structured output (or --regex, ...)
    textgen-client info
    textgen-client health

Exit codes: 0 on success (`health`: SERVING), 1 when the server answers with an error (or NOT_SERVING),
2 for bad arguments. The token may also come from TEXTGEN_AUTH_TOKEN.

Just over 400 lines: one command line, its subcommands and their printing, for users to read in one place.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serve._proto.textgen.v1 import textgen_pb2 as pb
from serve._proto.textgen.v1 import textgen_pb2_grpc as pb_grpc

DEFAULT_TARGET = "localhost:50051"
TOKEN_ENV = "TEXTGEN_AUTH_TOKEN"
# Requests that never reached a server (replica gone, draining) are safe to send again, to another replica.
RETRY_POLICY = {
    "maxAttempts": 3,
    "initialBackoff": "0.1s",
    "maxBackoff": "1s",
    "backoffMultiplier": 2,
    "retryableStatusCodes": ["UNAVAILABLE"],
}


def service_config(lb: str | None) -> str:
    config: dict[str, object] = {"methodConfig": [{"name": [{}], "retryPolicy": RETRY_POLICY}]}
    if lb is not None:
        config["loadBalancingConfig"] = [{lb: {}}]
    return json.dumps(config)


def channel_credentials(
    tls_ca: Path | None, tls_cert: Path | None, tls_key: Path | None
) -> grpc.ChannelCredentials | None:
    """TLS when any TLS option is given (no CA: the system roots); mTLS with a client certificate and key."""
    if (tls_cert is None) != (tls_key is None):
        raise ValueError("--tls-cert and --tls-key must be given together")
    if tls_ca is None and tls_cert is None:
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls_ca.read_bytes() if tls_ca else None,
        private_key=tls_key.read_bytes() if tls_key else None,
        certificate_chain=tls_cert.read_bytes() if tls_cert else None,
    )


def connect(
    target: str,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    lb: str | None = None,
    server_name: str | None = None,
    max_message_bytes: int = 4 * 1024 * 1024,
) -> grpc.Channel:
    """A channel with the retry policy for UNAVAILABLE and, optionally, a load-balancing policy."""
    options: list[tuple[str, object]] = [
        ("grpc.service_config", service_config(lb)),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if server_name is not None:
        options.append(("grpc.ssl_target_name_override", server_name))
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def auth_metadata(token: str | None) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")] if token else []


def generate_request(args: argparse.Namespace) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        logit_bias=dict(args.logit_bias),
    )
    if args.seed is not None:
        sampling.seed = args.seed
    request = pb.GenerateRequest(
        request_id=args.request_id,
        text=args.prompt,
        sampling=sampling,
        stopping=pb.StoppingCriteria(
            max_new_tokens=args.max_new_tokens,
            stop=args.stop,
            ignore_eos=args.ignore_eos,
            min_new_tokens=args.min_new_tokens,
            stop_token_ids=args.stop_token_id,
            include_stop_str_in_output=args.include_stop_str,
        ),
        include_logprobs=args.logprobs or args.top_logprobs > 0,
        top_logprobs=args.top_logprobs,
        truncate_prompt_tokens=args.truncate_prompt_tokens,
        include_prompt_logprobs=args.prompt_logprobs or args.prompt_top_logprobs > 0,
        prompt_top_logprobs=args.prompt_top_logprobs,
        constraint=constraint(args),
        priority=args.priority,
        adapter=args.adapter,
    )
    if args.num_speculative_tokens is not None:
        request.num_speculative_tokens = args.num_speculative_tokens
    return request


def constraint(args: argparse.Namespace) -> pb.Constraint | None:
    """The --json-schema / --json-object / --regex / --grammar / --choice flag given, if any."""
    if args.json_schema is not None:
        return pb.Constraint(json_schema=args.json_schema)
    if args.json_object:
        return pb.Constraint(json_object=True)
    if args.regex is not None:
        return pb.Constraint(regex=args.regex)
    if args.grammar is not None:
        return pb.Constraint(grammar=args.grammar)
    if args.choice:
        return pb.Constraint(choice=pb.ChoiceList(choices=args.choice))
    return None


def _report(fields: dict[str, object], err: TextIO) -> None:
    print(" ".join(f"{key}={value}" for key, value in fields.items()), file=err)


def run_generate(stub: pb_grpc.TextGenerationStub, args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    request = generate_request(args)
    metadata = auth_metadata(args.token)
    if not args.stream:
        response = stub.Generate(request, metadata=metadata, timeout=args.timeout)
        out.write(response.text + "\n")
        if args.verbose:
            _report(
                {
                    "request_id": response.request_id,
                    "finish_reason": pb.FinishReason.Name(response.finish_reason),
                    "prompt_tokens": response.usage.prompt_tokens,
                    "cached_prompt_tokens": response.usage.cached_prompt_tokens,
                    "completion_tokens": response.usage.completion_tokens,
                    "queue_s": f"{response.queue_seconds:.4f}",
                    "ttft_s": f"{response.time_to_first_token_seconds:.4f}",
                    "total_s": f"{response.total_seconds:.4f}",
                    **_incomplete(response.constraint_incomplete),
                    **_prompt_score(response.prompt_logprobs, response.prompt_top_logprobs),
                },
                err,
            )
            _report_logprobs(stub, args, response.token_ids, response.logprobs, response.top_logprobs, err)
        return 0
    last = pb.GenerateStreamResponse()
    tokens: list[int] = []
    logprobs: list[float] = []
    top: list[pb.TopLogprobs] = []
    prompt: list[float] = []
    prompt_top: list[pb.TopLogprobs] = []
    for message in stub.GenerateStream(request, metadata=metadata, timeout=args.timeout):
        out.write(message.text)
        out.flush()
        prompt += message.prompt_logprobs
        prompt_top += message.prompt_top_logprobs
        tokens += message.token_ids
        logprobs += message.logprobs
        top += message.top_logprobs
        last = message
    out.write("\n")
    if args.verbose:
        _report(
            {
                "request_id": last.request_id,
                "finish_reason": pb.FinishReason.Name(last.finish_reason),
                "prompt_tokens": last.usage.prompt_tokens,
                "cached_prompt_tokens": last.usage.cached_prompt_tokens,
                "completion_tokens": last.usage.completion_tokens,
                **_incomplete(last.constraint_incomplete),
                **_prompt_score(prompt, prompt_top),
            },
            err,
        )
        _report_logprobs(stub, args, tokens, logprobs, top, err)
    return 0


def _incomplete(incomplete: bool) -> dict[str, str]:
    """A constrained completion cut short (max tokens, context, a stop) says so: it is not a full match."""
    return {"constraint_incomplete": "true"} if incomplete else {}


def _prompt_score(logprobs: Sequence[float], top: Sequence[pb.TopLogprobs]) -> dict[str, str]:
    """What --prompt-logprobs reports: the prompt's total logprob and perplexity (tokens 2..n); with
    --prompt-top-logprobs also how many of those tokens were the model's first choice (what evaluation
    harnesses call is_greedy)."""
    if not logprobs:
        return {}
    total = sum(logprobs)
    perplexity = math.exp(-total / len(logprobs))
    report = {"prompt_logprob": f"{total:.4f}", "prompt_perplexity": f"{perplexity:.3f}"}
    if top:  # the same computation gives a token that is the first choice exactly the first logprob
        greedy = sum(1 for lp, step in zip(logprobs, top, strict=True) if lp == step.logprobs[0])
        report["prompt_greedy"] = f"{greedy}/{len(logprobs)}"
    return report


def _report_logprobs(
    stub: pb_grpc.TextGenerationStub,
    args: argparse.Namespace,
    tokens: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[pb.TopLogprobs],
    err: TextIO,
) -> None:
    """One line per generated token: its id, text and logprob, then the most likely alternatives."""
    if not logprobs:
        return
    ids = [*tokens, *(i for step in top for i in step.token_ids)]
    texts = iter(
        stub.Detokenize(
            pb.DetokenizeRequest(ids=ids), metadata=auth_metadata(args.token), timeout=args.timeout
        ).texts
    )
    lines = [
        f"{token} {next(texts)!r} {logprob:.4f}" for token, logprob in zip(tokens, logprobs, strict=True)
    ]
    for index, step in enumerate(top):
        alternatives = ", ".join(f"{next(texts)!r} {lp:.4f}" for lp in step.logprobs)
        lines[index] += f" | {alternatives}"
    for line in lines:
        print(line, file=err)


def run_info(stub: pb_grpc.TextGenerationStub, args: argparse.Namespace, out: TextIO) -> int:
    info = stub.GetModelInfo(
        pb.GetModelInfoRequest(), metadata=auth_metadata(args.token), timeout=args.timeout
    )
    # Every field, zeros included: an eos_token_id of 0 is information, not an unset field.
    fields = json_format.MessageToDict(
        info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    out.write(json.dumps(fields, indent=2) + "\n")
    return 0


def run_health(channel: grpc.Channel, args: argparse.Namespace, out: TextIO) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    response = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    out.write(status + "\n")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


def _connection_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="host:port, or a gRPC name (dns:///, ipv4:a,b)"
    )
    parser.add_argument("--tls-ca", type=Path, help="PEM CA to verify the server (enables TLS)")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate (mTLS)")
    parser.add_argument("--tls-key", type=Path, help="PEM client key (mTLS)")
    parser.add_argument("--tls-server-name", help="expected server name when it differs from the target host")
    parser.add_argument(
        "--token", default=os.environ.get(TOKEN_ENV), help=f"bearer token (default ${TOKEN_ENV})"
    )
    parser.add_argument("--lb", choices=["pick_first", "round_robin"], help="load-balancing policy")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def _positive_or_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _int32(text: str) -> int:
    value = int(text)
    if not -(2**31) <= value < 2**31:
        raise argparse.ArgumentTypeError(f"must be a 32-bit integer, got {value}")
    return value


def _token_bias(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return _positive_or_zero(token), float(bias)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 50256=-100, got {text!r}") from None


def _text_or_file(text: str) -> str:
    """A flag's value, or the contents of the file it names."""
    path = Path(text)
    try:
        if path.is_file():
            return path.read_text()
    except (OSError, ValueError):  # not a usable path: the text itself
        pass
    return text


def _schema(text: str) -> str:
    schema = _text_or_file(text)
    try:
        json.loads(schema)
    except ValueError:
        raise argparse.ArgumentTypeError(f"neither a file nor JSON: {text[:80]!r}") from None
    return schema


def _constraint_options(gen: argparse.ArgumentParser) -> None:
    group = gen.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", type=_schema, metavar="FILE|JSON", help="the output is JSON valid against it"
    )
    group.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    group.add_argument("--regex", metavar="PATTERN", help="the whole output matches the pattern")
    group.add_argument(
        "--grammar", type=_text_or_file, metavar="FILE|LARK", help="a Lark grammar (llguidance's syntax)"
    )
    group.add_argument(
        "--choice", action="append", default=[], metavar="TEXT", help="the output is one of these (repeat)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="textgen-client", description="Call a textgen server.")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="generate a completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are produced")
    gen.add_argument("--max-new-tokens", type=_positive_or_zero, default=0, help="0: the server's default")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=_positive_or_zero, default=0, help="0: off")
    gen.add_argument("--top-p", type=float, default=0.0, help="0: off")
    gen.add_argument("--repetition-penalty", type=float, default=0.0, help="0: off")
    gen.add_argument("--min-p", type=float, default=0.0, help="0: off")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, -2..2; 0: off")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, -2..2; 0: off")
    gen.add_argument(
        "--logit-bias", type=_token_bias, action="append", default=[], help="TOKEN_ID=BIAS (repeatable)"
    )
    gen.add_argument("--seed", type=_positive_or_zero, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--include-stop-str", action="store_true", help="end the text with the matched stop string"
    )
    gen.add_argument(
        "--min-new-tokens", type=_positive_or_zero, default=0, help="nothing stops before this many"
    )
    gen.add_argument(
        "--stop-token-id", type=_positive_or_zero, action="append", default=[], help="stop token (repeatable)"
    )
    gen.add_argument("--logprobs", action="store_true", help="ask for token logprobs")
    gen.add_argument(
        "--top-logprobs", type=_positive_or_zero, default=0, help="and the N most likely tokens of each step"
    )
    gen.add_argument(
        "--prompt-logprobs",
        action="store_true",
        help="score the prompt: with --verbose, its logprob and perplexity over tokens 2..n",
    )
    gen.add_argument(
        "--prompt-top-logprobs",
        type=_positive_or_zero,
        default=0,
        help="and the N most likely tokens at each prompt position (--verbose: how many were first)",
    )
    gen.add_argument(
        "--truncate-prompt-tokens", type=_positive_or_zero, default=0, help="keep the prompt's last N tokens"
    )
    gen.add_argument(
        "--num-speculative-tokens",
        type=_positive_or_zero,
        default=None,
        help="on a speculating server: the most tokens proposed per step for this request (0: none)",
    )
    gen.add_argument(
        "--priority",
        type=_int32,
        default=0,
        help="on a server with --scheduling-policy priority: lower is admitted first (default 0)",
    )
    gen.add_argument(
        "--adapter", default="", help="a LoRA adapter the server serves (default: the base model)"
    )
    _constraint_options(gen)
    gen.add_argument("--request-id", default="")
    gen.add_argument("--verbose", action="store_true", help="print usage and timings to stderr")
    health = commands.add_parser("health", help="the server's health status")
    health.add_argument("--service", default="", help="service name ('' = the whole server)")
    info = commands.add_parser("info", help="the served model")
    for sub in (gen, health, info):
        _connection_options(sub)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    with connect(
        args.target, credentials=credentials, lb=args.lb, server_name=args.tls_server_name
    ) as channel:
        try:
            if args.command == "health":
                return run_health(channel, args, out)
            stub = pb_grpc.TextGenerationStub(channel)
            if args.command == "info":
                return run_info(stub, args, out)
            return run_generate(stub, args, out, err)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=err)
            return 1


if __name__ == "__main__":
    sys.exit(main())
