"""Structured output: constraints compiled with llguidance and enforced token by token.

- `ConstraintCompiler` (thread-safe) turns a `Constraint` into a `CompiledConstraint` on worker threads of
  its own (llguidance drops the GIL while it builds a grammar, so engine steps go on meanwhile). Compiles
  are bounded by `LLParserLimits` and cached: an LRU of futures keyed by the constraint without its
  `source`, so the same schema sent twice, or twice at once, or from two request fields, compiles once. What
  llguidance rejects is an `InvalidRequest` that names the request's field and carries the library's
  message.
- `ConstraintRows` holds the running rows' matchers in the engine's row order (swap-remove, as the KV rows
  and `SamplingBatch`). `start_fill()` computes every constrained row's allowed-token bitmask with
  llguidance's `fill_next_token_bitmask_par` on the masks' thread (`MaskWorker`) while ONNX Runtime runs the
  step (both release the GIL); the engine joins it before sampling, and sampling sets every token outside
  a row's mask to -inf before any other processor. `consume(tokens)` then advances each matcher by its
  row's token. A batch without a constrained row does no mask work at all.

JSON is generated compact (no whitespace between tokens: `{"a":1,"b":[2,3]}`) unless the schema's own
`"x-guidance"` options say otherwise (e.g. `{"whitespace_flexible": true}`): flexible whitespace lets a weak
model pad the output with blanks until it runs out of tokens. For the same reason an object schema that
lists its properties and says nothing of other keys allows none (`closed_schema`, xgrammar's strict mode).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, NamedTuple, cast

import llguidance
import numpy as np
import tokenizers
from llguidance.numpy import fill_next_token_bitmask_par

from serve.engine.types import (
    COMPACT_JSON,
    CompiledConstraint,
    Constraint,
    ConstraintKind,
    ConstraintState,
    closed_schema,
)
from serve.errors import InvalidRequest

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

log = logging.getLogger("textgen.constraints")

# Compiles kept (their futures): a schema sent again is served from here.
DEFAULT_CACHE_SIZE = 128
COMPILE_WORKERS = 2  # one pathological grammar does not hold every other compile back
JSON_DEFAULTS = cast("JsonCompileOptions", COMPACT_JSON)  # x-guidance may override
MAX_ERROR_CHARS = 1_000  # of llguidance's message in a refusal
MAX_UNREAD_COMPILE_TIMES = 1_024  # compile times kept for the metrics between two steps' reads


class _Refused(Exception):
    """llguidance's verdict on a constraint, before it names a request field: one cached compile serves
    requests whose constraint came from different fields, and each refusal names its own."""


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint; _Refused when it is not even well formed."""
    kind = constraint.kind
    try:
        match kind:
            case ConstraintKind.JSON_SCHEMA:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    _closed(constraint.text), defaults=JSON_DEFAULTS
                )
            case ConstraintKind.JSON_OBJECT:
                return llguidance.LLMatcher.grammar_from_json_schema(
                    '{"type": "object"}', defaults=JSON_DEFAULTS
                )
            case ConstraintKind.REGEX:
                return llguidance.grammar_from("regex", constraint.text)
            case ConstraintKind.GRAMMAR:
                return llguidance.grammar_from("lark", constraint.text)
            case ConstraintKind.CHOICE:
                return llguidance.grammar_from("choice", json.dumps(list(constraint.choices)))
    except ValueError as exc:
        raise _Refused(_short(str(exc))) from None
    raise ValueError(f"unknown constraint kind {kind!r}")


def _closed(schema: str) -> str:
    """A schema's text with its objects closed (`closed_schema`); text that is no JSON goes to llguidance
    as it is, whose refusal names the field."""
    try:
        return json.dumps(closed_schema(json.loads(schema)))
    except ValueError:
        return schema


def parser_limits() -> llguidance.LLParserLimits:
    """What one grammar may cost: llguidance's defaults but a smaller grammar. They bound the compile
    (initial lexer fuel, ~50k a ms; grammar symbols) and each step's mask (lexer fuel, ~14k a ms; Earley
    items, ~20k a ms): past them the compile is refused, or the request fails at that step."""
    return llguidance.LLParserLimits(
        max_items_in_row=2_000,
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=200_000,
    )


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 1] + "…"


class ConstraintCompiler:
    """Compiles constraints for one model's tokenizer, on worker threads, with an LRU cache of the results.

    `eos_token_ids`: every token that ends the model's output; the masks allow them exactly where the
    constraint may end. Thread-safe: the server's event loop (or the engine process's loop) submits while
    the engine thread steps."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        workers: int = COMPILE_WORKERS,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a model needs at least one EOS token id")
        self._tokenizer_json = tokenizer.to_str()
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # Keyed by the constraint without its source (the request field, named only in refusals).
        self._cache: OrderedDict[Constraint, Future[CompiledConstraint]] = OrderedDict()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="textgen-compile")
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self.compiles = 0  # compiles started (cache misses)
        # Of finished compiles, until `take_compile_seconds` (bounded: a server without metrics never takes).
        self._compile_seconds: deque[float] = deque(maxlen=MAX_UNREAD_COMPILE_TIMES)

    def submit(self, constraint: Constraint) -> Future[CompiledConstraint]:
        """The constraint's compile: the cached one, or one started now on a worker thread. Its result is the
        `CompiledConstraint`, or the InvalidRequest that names its field and llguidance's verdict."""
        key = replace(constraint, source="")
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
            else:
                future = self._pool.submit(self._compile, key)
                self._cache[key] = future
                self.compiles += 1
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
                future.add_done_callback(lambda done: self._forget_unless_final(key, done))
        return _for_field(future, constraint)

    def take_compile_seconds(self) -> list[float]:
        """How long each compile that succeeded since the last call took (for the metrics)."""
        taken = []
        while self._compile_seconds:
            taken.append(self._compile_seconds.popleft())
        return taken

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """`submit` and wait (tests, benchmarks)."""
        return self.submit(constraint).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (built on first use: a server that never
        constrains output never pays for it)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
                )
            return self._tokenizer

    def _compile(self, constraint: Constraint) -> CompiledConstraint:
        start = time.perf_counter()
        grammar = grammar_of(constraint)
        limits = parser_limits()
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise _Refused(_short(matcher.get_error()))
        seconds = time.perf_counter() - start
        if seconds > 1.0:
            log.warning("a %s constraint took %.2f s to compile", constraint.kind.value, seconds)
        self._compile_seconds.append(seconds)  # a deque: appends and pops are thread-safe
        return CompiledConstraint(constraint, matcher, seconds)

    def _forget_unless_final(self, constraint: Constraint, future: Future[CompiledConstraint]) -> None:
        """A refusal is final and stays cached; any other failure (out of memory) may not recur: drop it."""
        error = future.exception()
        if error is None or isinstance(error, _Refused):
            return
        with self._lock:
            if self._cache.get(constraint) is future:
                del self._cache[constraint]


def _for_field(compiling: Future[CompiledConstraint], constraint: Constraint) -> Future[CompiledConstraint]:
    """The shared compile as this request sees it: its refusal names the request's own field."""
    out: Future[CompiledConstraint] = Future()

    def settle(done: Future[CompiledConstraint]) -> None:
        if done.cancelled():  # the compiler shut down
            out.cancel()
            return
        error = done.exception()
        if isinstance(error, _Refused):
            out.set_exception(InvalidRequest(f"{constraint.field_name} is not valid: {error}"))
        elif error is not None:
            out.set_exception(error)
        else:
            out.set_result(done.result())

    compiling.add_done_callback(settle)
    return out


class MaskStats:
    """What the masks cost, summed since the engine started (benchmarks read them)."""

    def __init__(self) -> None:
        self.fills = 0  # steps with at least one constrained row
        self.rows = 0  # masks computed (row-steps)
        self.fill_seconds = 0.0  # on the masks' thread, beside ONNX Runtime's run
        self.wait_seconds = 0.0  # the engine thread waited for a fill after its run: the cost not hidden
        self.consume_seconds = 0.0  # advancing the matchers by the sampled tokens

    def as_dict(self) -> dict[str, float]:
        return dict(vars(self))

    def copy(self) -> MaskStats:
        copied = MaskStats()
        vars(copied).update(vars(self))
        return copied


class MaskWorker:
    """The thread that computes masks beside the engine's runs, and llguidance's executor that computes a
    step's masks in parallel (`threads`: 0 lets llguidance choose, 80% of the cores)."""

    def __init__(self, vocab_size: int, threads: int = 0) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words per row: bit t % 32 of word t // 32 is token t
        self._threads = threads
        self._executor: llguidance.LLExecutor | None = None
        self._thread: ThreadPoolExecutor | None = None
        self.stats = MaskStats()

    def start(self, matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> Future[float]:
        if self._thread is None:
            self._executor = llguidance.LLExecutor(self._threads or None)
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="textgen-masks")
        return self._thread.submit(self._fill, matchers, bitmask)

    def _fill(self, matchers: list[tuple[llguidance.LLMatcher, int]], bitmask: np.ndarray) -> float:
        start = time.perf_counter()
        assert self._executor is not None
        fill_next_token_bitmask_par(self._executor, matchers, bitmask)
        return time.perf_counter() - start


class Masks(NamedTuple):
    """A step's allowed tokens: `bits[j]` is the bitmask of row `rows[j]`."""

    rows: np.ndarray  # int64 row indices, ascending
    bits: np.ndarray  # int32 [len(rows), words]


class PendingMasks:
    """A fill in progress; `wait()` returns its masks and the rows whose matcher failed (with the reason)."""

    def __init__(
        self,
        worker: MaskWorker,
        rows: np.ndarray,
        matchers: list[llguidance.LLMatcher],
    ) -> None:
        self._worker = worker
        self._matchers = matchers
        self.masks = Masks(rows, np.empty((len(rows), worker.words), np.int32))
        self._future = worker.start([(m, j) for j, m in enumerate(matchers)], self.masks.bits)

    def wait(self) -> tuple[Masks, dict[int, str]]:
        start = time.perf_counter()
        fill_seconds = self._future.result()
        stats = self._worker.stats
        stats.wait_seconds += time.perf_counter() - start
        stats.fill_seconds += fill_seconds
        stats.fills += 1
        stats.rows += len(self._matchers)
        failed = {
            int(row): _short(m.get_error())
            for row, m in zip(self.masks.rows.tolist(), self._matchers, strict=True)
            if m.is_error()
        }
        return self.masks, failed

    def settle(self) -> None:
        """Wait for the fill without using it (the step failed): its thread holds the matchers until then."""
        try:
            self._future.result()
        except Exception:  # the step's own error is the one to report
            log.exception("a mask fill failed")


class ConstraintRows:
    """The matchers of the running rows in the engine's row order (None: an unconstrained row)."""

    def __init__(self, worker: MaskWorker) -> None:
        self._worker = worker
        self._matchers: list[llguidance.LLMatcher | None] = []
        self._constrained: np.ndarray | None = np.empty(0, np.int64)  # None: to recompute

    def __len__(self) -> int:
        return len(self._matchers)

    @property
    def constrained(self) -> int:
        """Rows holding a matcher."""
        return len(self._rows())

    def group(self, constraints: Sequence[CompiledConstraint | None]) -> ConstraintRows:
        """Rows for sequences about to join, each with a fresh matcher of its constraint (or None)."""
        rows = ConstraintRows(self._worker)
        for compiled in constraints:
            rows.append(None if compiled is None else compiled.matcher())
        return rows

    def append(self, matcher: llguidance.LLMatcher | None) -> None:
        self._matchers.append(matcher)
        if matcher is not None:
            self._constrained = None

    def extend(self, other: ConstraintRows) -> None:
        self._matchers.extend(other._matchers)
        if other.constrained:
            self._constrained = None

    def remove(self, index: int) -> llguidance.LLMatcher | None:
        """Drop row `index` and return its matcher (freed unless kept); the last row moves into its place."""
        gone = self._matchers[index]
        last = self._matchers.pop()
        if index < len(self._matchers):
            self._matchers[index] = last
        if gone is not None or last is not None:
            self._constrained = None
        return gone

    def start_fill(self) -> PendingMasks | None:
        """Start computing every constrained row's mask on the masks' thread; None when no row is."""
        rows = self._rows()
        if not rows.size:
            return None
        matchers = [self._matchers[r] for r in rows.tolist()]
        return PendingMasks(self._worker, rows, [m for m in matchers if m is not None])

    def consume(
        self, tokens: np.ndarray, skip: Sequence[int] = ()
    ) -> dict[int, tuple[ConstraintState, str | None]]:
        """Advance each constrained row's matcher by its token (rows in `skip` failed this step and are left
        alone); each row's state after it, with an error where the matcher refused the token."""
        rows = self._rows()
        if not rows.size:
            return {}
        start = time.perf_counter()
        states: dict[int, tuple[ConstraintState, str | None]] = {}
        skipped = set(skip)
        for row, token in zip(rows.tolist(), tokens[rows].tolist(), strict=True):
            if row in skipped:
                continue
            matcher = self._matchers[row]
            assert matcher is not None
            if not matcher.consume_token(token):
                states[row] = (ConstraintState.PARTIAL, _short(matcher.get_error()) or "token refused")
            elif matcher.is_stopped():
                states[row] = (ConstraintState.COMPLETE, None)
            elif matcher.is_accepting():
                states[row] = (ConstraintState.ACCEPTING, None)
            else:
                states[row] = (ConstraintState.PARTIAL, None)
        self._worker.stats.consume_seconds += time.perf_counter() - start
        return states

    def _rows(self) -> np.ndarray:
        if self._constrained is None:
            self._constrained = np.array(
                [i for i, m in enumerate(self._matchers) if m is not None], dtype=np.int64
            )
        return self._constrained
