"""Model inspection: recorded attention, the recompute check, head diversity, layer statistics, embedding
neighbours, and the pictures and page of `textgen-export inspect`."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer
from torch import Tensor

from export import cli as export_cli
from export import inspection
from export.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from export.inspection import cli, plots
from export.inspection.attention import (
    InspectionError,
    TextBatch,
    attention_layers,
    encode_texts,
    recompute_errors,
    record_attention,
    weight_on_padding,
)
from export.inspection.diversity import HeadStats, LayerDiversity, head_stats, layer_diversity
from export.inspection.embeddings import Neighbours, nearest_neighbours
from export.inspection.layers import LayerStats, residual_stats
from export.inspection.report import Findings, Images, write_index
from export.model import Attention, Decoder, DecoderConfig
from export.tokenizer import EOS_ID, PAD_ID, train_tokenizer

TOL = 1e-5
CODE = "def __init__(self, items):\n    self.items = list(items)\n    return None\n"
TEXTS = [CODE, "for item in self.items:\n    print(item)\n"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    corpus = [CODE * 3, "import os\nimport sys\nfor i in range(10):\n    print(i, os.sep, sys.argv)\n"] * 5
    return train_tokenizer(corpus, vocab_size=320, min_frequency=1)


def _sharp_model(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    """Q and K weights large enough that heads attend sharply and differently (default init: ~uniform)."""
    torch.manual_seed(seed)
    model = Decoder(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[: 2 * cfg.d_model].normal_(std=0.4)
    return model


def _tiny(tokenizer: Tokenizer, **changes: int) -> DecoderConfig:
    cfg = DecoderConfig(
        vocab_size=tokenizer.get_vocab_size(), context_length=64, d_model=32, n_layers=2, n_heads=4, d_ff=64
    )
    return dataclasses.replace(cfg, **changes)


@pytest.fixture
def model(tiny_config: DecoderConfig, tokenizer: Tokenizer) -> Decoder:
    """Once per position variant: where the recorded weights could go wrong."""
    return _sharp_model(dataclasses.replace(tiny_config, vocab_size=tokenizer.get_vocab_size()))


@pytest.fixture
def learned(tokenizer: Tokenizer) -> Decoder:
    """One model for what does not depend on the position variant."""
    return _sharp_model(_tiny(tokenizer))


@pytest.fixture
def batch(tokenizer: Tokenizer) -> TextBatch:
    return encode_texts(tokenizer, TEXTS, max_tokens=40)


def test_batch_is_left_padded(batch: TextBatch, tokenizer: Tokenizer) -> None:
    short = len(tokenizer.encode(TEXTS[1]).ids)
    width = batch.input_ids.shape[1]
    assert batch.lengths == [width, short] and short < width
    assert batch.input_ids[1, : width - short].eq(PAD_ID).all()
    assert batch.labels[1][: width - short] == ["<pad>"] * (width - short)
    assert batch.position_ids[1, width - short :].tolist() == list(range(short))


def test_recorded_rows_sum_to_one_over_allowed_keys(model: Decoder, batch: TextBatch) -> None:
    weights = record_attention(model, batch)
    cfg = model.cfg
    b, s = batch.input_ids.shape
    assert weights.shape == (cfg.n_layers, b, cfg.n_heads, s, s)
    allowed = batch.allowed()[None, :, None]  # [1,B,1,S,S]
    real = batch.attention_mask.bool()[None, :, None, :]  # [1,B,1,S]
    sums = weights.sum(-1)
    torch.testing.assert_close(
        sums[real.expand_as(sums)], torch.ones(int(real.expand_as(sums).sum())), atol=TOL, rtol=0
    )
    assert weights.masked_select(~allowed).abs().max() == 0  # masked keys, padding query rows
    assert weights.triu(diagonal=1).abs().max() == 0  # the future
    assert sums[~real.expand_as(sums)].abs().max() == 0  # padding query rows are zeroed
    assert weight_on_padding(weights, batch) == 0


def test_recording_restores_the_flag(learned: Decoder, batch: TextBatch) -> None:
    layers = attention_layers(learned)
    layers[0].record = True  # a caller's own setting survives
    record_attention(learned, batch)
    assert [layer.record for layer in layers] == [True] + [False] * (len(layers) - 1)
    assert all(layer.recorded is None for layer in layers)


def test_recomputed_output_matches_the_fast_path(model: Decoder, batch: TextBatch) -> None:
    errors = recompute_errors(model, batch)
    assert len(errors) == model.cfg.n_layers
    assert max(errors) <= TOL


def test_recompute_check_catches_wrong_weights(learned: Decoder, batch: TextBatch) -> None:
    def scramble(module: torch.nn.Module, _args: object, _out: object) -> None:
        if isinstance(module, Attention) and module.recorded is not None:
            module.recorded = module.recorded.flip(-2)  # rows of other queries

    hook = attention_layers(learned)[1].register_forward_hook(scramble)
    try:
        errors = recompute_errors(learned, batch)
    finally:
        hook.remove()
    assert errors[0] <= TOL < errors[1]


def test_padded_row_attends_like_the_text_alone(
    model: Decoder, tokenizer: Tokenizer, batch: TextBatch
) -> None:
    together = record_attention(model, batch)[:, 1]  # [L,H,S,S]
    alone = record_attention(model, encode_texts(tokenizer, TEXTS[1:], max_tokens=40))[:, 0]
    n = alone.shape[-1]
    torch.testing.assert_close(together[..., -n:, -n:], alone, atol=TOL, rtol=0)


def _identical_heads(model: Decoder) -> Decoder:
    """Copy head 0's Q, K and V weights and biases into every head of every layer."""
    d, dh = model.cfg.d_model, model.cfg.head_dim
    with torch.no_grad():
        for block in model.blocks:
            qkv = block.attn.qkv
            for part in range(3):  # Q | K | V
                head0 = slice(part * d, part * d + dh)
                for h in range(1, model.cfg.n_heads):
                    head = slice(part * d + h * dh, part * d + (h + 1) * dh)
                    qkv.weight[head] = qkv.weight[head0]
                    qkv.bias[head] = qkv.bias[head0]
    return model


def test_identical_heads_are_flagged(learned: Decoder, batch: TextBatch) -> None:
    assert not any(d.flagged for d in layer_diversity(record_attention(learned, batch), batch))
    same = layer_diversity(record_attention(_identical_heads(learned), batch), batch)
    assert all(d.flagged for d in same)
    assert max(d.max_jsd for d in same) < 1e-6


def _attention_from(pattern: str, batch: TextBatch) -> Tensor:
    """Synthetic weights [1,B,1,S,S]: every head looks only at itself, at the previous token, or uniformly."""
    allowed = batch.allowed().float()
    if pattern == "self":
        w = torch.eye(allowed.shape[-1]) * allowed
    elif pattern == "previous":
        first = batch.position_ids == 0  # a text's first token has no previous one: it looks at itself
        w = torch.diag_embed(first.float()) + torch.diag_embed(~first[..., 1:], offset=-1).float()
        w = w * allowed
    else:
        w = allowed / allowed.sum(-1, keepdim=True).clamp(min=1)
    return w[None, :, None]


def test_head_stats_of_known_patterns(batch: TextBatch) -> None:
    (self_head,) = head_stats(_attention_from("self", batch), batch)
    assert self_head.entropy == pytest.approx(0, abs=TOL) and self_head.distance == pytest.approx(0, abs=TOL)
    (previous,) = head_stats(_attention_from("previous", batch), batch)
    assert previous.entropy == pytest.approx(0, abs=TOL) and previous.distance == pytest.approx(1, abs=TOL)
    # Uniform over the i + 1 visible keys: entropy log2(i + 1), distance i / 2, averaged over rows i >= 1.
    (uniform,) = head_stats(_attention_from("uniform", batch), batch)
    rows = [i for n in batch.lengths for i in range(1, n)]
    assert uniform.entropy == pytest.approx(sum(math.log2(i + 1) for i in rows) / len(rows), abs=1e-4)
    assert uniform.distance == pytest.approx(sum(i / 2 for i in rows) / len(rows), abs=1e-4)


def test_layer_stats_catch_an_injected_nan(learned: Decoder, batch: TextBatch) -> None:
    healthy = residual_stats(learned, batch)
    assert [s.name for s in healthy] == ["embeddings"] + [f"block {i}" for i in range(learned.cfg.n_layers)]
    assert not any(s.flags for s in healthy)
    with torch.no_grad():
        learned.blocks[1].ffn.down.weight[0, 0] = float("nan")
    broken = residual_stats(learned, batch)
    assert not any(s.flags for s in broken[:2])
    assert broken[2].nan > 0 and any("NaN" in f for f in broken[2].flags)
    assert math.isfinite(broken[2].std)  # one NaN column does not hide the scale of the others


def test_layer_stats_flag_a_scale_jump(learned: Decoder, batch: TextBatch) -> None:
    with torch.no_grad():
        learned.blocks[1].ffn.down.weight.mul_(1000)
    stats = residual_stats(learned, batch, jump=8.0)
    assert stats[2].ratio is not None and stats[2].ratio > 8
    assert any("std changed" in f for f in stats[2].flags)
    assert not any(s.flags for s in stats[:2])


def test_first_block_growth_is_not_a_jump(learned: Decoder, batch: TextBatch) -> None:
    with torch.no_grad():
        learned.blocks[0].ffn.down.weight.mul_(1000)
    stats = residual_stats(learned, batch, jump=8.0)
    assert stats[1].ratio is not None and stats[1].ratio > 8 and not stats[1].flags


def test_nearest_neighbour_is_the_parallel_embedding(learned: Decoder, tokenizer: Tokenizer) -> None:
    a, b = tokenizer.encode("self").ids[0], tokenizer.encode("items").ids[0]
    with torch.no_grad():
        learned.tok_emb.weight[b] = 3 * learned.tok_emb.weight[a]
        learned.tok_emb.weight[EOS_ID] = learned.tok_emb.weight[a]  # special tokens never count as neighbours
    (found,) = nearest_neighbours(learned, tokenizer, [a], k=3)
    assert found.token_id == a and len(found.neighbours) == 3
    assert found.neighbours[0] == ("items", pytest.approx(1.0, abs=TOL))
    assert [s for _, s in found.neighbours] == sorted((s for _, s in found.neighbours), reverse=True)


def _inspect(checkpoint: Path | str, text: str, out: Path, *extra: str) -> int:
    """`textgen-export inspect ...` through the exporter's command line, which registers the subcommand."""
    argv = ["inspect", "--checkpoint", str(checkpoint), "--text", text, "--out", str(out), *extra]
    return export_cli.main(argv)


def _assert_png(path: Path) -> None:
    assert path.stat().st_size > 1000
    with Image.open(path) as image:
        assert image.format == "PNG" and min(image.size) > 100
        image.verify()


def test_command_writes_pictures_and_page(
    tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = save_checkpoint(tmp_path / "ckpt.pt", _sharp_model(_tiny(tokenizer)), tokenizer)
    out = tmp_path / "report"
    assert _inspect(path, CODE, out) == 0
    pngs = [
        "attention_layer0.png",
        "attention_layer1.png",
        "attention_padded.png",
        "diversity.png",
        "layers.png",
    ]
    for name in pngs:
        _assert_png(out / name)
    page = (out / "index.html").read_text(encoding="utf-8")
    assert "<script" not in page
    for name in pngs:
        assert f'<img src="{name}"' in page
    assert "Nothing flagged." in page and "self" in page  # the neighbours table names tokens of the text
    assert str(out / "index.html") in capsys.readouterr().out


@pytest.mark.parametrize(
    ("checkpoint", "text", "extra", "message"),
    [
        ("missing.pt", CODE, [], "file not found"),
        (None, "x", [], "at least 2 tokens"),
        (None, CODE, ["--max-tokens", "1000"], "--max-tokens"),
        (None, CODE, ["--jump", "0.5"], "--jump"),
    ],
)
def test_command_errors_are_one_line(
    tokenizer: Tokenizer,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    checkpoint: str | None,
    text: str,
    extra: list[str],
    message: str,
) -> None:
    tiny = Decoder(_tiny(tokenizer, n_layers=1))
    ckpt = tmp_path / checkpoint if checkpoint else save_checkpoint(tmp_path / "c.pt", tiny, tokenizer)
    assert _inspect(ckpt, text, tmp_path / "out", *extra) == 1
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_page_lists_problems_and_escapes_text(tmp_path: Path) -> None:
    jsd = np.zeros((2, 2))
    findings = Findings(
        source="<b>ckpt</b>",
        texts=["<script>alert(1)</script>", "x"],
        truncated=[False, False],
        recompute=[1e-7, 0.5],
        padding_weight=0.0,
        diversity=[LayerDiversity(0, jsd, 0.0, 0.0, True)],
        min_jsd=0.01,
        heads=[HeadStats(0, 0, 1.0, 2.0), HeadStats(0, 1, 1.0, 2.0)],
        layers=[
            LayerStats("embeddings", 0.0, 1.0, 2.0, 0, 0, None, ()),
            LayerStats("block 0", math.nan, math.nan, math.nan, 3, 0, math.nan, ("3 NaN",)),
        ],
        jump=8.0,
        neighbours=[Neighbours("␣self", 5, [("␣cls", 0.9)])],
        images=Images([tmp_path / "a.png"], tmp_path / "p.png", tmp_path / "d.png", tmp_path / "l.png"),
    )
    assert findings.problems() == [
        "layer 1: recomputed attention output differs by 0.5 (relative)",
        "layer 0: all heads attend alike (max pairwise JSD 0 bits)",
        "block 0: 3 NaN",
    ]
    page = write_index(findings, tmp_path).read_text(encoding="utf-8")
    assert "<script" not in page and "&lt;script&gt;" in page and "&lt;b&gt;ckpt" in page
    assert page.count('class="flag"') >= 6  # three summary lines and three table cells
    assert '<img src="a.png"' in page and "␣cls (0.90)" in page


def test_summary_pictures_survive_nan(tmp_path: Path) -> None:
    """A model with NaN from its embeddings on has NaN head statistics in every layer."""
    nan = math.nan
    diversity = [LayerDiversity(0, np.full((2, 2), nan), nan, nan, False)]
    heads = [HeadStats(0, 0, nan, nan), HeadStats(0, 1, nan, nan)]
    layers = [LayerStats("embeddings", nan, nan, nan, 4, 0, None, ("4 NaN",))]
    _assert_png(plots.diversity_summary(diversity, heads, 0.01, tmp_path / "d.png"))
    _assert_png(plots.layer_stats_plot(layers, tmp_path / "l.png"))


def test_missing_matplotlib_is_one_line(
    tokenizer: Tokenizer, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = save_checkpoint(tmp_path / "c.pt", Decoder(_tiny(tokenizer, n_layers=1)), tokenizer)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    monkeypatch.delitem(sys.modules, "export.inspection.plots")
    monkeypatch.delattr(inspection, "plots")
    assert _inspect(path, CODE, tmp_path / "out") == 1
    assert "pip install -e '.[inspect]'" in capsys.readouterr().err


def test_a_long_text_still_gets_a_padded_companion(tokenizer: Tokenizer) -> None:
    long_text = CODE * 4
    texts = cli.texts_to_inspect(tokenizer, long_text, None, max_tokens=10)
    batch = encode_texts(tokenizer, texts, max_tokens=10)
    assert batch.truncated[0] and batch.lengths == [10, 5]


def test_empty_text_is_refused(tokenizer: Tokenizer) -> None:
    with pytest.raises(InspectionError, match="empty"):
        encode_texts(tokenizer, [CODE, ""], max_tokens=40)


def test_trained_demo_model_is_not_flagged(demo_checkpoint: Path) -> None:
    ckpt: Checkpoint = load_checkpoint(demo_checkpoint)
    batch = encode_texts(ckpt.tokenizer, TEXTS, max_tokens=40)
    diversity = layer_diversity(record_attention(ckpt.model, batch), batch)
    assert not any(d.flagged for d in diversity), [d.max_jsd for d in diversity]
    assert max(recompute_errors(ckpt.model, batch)) <= 1e-4
    assert not any(s.flags for s in residual_stats(ckpt.model, batch))
