"""The dense families beyond Llama: Gemma 3 and 2, Phi-3 / Phi-4-mini, SmolLM3, Granite and OLMo 2, each
imported from tiny random transformers checkpoints (tests/support/hf_models.py) in several configurations:
grouped-query and multi-query, tied and untied, windows shorter than the prompts.

For each: our PyTorch decoder's logits (and prompt log-probabilities) equal transformers' within 1e-4 on
whole prompts and on KV-cache decode steps of a left-padded batch; the in-place ONNX serving graph makes the
same 20 greedy tokens as transformers' generate, batched and each prompt alone, its logits within 1e-4.
Controls show the blocks each family adds change the logits, so the matches do test them; configs in
transformers 4's form read as in 5's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_models import (
    FAMILIES,
    PHI3_LONGROPE,
    PROMPTS,
    Run,
    build,
    gemma2_config,
    gemma3_config,
    gemma3_transformers4_form,
    granite_config,
    hf_greedy_batch,
    max_diff,
    olmo2_config,
    phi3_config,
    rewrite_config,
    run_inplace,
    smollm3_config,
    torch_forced,
)
from transformers import PretrainedConfig, PreTrainedModel

from export.hf_import import decoder_config, import_checkpoint, load_tokenizer
from export.model import Decoder, DecoderConfig, LayerAttention
from export.onnx_inplace import build_inplace_graph
from export.quantize import DEFAULT_BLOCK_SIZE, quantize_nbits
from serve.api.chat import ChatTemplate, special_tokens

TOL = 1e-4
LOGPROB_TOL = 2e-3
CASES: dict[str, Callable[[], PretrainedConfig]] = {
    "gemma3-local-rope-gqa-untied": lambda: gemma3_config(tie_word_embeddings=False),
    # transformers' Gemma 3 ignores an attention soft cap: so must the import.
    "gemma3-mqa-tied": lambda: gemma3_config(num_key_value_heads=1, attn_logit_softcapping=5.0),
    "gemma2-softcaps-window8": lambda: gemma2_config(),
    "phi3-partial-rotary-mqa-window8": lambda: phi3_config(sliding_window=8),
    "phi3-longrope-gqa": lambda: phi3_config(
        num_key_value_heads=2,
        max_position_embeddings=256,
        original_max_position_embeddings=128,
        rope_parameters=dict(PHI3_LONGROPE),
    ),
    "smollm3-nope-layers-tied": lambda: smollm3_config(),
    "granite-multipliers-mqa": lambda: granite_config(num_key_value_heads=1),
    "olmo2-post-norms-untied": lambda: olmo2_config(),
}

Generated = dict[str, tuple[PreTrainedModel, Decoder, Run]]


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> Generated:
    """Each case's transformers model, our import of it, and transformers' greedy run (built once)."""
    out = {}
    for name, make in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        hf = build(make(), folder)
        out[name] = (hf, import_checkpoint(folder).model, hf_greedy_batch(hf, PROMPTS))
    return out


def _assert_same_run(ref: Run, got: Run, what: str) -> None:
    assert np.array_equal(got.tokens, ref.tokens), f"{what}: greedy tokens differ"
    diff = max_diff(ref.logits, got.logits)
    assert diff <= TOL, f"{what}: max |logits diff| {diff:.2e}"


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_pytorch_decoder_matches_transformers(case: str, generated: Generated) -> None:
    hf, model, ref = generated[case]
    for p in PROMPTS:
        ids = torch.tensor([p])
        ours, _ = model(ids, torch.ones_like(ids), torch.arange(len(p))[None])
        theirs = hf(ids).logits
        assert float((theirs - ours).abs().max()) <= TOL
        logprobs = (theirs.log_softmax(-1) - ours.log_softmax(-1)).abs().max()
        assert float(logprobs) <= LOGPROB_TOL
    # Left-padded batch, prefill then KV-cache decode steps fed transformers' tokens.
    _assert_same_run(ref, torch_forced(model, PROMPTS, ref.tokens), "pytorch")


@pytest.mark.parametrize("case", CASES)
def test_inplace_graph_matches_transformers_generate(case: str, generated: Generated) -> None:
    _, model, ref = generated[case]
    graph = build_inplace_graph(model)
    _assert_same_run(ref, run_inplace(graph, model.cfg, PROMPTS), "in-place graph, batched")
    for row, prompt in enumerate(PROMPTS):
        alone = run_inplace(graph, model.cfg, [prompt])
        assert np.array_equal(alone.tokens[0], ref.tokens[row]), f"in-place graph, prompt {row} alone"


def _ablated(model: Decoder, **changes: Any) -> Decoder:
    other = Decoder(replace(model.cfg, **changes)).eval()
    other.load_state_dict(model.state_dict())
    return other


CONTROLS: list[tuple[str, str, Callable[[DecoderConfig], dict[str, Any]]]] = [
    ("gemma3-local-rope-gqa-untied", "local RoPE base", lambda c: {"layer_attention": _windows_only(c)}),
    ("gemma3-local-rope-gqa-untied", "windows", lambda c: {"layer_attention": ()}),
    ("gemma3-mqa-tied", "embedding scale", lambda c: {"embedding_scale": 1.0}),
    ("gemma3-mqa-tied", "query_pre_attn_scalar", lambda c: {"attn_scale": 0.0}),
    ("gemma2-softcaps-window8", "attention soft cap", lambda c: {"attn_softcap": 0.0}),
    ("gemma2-softcaps-window8", "logit soft cap", lambda c: {"logit_softcap": 0.0}),
    ("phi3-partial-rotary-mqa-window8", "partial rotary", lambda c: {"rotary_dim": 0}),
    ("phi3-longrope-gqa", "longrope", lambda c: {"rope_scaling": "none"}),
    ("smollm3-nope-layers-tied", "layers without rotary", lambda c: {"layer_attention": ()}),
    ("granite-multipliers-mqa", "residual multiplier", lambda c: {"residual_scale": 1.0}),
    ("granite-multipliers-mqa", "logits scaling", lambda c: {"logit_scale": 1.0}),
]


def _windows_only(cfg: DecoderConfig) -> tuple[LayerAttention, ...]:
    return tuple(LayerAttention(window=layer.window) for layer in cfg.layers)


@pytest.mark.parametrize(("case", "block", "change"), CONTROLS, ids=[f"{c}: {b}" for c, b, _ in CONTROLS])
def test_each_block_changes_the_logits(
    case: str, block: str, change: Callable[[DecoderConfig], dict[str, Any]], generated: Generated
) -> None:
    """Without the block, the same weights give logits far outside the tolerance of the matches above."""
    _, model, ref = generated[case]
    other = torch_forced(_ablated(model, **change(model.cfg)), PROMPTS, ref.tokens)
    assert max_diff(ref.logits, other.logits) > 100 * TOL, block


def test_imported_configs_have_the_families_blocks(generated: Generated) -> None:
    cfg = {name: model.cfg for name, (_, model, _) in generated.items()}
    gemma3 = cfg["gemma3-local-rope-gqa-untied"]
    local, glob = LayerAttention(window=8, rope_theta=1000.0), LayerAttention()
    assert gemma3.layers == (local, local, glob) and gemma3.rope_thetas == (0.0, 1000.0)
    assert (gemma3.rope_theta, gemma3.rope_scaling, gemma3.rope_factor) == (100000.0, "linear", 2.0)
    assert (gemma3.norm_placement, gemma3.activation, gemma3.qk_norm, gemma3.tie_embeddings) == (
        "sandwich",
        "geglu",
        True,
        False,
    )
    assert gemma3.attn_scale == 24**-0.5 and gemma3.embedding_scale == pytest.approx(8.0)
    mqa = cfg["gemma3-mqa-tied"]
    assert mqa.tie_embeddings and mqa.kv_heads == 1 and mqa.attn_softcap == 0.0
    gemma2 = cfg["gemma2-softcaps-window8"]
    assert [layer.window for layer in gemma2.layers] == [8, 0, 8] and not gemma2.qk_norm
    assert (gemma2.attn_softcap, gemma2.logit_softcap) == (5.0, 3.0)
    phi3 = cfg["phi3-partial-rotary-mqa-window8"]
    assert (phi3.head_dim, phi3.rotary_features, phi3.sliding_window, phi3.kv_heads) == (32, 16, 8, 1)
    longrope = cfg["phi3-longrope-gqa"]
    assert (longrope.rope_scaling, longrope.context_length, longrope.rope_original_context) == (
        "longrope",
        256,
        128,
    )
    assert longrope.rope_attention_factor == pytest.approx((1 + np.log(2) / np.log(128)) ** 0.5)
    assert [layer.rotary for layer in cfg["smollm3-nope-layers-tied"].layers] == [True, False, True]
    granite = cfg["granite-multipliers-mqa"]
    assert (granite.embedding_scale, granite.attn_scale, granite.residual_scale, granite.logit_scale) == (
        3.0,
        0.1,
        0.5,
        0.5,
    )
    olmo2 = cfg["olmo2-post-norms-untied"]
    assert (olmo2.norm_placement, olmo2.qk_norm, olmo2.qk_norm_scope) == ("post", True, "projection")


def _top_level_rope(config: dict[str, Any]) -> dict[str, Any]:
    """transformers 4's form of the other families: rope_theta, rope_scaling (with a "type") and
    partial_rotary_factor at the top level."""
    out = dict(config)
    rope = dict(out.pop("rope_parameters"))
    out["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        out["partial_rotary_factor"] = rope.pop("partial_rotary_factor")
    kind = rope.pop("rope_type", "default")
    out["rope_scaling"] = None if kind == "default" else {"type": kind, **rope}
    out["torch_dtype"] = out.pop("dtype")
    return out


@pytest.mark.parametrize(
    ("case", "to_four"),
    [
        ("gemma3-local-rope-gqa-untied", gemma3_transformers4_form),
        ("gemma2-softcaps-window8", _top_level_rope),
        ("phi3-longrope-gqa", _top_level_rope),
        ("smollm3-nope-layers-tied", _top_level_rope),
    ],
)
def test_transformers4_config_form_reads_as_the_transformers5_form(
    case: str, to_four: Callable[[dict[str, Any]], dict[str, Any]], tmp_path: Path, generated: Generated
) -> None:
    hf, model, _ = generated[case]
    hf.config.save_pretrained(tmp_path)
    rewrite_config(tmp_path, to_four)
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    assert decoder_config(tmp_path)[1] == model.cfg


# -- chat templates, quantized bundles ---------------------------------------------------------------------

DENSE = ("gemma3", "gemma2", "phi3", "smollm3", "granite", "olmo2")
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief. /no_think"},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "  and 3+3?\n"},
]


@pytest.mark.parametrize("name", DENSE)
def test_chat_template_renders_as_transformers(name: str, tmp_path: Path) -> None:
    """The family's template, as the importer reads it and the server compiles it with the bundle's special
    tokens (serve/api/common.py), renders and tokenizes a chat as apply_chat_template does."""
    family = FAMILIES[name]
    family.make_config().save_pretrained(tmp_path)  # its special token ids, as a checkpoint has them
    hf = family.save_tokenizer(tmp_path)
    imported = load_tokenizer(tmp_path)
    assert imported.chat_template == family.chat_template
    ids = {"eos_token": imported.eos_token_ids[0], "pad_token": imported.pad_token_id}
    if imported.bos_token_id is not None:
        ids["bos_token"] = imported.bos_token_id
    ours = ChatTemplate(family.chat_template, special_tokens(imported.tokenizer, ids))
    chat = CHAT[1:] if name == "gemma2" else CHAT  # Gemma 2's template refuses a system turn
    expected = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert ours.render(chat) == expected
    tokens = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ours.prompt_ids(imported.tokenizer, chat) == list(tokens)


QUANTIZED = [
    ("gemma3-local-rope-gqa-untied", 8),
    ("gemma2-softcaps-window8", 4),
    ("phi3-longrope-gqa", 4),
    ("olmo2-post-norms-untied", 8),
]


@pytest.mark.parametrize(("case", "bits"), QUANTIZED)
def test_quantized_serving_graph_is_batch_invariant(case: str, bits: int, generated: Generated) -> None:
    """The serving graph quantized as `--int8` / `--int4` quantize it (MatMulNBits, the embedding
    block-quantized, single rows padded): each prompt alone gives exactly its tokens and logits in the
    batch. (How far the rounding moves these random models' logits says nothing of a trained model's:
    the exporter's accuracy report measures that on text.)"""
    _, model, _ = generated[case]
    graph, counts = quantize_nbits(build_inplace_graph(model), bits, DEFAULT_BLOCK_SIZE[bits])
    assert counts["float"] == 0 and counts["quantized"] == 4 * model.cfg.n_layers + 1
    batched = run_inplace(graph, model.cfg, PROMPTS)
    for row, prompt in enumerate(PROMPTS):
        alone = run_inplace(graph, model.cfg, [prompt])
        assert np.array_equal(alone.tokens[0], batched.tokens[row]), f"prompt {row}"
        assert all(np.array_equal(a[0], b[row]) for a, b in zip(alone.logits, batched.logits, strict=True))
    assert all(np.isfinite(step).all() for step in batched.logits)
