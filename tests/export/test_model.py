"""Decoder: shapes, KV-cache decoding == full forward, padding invariance, tying, config validation."""

from __future__ import annotations

import pytest
import torch

from export.model import Decoder, DecoderConfig, count_parameters, position_ids_from_mask

TOL = 1e-5


def _model(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(cfg).eval()


def _full(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    logits, _ = model(ids, mask, position_ids_from_mask(mask))
    return logits


def test_shapes(tiny_config: DecoderConfig) -> None:
    model = _model(tiny_config)
    ids = torch.randint(0, tiny_config.vocab_size, (3, 7))
    mask = torch.ones_like(ids)
    logits, presents = model(ids, mask, position_ids_from_mask(mask))
    assert logits.shape == (3, 7, tiny_config.vocab_size)
    assert len(presents) == tiny_config.n_layers
    for k, v in presents:
        assert k.shape == v.shape == (3, tiny_config.n_heads, 7, tiny_config.head_dim)


@torch.no_grad()
def test_kv_cache_decoding_equals_full_forward(tiny_config: DecoderConfig) -> None:
    model = _model(tiny_config)
    ids = torch.randint(0, tiny_config.vocab_size, (2, 12))
    expected = _full(model, ids)
    prompt = 5
    mask = torch.ones(2, prompt, dtype=torch.long)
    logits, past = model(ids[:, :prompt], mask, position_ids_from_mask(mask))
    steps = [logits]
    for t in range(prompt, ids.shape[1]):
        mask = torch.ones(2, t + 1, dtype=torch.long)
        position = torch.full((2, 1), t, dtype=torch.long)
        logits, past = model(ids[:, t : t + 1], mask, position, past)
        steps.append(logits)
    assert past[0][0].shape[2] == ids.shape[1]
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() <= TOL


@torch.no_grad()
def test_left_padded_row_equals_the_sequence_alone(tiny_config: DecoderConfig) -> None:
    model = _model(tiny_config)
    short = torch.randint(2, tiny_config.vocab_size, (1, 6))
    long = torch.randint(2, tiny_config.vocab_size, (1, 10))
    pad = 1
    batch = torch.cat([torch.cat([torch.full((1, 4), pad), short], dim=1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 4), torch.ones(1, 6)], dim=1), torch.ones(1, 10)]).long()
    logits, past = model(batch, mask, position_ids_from_mask(mask))
    assert (logits[0, 4:] - _full(model, short)[0]).abs().max().item() <= TOL
    assert (logits[1] - _full(model, long)[0]).abs().max().item() <= TOL
    assert torch.isfinite(logits).all()

    # One decode step after the padded prefill still matches the unpadded sequence.
    nxt = torch.randint(2, tiny_config.vocab_size, (2, 1))
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    position = position_ids_from_mask(step_mask)[:, -1:]
    step_logits, _ = model(nxt, step_mask, position, past)
    alone = _full(model, torch.cat([short, nxt[:1]], dim=1))[0, -1]
    assert (step_logits[0, 0] - alone).abs().max().item() <= TOL


def test_position_ids_from_mask_for_left_padding() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_tied_weights_are_one_tensor(tiny_config: DecoderConfig) -> None:
    model = _model(tiny_config)
    assert model.lm_head.weight is model.tok_emb.weight
    untied = Decoder(DecoderConfig(**{**tiny_config.to_dict(), "tie_embeddings": False}))
    assert untied.lm_head.weight is not untied.tok_emb.weight
    extra = tiny_config.vocab_size * tiny_config.d_model
    assert count_parameters(untied) == count_parameters(model) + extra


def test_positions_change_the_output() -> None:
    # Without position information "a b" and "a b a b" end in identical logits (the same mixture of
    # the same values); any of the three variants must tell them apart.
    for positions in ("learned", "sinusoidal", "rotary"):
        cfg = DecoderConfig(
            vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, d_ff=32, positions=positions
        )
        logits = _full(_model(cfg), torch.tensor([[3, 5, 3, 5]]))
        assert not torch.allclose(logits[0, 1], logits[0, 3]), positions


def test_config_round_trip(tiny_config: DecoderConfig) -> None:
    assert DecoderConfig.from_dict(tiny_config.to_dict()) == tiny_config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"d_model": 30, "n_heads": 4}, "divisible"),
        ({"positions": "alibi"}, "positions"),
        ({"activation": "swish"}, "activation"),
        ({"d_model": 12, "n_heads": 4, "positions": "rotary"}, "even head_dim"),
        ({"n_layers": 0}, "n_layers must be a positive integer"),
        ({"vocab_size": -5}, "vocab_size"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_config_validation(changes: dict[str, object], message: str) -> None:
    base = {"vocab_size": 16, "context_length": 8, "d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**base, **changes})  # type: ignore[arg-type]


def test_unknown_config_key_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown decoder config keys"):
        DecoderConfig.from_dict({"vocab_size": 16, "n_embd": 4})


def test_dropout_is_active_only_in_training() -> None:
    cfg = DecoderConfig(
        vocab_size=11, context_length=8, d_model=16, n_layers=1, n_heads=2, d_ff=32, dropout=0.5
    )
    model = _model(cfg)
    ids = torch.randint(0, 11, (2, 8))
    assert torch.equal(_full(model, ids), _full(model, ids))
    model.train()
    assert not torch.equal(_full(model, ids), _full(model, ids))
