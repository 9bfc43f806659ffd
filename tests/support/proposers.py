"""A proposer for speculation tests that does not depend on what a model happens to repeat."""

from __future__ import annotations

import numpy as np


class Oracle:
    """Proposes what a plain run of the same request produced next (references the test computed), spoiling
    the last token of every third proposal: right guesses and wrong ones on any model and any CPU, so every
    test sees tokens accepted and rejected without depending on what one trained model happens to repeat."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.references: dict[tuple[int, ...], list[int]] = {}  # prompt -> the plain run's tokens
        self.calls = 0

    def propose(self, context: np.ndarray, k: int) -> np.ndarray:
        ids = context.tolist()
        for prompt, reference in self.references.items():
            if tuple(ids[: len(prompt)]) == prompt:
                done = len(ids) - len(prompt)  # generated so far, the pending token included
                guess = np.array(reference[done : done + k], np.int64)
                self.calls += 1
                if self.calls % 3 == 0 and guess.size:
                    guess[-1] = (guess[-1] + 1) % self.vocab_size
                return guess
        return context[:0]
