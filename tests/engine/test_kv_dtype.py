"""--kv-cache-dtype fp16: a float32 bundle served with a float16 KV cache (serve/engine/kv_dtype.py) takes
half the memory, stays close to the float32 cache's logits and greedy tokens, keeps a request's tokens
independent of its batch, and moves its rows (prefix cache, preemption) as the float32 cache does.
Speculation with a float16 cache: tests/engine/test_speculation.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest

from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.kv_dtype import fp16_attention, needs_rewrite
from serve.engine.sampling import SamplingParams
from serve.engine.types import EngineSettings, NewSequence, SessionConfig
from serve.errors import BundleError

SETTINGS = EngineSettings(
    max_batch_size=6,
    session=SessionConfig(threads=2, spinning=False),
    prefix_cache_rows=2,
    prefix_cache_min_tokens=4,
)
GREEDY = SamplingParams()
PROMPTS = [
    "Once upon a time",
    "The little dog ran to the",
    "She said",
    "One day, a girl named Lily went to the park with her mom. They",
    "Tom had a big red ball",
    "The sun",
]
NEW_TOKENS = 32
# float16 keeps 11 significant bits: each query, key and value is rounded by at most 2^-11 of itself. The
# logits may move by a few such roundings of their own scale (measured on the demo: 2e-4 of the largest
# logit); a bound of 4 x 2^-11 of it leaves room for other CPUs' kernels.
LOGIT_BOUND = 4 * 2.0**-11
# Greedy tokens the float16 cache must share with the float32 one, position by position. Two greedy runs may
# part at a near tie (then the rest of that sequence differs); a part at the very first token of one prompt of
# six costs a sixth. Measured on the demo: every token agrees.
AGREEMENT = 0.75


@pytest.fixture(scope="module")
def engines(demo_bundle: Path) -> tuple[Engine, Engine]:
    bundle = load_bundle(demo_bundle)
    fp16 = replace(SETTINGS, kv_cache_dtype="fp16")
    return Engine.from_bundle(bundle, SETTINGS), Engine.from_bundle(bundle, fp16)


def prompts(engine: Engine) -> list[list[int]]:
    return [engine.tokenizer.encode(text).ids for text in PROMPTS]


def greedy(engine: Engine, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """A sequence's greedy tokens, run alone, and the logits each was picked from."""
    tokens = [engine.prefill([NewSequence("greedy", prompt, GREEDY)])[0].token_id]
    logits = [engine.last_logits[0].copy()]
    while len(tokens) < NEW_TOKENS:
        tokens.append(engine.decode()[0].token_id)
        logits.append(engine.last_logits[0].copy())
    engine.release(["greedy"])
    return tokens, np.stack(logits)


def test_an_fp16_cache_takes_half_the_memory(engines: tuple[Engine, Engine]) -> None:
    fp32, fp16 = engines
    assert (fp32.kv_dtype, fp16.kv_dtype) == ("float32", "float16")
    assert fp16.kv_bytes * 2 == fp32.kv_bytes
    assert fp16.info.kv_bytes == fp16.kv_bytes  # what GetModelInfo's kv_cache_bytes reports


def test_logits_stay_close_and_greedy_tokens_agree(engines: tuple[Engine, Engine]) -> None:
    """Logits of a batch's prefill and of every decode step on the same tokens (up to and at the first token
    the two caches' greedy outputs part at, if any) stay within the bound: a part is a near tie."""
    fp32, fp16 = engines
    batch = prompts(fp32)
    logits = []
    for engine in engines:
        engine.prefill([NewSequence(str(i), p, GREEDY) for i, p in enumerate(batch)])
        logits.append(engine.last_logits.copy())
        engine.release([str(i) for i in range(len(batch))])
    assert np.abs(logits[1] - logits[0]).max() <= LOGIT_BOUND * np.abs(logits[0]).max()
    assert not np.array_equal(logits[0], logits[1])  # the float16 cache is in use
    agreed = 0
    for prompt in batch:
        (want, want_logits), (got, got_logits) = greedy(fp32, prompt), greedy(fp16, prompt)
        same = next((i for i, (a, b) in enumerate(zip(want, got, strict=True)) if a != b), NEW_TOKENS)
        shared = slice(0, same + 1)  # the steps both ran on the same tokens
        bound = LOGIT_BOUND * np.abs(want_logits).max()
        assert np.abs(got_logits[shared] - want_logits[shared]).max() <= bound
        agreed += sum(a == b for a, b in zip(want, got, strict=True))
    assert agreed >= AGREEMENT * NEW_TOKENS * len(batch)


def test_a_request_gets_the_same_tokens_alone_and_batched(engines: tuple[Engine, Engine]) -> None:
    """Bit-identical: rows of mixed lengths, joining at different steps, computed as each one alone."""
    _, engine = engines
    batch = prompts(engine)
    want = [greedy(engine, p)[0] for p in batch]
    got: dict[str, list[int]] = {}
    first, later = batch[:3], batch[3:]
    for out in engine.prefill([NewSequence(str(i), p, GREEDY) for i, p in enumerate(first)]):
        got[out.seq_id] = [out.token_id]
    step = 0
    while engine.running_ids:
        if step == 5:  # the rest join mid-way, beside rows further on
            joining = [NewSequence(str(i + len(first)), p, GREEDY) for i, p in enumerate(later)]
            for out in engine.prefill(joining):
                got[out.seq_id] = [out.token_id]
        for out in engine.decode():
            got[out.seq_id].append(out.token_id)
        engine.release([seq for seq in engine.running_ids if len(got[seq]) == NEW_TOKENS])
        step += 1
    assert [got[str(i)] for i in range(len(batch))] == want


def test_kept_and_preempted_rows_resume_with_the_same_tokens(engines: tuple[Engine, Engine]) -> None:
    _, engine = engines
    prompt = prompts(engine)[3]
    want = greedy(engine, prompt)[0]  # its row is kept by the prefix cache as it leaves
    assert engine._hit(prompt, 0) is not None
    assert greedy(engine, prompt)[0] == want  # the prompt's keys and values come from the kept row
    tokens = [engine.prefill([NewSequence("paused", [*prompt, 7], GREEDY)])[0].token_id]
    tokens.append(engine.decode()[0].token_id)
    foreseen = engine.swap_bytes("paused")
    engine.swap_out(["paused"])
    spec = engine.spec
    per_token = 2 * spec.n_layers * spec.kv_heads * spec.head_dim * 2 + 8  # fp16 K and V, the token id
    assert engine.swapped_bytes == per_token * (len(prompt) + 2) == foreseen
    greedy(engine, prompts(engine)[0])  # another sequence takes its row
    engine.swap_in(["paused"])
    while len(tokens) < NEW_TOKENS:
        tokens.append(engine.decode()[0].token_id)
    engine.release(["paused"])
    assert tokens == greedy(engine, [*prompt, 7])[0]


def test_what_a_graph_cannot_take_is_refused(demo_bundle: Path) -> None:
    assert not needs_rewrite("auto", "float32", "b") and not needs_rewrite("fp32", "float32", "b")
    assert needs_rewrite("fp16", "float32", "b") and not needs_rewrite("fp16", "float16", "b")
    with pytest.raises(BundleError, match=r"the bundle is float16.*needs a float32 bundle"):
        needs_rewrite("fp32", "float16", "b")
    graph = load_bundle(demo_bundle).inplace_graph
    assert graph is not None
    model = onnx.load(str(graph))
    biased = onnx.ModelProto()  # with an attention_bias (input 10): a float input the rewrite does not handle
    biased.CopyFrom(model)
    attention = next(node for node in biased.graph.node if node.op_type == "GroupQueryAttention")
    attention.input.extend([""] * (10 - len(attention.input)) + ["bias"])
    with pytest.raises(
        BundleError, match=r"inputs \(at positions \[10\]\) that the float16 KV cache rewrite"
    ):
        fp16_attention(biased, graph)
    fp16_attention(model, graph)
    with pytest.raises(BundleError, match="KV cache is not float32"):  # already rewritten
        fp16_attention(model, graph)
