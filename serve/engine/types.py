"""The types that cross into and out of the engine: what a model is, how an engine is set up, a sequence that
joins it, what its output must match, how its ONNX Runtime sessions are set up, what a step returns, and
what the server reports of it; and how a prompt continued over a cached prefix is cut into pieces, which the
scheduler's records follow."""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from serve.engine.sampling import Alternatives, PromptScores, SamplingParams

# The most LoRA adapters registered at once (--max-cpu-loras; vLLM's name): each holds its weights in memory.
DEFAULT_MAX_CPU_LORAS = 16

if TYPE_CHECKING:
    import llguidance


# --kv-cache-dtype (serve/engine/kv_dtype.py): auto keeps the bundle's own; the others as manifests name them
KvCacheDtype = Literal["auto", "fp32", "fp16"]
KV_CACHE_DTYPES = {"fp32": "float32", "fp16": "float16"}

# The fewest prompt tokens one prefill run computes for a row: a prefix-cache hit leaves at least this many
# to prefill, and no piece of a chunked prefill is shorter. ONNX Runtime's GroupQueryAttention sums a
# one-token query (a decode step's) in another order than a multi-token one (a prefill's, whole or continued
# over a cached prefix: those agree), and the next layers' keys and values at that position then differ in
# the last bits from those the whole prompt's prefill computes; so a prompt's positions are computed alike
# whether it was prefilled whole, in pieces, or after a copied prefix.
MIN_PIECE = 2


def next_piece(done: int, chunk: int, total: int) -> int:
    """How many prompt tokens the next piece of a chunked prefill computes, `done` of `total` being in the
    cache: `chunk`, or all that is left, never fewer than MIN_PIECE nor leaving fewer behind (such a piece
    stops short, or takes the rest)."""
    left = total - done
    piece = min(max(chunk, MIN_PIECE), left)
    if 0 < left - piece < MIN_PIECE:
        shorter = left - MIN_PIECE
        piece = shorter if shorter >= MIN_PIECE else left
    return piece


@dataclass(frozen=True)
class SessionConfig:
    providers: tuple[str, ...] = ()  # empty: best available; else short (cpu/cuda/tensorrt) or full names
    threads: int = 0  # intra-op threads; 0 lets ONNX Runtime use every core
    spinning: bool = True  # busy-wait between ops: faster steps, but burns the cores the event loop needs
    # With spinning: whether the threads go on spinning after a run returns (ONNX Runtime's default) or stop
    # until the next run (session.force_spinning_stop), leaving the cores to the Python between steps.
    spin_between_runs: bool = True
    # ONNX Runtime's profiler: a JSON trace of every operator a run executes, written under this path prefix
    # when the session ends its profiling (bench/scenarios/step_profile.py); empty: off
    profile_prefix: str = ""
    tensorrt_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSpec:
    n_layers: int
    n_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    eos_token_id: int  # the first of eos_token_ids
    pad_token_id: int
    n_kv_heads: int = 0  # the KV cache's heads (grouped-query attention); 0: n_heads
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a generation; empty: eos_token_id alone

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.eos_token_ids or (self.eos_token_id,)


@dataclass(frozen=True)
class SpeculationSettings:
    """Speculative decoding (serve/engine/speculation.py): prompt lookup, or a draft model when
    `draft_bundle` is set; the server's flags have vLLM's names (num_speculative_tokens, prompt_lookup_min,
    prompt_lookup_max)."""

    num_tokens: int = 0  # the most tokens proposed per step; 0: speculation off
    ngram_min: int = 2  # the shortest n-gram looked up
    ngram_max: int = 4  # the longest
    draft_bundle: str | None = None  # a smaller bundle with the same vocabulary that proposes instead

    @property
    def method(self) -> str:
        """What proposes: "ngram", "draft", or "" when off (GetModelInfo's `speculative`)."""
        if not self.enabled:
            return ""
        return "ngram" if self.draft_bundle is None else "draft"

    def validate(self) -> None:
        if self.num_tokens < 0:
            raise ValueError(f"the number of speculative tokens must be >= 0, got {self.num_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"the n-gram sizes must satisfy 1 <= min <= max, "
                f"got min {self.ngram_min}, max {self.ngram_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


def default_compiled_cache() -> Path:
    """Where prepared serving graphs are cached unless told (serve/engine/prepared.py):
    $TEXTGEN_HOME/compiled, or ./models/compiled (where the demo's bundle lives by default)."""
    return Path(os.environ.get("TEXTGEN_HOME") or "models") / "compiled"


@dataclass(frozen=True)
class EngineSettings:
    max_batch_size: int = 16
    capacity: int | None = None  # tokens per slot; default: the model's context length
    session: SessionConfig = field(default_factory=SessionConfig)
    # Extra KV rows that keep finished sequences for prompts that start the same way (prefix_cache.py).
    prefix_cache_rows: int = 0
    prefix_cache_min_tokens: int = 16  # the shortest prefix kept or reused
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)  # off by default
    # LoRA adapters loaded at start, (name, peft folder), into a LoRA bundle's slots (serve/engine/lora/).
    adapters: tuple[tuple[str, str], ...] = ()
    max_cpu_loras: int = DEFAULT_MAX_CPU_LORAS  # the most adapters registered at once (Residency)
    # The KV cache's element type (serve/engine/kv_dtype.py); auto: the bundle's own.
    kv_cache_dtype: KvCacheDtype = "auto"
    # Where prepared serving graphs are cached (serve/engine/prepared.py); None: sessions are built from the
    # bundle's graph, packing the weights in memory.
    compiled_cache: Path | None = None


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # one JSON value that validates against the schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"  # the whole output matches the pattern
    GRAMMAR = "grammar"  # a Lark grammar in llguidance's syntax
    CHOICE = "choice"  # exactly one of the strings


@dataclass(frozen=True)
class Constraint:
    """What a request's output must be, enforced token by token (serve/engine/constraints.py compiles it with
    llguidance). Protocol-neutral and hashable (without `source`, the compile cache's key): the gRPC front end
    builds one from `GenerateRequest.constraint`, the HTTP one from `response_format`, a forced tool call or
    vLLM's guided fields. Build it with the class methods; `text` is the schema's JSON, the pattern or the
    grammar; `source` the request field it came from, which error messages name (default:
    `constraint.<kind>`)."""

    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    source: str = ""

    @property
    def field_name(self) -> str:
        return self.source or f"constraint.{self.kind.value}"

    @classmethod
    def json_schema(cls, schema: str | Mapping[str, Any] | bool) -> Constraint:
        """A JSON Schema, as JSON text or as the parsed value (kept in its own key order: properties come out
        in the order the schema lists them)."""
        return cls(ConstraintKind.JSON_SCHEMA, schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        return cls(ConstraintKind.GRAMMAR, lark)

    @classmethod
    def choice(cls, choices: Iterable[str]) -> Constraint:
        return cls(ConstraintKind.CHOICE, choices=tuple(choices))


# llguidance's JSON options unless a schema's own "x-guidance" says otherwise: compact, since flexible
# whitespace lets a weak model pad its output with blanks until it runs out of tokens.
COMPACT_JSON: dict[str, Any] = {"whitespace_flexible": False}


def lark_json(schema: Mapping[str, Any]) -> str:
    """A JSON Schema as a `%json` item of a Lark grammar (llguidance's syntax), read as a JSON_SCHEMA
    constraint's schema is: closed (`closed_schema`), compact unless its "x-guidance" says otherwise."""
    closed = closed_schema(dict(schema))
    closed["x-guidance"] = {**COMPACT_JSON, **(closed.get("x-guidance") or {})}
    return "%json " + json.dumps(closed)


# Keywords whose value is one subschema, or a map or list of them, where an object schema may be found.
_SUBSCHEMA = ("items", "additionalItems", "contains", "not", "if", "then", "else", "additionalProperties")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
# Keywords that already say what an object's other keys may be.
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_schema(schema: Any, *, close: bool = True) -> Any:
    """A JSON Schema whose object schemas that list `properties` and say nothing of other keys forbid them
    (`"additionalProperties": false`), as xgrammar's strict mode (vLLM's default backend) reads them.

    JSON Schema allows any other key there, and a constrained model may then write `,"` and one endless key
    until it runs out of tokens; frameworks leave the keyword out by default (LangChain's non-strict tools,
    instructor's models, every Anthropic tool). An explicit `additionalProperties` (true or a schema),
    `patternProperties` or `unevaluatedProperties` is kept, and an object schema without `properties` (any
    object) stays open. The members of an `allOf` are not closed one by one (their intersection would
    allow no key of the others); objects nested in them are."""
    if isinstance(schema, list):
        return [closed_schema(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in out:
            out[key] = closed_schema(out[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_schema(sub, close=False) for sub in out["allOf"]]
    if close and isinstance(out.get("properties"), dict) and not any(k in out for k in _OTHER_KEYS):
        out["additionalProperties"] = False
    return out


class ConstraintState(enum.Enum):
    """Where a constrained sequence's output stands after a token."""

    PARTIAL = "partial"  # not a match yet: more tokens are needed
    ACCEPTING = "accepting"  # a match: it may end here (EOS is allowed) or go on
    COMPLETE = "complete"  # a match that nothing may extend: the sequence ends here


@dataclass(frozen=True, eq=False)
class CompiledConstraint:
    """A compiled constraint (serve/engine/constraints.py's ConstraintCompiler makes them): a matcher at its
    start state that is never advanced; each sequence gets its own copy (`matcher()`, a few microseconds)."""

    constraint: Constraint
    template: llguidance.LLMatcher
    seconds: float  # the compile's

    def matcher(self) -> llguidance.LLMatcher:
        return self.template.deep_copy()


@dataclass(frozen=True)
class NewSequence:
    seq_id: str
    prompt_ids: Sequence[int]
    sampling: SamplingParams
    logprobs: bool = False  # report each token's logprob (TokenOut.logprob is NaN otherwise)
    banned: tuple[int, ...] = ()  # token ids its first `banned_for` tokens may not be
    banned_for: int = 0
    top_logprobs: int = 0  # report this many most likely tokens of each step (TokenOut.top)
    prompt_logprobs: bool = False  # score the prompt (the first TokenOut's `prompt`)
    prompt_top_logprobs: int = 0  # and list this many most likely tokens at each of its positions
    # Another sequence of the same prefill group with the same prompt (n choices of one request): this one's
    # prompt is not computed; its row is a copy of that one's, its first token sampled from the same
    # logits. Outside that sequence's group (or with another prompt) it is prefilled as any other.
    fork_of: str | None = None
    constraint: CompiledConstraint | None = None  # what its output must match (tokens outside it are -inf)
    # The most tokens speculation proposes for it per step (serve/engine/speculation.py), within the
    # engine's own limit; None: the engine's limit, 0: none.
    speculative_tokens: int | None = None
    adapter: str = ""  # the LoRA adapter it runs with, by name (Engine.adapters); "": the base model


@dataclass(frozen=True)
class EngineInfo:
    """What the server reports of an engine and checks requests against; it crosses to the server's
    process when the engine runs in one of its own (serve/scheduling/engine_core.py)."""

    vocab_size: int
    context_length: int
    max_batch_size: int
    capacity: int
    eos_token_id: int
    providers: tuple[str, ...]
    kv_device: str  # "cpu", "cuda"
    prefix_cache_rows: int
    kv_bytes: int
    eos_token_ids: tuple[int, ...] = ()  # every id that ends a generation, eos_token_id first
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    adapters: tuple[str, ...] = ()  # the LoRA adapters a request may name
    lora_slots: int = 0  # the bundle's LoRA slots (0: it serves no adapter)


class TokenOut(NamedTuple):
    """One sequence's new token. A tuple: the engine makes one per row per step."""

    seq_id: str
    token_id: int
    logprob: float  # NaN unless the sequence asked for logprobs
    top: Alternatives | None = None  # unless the sequence asked for top_logprobs
    prompt: PromptScores | None = None  # on a sequence's first token, if it asked for prompt logprobs
    constraint: ConstraintState | None = None  # a constrained sequence's state after this token
    # The sequence cannot go on (no token was allowed: its constraint and its sampling settings exclude them
    # all, or the constraint failed); `token_id` is then meaningless and the sequence must be released.
    error: str | None = None
    # On the first token a speculating step gives a sequence: the tokens proposed for it, and how many of them
    # its sampling picked (each of those comes as a TokenOut of its own after this one).
    proposed: int = 0
    accepted: int = 0
