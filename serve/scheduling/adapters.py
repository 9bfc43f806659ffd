"""Changing the served LoRA adapters while the server runs: the updates, and how the engine thread makes one.

An update (`LoadAdapter`, `UnloadAdapter`) reaches the engine thread between two engine steps, never during
one: `BatchRunner.request_update` queues it and its next step makes it first (in an engine process the
command comes over the pipe, serve/scheduling/messages.py). A load carries the adapter already read and laid
out for the bundle's slots, so the engine thread only copies it into a slot: the decoding of other requests
pauses for that copy alone. An unload of an adapter that running or queued requests use is deferred: from
then on no new request may name it (as if it were gone), the requests that have it already (running,
queued, preempted) finish with it, and the step after the last of them ends unregisters it
(`retire_unused`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from serve.bundle import Manifest
from serve.engine.lora import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Adapter,
    AdapterError,
    adapters_full,
    model_names,
    read_adapter,
)
from serve.errors import InvalidRequest, NotFound, TextgenError
from serve.lora_layout import LoraLayout

# An adapter's name: what a request gives as its `model`, and a value in Prometheus labels, where the
# adapters of running requests are listed comma-separated (vllm:lora_requests_info). Letters, digits and
# `._:/-` only, starting with a letter or digit: no comma, space, quote or control character.
ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]*")
MAX_ADAPTER_NAME = 128


def name_problem(name: str) -> str | None:
    """What is wrong with `name` as an adapter's name (ADAPTER_NAME); None: nothing."""
    if not name:
        return "an adapter's name must not be empty"
    if len(name) > MAX_ADAPTER_NAME or ADAPTER_NAME.fullmatch(name) is None:
        return (
            f"adapter name {name[:MAX_ADAPTER_NAME]!r} is not allowed: at most {MAX_ADAPTER_NAME} letters, "
            "digits and ._:/- starting with a letter or digit"
        )
    return None


@dataclass(frozen=True)
class LoadAdapter:
    """Serve `adapter` (read and checked against the bundle already) as `name`."""

    name: str
    adapter: Adapter


@dataclass(frozen=True)
class UnloadAdapter:
    name: str


AdapterUpdate = LoadAdapter | UnloadAdapter


@dataclass(frozen=True)
class UpdateResult:
    """An update made: the adapters served after it, and for a deferred unload the running and queued
    requests it waits for (0: made at once)."""

    adapters: tuple[str, ...]
    deferred: int = 0


def read_load(
    name: str,
    folder: Path | str,
    layout: LoraLayout,
    base_names: Collection[str] = (),
    root: Path | None = None,
) -> LoadAdapter:
    """The load of the peft adapter in `folder` as `name`, read and laid out for `layout`'s slots (seconds
    for a large one: call it off the event loop and the engine thread). InvalidRequest names what does not
    fit, and its file relative to `root` when under it."""
    try:
        return LoadAdapter(name, read_adapter(folder, layout, base_names))
    except AdapterError as exc:
        where = exc.path.relative_to(root) if root and exc.path.is_relative_to(root) else exc.path
        raise InvalidRequest(f"adapter {name!r}: {where}: {exc.problem}") from None


def runtime_load(name: str, folder: str, manifest: Manifest, root: Path) -> LoadAdapter:
    """The load of the peft adapter in `folder` (relative to `root`, or absolute) as `name`, for a bundle of
    `manifest` (LoRA slots): only a folder under `root` is read, and errors name files relative to it."""
    if manifest.lora is None:
        raise InvalidRequest(f"model {manifest.model_name} has no LoRA slots")
    real_root = Path(os.path.realpath(root))
    path = under_root(folder, real_root)
    return read_load(name, path, manifest.lora, model_names(manifest), real_root)


def under_root(folder: str, root: Path) -> Path:
    """`folder` (relative to `root`, or absolute) resolved, with the adapter files in it; InvalidRequest
    if any of them resolves outside `root`, saying nothing of what is there."""
    path = Path(os.path.realpath(root / folder))  # an absolute folder is taken as it is
    for resolved in (path, *(Path(os.path.realpath(path / file)) for file in (CONFIG_FILE, WEIGHTS_FILE))):
        if not resolved.is_relative_to(root):
            raise InvalidRequest(
                f"lora_path {folder!r} is not a folder under the server's --lora-root: adapters are loaded "
                "from there only (give a path relative to it)"
            )
    return path


def check_room(loaded: int, limit: int) -> None:
    """InvalidRequest when `loaded` adapters are as many as --max-cpu-loras (`limit`) allows."""
    if loaded >= limit:
        raise InvalidRequest(adapters_full(loaded))


@runtime_checkable
class AdapterEngine(Protocol):
    """What an update needs of the engine (serve.engine.engine.Engine); an engine without it serves none."""

    @property
    def lora_slots(self) -> int: ...
    @property
    def adapter_names(self) -> tuple[str, ...]: ...  # those a request may name: not those retiring
    @property
    def retiring_adapters(self) -> tuple[str, ...]: ...
    @property
    def adapter_counts(self) -> tuple[int, int]: ...  # adapters written into a slot, and evictions
    def register_adapter(self, name: str, adapter: Adapter) -> None: ...
    def unregister_adapter(self, name: str) -> None: ...
    def retire_adapter(self, name: str) -> None: ...


def lora_engine(engine: object) -> AdapterEngine | None:
    """`engine` if it serves adapters (a bundle with LoRA slots); None for one that cannot."""
    return engine if isinstance(engine, AdapterEngine) and engine.lora_slots else None


def apply_update(engine: AdapterEngine | None, update: AdapterUpdate, users: Iterable[str]) -> UpdateResult:
    """Make `update` on the engine, between two steps. `users`: the adapter of each running or queued
    request; an unload of an adapter some use is deferred (the module docstring). InvalidRequest or
    NotFound say why nothing changed."""
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
        return UpdateResult(engine.adapter_names)
    if name not in engine.adapter_names:
        raise NotFound(f"no adapter named {name!r} is loaded ({_listed(engine.adapter_names)})")
    using = sum(1 for user in users if user == name)
    _engine_call(engine.retire_adapter if using else engine.unregister_adapter, name)
    return UpdateResult(engine.adapter_names, using)


def retire_unused(engine: AdapterEngine | None, users: Iterable[str]) -> None:
    """Unregister the retiring adapters no running or queued request (`users`) uses any more; one the
    engine still holds (a preempted request's) waits for a later step."""
    if engine is None or not engine.retiring_adapters:
        return
    used = set(users)
    for name in engine.retiring_adapters:
        if name not in used:
            try:
                engine.unregister_adapter(name)
            except ValueError:
                continue


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
