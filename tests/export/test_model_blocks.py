"""The decoder's blocks for imported checkpoints: old configs unchanged, the new blocks self-consistent
(KV-cache decode == full forward, padding), the sliding window's reach, and the standard graph traced."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from export.generation import Shape, greedy, session_step, torch_step
from export.model import Decoder, DecoderConfig, position_ids_from_mask
from export.onnx_standard import export_standard_graph
from export.verify import max_logit_diff

TOL = 1e-5
# Every new block at once: RMSNorm, SwiGLU, 2 of 4 heads for k/v, head_dim 16 on d_model 32 (q is 64
# wide), q/k biases without an out bias, q/k norms, a window of 5 keys, llama3 RoPE scaling, untied head.
EXTENDED = DecoderConfig(
    vocab_size=97,
    context_length=64,
    d_model=32,
    n_layers=2,
    n_heads=4,
    d_ff=48,
    positions="rotary",
    activation="swiglu",
    tie_embeddings=False,
    norm="rms",
    n_kv_heads=2,
    explicit_head_dim=16,
    qkv_bias=True,
    out_bias=False,
    mlp_bias=False,
    qk_norm=True,
    sliding_window=5,
    rope_scaling="llama3",
    rope_factor=4.0,
    rope_original_context=16,
)


def _model(cfg: DecoderConfig, seed: int = 0) -> Decoder:
    """Random weights large enough for sharp logits, norms and biases away from 1 and 0."""
    torch.manual_seed(seed)
    model = Decoder(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(std=0.3)
    return model


def _full(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    return model(ids, mask, position_ids_from_mask(mask))[0]


def test_a_config_saved_before_the_new_fields_loads_as_it_was() -> None:
    old = {
        "vocab_size": 50,
        "context_length": 16,
        "d_model": 16,
        "n_layers": 1,
        "n_heads": 2,
        "d_ff": 24,
        "positions": "learned",
        "activation": "gelu",
        "tie_embeddings": True,
        "dropout": 0.0,
        "layer_norm_eps": 1e-5,
        "rope_theta": 10000.0,
    }
    cfg = DecoderConfig.from_dict(old)
    assert (cfg.norm, cfg.kv_heads, cfg.head_dim, cfg.sliding_window, cfg.rope_scaling) == (
        "layer",
        2,
        8,
        0,
        "none",
    )
    assert cfg.qkv_bias and cfg.out_bias and cfg.mlp_bias and not cfg.qk_norm
    shapes = {k: list(v.shape) for k, v in Decoder(cfg).state_dict().items()}
    assert shapes == {
        "tok_emb.weight": [50, 16],
        "pos_emb.weight": [16, 16],
        "blocks.0.ln_attn.weight": [16],
        "blocks.0.ln_attn.bias": [16],
        "blocks.0.attn.qkv.weight": [48, 16],
        "blocks.0.attn.qkv.bias": [48],
        "blocks.0.attn.out.weight": [16, 16],
        "blocks.0.attn.out.bias": [16],
        "blocks.0.ln_ffn.weight": [16],
        "blocks.0.ln_ffn.bias": [16],
        "blocks.0.ffn.up.weight": [24, 16],
        "blocks.0.ffn.up.bias": [24],
        "blocks.0.ffn.down.weight": [16, 24],
        "blocks.0.ffn.down.bias": [16],
        "ln_f.weight": [16],
        "ln_f.bias": [16],
        "lm_head.weight": [50, 16],
    }
    assert DecoderConfig.from_dict(EXTENDED.to_dict()) == EXTENDED


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"n_kv_heads": 3}, "must divide n_heads"),
        ({"norm": "batch"}, "norm must be"),
        ({"rope_scaling": "dynamic"}, "rope_scaling must be"),
        ({"rope_scaling": "llama3", "rope_low_freq_factor": 4.0}, "above rope_low_freq_factor"),
        ({"rope_factor": 0.0}, "rope_factor must be positive"),
        ({"sliding_window": -1}, "sliding_window must be a non-negative integer"),
        ({"explicit_head_dim": 7}, "even head_dim"),
    ],
)
def test_new_fields_are_validated(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecoderConfig(**{**EXTENDED.to_dict(), **changes})  # type: ignore[arg-type]


def test_explicit_head_dim_need_not_divide_d_model() -> None:
    cfg = DecoderConfig(**{**EXTENDED.to_dict(), "d_model": 24, "explicit_head_dim": 16})
    assert (cfg.head_dim, cfg.q_dim, cfg.kv_dim) == (16, 64, 32)


@torch.no_grad()
def test_kv_cache_decoding_equals_full_forward_with_every_new_block() -> None:
    model = _model(EXTENDED)
    ids = torch.randint(0, EXTENDED.vocab_size, (2, 16))  # past the window of 5
    expected = _full(model, ids)
    prompt = 6
    mask = torch.ones(2, prompt, dtype=torch.long)
    logits, past = model(ids[:, :prompt], mask, position_ids_from_mask(mask))
    steps = [logits]
    for t in range(prompt, ids.shape[1]):
        mask = torch.ones(2, t + 1, dtype=torch.long)
        logits, past = model(ids[:, t : t + 1], mask, torch.full((2, 1), t), past)
        steps.append(logits)
    assert past[0][0].shape == (2, 2, 16, 16)  # [B, Hkv, T, Dh]
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() <= TOL


@torch.no_grad()
def test_left_padding_with_every_new_block() -> None:
    model = _model(EXTENDED)
    short = torch.randint(2, EXTENDED.vocab_size, (1, 9))
    batch = torch.cat([torch.full((1, 4), 1), short], dim=1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 9)], dim=1).long()
    logits, _ = model(batch, mask, position_ids_from_mask(mask))
    assert (logits[0, 4:] - _full(model, short)[0]).abs().max().item() <= TOL


@torch.no_grad()
def test_a_window_of_w_keys_includes_the_query_itself() -> None:
    """One layer: the logits at t depend on tokens t - W + 1 .. t only."""
    cfg = DecoderConfig(**{**EXTENDED.to_dict(), "n_layers": 1})
    model = _model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    t, w = 10, cfg.sliding_window
    base = _full(model, ids)[0, t]
    outside, inside = ids.clone(), ids.clone()
    outside[0, t - w] = (ids[0, t - w] + 1) % cfg.vocab_size
    inside[0, t - w + 1] = (ids[0, t - w + 1] + 1) % cfg.vocab_size
    assert torch.allclose(_full(model, outside)[0, t], base, rtol=0, atol=1e-6)
    assert not torch.allclose(_full(model, inside)[0, t], base)


def test_standard_graph_of_every_new_block_matches_pytorch() -> None:
    """One trace (~10 s): the portable graph of the extended decoder against PyTorch, teacher-forced."""
    model = _model(EXTENDED)
    session = ort.InferenceSession(
        export_standard_graph(model).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    prompts = [list(range(3, 15)), [20, 21], [30, 31, 32, 33, 34, 35]]
    shape = Shape(EXTENDED.n_layers, EXTENDED.kv_heads, EXTENDED.head_dim)
    reference = greedy(torch_step(model), prompts, 0, shape)
    graph = greedy(session_step(session), prompts, 0, shape, forced=reference.tokens)
    assert max_logit_diff(reference, graph) <= 1e-4
    assert np.array_equal(graph.own, reference.tokens)
