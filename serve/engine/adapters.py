"""The engine's LoRA adapters: which one is in which slot (serve/engine/lora/residency.py), and the slots'
weights and the token routes bound to a run (lora/slots.py, lora/routing.py).

A running sequence's slot is its KV row's `_row_adapter` (0: the base model). An adapter is written into a
slot when a sequence about to run needs it, evicting the least recently used idle one; a slot rewritten
forgets the prefix-cache rows kept under the adapter it held.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from serve.engine.lora.reading import Adapter
from serve.engine.lora.routing import token_slots
from serve.engine.runtime import ortvalue
from serve.engine.state import EngineState


class Adapters(EngineState):
    """Adapter residency and binding over the engine's state."""

    @property
    def lora_slots(self) -> int:
        """Adapters resident at once (0: the bundle serves none); the scheduler runs no more distinct ones."""
        return self._adapters.slots

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """The LoRA adapters a request may name, in the order they were registered (not those retiring)."""
        return self._adapters.served

    @property
    def retiring_adapters(self) -> tuple[str, ...]:
        """The adapters unloaded once no request uses them (retire_adapter)."""
        return tuple(self._adapters.retiring)

    @property
    def adapter_counts(self) -> tuple[int, int]:
        """Adapters written into a slot so far, and how many of those evicted another."""
        return self._adapters.loads, self._adapters.evictions

    def register_adapter(self, name: str, adapter: Adapter) -> None:
        """Serve `adapter` as `name`: it takes a free slot now, or one when a request needs it. ValueError
        when the bundle has no LoRA slots or the name is taken."""
        if self._lora is None:
            raise ValueError("the bundle has no LoRA slots: export it with --lora-slots to serve adapters")
        self._adapters.register(name, adapter)
        if self._adapters.free_slot() is not None:
            self._place(name)

    def unregister_adapter(self, name: str) -> None:
        """Stop serving `name`; ValueError for an unknown one or while a sequence runs with it."""
        resuming = {kept.adapter for kept in self._swapped.values()}
        slot = self._adapters.unregister(name, self._busy_adapters() | resuming)
        if slot is not None and self._lora is not None:
            self._lora.write(slot, None)
            self._prefix.forget(slot)

    def retire_adapter(self, name: str) -> None:
        """Serve `name` to the requests that have it already, and to no new one: no request may name it
        from now on, and unregister_adapter forgets it once those end. ValueError for an unknown one."""
        if name not in self.adapter_names:
            raise ValueError(f"no adapter named {name!r} is loaded")
        self._adapters.retiring.add(name)

    def slot(self, adapter: str) -> int:
        """The slot of a resident adapter ("": the base model, 0)."""
        return self._adapters.resident[adapter] if adapter else 0

    def _make_resident(self, wanted: set[str]) -> None:
        """Write the adapters about to run that are not in a slot into one (evicting idle ones)."""
        for name in wanted:
            if name not in self._adapters.resident:
                self._place(name, self._busy_adapters() | wanted)
            self._adapters.touch(name)

    def _place(self, name: str, busy: frozenset[str] | set[str] = frozenset()) -> None:
        assert self._lora is not None
        slot = self._adapters.place(name, busy)
        self._prefix.forget(slot)  # rows kept from the adapter this slot held before
        self._lora.write(slot, self._adapters.registered[name])

    def _adapter_in(self, slot: int) -> str:
        """The name of the adapter in `slot` ("" for 0, the base model)."""
        return next((name for name, s in self._adapters.resident.items() if s == slot), "")

    def _busy_adapters(self) -> set[str]:
        """The adapters of the sequences that hold rows: running, prefilled in chunks or beside decode."""
        held = len(self._ids) + (self._staged is not None)
        if self._background is not None:
            held = self._background.first + len(self._background.new)
        slots = set(self._row_adapter[:held].tolist())
        return {name for name, slot in self._adapters.resident.items() if slot in slots}

    def _lora_span(self, rows: slice) -> tuple[int, int]:
        """The first and last slot the rows of a run use ((0, 0): none)."""
        slots = self._row_adapter[rows]
        used = slots[slots > 0]
        return (int(used.min()), int(used.max())) if used.size else (0, 0)

    def _lora_routes(self, rows: slice, tokens: int, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """The LoRA graph's inputs that route the tokens of a run over `rows` of `tokens` positions to the
        slots of `span` (lora.token_slots)."""
        if self._lora is None:
            return {}
        return token_slots(self._row_adapter[rows], tokens, span)

    def _bind_adapters(self, binding: Any, span: tuple[int, int]) -> None:
        """Bind the weights of the slots `span` ((0, 0): inputs of no length); rebound only when it changes.
        ONNX Runtime reads the arrays in place: a slot written later is read."""
        if self._lora is None or self._lora_bound.get(id(binding)) == span:
            return
        values = self._lora_values.get(span)
        if values is None:
            values = self._lora_values[span] = {
                name: ortvalue(a) for name, a in self._lora.span(*span).items()
            }
        for name, value in values.items():
            binding.bind_ortvalue_input(name, value)
        self._lora_bound[id(binding)] = span
