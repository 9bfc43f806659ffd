"""Gemma 3's multimodal checkpoints (Gemma3ForConditionalGeneration: 4B, 12B, 27B) import as their text
stack, a text-only Gemma 3: tiny random ones saved by transformers 5 (tests/support/hf_models.py), with the
text stack under either prefix transformers uses (language_model.model.* as it saves them,
model.language_model.* as its modules name them), tied and untied.

On text-only input our decoder and the in-place serving graph make the same greedy tokens as transformers'
Gemma3ForConditionalGeneration, the logits within 1e-4 and prompt log-probabilities within 2e-3; the vision
tower is left out with one warning, and so are the soft caps the multimodal model does not apply; the
published checkpoints' sparse text_config and transformers 4's form of it read as transformers completes them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_models import (
    PROMPTS,
    build,
    gemma3_transformers4_form,
    gemma3_vlm_config,
    hf_greedy_batch,
    max_diff,
    rewrite_config,
    run_inplace,
    torch_forced,
)
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PreTrainedModel

from export.hf_import import TEXT_STACK_OF, decoder_config, import_checkpoint
from export.model import Decoder
from export.onnx_inplace import build_inplace_graph

TOL = 1e-4
LOGPROB_TOL = 2e-3
# Where transformers' modules keep what its save_pretrained writes under language_model.* and beside it.
MODULE_NAMES = {
    "language_model.model.": "model.language_model.",
    "language_model.lm_head.": "lm_head.",
    "vision_tower.": "model.vision_tower.",
    "multi_modal_projector.": "model.multi_modal_projector.",
}
CASES = {"untied-saved-names": False, "tied-module-names": True}
# Soft caps near the scores' and logits' size, which the multimodal model applies neither of.
CAPS = {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}

Imported = dict[str, tuple[PreTrainedModel, Decoder, list[logging.LogRecord]]]


def _to_module_names(folder: Path) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    renamed = {}
    for name, tensor in tensors.items():
        old = next(p for p in MODULE_NAMES if name.startswith(p))
        renamed[MODULE_NAMES[old] + name.removeprefix(old)] = tensor
    save_file(renamed, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> Imported:
    """Each case's transformers model and our import of it, with the warnings the import logged."""
    out = {}
    for name, tied in CASES.items():
        folder = tmp_path_factory.mktemp(name)
        hf = build(gemma3_vlm_config(tie_word_embeddings=tied, **CAPS), folder)
        if name.endswith("module-names"):
            _to_module_names(folder)
        records: list[logging.LogRecord] = []
        handler = logging.Handler()
        handler.emit = records.append  # type: ignore[method-assign]
        logger = logging.getLogger("textgen.hf_import")
        logger.addHandler(handler)
        try:
            model = import_checkpoint(folder).model
        finally:
            logger.removeHandler(handler)
        out[name] = (hf, model, records)
    return out


@pytest.mark.parametrize("case", CASES)
@torch.no_grad()
def test_prompt_logprobs_match_transformers_multimodal_model(case: str, imported: Imported) -> None:
    hf, model, _ = imported[case]
    assert model.cfg.tie_embeddings == CASES[case]
    for p in PROMPTS:
        ids = torch.tensor([p])
        ours, _ = model(ids, torch.ones_like(ids), torch.arange(len(p))[None])
        theirs = hf(input_ids=ids).logits
        assert float((theirs - ours).abs().max()) <= TOL
        assert float((theirs.log_softmax(-1) - ours.log_softmax(-1)).abs().max()) <= LOGPROB_TOL


@torch.no_grad()
def test_greedy_tokens_match_transformers_generate(imported: Imported) -> None:
    """A left-padded batch through our decoder (fed transformers' tokens) and the in-place serving graph
    (its own tokens) against the multimodal model's generate on text alone."""
    hf, model, _ = imported["untied-saved-names"]
    ref = hf_greedy_batch(hf, PROMPTS)
    forced = torch_forced(model, PROMPTS, ref.tokens)
    assert np.array_equal(forced.tokens, ref.tokens), "pytorch: greedy tokens differ"
    assert max_diff(ref.logits, forced.logits) <= TOL
    served = run_inplace(build_inplace_graph(model), model.cfg, PROMPTS)
    assert np.array_equal(served.tokens, ref.tokens), "in-place graph: greedy tokens differ"
    assert max_diff(ref.logits, served.logits) <= TOL


def test_soft_caps_the_multimodal_model_ignores_would_change_the_logits(imported: Imported) -> None:
    """The config's caps are left out as transformers leaves them out, and they are not no-ops here."""
    hf, model, _ = imported["untied-saved-names"]
    assert (model.cfg.attn_softcap, model.cfg.logit_softcap) == (0.0, 0.0)
    assert all(getattr(hf.config.text_config, key) == cap for key, cap in CAPS.items())
    ids = torch.tensor([PROMPTS[2]])
    positions = torch.arange(len(PROMPTS[2]))[None]
    for change in (
        {"attn_softcap": CAPS["attn_logit_softcapping"]},
        {"logit_softcap": CAPS["final_logit_softcapping"]},
    ):
        capped = Decoder(replace(model.cfg, **change)).eval()
        capped.load_state_dict(model.state_dict())
        with torch.no_grad():
            diff = (
                capped(ids, torch.ones_like(ids), positions)[0]
                - model(ids, torch.ones_like(ids), positions)[0]
            )
        assert float(diff.abs().max()) > 100 * TOL, change


def test_vision_tower_left_out_with_one_warning(imported: Imported) -> None:
    for _, model, records in imported.values():
        assert [r.levelno for r in records] == [logging.WARNING]
        message = records[0].getMessage()
        assert "vision tower is left out" in message and "\n" not in message
        assert not any("vision" in name or "projector" in name for name in model.state_dict())


def _published_form(tmp_path: Path, text_config: dict[str, object]) -> Path:
    """A multimodal config.json with `text_config` as given (the vision tower's left at its defaults)."""
    config = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_published_sparse_text_config_reads_as_transformers_completes_it(tmp_path: Path) -> None:
    """Gemma 3 4B's text_config names only what differs from Gemma3TextConfig's defaults (transformers 4's
    form: rope_scaling at its top level); each value the decoder reads is transformers' own."""
    sparse = {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    }
    folder = _published_form(tmp_path, sparse)
    architecture, cfg = decoder_config(folder)
    text = AutoConfig.from_pretrained(folder).text_config
    full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert (architecture, TEXT_STACK_OF[architecture]) == (
        "Gemma3ForConditionalGeneration",
        "Gemma3ForCausalLM",
    )
    assert (cfg.vocab_size, cfg.context_length, cfg.d_model, cfg.d_ff) == (
        text.vocab_size,
        text.max_position_embeddings,
        text.hidden_size,
        text.intermediate_size,
    )
    assert (cfg.n_layers, cfg.n_heads, cfg.kv_heads, cfg.head_dim) == (
        text.num_hidden_layers,
        text.num_attention_heads,
        text.num_key_value_heads,
        text.head_dim,
    )
    assert [layer.window for layer in cfg.layers] == [
        text.sliding_window if t == "sliding_attention" else 0 for t in text.layer_types
    ]
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.rope_factor) == (
        full["rope_theta"],
        full["rope_type"],
        full["factor"],
    )
    assert cfg.rope_thetas == (0.0, local["rope_theta"])
    assert cfg.attn_scale == text.query_pre_attn_scalar**-0.5
    assert cfg.layer_norm_eps == text.rms_norm_eps and cfg.tie_embeddings == text.tie_word_embeddings


def test_transformers4_text_config_reads_as_transformers5(tmp_path: Path, imported: Imported) -> None:
    hf, model, _ = imported["untied-saved-names"]
    hf.config.save_pretrained(tmp_path)

    def to_four(config: dict[str, object]) -> dict[str, object]:
        assert isinstance(config["text_config"], dict)
        return {**config, "text_config": gemma3_transformers4_form(config["text_config"])}

    rewrite_config(tmp_path, to_four)
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())["text_config"]
    assert decoder_config(tmp_path)[1] == model.cfg
