"""peft adapters of imported checkpoints, served from LoRA slots: for each family, the serving graph with an
adapter in one of its slots gives transformers + peft's greedy tokens and logits (random A and B, several
ranks and target module sets), and a slot with nothing in it gives the base model's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hf_models import (
    PROMPTS,
    Run,
    build,
    gemma3_config,
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
from peft import LoraConfig, get_peft_model
from transformers import PretrainedConfig

from export.hf_import import checkpoint_modules, import_checkpoint
from export.lora import LoraOptions, lora_layout
from export.onnx_inplace import build_inplace_graph
from serve.engine.lora import LoraSlots, read_adapter

TOL = 1e-4
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
