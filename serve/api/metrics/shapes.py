"""The metrics' shapes: histogram buckets, and the bounded label sets a hook checks its labels against.

Bucket choices (a quantile is only as precise as the buckets around it, and a quantile above the largest
finite bucket is reported as that bucket's bound, so the largest bucket must exceed the worst real value):
- Latencies that include queueing (TTFT, request duration, queue time) start at 1 ms (an idle server
  answers in milliseconds) and reach minutes: under overload a request waits for others' generations, and
  the longest generations of a context-length budget take minutes on CPU.
- Inter-token latency is one decode step seen by one request: ~1 ms for a tiny model, 9-35 ms for a 30M
  model at batch 16 on 2 CPU cores (measured for the KV-cache design), up to seconds on a starved machine.
  A step that gives a request several tokens (speculation) is observed once per token, each its share of
  the step's interval, so its accepted tokens are not ~0. Buckets are dense between 5 and 100 ms, where
  SLOs for streaming text sit.
- Step duration covers decode steps (as above) and prefill steps, which process whole prompts: up to 10 s.
- Token counts are exponential (powers of two) because prompt and generation lengths span orders of
  magnitude; they reach 65536, above any context length this service is built for.
- Batch size: every size up to 8, then powers of two up to 256 (the largest sensible `max_batch_size`).
- Padding ratio is a fraction in [0, 1]: 0 is its own bucket (decode steps have no padding), then 0.1 steps.
- A constraint's compile (llguidance) takes about a millisecond for a small schema, regex or choice list and
  is bounded by the compiler's limits; buckets reach 10 s. Token masks are counted as totals (masks, seconds
  computing them, seconds a step waited for them): their ratio is the mask cost per constrained token.
- Speculation is counted as vLLM's spec-decode metrics are (drafts, proposed tokens, accepted tokens) plus
  the tokens its steps emitted, as far as the request kept them: a step cut by its stop, EOS or token
  limit counts the tokens before the cut (serve/scheduling/delivery.py `_speculated`); a request's acceptance
  rate (accepted over proposed) is a fraction in 0.1 buckets.
"""

from __future__ import annotations

QUEUEING_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)
INTER_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKEN_COUNT_BUCKETS = tuple(float(2**i) for i in range(17))  # 1 .. 65536
BATCH_SIZE_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
PADDING_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
ACCEPTANCE_BUCKETS = PADDING_RATIO_BUCKETS  # a fraction in [0, 1] as well
# A constraint's compile: ~1 ms for a small schema or regex, up to the compiler's limits (seconds).
COMPILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def check_label(kind: str, value: str, allowed: frozenset[str] | tuple[str, ...]) -> None:
    # Labels must stay a small bounded set: an unexpected value is a caller bug, not a new series.
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}: expected one of {', '.join(sorted(allowed))}")
