"""Changing the served LoRA adapters while the server runs: the updates, and how the engine thread makes one.

An update (`LoadAdapter`, `UnloadAdapter`) reaches the engine thread between two engine steps, never during
one: `BatchRunner.request_update` queues it and its next step makes it first (in an engine process the
command comes over the pipe, serve/scheduling/messages.py). A load carries the adapter already read and laid
out for the bundle's slots, so the engine thread only copies it into a slot: the decoding of other requests
pauses for that copy alone. An unload of an adapter that running or queued requests use is refused, not
deferred: the caller retries once they finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from serve.bundle import LoraLayout
from serve.engine.lora import Adapter, AdapterError, read_adapter
from serve.errors import InvalidRequest, NotFound, TextgenError


@dataclass(frozen=True)
class LoadAdapter:
    """Serve `adapter` (read and checked against the bundle already) as `name`."""

    name: str
    adapter: Adapter


@dataclass(frozen=True)
class UnloadAdapter:
    name: str


AdapterUpdate = LoadAdapter | UnloadAdapter


def read_load(name: str, folder: str, layout: LoraLayout) -> LoadAdapter:
    """The load of the peft adapter in `folder` as `name`, read and laid out for `layout`'s slots (seconds
    for a large one: call it off the event loop and the engine thread). InvalidRequest names what does not
    fit."""
    try:
        return LoadAdapter(name, read_adapter(folder, layout))
    except AdapterError as exc:
        raise InvalidRequest(f"adapter {name!r}: {exc}") from None


@runtime_checkable
class AdapterEngine(Protocol):
    """What an update needs of the engine (serve.engine.engine.Engine); an engine without it serves none."""

    @property
    def lora_slots(self) -> int: ...
    @property
    def adapter_names(self) -> tuple[str, ...]: ...
    @property
    def adapter_counts(self) -> tuple[int, int]: ...  # adapters written into a slot, and evictions
    def register_adapter(self, name: str, adapter: Adapter) -> None: ...
    def unregister_adapter(self, name: str) -> None: ...


def lora_engine(engine: object) -> AdapterEngine | None:
    """`engine` if it serves adapters (a bundle with LoRA slots); None for one that cannot."""
    return engine if isinstance(engine, AdapterEngine) and engine.lora_slots else None


def apply_update(
    engine: AdapterEngine | None, update: AdapterUpdate, users: Iterable[str]
) -> tuple[str, ...]:
    """Make `update` on the engine, between two steps; returns the adapters served after it. `users`: the
    adapter of each running or queued request. InvalidRequest or NotFound say why nothing changed."""
    if engine is None:
        raise InvalidRequest(
            "this model's bundle has no LoRA slots: export it with --lora-slots N --max-lora-rank R to "
            "serve adapters"
        )
    name = update.name
    if isinstance(update, LoadAdapter):
        if name in engine.adapter_names:
            raise name_taken(name)
        _engine_call(engine.register_adapter, name, update.adapter)
    else:
        if name not in engine.adapter_names:
            raise NotFound(f"no adapter named {name!r} is loaded ({_listed(engine.adapter_names)})")
        using = sum(1 for user in users if user == name)
        if using:
            raise InvalidRequest(
                f"adapter {name!r} is in use by {using} running or queued requests: an unload is refused, "
                "not deferred; retry once they finish"
            )
        _engine_call(engine.unregister_adapter, name)
    return engine.adapter_names


def name_taken(name: str) -> InvalidRequest:
    return InvalidRequest(f"an adapter named {name!r} is already loaded: unload it first")


def unknown_adapter(request_id: str, adapter: str, served: tuple[str, ...]) -> TextgenError:
    """The error of a request naming an adapter that is not (or no longer) loaded."""
    return NotFound(f"request {request_id}: adapter {adapter!r} is not loaded ({_listed(served)})")


def _engine_call(call: Callable[..., None], *args: object) -> None:
    """The engine's own refusals (ValueError) as the caller's error: the engine is left as it was."""
    try:
        call(*args)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


def _listed(names: tuple[str, ...]) -> str:
    return f"adapters: {', '.join(names)}" if names else "none is"
