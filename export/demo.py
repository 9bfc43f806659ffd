"""The embedded demo model: its size, its training recipe, where it lives, and building it once.

`ensure_demo_checkpoint()` trains the demo decoder on the stdlib the first time and reuses the file after
that. Several processes (the server, parallel test runs) may ask at once: a lock file makes one of them
train while the others wait and then reuse its result.

`$TEXTGEN_DEMO_CHECKPOINT` names a checkpoint to use as the demo model as it is (never retrained over the
recipe's): `make test-other-seed` runs the suite against one trained with another seed and one thread, which
shows that no test depends on what one training run happened to produce.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from export.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from export.model import DecoderConfig
from export.train import TrainConfig, train

# Sized for about 3 minutes of training on 2 CPU cores. At that budget a small model that sees more tokens
# beats a wider one that sees fewer: d_model 96 x 3 layers, 900 steps: held-out loss 4.13 nats/token;
# d_model 192 x 4 layers, 400 steps (about the same CPU time): 4.49. Unigram baseline: 6.27.
DEMO_CONFIG = DecoderConfig(
    vocab_size=2048,
    context_length=256,
    d_model=96,
    n_layers=3,
    n_heads=4,
    d_ff=384,
    positions="learned",
    activation="gelu",
    tie_embeddings=True,
    dropout=0.0,
)

DEMO_TRAIN = TrainConfig(
    steps=900,
    batch_size=8,
    learning_rate=6e-3,
    min_learning_rate=6e-4,
    warmup_steps=30,
    label_smoothing=0.0,
    corpus_bytes=5_000_000,
    eval_every=100,
    eval_batches=8,
)


# The demo bundle's chat template (ChatML's layout, written as plain text: the demo tokenizer has no ChatML
# tokens and the model never saw a chat, so its replies are code-shaped, not answers). Rendered as
# transformers' apply_chat_template(add_generation_prompt=True) would; serve/api/chat.py.
DEMO_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def textgen_home() -> Path:
    """$TEXTGEN_HOME, or ./models relative to the working directory."""
    return Path(os.environ.get("TEXTGEN_HOME") or "models")


def demo_checkpoint_path() -> Path:
    """$TEXTGEN_DEMO_CHECKPOINT, or the recipe's checkpoint under $TEXTGEN_HOME."""
    override = os.environ.get("TEXTGEN_DEMO_CHECKPOINT")
    return Path(override) if override else textgen_home() / "demo" / "checkpoint.pt"


def demo_bundle_path() -> Path:
    return textgen_home() / "demo" / "bundle"


def is_current_demo(path: Path) -> bool:
    """True if `path` is a valid checkpoint built from the current demo config and recipe."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError:
        return False
    return ckpt.config == DEMO_CONFIG and ckpt.meta.get("train_config") == DEMO_TRAIN.to_dict()


@contextmanager
def exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive file lock on `lock_path` (created if missing): one process at a time builds what it
    guards, the others wait and then find it built."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_demo_checkpoint(progress: bool = True) -> Path:
    """Return the demo checkpoint's path, training it first if it is missing, invalid or stale.

    The file is written atomically (temp file + rename), so an interrupted run leaves no truncated
    checkpoint behind: the next call simply trains again.
    """
    path = demo_checkpoint_path()
    if os.environ.get("TEXTGEN_DEMO_CHECKPOINT"):
        load_checkpoint(path)  # a CheckpointError names the file; a given checkpoint is never replaced
        return path
    if path.exists() and is_current_demo(path):
        return path
    with exclusive_lock(path.with_name(".checkpoint.lock")):
        # Another process may have finished training while this one waited for the lock.
        if path.exists() and is_current_demo(path):
            return path
        if progress:
            print(f"building the demo model into {path} (first run only)", file=sys.stderr)
        result = train(DEMO_CONFIG, DEMO_TRAIN, progress=progress)
        save_checkpoint(path, result.model, result.tokenizer, result.meta)
    return path


def train_variant(out: Path, seed: int, threads: int) -> Path:
    """Train the demo recipe with another seed into `out` (kept if it is already that variant)."""
    recipe = dataclasses.replace(DEMO_TRAIN, seed=seed)
    try:
        if load_checkpoint(out).meta.get("train_config") == recipe.to_dict():
            return out
    except CheckpointError:
        pass
    result = train(DEMO_CONFIG, recipe, progress=True, threads=threads)
    save_checkpoint(out, result.model, result.tokenizer, result.meta)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m export.demo",
        description="Build the demo checkpoint (once), or with --out a variant of it with another seed.",
    )
    parser.add_argument("--out", type=Path, help="train a variant into this file instead of the demo's")
    parser.add_argument("--seed", type=int, default=DEMO_TRAIN.seed, help="with --out (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="with --out (default: %(default)s)")
    args = parser.parse_args(argv)
    print(train_variant(args.out, args.seed, args.threads) if args.out else ensure_demo_checkpoint())


if __name__ == "__main__":
    # `python -m export.demo`: build the demo checkpoint ahead of the tests that share it.
    main()
