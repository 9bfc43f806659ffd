"""Structured output: constrained requests by kind, each constraint's compile, and the cost of the masks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from serve.api.metrics.shapes import COMPILE_BUCKETS, check_label

# Structured output's kinds (serve/engine/types.py ConstraintKind) and "tool": a call tool_choice forces.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice", "tool")


class ConstraintMetrics:
    registry: CollectorRegistry

    def _define_constraints(self) -> None:
        reg = self.registry
        self.constraint_compile = Histogram(
            "textgen_constraint_compile_seconds",
            "Time to compile one constraint with llguidance (the same constraint again is cached).",
            buckets=COMPILE_BUCKETS,
            registry=reg,
        )
        self.constrained = Counter(
            "textgen_constrained_requests",
            "Requests with structured output accepted, by kind (tool: a call that tool_choice forces).",
            ["kind"],
            registry=reg,
        )
        self.constraint_masks = Counter(
            "textgen_constraint_masks",
            "Allowed-token masks computed: one per constrained sequence and engine step.",
            registry=reg,
        )
        self.constraint_mask_seconds = Counter(
            "textgen_constraint_mask_seconds",
            "Time spent computing allowed-token masks (beside ONNX Runtime's run of the step).",
            registry=reg,
        )
        self.constraint_mask_wait_seconds = Counter(
            "textgen_constraint_mask_wait_seconds",
            "Time engine steps waited for their masks after ONNX Runtime's run: the mask cost not hidden.",
            registry=reg,
        )
        for kind in CONSTRAINT_KINDS:  # known label values exist from the start, for rate()
            self.constrained.labels(kind=kind)

    def on_masks(self, masks: int, seconds: float, wait_seconds: float) -> None:
        """After an engine step with constrained rows: masks made, their time, the step's wait for them."""
        self.constraint_masks.inc(masks)
        self.constraint_mask_seconds.inc(seconds)
        self.constraint_mask_wait_seconds.inc(wait_seconds)

    def on_constraint_compiled(self, seconds: float) -> None:
        """Once per compile (a cache miss that llguidance accepted)."""
        self.constraint_compile.observe(seconds)

    def on_constrained(self, kind: str) -> None:
        """Once per request with structured output, when it is submitted (by a front end)."""
        check_label("constraint kind", kind, CONSTRAINT_KINDS)
        self.constrained.labels(kind=kind).inc()
