"""Adapters checked before they cost anything: half-precision adapters read exactly, non-finite weights and
an overflowing scale refused naming the tensor, a rank or a module the bundle cannot serve refused from the
header with no tensor read, another base model warned of, a registered adapter costing its own size, and the
engine's limit on registered adapters and its deferred unload."""

from __future__ import annotations

import json
import logging
import shutil
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from lora_adapters import MAX_RANK, copied, expected, save_adapter
from safetensors import safe_open
from safetensors.numpy import load_file

from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.lora import WEIGHTS_FILE, AdapterError, model_names, read_adapter, reading
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence
from serve.lora_layout import LoraLayout

HEADER_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16"}


def layout_of(root: Path) -> LoraLayout:
    layout = load_bundle(root).manifest.lora
    assert layout is not None
    return layout


@pytest.fixture
def counted_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the tensors read from now on."""
    reads: list[str] = []
    read = reading._read_tensor

    def counting(path: Path, file: object, name: str) -> np.ndarray:
        reads.append(name)
        return read(path, file, name)

    monkeypatch.setattr(reading, "_read_tensor", counting)
    return reads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_precision_adapters_serve_as_their_weights_widened(
    lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path, dtype: torch.dtype
) -> None:
    root, _ = lora_bundle
    half = save_adapter(tmp_path / "half", seed=7, dtype=dtype)
    widened = save_adapter(tmp_path / "widened", seed=7, dtype=dtype, widened=True)
    with safe_open(str(half / WEIGHTS_FILE), framework="numpy") as file:
        assert {file.get_slice(k).get_dtype() for k in file.keys()} == {HEADER_DTYPES[dtype]}  # noqa: SIM118
    got, want = read_adapter(half, layout_of(root)), read_adapter(widened, layout_of(root))
    assert len(got.modules) == len(want.modules) > 0
    for mine, theirs in zip(got.modules, want.modules, strict=True):
        assert mine.a.dtype == mine.b.dtype == np.float32
        assert np.array_equal(mine.a, theirs.a) and np.array_equal(mine.b, theirs.b)
    assert expected(root, {"half": half}, "half") == expected(root, {"half": widened}, "half")


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
def test_non_finite_weights_are_refused_naming_the_tensor(
    lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path, value: float
) -> None:
    root, adapters = lora_bundle
    tensors = load_file(str(adapters["sql"] / WEIGHTS_FILE))
    name = sorted(tensors)[-1]
    tensors[name][0, 0] = value
    with pytest.raises(AdapterError, match=f"{name} holds 1 NaN or infinite values"):
        read_adapter(copied(adapters["sql"], tmp_path / "bad", tensors), layout_of(root))


def test_a_scale_past_float32_is_refused_naming_the_tensor(
    lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    root, adapters = lora_bundle
    folder = copied(adapters["sql"], tmp_path / "loud", lora_alpha=1e40)
    with pytest.raises(AdapterError, match=r"lora_B\.weight times its scale 2\.5e\+39 \(lora_alpha 1e\+40\)"):
        read_adapter(folder, layout_of(root))


def huge_rank_adapter(source: Path, folder: Path, rank: int) -> Path:
    """A copy of `source` whose first module the header claims is of rank `rank` (lora_A [rank, in],
    lora_B [out, rank]): a sparse file as large as that says, taking no disk (nor memory, if not read)."""
    shutil.copytree(source, folder)
    with safe_open(str(source / WEIGHTS_FILE), framework="numpy") as file:
        shapes = {name: file.get_slice(name).get_shape() for name in file.keys()}  # noqa: SIM118
    module = sorted(shapes)[0].rsplit(".lora_", 1)[0]
    shapes[f"{module}.lora_A.weight"][0] = shapes[f"{module}.lora_B.weight"][1] = rank
    header: dict[str, object] = {}
    offset = 0
    for name, shape in sorted(shapes.items()):
        size = 4 * int(np.prod(shape))
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(folder / WEIGHTS_FILE, "wb") as out:
        out.write(struct.pack("<Q", len(text)) + text)
        out.truncate(8 + len(text) + offset)
    return folder


def test_a_rank_above_the_bundles_is_refused_before_any_tensor_is_read(
    lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path, counted_reads: list[str]
) -> None:
    """A header claiming a 250 MiB lora_A: refused by its rank, with no tensor read and no memory taken."""
    root, adapters = lora_bundle
    rank = 2**21
    folder = huge_rank_adapter(adapters["sql"], tmp_path / "huge", rank)
    assert (folder / WEIGHTS_FILE).stat().st_size > 200 * 2**20
    tracemalloc.start()
    try:
        with pytest.raises(
            AdapterError, match=f"has rank {rank}, above the bundle's --max-lora-rank {MAX_RANK}"
        ):
            read_adapter(folder, layout_of(root))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert counted_reads == [] and peak < 8 * 2**20
    wide = save_adapter(tmp_path / "wide", seed=3, rank=MAX_RANK + 1)
    with pytest.raises(AdapterError, match="above the bundle's --max-lora-rank"):
        read_adapter(wide, layout_of(root))
    assert counted_reads == []


def test_an_untargeted_module_is_refused_before_any_tensor_is_read(
    lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path, counted_reads: list[str]
) -> None:
    root, adapters = lora_bundle
    tensors = load_file(str(adapters["sql"] / WEIGHTS_FILE))
    first = sorted(tensors)[0]
    module = first.rsplit(".lora_", 1)[0]
    for side in ("A", "B"):
        name = f"{module}.lora_{side}.weight"
        tensors[name.replace(module, f"{module}_gate")] = tensors.pop(name)
    folder = copied(adapters["sql"], tmp_path / "gate", tensors)
    with pytest.raises(AdapterError, match=r"targets .*_gate, for which the bundle has no LoRA branch"):
        read_adapter(folder, layout_of(root))
    assert counted_reads == []


def test_an_adapter_of_another_base_model_is_served_with_a_warning(
    lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Shapes alone do not prove the base: the config's base_model_name_or_path is compared too."""
    root, adapters = lora_bundle
    manifest = load_bundle(root).manifest
    names = model_names(manifest)
    assert manifest.model_name.lower() in names
    other = copied(adapters["sql"], tmp_path / "other", base_model_name_or_path="meta-llama/Llama-3.1-8B")
    same = copied(adapters["sql"], tmp_path / "same", base_model_name_or_path=f"org/{manifest.model_name}")
    with caplog.at_level(logging.WARNING, logger="textgen.lora"):
        read_adapter(same, layout_of(root), names)
        assert not caplog.records
        read_adapter(other, layout_of(root), names)
    assert "'meta-llama/Llama-3.1-8B' is not the bundle's model" in caplog.text
    hub_cache = "/cache/hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abcd"  # a hub cache folder: its hub id
    exported = {"export": {"source": {"hf_model": hub_cache}}}
    imported = manifest.model_copy(update={"model_name": "qwen", "verification": exported})
    assert model_names(imported) == {"qwen", "qwen2.5-0.5b"}


def test_a_registered_adapter_costs_its_own_size(
    lora_bundle: tuple[Path, dict[str, Path]], tmp_path: Path
) -> None:
    """Rank 1 on two modules per block: its own A and B in float32, not the slot's dense layout."""
    root, _ = lora_bundle
    layout = layout_of(root)
    tiny = read_adapter(save_adapter(tmp_path / "r1", seed=2, rank=1), layout)
    tensors = load_file(str(tmp_path / "r1" / WEIGHTS_FILE))
    own = sum(t.astype(np.float32).nbytes for t in tensors.values())
    assert tiny.rank == 1 and tiny.nbytes == own
    assert layout.max_adapter_bytes >= MAX_RANK * tiny.nbytes  # what a rank-R adapter on every module takes
    full = read_adapter(save_adapter(tmp_path / "r4", seed=2, rank=MAX_RANK), layout)
    assert full.nbytes == MAX_RANK * own < layout.max_adapter_bytes
    every = save_adapter(tmp_path / "all", seed=2, rank=MAX_RANK, targets=("qkv", "out", "up", "down"))
    assert read_adapter(every, layout).nbytes == layout.max_adapter_bytes  # the most one may take


def engine_of(root: Path, adapters: dict[str, Path], max_cpu_loras: int = 16) -> Engine:
    named = tuple((name, str(path)) for name, path in adapters.items())
    settings = EngineSettings(max_batch_size=2, adapters=named, max_cpu_loras=max_cpu_loras)
    return Engine.from_bundle(load_bundle(root), settings)


def test_the_engine_registers_no_more_adapters_than_max_cpu_loras(
    lora_bundle: tuple[Path, dict[str, Path]],
) -> None:
    root, adapters = lora_bundle
    engine = engine_of(root, {"sql": adapters["sql"], "poet": adapters["poet"]}, max_cpu_loras=2)
    with pytest.raises(ValueError, match="2 adapters are loaded, as many as --max-cpu-loras allows"):
        engine.register_adapter("chef", read_adapter(adapters["chef"], layout_of(root)))
    engine.unregister_adapter("poet")
    engine.register_adapter("chef", read_adapter(adapters["chef"], layout_of(root)))
    assert engine.adapter_names == ("sql", "chef")


def test_a_retiring_adapter_serves_its_requests_and_no_new_one(
    lora_bundle: tuple[Path, dict[str, Path]],
) -> None:
    root, adapters = lora_bundle
    engine = engine_of(root, {"sql": adapters["sql"]})
    engine.prefill([NewSequence("s", [5, 6, 7], SamplingParams(), adapter="sql")])
    engine.retire_adapter("sql")
    assert engine.adapter_names == () and engine.retiring_adapters == ("sql",)
    engine.decode()  # its running sequence goes on with it
    with pytest.raises(ValueError, match="'sql' is being unloaded"):
        engine.register_adapter("sql", read_adapter(adapters["sql"], layout_of(root)))
    engine.release(["s"])
    engine.unregister_adapter("sql")
    assert engine.retiring_adapters == () and engine.adapter_counts[0] == 1
