"""A tiny LoRA bundle and peft adapters of its model, made in seconds, and what the engine gives with them
alone: what the servers under test must answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import openai
import torch
from peft import LoraConfig, get_peft_model
from safetensors.numpy import save_file

from export.lora import LoraOptions
from export.model import Decoder
from export.pipeline import PRESETS, random_bundle
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.lora import CONFIG_FILE, WEIGHTS_FILE
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence

NEW_TOKENS = 12
PROMPT = "def main():"
SLOTS, MAX_RANK = 2, 4


def save_adapter(
    folder: Path,
    seed: int,
    rank: int = MAX_RANK,
    dtype: torch.dtype | None = None,
    widened: bool = False,
    targets: tuple[str, ...] = ("qkv", "up"),
) -> Path:
    """A random peft adapter of the tiny preset's model on `targets` (its qkv and up projections), saved in
    `folder`; with `dtype`, its weights are rounded to it and saved so (widened: saved as float32 again)."""
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=32, target_modules=list(targets), init_lora_weights=False)
    model = get_peft_model(Decoder(PRESETS["tiny"]), config)
    if dtype is not None:
        model = model.to(dtype)
        if widened:
            model = model.to(torch.float32)
    model.save_pretrained(folder)
    return folder


def copied(
    source: Path, folder: Path, tensors: dict[str, np.ndarray] | None = None, **config: object
) -> Path:
    """A copy of the adapter at `source` in `folder`, with these tensors and config entries for its own."""
    shutil.copytree(source, folder)
    if tensors is not None:
        save_file(tensors, str(folder / WEIGHTS_FILE))
    raw = json.loads((folder / CONFIG_FILE).read_text())
    (folder / CONFIG_FILE).write_text(json.dumps(raw | config))
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
