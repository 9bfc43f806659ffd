"""A tiny LoRA bundle and peft adapters of its model, made in seconds, and what the engine gives with them
alone: what the servers under test must answer."""

from __future__ import annotations

from pathlib import Path

import openai
import torch
from peft import LoraConfig, get_peft_model

from export.lora import LoraOptions
from export.model import Decoder
from export.pipeline import PRESETS, random_bundle
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence

NEW_TOKENS = 12
PROMPT = "def main():"
SLOTS, MAX_RANK = 2, 4


def save_adapter(folder: Path, seed: int, rank: int = MAX_RANK) -> Path:
    """A random peft adapter of the tiny preset's model on its qkv and up projections, saved in `folder`."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=32, target_modules=["qkv", "up"], init_lora_weights=False)
    get_peft_model(Decoder(PRESETS["tiny"]), config).save_pretrained(folder)
    return folder


def lora_bundle(out: Path, slots: int = SLOTS) -> tuple[Path, dict[str, Path]]:
    """The tiny preset with 2 LoRA slots (or `slots`), and three peft adapters of its model (one more than
    the 2 slots)."""
    bundle = random_bundle("tiny", out / "bundle", seed=0, progress=False, lora=LoraOptions(slots, MAX_RANK))
    names = ("sql", "poet", "chef")
    return bundle.root, {name: save_adapter(out / name, seed) for seed, name in enumerate(names, start=1)}


def expected(bundle: Path, adapters: dict[str, Path], adapter: str) -> str:
    """The text of the greedy tokens the engine gives the prompt with `adapter`, run here without a server."""
    loaded = load_bundle(bundle)
    named = tuple((name, str(path)) for name, path in adapters.items())
    engine = Engine.from_bundle(loaded, EngineSettings(max_batch_size=2, adapters=named))
    prompt = loaded.tokenizer.encode(PROMPT).ids
    seq = NewSequence("x", prompt, SamplingParams(), adapter=adapter)
    tokens = [out.token_id for out in engine.prefill([seq])]
    while len(tokens) < NEW_TOKENS:
        tokens += [out.token_id for out in engine.decode()]
    return loaded.tokenizer.decode(tokens)


def completion(client: openai.OpenAI, model: str, max_tokens: int = NEW_TOKENS) -> str:
    answer = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.model == model
    return answer.choices[0].text
