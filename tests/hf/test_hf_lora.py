"""peft adapters of imported checkpoints, served from LoRA slots: for each family, the serving graph with an
adapter in one of its slots gives transformers + peft's greedy tokens and logits (random A and B, several
ranks and target module sets), and a slot with nothing in it gives the base model's. An adapter of Gemma 3's
multimodal checkpoint, named as peft names it with transformers 5 or 4, serves on the text stack the import
keeps, its vision-tower weights left out with one warning."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from hf_models import (
    PROMPTS,
    Run,
    build,
    gemma3_config,
    gemma3_vlm_config,
    gpt2_config,
    hf_greedy_batch,
    llama_config,
    max_diff,
    mistral_config,
    olmo2_config,
    phi3_config,
    qwen2_config,
    qwen3_config,
    run_inplace,
)
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import PretrainedConfig

from export.hf_import import adapter_names, checkpoint_modules, import_checkpoint
from export.lora import LoraOptions, lora_layout
from export.model import DecoderConfig
from export.onnx_inplace import build_inplace_graph
from serve.engine.lora import LoraSlots, read_adapter
from serve.engine.lora.reading import Adapter
from serve.lora_layout import LoraLayout

TOL = 1e-4
LOGPROB_TOL = 2e-3
LLAMA_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> its config, and the adapter: (rank, alpha, target modules, rsLoRA)
CASES: dict[str, tuple[PretrainedConfig, tuple[int, int, list[str], bool]]] = {
    "llama": (llama_config(), (8, 16, LLAMA_ALL, False)),
    "mistral": (mistral_config(), (4, 8, ["q_proj", "v_proj", "down_proj"], False)),
    "qwen2": (qwen2_config(), (6, 12, ["k_proj", "o_proj", "up_proj"], True)),
    "qwen3": (qwen3_config(), (2, 8, ["q_proj", "gate_proj"], False)),
    "gpt2": (gpt2_config(), (4, 8, ["c_attn", "c_proj", "c_fc"], False)),
    "llama, 3 slots of rank 48": (llama_config(), (40, 32, LLAMA_ALL, False)),
    "gemma3": (gemma3_config(), (4, 8, ["q_proj", "o_proj", "down_proj"], False)),
    "phi3, fused projections": (phi3_config(), (4, 8, ["qkv_proj", "gate_up_proj", "o_proj"], False)),
    "olmo2": (olmo2_config(), (2, 4, ["k_proj", "up_proj"], True)),
}
SLOTS, RANK = 2, 8
# a wider rank over more slots
WIDE = LoraOptions(3, 48)


@pytest.mark.parametrize("family", CASES)
def test_an_adapter_in_a_slot_gives_transformers_and_pefts_tokens(family: str, tmp_path: Path) -> None:
    config, (rank, alpha, targets, rslora) = CASES[family]
    base = build(config, tmp_path / "model")
    model = import_checkpoint(tmp_path / "model").model
    options = LoraOptions(SLOTS, RANK) if rank <= RANK else WIDE
    layout = lora_layout(model.cfg, checkpoint_modules(model.cfg, type(base).__name__), options)
    graph = build_inplace_graph(model, layout)
    slots, last = LoraSlots(layout), options.slots
    # nothing in slot 1 yet
    plain = run_inplace(graph, model.cfg, PROMPTS, lora=(slots.span(1, last), (1, last), 1))

    lora = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    peft = get_peft_model(base, lora).eval()
    peft.save_pretrained(tmp_path / "adapter")
    slots.write(last, read_adapter(tmp_path / "adapter", layout))
    got = run_inplace(graph, model.cfg, PROMPTS, lora=(slots.span(1, last), (1, last), last))
    want = hf_greedy_batch(peft, PROMPTS)
    assert_same(got, want)
    with peft.disable_adapter():
        assert_same(plain, hf_greedy_batch(peft, PROMPTS))
    assert not np.array_equal(got.tokens, plain.tokens)  # the adapter changes the model


def assert_same(got: Run, want: Run) -> None:
    assert np.array_equal(got.tokens, want.tokens), "greedy tokens differ"
    assert max_diff(got.logits, want.logits) <= TOL


@dataclass(frozen=True)
class Multimodal:
    peft: PeftModel  # transformers' Gemma3ForConditionalGeneration with the adapter
    adapter: Path  # as peft saved it
    cfg: DecoderConfig
    layout: LoraLayout
    graph: onnx.ModelProto


# q_proj, o_proj and down_proj in the text stack, q_proj and fc1 in the vision tower too (peft matches a
# target's name in every module of the model).
MULTIMODAL_TARGETS = ["q_proj", "o_proj", "down_proj", "fc1"]
# peft's names of the modules with transformers 4, where Gemma3ForConditionalGeneration held the text-only
# model as language_model and SigLIP's model as vision_tower.
TRANSFORMERS4_NAMES = {
    "base_model.model.model.language_model.": "base_model.model.language_model.model.",
    "base_model.model.model.vision_tower.": "base_model.model.vision_tower.vision_model.",
}


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> Multimodal:
    folder = tmp_path_factory.mktemp("gemma3-multimodal")
    base = build(gemma3_vlm_config(), folder / "model")
    architecture = type(base).__name__
    model = import_checkpoint(folder / "model").model
    modules = checkpoint_modules(model.cfg, architecture)
    layout = lora_layout(model.cfg, modules, LoraOptions(SLOTS, RANK), adapter_names(architecture))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=MULTIMODAL_TARGETS, init_lora_weights=False)
    peft = get_peft_model(base, lora).eval()
    peft.save_pretrained(folder / "adapter")
    return Multimodal(peft, folder / "adapter", model.cfg, layout, build_inplace_graph(model, layout))


def _read_logging(folder: Path, layout: LoraLayout, caplog: pytest.LogCaptureFixture) -> tuple[Adapter, str]:
    """The adapter at `folder`, and the one warning reading it logged."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="textgen.lora"):
        adapter = read_adapter(folder, layout)
    warnings = [r.getMessage() for r in caplog.records if r.name == "textgen.lora"]
    assert len(warnings) == 1
    return adapter, warnings[0]


@torch.no_grad()
def test_a_multimodal_gemma3_adapter_serves_on_its_text_stack(
    multimodal: Multimodal, caplog: pytest.LogCaptureFixture
) -> None:
    """Greedy tokens and logits as transformers + peft's on text input, and the prompts' log-probabilities
    (each position's, from the serving graph's last-token logits of every prefix) within 2e-3; the
    vision tower's modules left out with one warning."""
    tensors = load_file(multimodal.adapter / "adapter_model.safetensors")
    vision = [name for name in tensors if ".vision_tower." in name]
    assert vision and len(vision) < len(
        tensors
    )  # peft put weights on the vision tower, and on the text stack
    adapter, warning = _read_logging(multimodal.adapter, multimodal.layout, caplog)
    assert f"{len(vision) // 2} modules of the adapter" in warning and "vision_tower" in warning
    assert len(adapter.modules) == (len(tensors) - len(vision)) // 2

    slots = LoraSlots(multimodal.layout)
    slots.write(SLOTS, adapter)
    lora = (slots.span(1, SLOTS), (1, SLOTS), SLOTS)
    got = run_inplace(multimodal.graph, multimodal.cfg, PROMPTS, lora=lora)
    assert_same(got, hf_greedy_batch(multimodal.peft, PROMPTS))
    with multimodal.peft.disable_adapter():
        assert not np.array_equal(got.tokens, hf_greedy_batch(multimodal.peft, PROMPTS).tokens)
    for prompt in PROMPTS:
        prefixes = [prompt[:k] for k in range(1, len(prompt) + 1)]
        ours = run_inplace(multimodal.graph, multimodal.cfg, prefixes, steps=1, lora=lora).logits[0]
        theirs = multimodal.peft(input_ids=torch.tensor([prompt])).logits[0]
        diff = (torch.from_numpy(ours).log_softmax(-1) - theirs.log_softmax(-1)).abs().max()
        assert float(diff) <= LOGPROB_TOL


def test_transformers4_names_of_a_multimodal_adapter_read_as_transformers5s(
    multimodal: Multimodal, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tensors = load_file(multimodal.adapter / "adapter_model.safetensors")
    renamed = {}
    for name, tensor in tensors.items():
        old = next(p for p in TRANSFORMERS4_NAMES if name.startswith(p))
        renamed[TRANSFORMERS4_NAMES[old] + name.removeprefix(old)] = tensor
    save_file(renamed, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_bytes((multimodal.adapter / "adapter_config.json").read_bytes())
    ours, warning = _read_logging(tmp_path, multimodal.layout, caplog)
    assert "vision_tower.vision_model." in warning
    want, _ = _read_logging(multimodal.adapter, multimodal.layout, caplog)
    key = lambda m: (m.projection, m.part)  # noqa: E731
    pairs = zip(sorted(ours.modules, key=key), sorted(want.modules, key=key), strict=True)
    assert all(key(a) == key(b) and np.array_equal(a.a, b.a) and np.array_equal(a.b, b.b) for a, b in pairs)
