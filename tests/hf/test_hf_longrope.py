"""Phi-3.5 / Phi-4-mini's longrope over the whole context: short factors before the original context, long
factors from it on, one row of the cos/sin table per position.

A tiny random Phi3ForCausalLM with original_max_position_embeddings 32 of a 128-token context, its short and
long factors different and none of them 1. The reference past the original context is transformers' model
fed one token per forward call with its KV cache: each call picks the factors by its own last position, so a
token's rotation is that of its position, as in the bundle. Where transformers differs (one forward call
over positions on both sides of the original context, and Phi-3's generate, which recomputes its cache when
the sequence first outgrows it), the tests assert the difference, so what the docs say of it stays true.
"""

from __future__ import annotations

import inspect
import json
import math
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from hf_models import (
    CONTEXT,
    PHI3_LONGROPE,
    PROMPTS,
    STEPS,
    VOCAB,
    Run,
    build,
    hf_greedy,
    hf_greedy_batch,
    max_diff,
    phi3_config,
    rewrite_config,
    run_inplace,
    to_transformers4_form,
    torch_forced,
)
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from export.hf_import import HFImportError, decoder_config, import_checkpoint
from export.hf_verify import transformers_greedy
from export.model import Decoder, rotary_tables
from export.onnx_inplace import build_inplace_graph

TOL = 1e-4
LOGPROB_TOL = 2e-3
ORIGINAL = 32
BELOW = PROMPTS[:2]  # prompt and greedy tokens all before the original context
CROSSING = PROMPTS[2]  # a prompt before it whose greedy tokens run past it
LONG = tuple(3 + (7 * i) % (VOCAB - 3) for i in range(ORIGINAL + 8))  # a prompt past it


@dataclass(frozen=True)
class Longrope:
    folder: Path
    hf: PreTrainedModel
    model: Decoder
    graph: onnx.ModelProto


@pytest.fixture(scope="module")
def longrope(tmp_path_factory: pytest.TempPathFactory) -> Longrope:
    assert all(len(p) + STEPS <= ORIGINAL for p in BELOW)
    assert len(CROSSING) < ORIGINAL < len(CROSSING) + STEPS
    assert ORIGINAL < len(LONG) <= CONTEXT - STEPS
    folder = tmp_path_factory.mktemp("phi3-longrope")
    config = phi3_config(
        num_key_value_heads=2, original_max_position_embeddings=ORIGINAL, rope_parameters=dict(PHI3_LONGROPE)
    )
    hf = build(config, folder)
    model = import_checkpoint(folder).model
    return Longrope(folder, hf, model, build_inplace_graph(model))


@torch.no_grad()
def stepwise(hf: PreTrainedModel, prompt: tuple[int, ...], steps: int = STEPS) -> tuple[np.ndarray, Run]:
    """transformers' model fed one token per forward call with its KV cache: the prompt's logits [S, V],
    then `steps` greedy tokens."""
    # transformers 5 renamed the cache argument and output `cache` (past_key_values before).
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    past: Any = None

    def step(token: int) -> np.ndarray:
        nonlocal past
        feed: dict[str, Any] = {"input_ids": torch.tensor([[token]])}
        if past is not None:
            feed[name] = past
        out = hf(**feed, use_cache=True)
        past = out[name]
        return np.asarray(out.logits[0, -1].float().numpy())

    prompt_logits = np.stack([step(t) for t in prompt])
    seen, tokens = [prompt_logits[-1]], []
    for t in range(steps):
        tokens.append(int(seen[-1].argmax()))
        if t + 1 < steps:
            seen.append(step(tokens[-1]))
    return prompt_logits, Run(np.array([tokens]), [s[None] for s in seen])


def _logprob_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float((torch.from_numpy(a).log_softmax(-1) - torch.from_numpy(b).log_softmax(-1)).abs().max())


def _assert_same_run(ref: Run, got: Run, what: str) -> None:
    assert np.array_equal(got.tokens, ref.tokens), f"{what}: greedy tokens differ"
    assert max_diff(ref.logits, got.logits) <= TOL, f"{what}: logits differ"
    assert max(_logprob_diff(r, g) for r, g in zip(ref.logits, got.logits, strict=True)) <= LOGPROB_TOL


def test_the_import_keeps_the_whole_context_and_both_factor_sets(longrope: Longrope) -> None:
    cfg = longrope.model.cfg
    assert (cfg.context_length, cfg.rope_original_context, cfg.rotary_features) == (CONTEXT, ORIGINAL, 16)
    assert cfg.rope_short_factors == tuple(PHI3_LONGROPE["short_factor"])
    assert cfg.rope_long_factors == tuple(PHI3_LONGROPE["long_factor"])
    default = math.sqrt(1 + math.log(CONTEXT / ORIGINAL) / math.log(ORIGINAL))  # transformers' default
    assert cfg.rope_attention_factor == pytest.approx(default)


@torch.no_grad()
def test_each_table_row_is_transformers_rotary_of_its_position(longrope: Longrope) -> None:
    """Rows before the original context: transformers' rotary over positions that all are (short factors);
    from it on: over positions past it (long factors); both times the attention factor."""
    rotary, x = longrope.hf.model.rotary_emb, torch.zeros(1)
    pairs = longrope.model.cfg.rotary_features // 2
    below = rotary(x, torch.arange(ORIGINAL)[None])
    past = rotary(x, torch.arange(ORIGINAL, CONTEXT)[None])
    every_long = rotary(x, torch.arange(CONTEXT)[None])
    tables = rotary_tables(longrope.model.cfg)
    for ours, short, long, all_long in zip(tables, below, past, every_long, strict=True):
        theirs = torch.cat((short[0], long[0]))[:, :pairs]
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-5)
        # transformers' one call over the whole context rotates the early positions by the long factors
        assert float((ours[:ORIGINAL] - all_long[0, :ORIGINAL, :pairs]).abs().max()) > 0.1


@torch.no_grad()
def test_before_the_original_context_the_import_equals_transformers(longrope: Longrope) -> None:
    """Prompts and greedy tokens before the original context: transformers' generate, the prompts' logits
    and log-probabilities of one forward call."""
    model = longrope.model
    for p in BELOW:
        ids = torch.tensor([p])
        ours, _ = model(ids, torch.ones_like(ids), torch.arange(len(p))[None])
        theirs = longrope.hf(ids).logits
        assert float((theirs - ours).abs().max()) <= TOL
        assert _logprob_diff(theirs[0].numpy(), ours[0].numpy()) <= LOGPROB_TOL
    ref = hf_greedy_batch(longrope.hf, BELOW)
    _assert_same_run(ref, torch_forced(model, BELOW, ref.tokens), "pytorch")
    _assert_same_run(ref, run_inplace(longrope.graph, model.cfg, BELOW), "in-place graph")


@torch.no_grad()
def test_decoding_past_the_original_context_equals_transformers_token_by_token(longrope: Longrope) -> None:
    """A prompt before the original context, then greedy decode steps past it, one token at a time: as
    transformers' model decodes with its KV cache; the serving graph alike, alone and in a batch with
    prompts before and past the original context."""
    model, graph = longrope.model, longrope.graph
    _, ref = stepwise(longrope.hf, CROSSING)
    _assert_same_run(ref, torch_forced(model, [CROSSING], ref.tokens), "pytorch")
    _assert_same_run(ref, run_inplace(graph, model.cfg, [CROSSING]), "in-place graph")
    batch = [*BELOW, CROSSING, LONG]
    batched = run_inplace(graph, model.cfg, batch)
    for row, prompt in enumerate(batch):
        alone = run_inplace(graph, model.cfg, [prompt])
        assert np.array_equal(alone.tokens[0], batched.tokens[row]), f"prompt {row} alone"

    # The long factors take over exactly at the original context: without them (the short ones throughout)
    # the steps before it are unchanged and every step from it on is far off.
    short_only = Decoder(replace(model.cfg, rope_long_factors=model.cfg.rope_short_factors)).eval()
    short_only.load_state_dict(model.state_dict())
    other = torch_forced(short_only, [CROSSING], ref.tokens)
    for step, (a, b) in enumerate(zip(ref.logits, other.logits, strict=True)):
        position = len(CROSSING) - 1 + step  # of the token whose logits these are
        diff = float(np.abs(a - b).max())
        assert diff > 100 * TOL if position >= ORIGINAL else diff <= TOL, f"position {position}: {diff:.2e}"

    # Phi-3's generate drops its cache when the sequence first outgrows the original context and recomputes
    # it with the long factors: past that point its logits are not those of a cache kept as computed.
    generated = hf_greedy(longrope.hf, CROSSING)
    crossed = ORIGINAL - len(CROSSING) + 1  # the first step whose input holds original + 1 tokens
    assert max_diff(ref.logits[:crossed], generated.logits[:crossed]) <= TOL
    assert max_diff(ref.logits[crossed:], generated.logits[crossed:]) > 100 * TOL


@torch.no_grad()
def test_a_prompt_past_the_original_context_in_one_forward(longrope: Longrope) -> None:
    """One forward call over a prompt past the original context rotates each position by its own factors:
    its logits are transformers' fed the prompt one token at a time, and the serving graph prefills it in one
    step and decodes on as transformers does token by token. transformers' one call over the prompt rotates
    every position by the long factors, so its logits differ."""
    model = longrope.model
    prompt_ref, ref = stepwise(longrope.hf, LONG)
    ids = torch.tensor([LONG])
    ours = model(ids, torch.ones_like(ids), torch.arange(len(LONG))[None])[0][0].numpy()
    assert float(np.abs(ours - prompt_ref).max()) <= TOL
    assert _logprob_diff(ours, prompt_ref) <= LOGPROB_TOL
    _assert_same_run(ref, run_inplace(longrope.graph, model.cfg, [LONG]), "in-place graph")
    one_call = longrope.hf(ids).logits[0].numpy()
    assert float(np.abs(one_call - ours).max()) > 100 * TOL


@torch.no_grad()
def test_the_export_verifier_runs_transformers_as_the_bundle_rotates(longrope: Longrope) -> None:
    """`textgen-export hf` verifies a bundle against transformers_greedy: for a prompt past the original
    context, its prefill logits and greedy run are those of transformers token by token, not of one call."""
    prompt_ref, ref = stepwise(longrope.hf, LONG)
    got = transformers_greedy(longrope.hf, [LONG, CROSSING], pad_id=0, steps=STEPS - 1)
    assert float(np.abs(got.logits[0][0] - prompt_ref).max()) <= TOL
    assert np.array_equal(got.own[0], ref.tokens[0])
    assert max_diff([step[:1] for step in got.logits[1:]], ref.logits[1:]) <= TOL


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("long_factor", None),
        ("long_factor", [2.0, 3.0, 4.0]),
        ("long_factor", [*PHI3_LONGROPE["long_factor"][:-1], 0.0]),
        ("short_factor", [*PHI3_LONGROPE["short_factor"], 1.0]),
        ("short_factor", "1.0"),
    ],
    ids=["long-missing", "long-too-few", "long-zero", "short-too-many", "short-not-a-list"],
)
def test_bad_factors_are_refused_naming_the_field(
    longrope: Longrope, tmp_path: Path, key: str, value: Any
) -> None:
    longrope.hf.config.save_pretrained(tmp_path)

    def edit(config: dict[str, Any]) -> dict[str, Any]:
        rope = {k: v for k, v in config["rope_parameters"].items() if k != key}
        return {**config, "rope_parameters": rope if value is None else {**rope, key: value}}

    rewrite_config(tmp_path, edit)
    with pytest.raises(HFImportError) as error:
        decoder_config(tmp_path)
    assert "config.json" in str(error.value)
    assert f"longrope needs {key} as a list of 8 positive numbers" in error.value.problem


@pytest.mark.parametrize("name", ["su", "yarn"])
@torch.no_grad()
def test_phi3s_first_names_for_longrope_import_as_transformers_reads_them(
    longrope: Longrope, tmp_path: Path, name: str
) -> None:
    """Phi-3-mini-128k and Phi-3-medium-128k write rope_scaling {"type": "su", "short_factor", "long_factor"}
    (transformers 4's form), and Phi-3's first code also took "yarn" with the same factors: transformers reads
    both as longrope, and the import of such a folder is transformers' model loaded from it."""
    shutil.copytree(longrope.folder, tmp_path, dirs_exist_ok=True)
    factors = {k: PHI3_LONGROPE[k] for k in ("short_factor", "long_factor")}
    rewrite_config(
        tmp_path,
        lambda c: {
            **to_transformers4_form(c),
            "partial_rotary_factor": 0.5,
            "rope_scaling": {"type": name, **factors},
        },
    )
    assert "rope_parameters" not in json.loads((tmp_path / "config.json").read_text())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "longrope"
    model = import_checkpoint(tmp_path).model
    assert model.cfg == longrope.model.cfg
    prompt_ref, ref = stepwise(hf, LONG)
    ids = torch.tensor([LONG])
    ours = model(ids, torch.ones_like(ids), torch.arange(len(LONG))[None])[0][0].numpy()
    assert float(np.abs(ours - prompt_ref).max()) <= TOL
    assert _logprob_diff(ours, prompt_ref) <= LOGPROB_TOL
    _assert_same_run(ref, torch_forced(model, [LONG], ref.tokens), "pytorch")


@pytest.mark.parametrize("name", ["linear", "dynamic"])
def test_phi3_refuses_the_scalings_transformers_refuses_for_it(
    longrope: Longrope, tmp_path: Path, name: str
) -> None:
    longrope.hf.config.save_pretrained(tmp_path)
    rope = {"rope_type": name, "factor": 2.0, "rope_theta": 10000.0}
    rewrite_config(tmp_path, lambda c: {**c, "rope_parameters": rope})
    with pytest.raises(Exception, match=f"type field must be one of .*, got {name}"):  # transformers' own
        AutoConfig.from_pretrained(tmp_path)
    with pytest.raises(HFImportError) as error:
        decoder_config(tmp_path)
    assert f"RoPE type {name!r} is not supported for Phi-3; supported: default, longrope, su" in str(
        error.value
    )


def test_the_decoder_config_checks_both_factor_sets(longrope: Longrope) -> None:
    cfg = longrope.model.cfg
    for name in ("rope_short_factors", "rope_long_factors"):
        with pytest.raises(ValueError, match=f"longrope needs 8 positive {name}"):
            replace(cfg, **{name: (1.0,) * 7})
