"""The speculation benchmark's pieces: the draft model it cuts from a Llama, and its tally of one decode."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.scenarios.c_llama import make_draft
from bench.scenarios.speculation import Tally, decode
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.types import EngineSettings, SessionConfig, SpeculationSettings


def test_a_draft_is_the_first_layers_with_the_same_embedding_and_head(tmp_path: Path) -> None:
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
    source = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, num_hidden_layers=3, **shape)).save_pretrained(source)
    (source / "tokenizer.json").write_text("{}")
    make_draft(source, tmp_path / "draft", 1)
    full = LlamaForCausalLM.from_pretrained(source)
    draft = LlamaForCausalLM.from_pretrained(tmp_path / "draft")
    assert draft.config.num_hidden_layers == 1 and (tmp_path / "draft" / "tokenizer.json").exists()
    for name, tensor in draft.state_dict().items():
        assert torch.equal(tensor, full.state_dict()[name]), name


def test_a_decode_tallies_its_tokens_steps_and_proposals(demo_bundle: Path) -> None:
    settings = EngineSettings(
        max_batch_size=1,
        session=SessionConfig(threads=1, spinning=False),
        speculation=SpeculationSettings(num_tokens=4, ngram_min=1),
    )
    engine = Engine.from_bundle(load_bundle(demo_bundle), settings)
    tally = Tally()
    prompt = engine.tokenizer.encode("def f(self):\n    return self.x\n\ndef g(self):\n    return self.").ids
    decode(engine, prompt, 40, tally)
    assert len(tally.outputs[0]) == 40
    assert tally.tokens >= 39 and tally.steps <= tally.tokens  # the first token comes from the prefill
    assert tally.spec_steps > 0 and 0 <= tally.accepted <= tally.proposed
    assert tally.tokens == tally.steps + tally.accepted  # each step one token, and the accepted ones
