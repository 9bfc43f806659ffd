"""Server configuration: one pydantic-settings model fed by CLI flags and `TEXTGEN_*` environment variables.

Precedence: CLI flag > environment variable > default. Every field `x_y` is the flag `--x-y` and the variable
`TEXTGEN_X_Y`. Invalid values fail at start with a message naming the setting and what is allowed.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, FilePath, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, CliApp, NoDecode, SettingsConfigDict, SettingsError

from serve.engine.types import DEFAULT_MAX_CPU_LORAS, KvCacheDtype
from serve.memory import parse_memory
from serve.process import read_engine_cpus
from serve.scheduling.adapters import name_problem
from serve.scheduling.limits import BatchingKnobs

LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR"]
Port = Annotated[int, Field(ge=0, le=65535)]


class ConfigError(ValueError):
    """Invalid configuration; the message lists every bad setting."""


class ServerSettings(BaseSettings, BatchingKnobs):
    """Every setting of textgen-serve; the batching knobs come from `BatchingKnobs`, defined once there."""

    model_config = SettingsConfigDict(
        env_prefix="TEXTGEN_",
        env_ignore_empty=True,
        extra="forbid",
        cli_prog_name="textgen-serve",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_show_env_vars=True,
    )

    bundle: Path = Field(description="model bundle directory (written by textgen-export)")
    print_pod_memory: bool = Field(
        False,
        description="print the memory a Kubernetes pod serving this configuration needs (requests and "
        "limits: the bundle's weights x a factor + the KV rows + a fixed part; docs/deploy.md) and exit",
    )
    prepare_only: bool = Field(
        False,
        description="prepare the serving graph these flags serve (threads, providers, KV cache dtype) for "
        "this CPU and ONNX Runtime in --compiled-cache, print where, and exit: an init container's command, "
        "so that the replicas map the graph rather than each preparing it (exit 1 when it cannot be)",
    )
    host: str = Field("0.0.0.0", description="gRPC listen address")
    port: Port = Field(50051, description="gRPC port (0: any free port, logged at start)")
    http_host: str = Field("0.0.0.0", description="OpenAI-compatible HTTP API listen address")
    http_port: Port = Field(
        8080,
        description="OpenAI-compatible HTTP API port (/v1/completions, /v1/chat/completions, /v1/models, "
        "/health) in the same process, beside gRPC (0: off)",
    )
    max_n: int = Field(
        8, ge=1, le=128, description="the most choices (OpenAI's n) one HTTP request may ask for"
    )
    metrics_host: str = Field("0.0.0.0", description="Prometheus /metrics listen address")
    metrics_port: Port = Field(
        8000, description="Prometheus /metrics port (0: any free port, logged at start)"
    )
    providers: Annotated[list[str] | None, NoDecode] = Field(
        None, description="ONNX Runtime execution providers, comma-separated, in order of preference"
    )
    threads: int | None = Field(None, ge=1, le=1024, description="ONNX Runtime intra-op threads")
    spinning: bool = Field(
        True,
        description="ONNX Runtime threads busy-wait between a step's operators instead of sleeping: steps "
        "of small models run much faster (see docs/benchmarks.md); off: they sleep",
    )
    spin_between_steps: bool = Field(
        False,
        description="with --spinning: ONNX Runtime threads go on spinning after a step returns, as ONNX "
        "Runtime's own default; off: they stop at once, leaving the cores to the Python between steps and "
        "the gRPC event loop, and spin again on the next step",
    )
    engine_process: bool = Field(
        True,
        description="run the engine and its scheduler in a process of their own, beside the gRPC one, so "
        "neither waits for the other's Python (see docs/architecture.md); off: an engine thread here",
    )
    engine_cpus: Annotated[frozenset[int] | Literal["auto"] | None, NoDecode] = Field(
        None,
        description="CPUs of the engine process, as a Linux CPU list (0-3,6), or auto: all this process may "
        "use but the first; the server's process runs on the others, so its threads never take the "
        "engine's cores; threads defaults to their number (default: no pinning)",
    )
    max_batch_size: int = Field(
        16, ge=1, le=1024, description="rows in one engine step (fewer if kv_cache_memory holds fewer)"
    )
    max_model_len: int | None = Field(
        None,
        ge=2,
        description="tokens of one KV row: the most prompt + new tokens a request may take (default: the "
        "model's context length, at most 4096)",
    )
    kv_cache_memory: Annotated[int | None, NoDecode] = Field(
        None,
        ge=1,
        description="memory for the KV cache, e.g. 512MiB or 4GiB (a bare number: MiB): rows of "
        "max_model_len tokens, running first (up to max_batch_size), then the prefix cache's (default: "
        "max_batch_size + prefix_cache_rows rows, whatever they take)",
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto",
        description="element type of the KV cache: auto keeps the bundle's own (float32; float16 for an fp16 "
        "bundle); fp16 halves a float32 bundle's cache (its attention then computes in float16: see "
        "docs/benchmarks.md, 'KV cache dtype', for the cost in speed and accuracy)",
    )
    compiled_cache: Path | None = Field(
        None,
        description="where the serving graph prepared for this CPU and ONNX Runtime is kept: its weights in "
        "the layout the kernels read, in a file every session and every replica on the machine maps rather "
        "than packing its own copy; prepared at the first start (or by --prepare-only), "
        "never in the bundle, which may be read-only (default: $TEXTGEN_HOME/compiled, else "
        "./models/compiled)",
    )
    prepared_graph: bool = Field(
        True,
        description="build the sessions from the prepared graph (--compiled-cache); off: from the bundle's "
        "graph, each session packing the weights into memory of its own at every start",
    )
    prefix_cache_rows: int = Field(
        4,
        ge=0,
        le=1024,
        description="KV rows beyond max_batch_size that keep finished sequences' prompts, so a prompt that "
        "starts the same way (a shared system prompt, a chat's next turn) prefills only the rest (0: off)",
    )
    prefix_cache_min_tokens: int = Field(
        16, ge=1, description="the shortest shared prefix the prefix cache keeps or reuses"
    )
    speculative: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="speculative decoding: ngram (prompt lookup) proposes the tokens that followed the last "
        "n-gram's earlier occurrence in the prompt or output, draft the greedy continuation of "
        "--draft-bundle's model; one engine run checks them all, and a request's tokens are the same "
        "either way. It runs while one request decodes alone (see docs/benchmarks.md)",
    )
    draft_bundle: Path | None = Field(
        None,
        description="with --speculative draft: a smaller model's bundle with the same tokenizer, run in the "
        "engine's process",
    )
    num_speculative_tokens: int = Field(
        5,
        ge=1,
        le=32,
        description="with --speculative: the most tokens proposed per step (requests may ask fewer)",
    )
    prompt_lookup_min: int = Field(
        2, ge=1, le=64, description="with --speculative ngram: the shortest n-gram"
    )
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="with --speculative ngram: the longest n-gram")
    lora: Annotated[list[tuple[str, Path]], NoDecode] = Field(
        default_factory=list,
        description="LoRA adapters to serve, comma-separated NAME=DIR (peft folders) into the bundle's LoRA "
        "slots (textgen-export --lora-slots); a request picks one by naming it as its model",
    )
    lora_runtime_updates: bool = Field(
        False,
        description="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's), which load and "
        "unload LoRA adapters while the server runs, from folders under --lora-root only; needs --auth-token "
        "(or --allow-unauthenticated-lora-updates); off: those routes are 404",
    )
    prompt_logprobs: bool = Field(
        True,
        description="score prompts for requests that ask (prompt_logprobs, echo with logprobs): a second "
        "session of the bundle's standard graph, created when first asked for, and the logits of a whole "
        "prompt; --no-prompt-logprobs refuses such requests (400) and --print-pod-memory counts neither",
    )
    lora_root: Path | None = Field(
        None,
        description="with --lora-runtime-updates: the folder runtime loads read adapters from; a lora_path "
        "is taken relative to it, and one that resolves (symlinks too) outside it is refused",
    )
    allow_unauthenticated_lora_updates: bool = Field(
        False,
        description="allow --lora-runtime-updates without --auth-token: any client may then load adapters "
        "from under --lora-root and unload them",
    )
    max_cpu_loras: int = Field(
        DEFAULT_MAX_CPU_LORAS,
        ge=1,
        le=4096,
        description="the most LoRA adapters loaded at once (--lora and runtime loads; vLLM's name): each "
        "holds its weights in memory, the bundle's LoraLayout.max_adapter_bytes at most; a load past it is "
        "refused (400)",
    )
    served_model_name: Annotated[list[str] | None, NoDecode] = Field(
        None,
        description="the names requests may give as their model, space- or comma-separated (vLLM's): the "
        "first is the one /v1/models, responses, GetModelInfo and metrics report (default: the bundle's "
        "model name)",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longest prompt in tokens; default and upper bound: the context length - 1"
    )
    default_max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="max_new_tokens of a request that gives none (gRPC 0, HTTP max_tokens left out), "
        "shortened to what its context leaves (default: what its context leaves, as vLLM)",
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="the most tokens one request generates: a larger max_new_tokens is lowered to it, as "
        "vLLM lowers it to a generation config's max_new_tokens (default: no cap but the context)",
    )
    max_stop_strings: int = Field(8, ge=0, le=1024, description="stop strings per request")
    max_stop_length: int = Field(64, ge=1, le=65536, description="characters per stop string")
    max_message_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        le=2**31 - 1,
        description="largest gRPC message received or sent, and largest HTTP request body",
    )
    grace_seconds: float = Field(
        30.0, ge=0, le=3600, description="drain time for running requests on SIGTERM"
    )
    tls_cert: FilePath | None = Field(
        None, description="PEM server certificate chain (enables TLS on the gRPC and the HTTP port)"
    )
    tls_key: FilePath | None = Field(None, description="PEM private key of tls_cert")
    tls_client_ca: FilePath | None = Field(
        None, description="PEM CA that client certificates must chain to (mTLS)"
    )
    auth_token: SecretStr | None = Field(
        None,
        description="bearer token clients must send (authorization header, gRPC and HTTP; health exempt)",
    )
    log_level: LogLevel = Field("INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_prompts: bool = Field(False, description="include prompt and completion text in request logs")
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP endpoint for a span per request (e.g. http://collector:4318/v1/traces; "
        "needs the tracing extra); unset: no tracing",
    )

    @field_validator("providers", mode="before")
    @classmethod
    def _split_providers(cls, value: object) -> object:
        if isinstance(value, str):
            return [p.strip() for p in value.split(",") if p.strip()]
        return value

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _split_names(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        names = value.replace(",", " ").split()
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must differ: {', '.join(names)}")
        return names

    @field_validator("lora", mode="before")
    @classmethod
    def _split_adapters(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        adapters = []
        for item in (part.strip() for part in value.split(",")):
            name, sep, folder = item.partition("=")
            if not sep or not name.strip() or not folder.strip():
                raise ValueError(f"{item!r} is not NAME=DIR: give each adapter a name and its peft folder")
            if (problem := name_problem(name.strip())) is not None:
                raise ValueError(problem)
            adapters.append((name.strip(), Path(folder.strip())))
        names = [name for name, _ in adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"adapter names must differ: {', '.join(names)}")
        return adapters

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_memory(cls, value: object) -> object:
        return parse_memory(value)

    @field_validator("engine_cpus", mode="before")
    @classmethod
    def _parse_cpus(cls, value: object) -> object:
        return read_engine_cpus(value) if isinstance(value, str) else value

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper_log_level(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _consistent(self) -> ServerSettings:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca (mTLS) needs tls_cert and tls_key")
        default, cap = self.default_max_new_tokens, self.max_new_tokens
        if default is not None and cap is not None and default > cap:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) must be <= "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        if self.engine_cpus is not None and not self.engine_process:
            raise ValueError("engine_cpus pins the engine process: it needs engine_process")
        if (self.speculative == "draft") != (self.draft_bundle is not None):
            raise ValueError("--speculative draft and --draft-bundle go together")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                f"({self.prompt_lookup_max})"
            )
        if self.prepare_only and not self.prepared_graph:
            raise ValueError("--prepare-only prepares what --no-prepared-graph turns off: leave one out")
        if self.served_model_name == []:
            raise ValueError("served_model_name must give at least one name when given")
        if self.providers == []:
            raise ValueError("providers must name at least one execution provider when given")
        if self.auth_token is not None and not self.auth_token.get_secret_value().strip():
            raise ValueError("auth_token must not be blank")
        if len(self.lora) > self.max_cpu_loras:
            raise ValueError(
                f"lora gives {len(self.lora)} adapters, more than max_cpu_loras ({self.max_cpu_loras})"
            )
        self._check_lora_door()
        self._check_tls_files()
        return self

    def _check_lora_door(self) -> None:
        """Runtime loads read server folders a client names: behind the token, and under --lora-root."""
        if not self.lora_runtime_updates:
            return
        if self.auth_token is None and not self.allow_unauthenticated_lora_updates:
            raise ValueError(
                "lora_runtime_updates lets a client load adapters from the server's disk: give auth_token "
                "(or allow_unauthenticated_lora_updates, to let any client do it)"
            )
        if self.lora_root is None:
            raise ValueError("lora_runtime_updates needs lora_root: the folder adapters are loaded from")
        if not self.lora_root.is_dir():
            raise ValueError(f"lora_root {self.lora_root} is not a directory")

    def _check_tls_files(self) -> None:
        # gRPC only says "failed to bind" for unusable PEM files; the ssl module says what is wrong.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        if self.tls_cert is not None and self.tls_key is not None:
            try:
                context.load_cert_chain(self.tls_cert, self.tls_key, password=lambda: b"")
            except ssl.SSLError as exc:
                raise ValueError(
                    f"tls_cert {self.tls_cert} and tls_key {self.tls_key} are not a matching PEM certificate "
                    f"chain and unencrypted private key: {exc}"
                ) from None
        if self.tls_client_ca is not None:
            try:
                context.load_verify_locations(cafile=self.tls_client_ca)
            except ssl.SSLError as exc:
                raise ValueError(
                    f"tls_client_ca {self.tls_client_ca} is not a PEM CA certificate: {exc}"
                ) from None

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "settings"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {message}")
    return "invalid configuration:\n" + "\n".join(lines)


# vLLM's flag takes its names as separate words; pydantic-settings reads one value per flag.
SEVERAL_WORDS = ("--served-model-name",)


def joined_words(argv: list[str]) -> list[str]:
    """`argv` with the words after each flag of SEVERAL_WORDS (up to the next flag) as one comma-separated
    value."""
    out: list[str] = []
    position = 0
    while position < len(argv):
        out.append(argv[position])
        position += 1
        if out[-1] in SEVERAL_WORDS:
            end = position
            while end < len(argv) and not argv[end].startswith("-"):
                end += 1
            if end > position:
                out.append(",".join(argv[position:end]))
            position = end
    return out


def load_settings(argv: list[str]) -> ServerSettings:
    """Settings from `argv` (CLI flags) over `TEXTGEN_*` variables over defaults.

    Raises ConfigError with one line per bad setting; an unknown flag exits with argparse's usage (code 2).
    """
    try:
        return CliApp.run(ServerSettings, cli_args=joined_words(argv))
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
    except SettingsError as exc:
        raise ConfigError(f"invalid configuration: {exc}") from None
