"""The one-file checkpoint: decoder config, weights, tokenizer and training metadata.

Format (written with `torch.save`, read with `torch.load(weights_only=True)`, so loading never runs
pickled code)::

    {"format": "textgen-checkpoint", "version": 1,
     "config": DecoderConfig.to_dict(), "state_dict": {name: tensor},
     "tokenizer": "<tokenizer.json text>", "meta": {...training metadata...}}

Tied embeddings are stored as one tensor under both names (torch.save keeps the sharing).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch.torch_version import TorchVersion

from export.model import Decoder, DecoderConfig
from export.tokenizer import TokenizerError, tokenizer_from_json, tokenizer_to_json

FORMAT = "textgen-checkpoint"
VERSION = 1
REQUIRED_KEYS = ("format", "version", "config", "state_dict", "tokenizer", "meta")


class CheckpointError(Exception):
    """A checkpoint that cannot be used; the message names the file and the problem."""

    def __init__(self, path: Path | str, problem: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}")
        self.path = Path(path)
        self.problem = problem


@dataclass
class Checkpoint:
    config: DecoderConfig
    model: Decoder
    tokenizer: Tokenizer
    meta: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(
    path: Path | str, model: Decoder, tokenizer: Tokenizer, meta: dict[str, Any] | None = None
) -> Path:
    """Write the checkpoint atomically (temp file in the same directory, then rename).

    A reader, or a run interrupted half-way, never sees a truncated file under `path`.
    """
    path = Path(path)
    vocab = tokenizer.get_vocab_size()
    if vocab > model.cfg.vocab_size:
        raise ValueError(f"tokenizer has {vocab} ids but the model's vocab_size is {model.cfg.vocab_size}")
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "config": model.cfg.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()},
        "tokenizer": tokenizer_to_json(tokenizer),
        "meta": dict(meta or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), 0o644)  # mkstemp creates 0600; a model file is meant to be shared
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        _check_loadable(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _check_loadable(path: Path) -> None:
    # Fail at save time, not at every later load, when meta holds a type weights_only refuses.
    try:
        _read_payload(path)
    except CheckpointError as exc:
        raise ValueError(f"checkpoint meta must hold only plain Python types and tensors: {exc}") from exc


def load_checkpoint(path: Path | str) -> Checkpoint:
    """Load and validate a checkpoint; the model is returned in eval mode on CPU."""
    path = Path(path)
    payload = _read_payload(path)
    try:
        config = DecoderConfig.from_dict(dict(payload["config"]))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(path, f"invalid decoder config: {exc}") from exc
    try:
        tokenizer = tokenizer_from_json(payload["tokenizer"])
    except (TokenizerError, TypeError) as exc:
        raise CheckpointError(path, f"invalid tokenizer: {exc}") from exc
    n_ids = tokenizer.get_vocab_size()
    if n_ids > config.vocab_size:
        raise CheckpointError(path, f"tokenizer has {n_ids} ids but config vocab_size is {config.vocab_size}")
    model = Decoder(config)
    _load_weights(path, model, payload["state_dict"])
    model.eval()
    return Checkpoint(config=config, model=model, tokenizer=tokenizer, meta=dict(payload["meta"]))


def _read_payload(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise CheckpointError(path, "file not found")
    if not path.is_file():
        raise CheckpointError(path, "not a regular file")
    try:
        # TorchVersion (a str subclass) is allowed: torch.__version__ in meta is natural and harmless.
        with torch.serialization.safe_globals([TorchVersion]):
            payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises OSError, KeyError, RuntimeError, ... for damaged files
        problem = f"truncated or not a torch checkpoint ({type(exc).__name__}: {exc})"
        raise CheckpointError(path, problem) from exc
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(path, f"not a {FORMAT} file")
    if payload.get("version") != VERSION:
        found = payload.get("version")
        raise CheckpointError(path, f"unsupported version {found!r} (this code reads version {VERSION})")
    missing = [k for k in REQUIRED_KEYS if k not in payload]
    if missing:
        raise CheckpointError(path, f"missing fields {missing}")
    return payload


def _load_weights(path: Path, model: Decoder, state_dict: Any) -> None:
    if not isinstance(state_dict, dict):
        raise CheckpointError(path, "state_dict is not a mapping of tensors")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        problem = f"weights do not match the config: missing {missing}, unexpected {unexpected}"
        raise CheckpointError(path, problem)
    not_tensors = sorted(k for k, v in state_dict.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise CheckpointError(path, f"state_dict entries are not tensors: {not_tensors}")
    wrong = [
        f"{name} {tuple(state_dict[name].shape)} != {tuple(t.shape)}"
        for name, t in expected.items()
        if state_dict[name].shape != t.shape
    ]
    if wrong:
        raise CheckpointError(path, f"weight shapes do not match the config: {'; '.join(wrong)}")
    model.load_state_dict(state_dict)
