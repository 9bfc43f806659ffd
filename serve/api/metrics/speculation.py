"""Speculative decoding, counted as vLLM's spec-decode metrics are: drafts, proposed and accepted tokens,
plus the tokens speculating steps emitted, and each finished request's acceptance rate."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from serve.api.metrics.shapes import ACCEPTANCE_BUCKETS


class SpeculationMetrics:
    registry: CollectorRegistry

    def _define_speculation(self) -> None:
        reg = self.registry
        self.spec_acceptance = Histogram(
            "textgen_spec_decode_acceptance_rate",
            "Per finished request that speculated: proposed tokens accepted over proposed.",
            buckets=ACCEPTANCE_BUCKETS,
            registry=reg,
        )
        self.spec_drafts = Counter(
            "textgen_spec_decode_drafts", "Speculating steps: proposals verified in one run.", registry=reg
        )
        self.spec_draft_tokens = Counter(
            "textgen_spec_decode_draft_tokens",
            "Tokens proposed by speculation (of a step cut by the request's end, the accepted ones it kept).",
            registry=reg,
        )
        self.spec_accepted_tokens = Counter(
            "textgen_spec_decode_accepted_tokens",
            "Proposed tokens sampling picked and the request kept (emitted without a step of their own).",
            registry=reg,
        )
        self.spec_emitted_tokens = Counter(
            "textgen_spec_decode_emitted_tokens",
            "Tokens emitted by speculating steps: the accepted ones and one sampled token per step.",
            registry=reg,
        )

    def on_speculated(self, proposed: int, accepted: int) -> None:
        """Once per speculating step of a request: tokens proposed, and how many of them were accepted."""
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(proposed)
        self.spec_accepted_tokens.inc(accepted)
        self.spec_emitted_tokens.inc(accepted + 1)

    def on_speculation_done(self, acceptance: float) -> None:
        """Once per finished request that speculated: its accepted over its proposed tokens."""
        self.spec_acceptance.observe(acceptance)
