"""Loading and unloading LoRA adapters while the server runs (`--lora-runtime-updates`; the HTTP routes are
vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`).

A load reads only folders under `--lora-root` (a path resolving outside it, through a symlink too, is
refused without saying whether it exists), and names them relative to it. It reads and checks the peft folder
here, off the event loop, against the bundle's LoRA layout (its manifest has it), before the engine hears of
it: the engine thread then only copies the adapter into a slot between two steps
(serve/scheduling/adapters.py), so the requests decoding meanwhile pause for that copy alone. Whatever fails
leaves the served adapters as they were. An unload of an adapter that requests use is deferred until they end.
"""

from __future__ import annotations

import asyncio

from serve.api.common import LoadedModel
from serve.api.config import ServerSettings
from serve.errors import InvalidRequest
from serve.scheduling.adapters import (
    UnloadAdapter,
    UpdateResult,
    check_room,
    name_problem,
    name_taken,
    runtime_load,
)


async def load_adapter(model: LoadedModel, name: str, folder: str, settings: ServerSettings) -> None:
    """Serve the peft adapter in `folder` (under settings.lora_root) as `name`; InvalidRequest (the bundle
    has no slots, the name is not allowed or taken, max_cpu_loras are loaded, the folder is not under the
    root, cannot be read or does not fit: the message names what differs)."""
    layout = model.bundle.manifest.lora
    if layout is None:
        raise InvalidRequest(
            f"model {model.name} has no LoRA slots: export its bundle with --lora-slots N --max-lora-rank R"
        )
    _check_name(model, name)
    check_room(len(model.info.adapters), settings.max_cpu_loras)  # before reading; the engine counts again
    if settings.lora_root is None:  # the settings refuse runtime updates without it
        raise InvalidRequest("this server has no --lora-root to load adapters from")
    load = await asyncio.to_thread(runtime_load, name, folder, model.bundle.manifest, settings.lora_root)
    await model.scheduler.update_adapters(load)


async def unload_adapter(model: LoadedModel, name: str) -> UpdateResult:
    """Stop serving the adapter `name`, at once or (requests use it) once they end: UpdateResult.deferred
    says which. NotFound for one not loaded."""
    return await model.scheduler.update_adapters(UnloadAdapter(name))


def _check_name(model: LoadedModel, name: str) -> None:
    """Refuse a name a request's `model` could not pick (before the folder is read: the engine checks a
    taken name again, as another load may take it meanwhile)."""
    if (problem := name_problem(name)) is not None:
        raise InvalidRequest(problem)
    if name in model.names:
        raise InvalidRequest(
            f"adapter {name!r} has a name the model is served by: a request could not pick it"
        )
    if name in model.info.adapters:
        raise name_taken(name)
