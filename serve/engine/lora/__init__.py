"""LoRA adapters served in a bundle's slots, one concept a module:

    reading.py    a peft folder read and checked against the bundle's layout: Adapter, AdapterError
    slots.py      the slots' weight arrays the graph reads (LoraSlots); the graph's LoRA inputs checked
    routing.py    which tokens of a run take which slot (token_slots)
    residency.py  which adapter is in which slot, and which one is evicted (Residency)

The engine uses them in serve/engine/adapters.py; the export side that writes the slots into the graph is
export/lora.py. The names below are those callers outside this package import.
"""

from serve.engine.lora.reading import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    Adapter,
    AdapterError,
    AdapterModule,
    model_names,
    read_adapter,
)
from serve.engine.lora.residency import Residency, adapters_full
from serve.engine.lora.routing import token_slots
from serve.engine.lora.slots import LoraSlots, check_graph_inputs

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "Adapter",
    "AdapterError",
    "AdapterModule",
    "LoraSlots",
    "Residency",
    "adapters_full",
    "check_graph_inputs",
    "model_names",
    "read_adapter",
    "token_slots",
]
