"""Loading and unloading LoRA adapters while the server runs (`--lora-runtime-updates`; the HTTP routes are
vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`).

A load reads and checks the peft folder here, off the event loop, against the bundle's LoRA layout (its
manifest has it), before the engine hears of it: the engine thread then only copies the adapter into a slot
between two steps (serve/scheduling/adapters.py), so the requests decoding meanwhile pause for that copy
alone. Whatever fails leaves the served adapters as they were.
"""

from __future__ import annotations

import asyncio

from serve.api.common import LoadedModel
from serve.errors import InvalidRequest
from serve.scheduling.adapters import UnloadAdapter, name_taken, read_load


async def load_adapter(model: LoadedModel, name: str, folder: str) -> None:
    """Serve the peft adapter in `folder` as `name`; InvalidRequest (the bundle has no slots, the name is
    taken or the model's, the folder cannot be read or does not fit: the message names what differs)."""
    layout = model.bundle.manifest.lora
    if layout is None:
        raise InvalidRequest(
            f"model {model.name} has no LoRA slots: export its bundle with --lora-slots N --max-lora-rank R"
        )
    _check_name(model, name)
    load = await asyncio.to_thread(read_load, name, folder, layout)
    await model.scheduler.update_adapters(load)


async def unload_adapter(model: LoadedModel, name: str) -> None:
    """Stop serving the adapter `name`; NotFound for one not loaded, InvalidRequest while running or queued
    requests use it (refused, not deferred)."""
    await model.scheduler.update_adapters(UnloadAdapter(name))


def _check_name(model: LoadedModel, name: str) -> None:
    """Refuse a name a request's `model` could not pick (before the folder is read: the engine checks a
    taken name again, as another load may take it meanwhile)."""
    if not name.strip():
        raise InvalidRequest("lora_name must not be empty")
    if name == model.name:
        raise InvalidRequest(f"adapter {name!r} has the model's own name: a request could not pick it")
    if name in model.info.adapters:
        raise name_taken(name)
