"""Trainer for small code-completion decoders on the Python standard library's own source.

The corpus is present on every machine and needs no network: the .py files of the running
interpreter's stdlib (tests and site-packages excluded). File order and the train / held-out split are
deterministic (a CRC of each file's relative path), so two runs with the same seed on the same Python
give the same model.
"""

from __future__ import annotations

import functools
import math
import os
import sysconfig
import time
import tokenize
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from tqdm import tqdm

from export.model import Decoder, DecoderConfig
from export.tokenizer import EOS_ID, train_tokenizer

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 16
    learning_rate: float = 3e-3
    min_learning_rate: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    label_smoothing: float = 0.0
    seed: int = 1234
    # Text budget (bytes of source) read from the corpus; the tokenizer and the model see only this.
    corpus_bytes: int = 4_000_000
    heldout_percent: int = 5
    eval_every: int = 100
    eval_batches: int = 8

    def __post_init__(self) -> None:
        positive = ("steps", "batch_size", "corpus_bytes", "eval_every", "eval_batches")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.heldout_percent < 100:
            raise ValueError(f"heldout_percent must be in (0, 100), got {self.heldout_percent}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if not 0.0 < self.min_learning_rate <= self.learning_rate:
            raise ValueError("need 0 < min_learning_rate <= learning_rate")
        if self.warmup_steps < 0 or self.warmup_steps >= self.steps:
            raise ValueError(f"warmup_steps must be in [0, steps), got {self.warmup_steps}")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class Corpus:
    train: list[str]
    heldout: list[str]
    files: int


@dataclass
class TrainResult:
    model: Decoder
    tokenizer: Tokenizer
    meta: dict[str, object] = field(default_factory=dict)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def stdlib_sources(root: Path | None = None) -> tuple[Path, ...]:
    """The stdlib's .py files in a machine-independent pseudo-random order (CRC32 of the relative path).

    Sorting by a hash, not by name, mixes packages, so a byte budget takes a bit of everything rather than
    the alphabetical prefix (all of asyncio, none of xml). Cached: walking the stdlib takes a second.
    """
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)]
    if not files:
        raise FileNotFoundError(f"no Python source files under the standard library directory {root}")
    return tuple(sorted(files, key=lambda p: (_path_crc(p, root), p.relative_to(root).as_posix())))


def _path_crc(path: Path, root: Path) -> int:
    return zlib.crc32(path.relative_to(root).as_posix().encode())


def _read_source(path: Path) -> str | None:
    # tokenize.open honours PEP 263 encoding cookies; undecodable files are skipped, not guessed at.
    try:
        with tokenize.open(path) as f:
            return f.read()
    except (SyntaxError, UnicodeDecodeError, OSError):
        return None


def load_corpus(budget_bytes: int, heldout_percent: int, root: Path | None = None) -> Corpus:
    """Read stdlib sources up to `budget_bytes`, split per file: held-out iff CRC % 100 < heldout_percent."""
    root = root or stdlib_root()
    train: list[str] = []
    heldout: list[str] = []
    used = 0
    for path in stdlib_sources(root):
        text = _read_source(path)
        if not text:
            continue
        (heldout if _path_crc(path, root) % 100 < heldout_percent else train).append(text)
        used += len(text)
        if used >= budget_bytes:
            break
    if not train or not heldout:
        raise ValueError(f"corpus budget {budget_bytes} bytes is too small for a train and a held-out split")
    return Corpus(train=train, heldout=heldout, files=len(train) + len(heldout))


def encode_stream(tok: Tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """All texts as one int64 token stream, each followed by EOS (the model learns where files end)."""
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def unigram_cross_entropy(train_ids: torch.Tensor, heldout_ids: torch.Tensor, vocab_size: int) -> float:
    """Cross-entropy (nats/token) of held-out tokens under the train unigram distribution (add-one)."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1.0
    log_probs = (counts / counts.sum()).log()
    return float(-log_probs[heldout_ids].mean())


def learning_rate(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to the peak, then cosine decay to min_learning_rate at the last step."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return cfg.min_learning_rate + (cfg.learning_rate - cfg.min_learning_rate) * cosine


def sample_windows(stream: torch.Tensor, length: int, batch: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` + 1 tokens (inputs and shifted targets) [batch, length + 1]."""
    if stream.numel() <= length + 1:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than a window of {length + 1}")
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen)
    return torch.stack([stream[s : s + length + 1] for s in starts.tolist()])


def lm_loss(model: Decoder, windows: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean next-token cross-entropy over full (unpadded) windows [B, S+1]."""
    inputs, targets = windows[:, :-1], windows[:, 1:]
    mask = torch.ones_like(inputs)
    positions = torch.arange(inputs.shape[1]).expand_as(inputs)
    logits, _ = model(inputs, mask, positions)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=label_smoothing)


@torch.no_grad()
def evaluate(model: Decoder, windows: torch.Tensor, batch_size: int) -> float:
    """Held-out loss over fixed windows, without label smoothing or dropout."""
    was_training = model.training
    model.eval()
    losses = [float(lm_loss(model, chunk)) for chunk in windows.split(batch_size)]
    model.train(was_training)
    return sum(losses) / len(losses)


def _optimizer(model: Decoder, cfg: TrainConfig) -> torch.optim.AdamW:
    # Decay matrices only: decaying LayerNorm gains and biases just fights the normalisation.
    params = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas)


@dataclass(frozen=True)
class TokenData:
    tokenizer: Tokenizer
    train_ids: torch.Tensor
    heldout_ids: torch.Tensor
    unigram_baseline: float


def prepare_data(corpus: Corpus, vocab_size: int) -> TokenData:
    """Train the tokenizer on the train split and encode both splits."""
    tok = train_tokenizer(corpus.train, vocab_size)
    train_ids = encode_stream(tok, corpus.train)
    heldout_ids = encode_stream(tok, corpus.heldout)
    baseline = unigram_cross_entropy(train_ids, heldout_ids, vocab_size)
    return TokenData(tok, train_ids, heldout_ids, baseline)


def _step(
    model: Decoder, opt: torch.optim.Optimizer, batch: torch.Tensor, lr: float, cfg: TrainConfig
) -> float:
    for group in opt.param_groups:
        group["lr"] = lr
    loss = lm_loss(model, batch, cfg.label_smoothing)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss.item()


def train(
    model_cfg: DecoderConfig,
    train_cfg: TrainConfig,
    corpus: Corpus | None = None,
    progress: bool = True,
    threads: int = 2,
) -> TrainResult:
    """Train a tokenizer and a decoder on `corpus` (default: the stdlib under train_cfg.corpus_bytes).

    `threads` (capped at the CPUs this process may use) is a resource setting, not part of the recipe:
    it changes only float summation order, so it is kept out of TrainConfig and the checkpoint's identity.
    """
    started = time.perf_counter()
    torch.manual_seed(train_cfg.seed)
    torch.set_num_threads(max(1, min(threads, len(os.sched_getaffinity(0)))))
    corpus = corpus or load_corpus(train_cfg.corpus_bytes, train_cfg.heldout_percent)
    data = prepare_data(corpus, model_cfg.vocab_size)
    gen = torch.Generator().manual_seed(train_cfg.seed)
    length = model_cfg.context_length
    n_eval = train_cfg.eval_batches * train_cfg.batch_size
    eval_windows = sample_windows(data.heldout_ids, length, n_eval, gen)
    model = Decoder(model_cfg)
    model.train()
    opt = _optimizer(model, train_cfg)
    losses: list[float] = []
    heldout = float("nan")
    bar = tqdm(range(train_cfg.steps), desc="training", unit="step", disable=not progress)
    for step in bar:
        batch = sample_windows(data.train_ids, length, train_cfg.batch_size, gen)
        losses.append(_step(model, opt, batch, learning_rate(step, train_cfg), train_cfg))
        if (step + 1) % train_cfg.eval_every == 0 or step + 1 == train_cfg.steps:
            heldout = evaluate(model, eval_windows, train_cfg.batch_size)
        bar.set_postfix(
            train=f"{losses[-1]:.3f}", heldout=f"{heldout:.3f}", unigram=f"{data.unigram_baseline:.3f}"
        )
    model.eval()
    meta: dict[str, object] = {
        "corpus": f"Python {sysconfig.get_python_version()} standard library",
        "corpus_files": corpus.files,
        "train_tokens": int(data.train_ids.numel()),
        "heldout_tokens": int(data.heldout_ids.numel()),
        "first_train_loss": losses[0],
        "train_loss": losses[-1],
        "heldout_loss": heldout,
        "unigram_baseline": data.unigram_baseline,
        "train_seconds": round(time.perf_counter() - started, 1),
        "train_config": train_cfg.to_dict(),
        "torch": str(torch.__version__),
    }
    return TrainResult(model=model, tokenizer=data.tokenizer, meta=meta)
