"""LoRA residency: which registered adapters sit in which slots, and which one is evicted (least recently
used, among those no sequence holds) when a sequence needs one that is not resident.
"""

from __future__ import annotations

from collections.abc import Collection

from serve.engine.lora.reading import Adapter
from serve.engine.types import DEFAULT_MAX_CPU_LORAS


def adapters_full(loaded: int) -> str:
    """Why a load is refused when `loaded` adapters are registered, as many as --max-cpu-loras allows."""
    return f"{loaded} adapters are loaded, as many as --max-cpu-loras allows: unload one first"


class Residency:
    """Which of the registered adapters sit in which slots. An adapter not resident is written into a free
    slot when a sequence needs it, else into the slot of the least recently used adapter no sequence holds
    (the scheduler admits no more distinct adapters than there are slots)."""

    def __init__(self, slots: int, limit: int = DEFAULT_MAX_CPU_LORAS) -> None:
        self.slots = slots
        self.limit = limit  # the most adapters registered at once (--max-cpu-loras)
        self.registered: dict[str, Adapter] = {}
        self.retiring: set[str] = set()  # registered, unloaded once no request uses them; none may name them
        self.resident: dict[str, int] = {}  # name -> slot
        self._used: dict[str, int] = {}  # name -> the clock when a sequence last took it
        self._clock = 0
        self.loads = 0  # adapters written into a slot, ever
        self.evictions = 0  # of them, those that replaced another adapter

    @property
    def served(self) -> tuple[str, ...]:
        """The adapters a new request may name, in the order they were registered."""
        return tuple(name for name in self.registered if name not in self.retiring)

    def register(self, name: str, adapter: Adapter) -> None:
        if name in self.retiring:
            raise ValueError(
                f"adapter {name!r} is being unloaded once its running requests finish: load it again then"
            )
        if name in self.registered:
            raise ValueError(f"an adapter named {name!r} is already loaded")
        if len(self.registered) >= self.limit:
            raise ValueError(adapters_full(len(self.registered)))
        self.registered[name] = adapter

    def unregister(self, name: str, busy: Collection[str]) -> int | None:
        """Forget `name`; returns the slot it leaves empty (None: it was not resident). ValueError while a
        sequence runs with it."""
        if name not in self.registered:
            raise ValueError(f"no adapter named {name!r} is loaded")
        if name in busy:
            raise ValueError(f"adapter {name!r} is in use by running requests; unload it once they finish")
        del self.registered[name]
        self.retiring.discard(name)
        self._used.pop(name, None)
        return self.resident.pop(name, None)

    def free_slot(self) -> int | None:
        taken = set(self.resident.values())
        return next((s for s in range(1, self.slots + 1) if s not in taken), None)

    def place(self, name: str, busy: Collection[str]) -> int:
        """The slot `name` is written into: a free one, else the least recently used adapter's that no
        sequence in `busy` holds (it is evicted). ValueError when every slot is held."""
        slot = self.free_slot()
        if slot is None:
            idle = [n for n in self.resident if n not in busy]
            if not idle:
                raise ValueError(
                    f"every one of the {self.slots} LoRA slots holds an adapter a running request uses"
                )
            slot = self.resident.pop(min(idle, key=lambda n: self._used.get(n, 0)))
            self.evictions += 1
        self.resident[name] = slot
        self.loads += 1
        return slot

    def touch(self, name: str) -> None:
        self._clock += 1
        self._used[name] = self._clock
