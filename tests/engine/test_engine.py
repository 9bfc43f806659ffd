"""The engine against the PyTorch reference, and its batch invariance under join and leave."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from scheduler_fakes import shared_prefix

from export.checkpoint import load_checkpoint
from export.model import Decoder
from export.onnx_inplace import build_inplace_graph
from serve.bundle import load_bundle
from serve.engine.engine import Engine
from serve.engine.prompt_scoring import scoring_session
from serve.engine.runtime import Device, SessionConfig, allocate, copy_graph, create_copy_session, kv_device
from serve.engine.sampling import SamplingParams
from serve.engine.types import MIN_PIECE, EngineSettings, ModelSpec, NewSequence, TokenOut, next_piece
from serve.errors import BundleError
from serve.scheduling.offline import generate

GREEDY = SamplingParams()
PROMPTS = [
    "def __init__(self",
    "import os\n",
    "class Config:\n    def",
    "for i in range(",
    "    return self._",
    "# Licensed under the",
]


def make_engine(
    model: Decoder, tokenizer: object, tmp: Path, max_batch_size: int = 16, prefix_cache_rows: int = 0
) -> Engine:
    cfg = model.cfg
    path = tmp / "serving.onnx"
    if not path.exists():
        onnx.save(build_inplace_graph(model), str(path))
    spec = ModelSpec(cfg.n_layers, cfg.n_heads, cfg.head_dim, cfg.vocab_size, cfg.context_length, 0, 1)
    settings = EngineSettings(
        max_batch_size=max_batch_size,
        session=SessionConfig(threads=2, spinning=False),
        prefix_cache_rows=prefix_cache_rows,
        prefix_cache_min_tokens=4,
    )
    return Engine(str(path), tokenizer, spec, settings)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def demo(demo_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Decoder, Engine]:
    ckpt = load_checkpoint(demo_checkpoint)
    return ckpt.model, make_engine(ckpt.model, ckpt.tokenizer, tmp_path_factory.mktemp("demo_engine"))


@pytest.fixture()
def cached(demo: tuple[Decoder, Engine], tmp_path: Path) -> Engine:
    """The demo model with a three-row prefix cache (fresh for each test: the cache is state)."""
    model, engine = demo
    return make_engine(model, engine.tokenizer, tmp_path, max_batch_size=8, prefix_cache_rows=3)


def torch_greedy(model: Decoder, prompt: list[int], n: int) -> list[int]:
    """Reference: greedy decoding with the PyTorch model's own KV cache."""
    ids = torch.tensor([prompt])
    out: list[int] = []
    with torch.no_grad():
        logits, past = model(ids, torch.ones_like(ids), torch.arange(len(prompt))[None])
        for _ in range(n):
            token = int(logits[0, -1].argmax())
            out.append(token)
            total = len(prompt) + len(out)
            step = torch.tensor([[token]])
            logits, past = model(
                step, torch.ones(1, total, dtype=torch.long), torch.tensor([[total - 1]]), past
            )
    return out


def run_alone(engine: Engine, prompt: list[int], n: int, params: SamplingParams = GREEDY) -> list[int]:
    out = [engine.prefill([NewSequence("alone", prompt, params)])[0].token_id]
    while len(out) < n:
        out.append(engine.decode()[0].token_id)
    engine.release(["alone"])
    return out


def encode(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text).ids


def test_engine_equals_pytorch_greedy(demo: tuple[Decoder, Engine]) -> None:
    model, engine = demo
    for text in PROMPTS[:4]:
        prompt = encode(engine, text)
        assert run_alone(engine, prompt, 64) == torch_greedy(model, prompt, 64), text


def test_prefill_logits_match_pytorch(demo: tuple[Decoder, Engine]) -> None:
    model, engine = demo
    prompts = [encode(engine, t) for t in PROMPTS]
    engine.prefill([NewSequence(str(i), p, GREEDY) for i, p in enumerate(prompts)])
    got = engine.last_logits.copy()
    engine.release([str(i) for i in range(len(prompts))])
    for row, prompt in enumerate(prompts):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref, _ = model(ids, torch.ones_like(ids), torch.arange(len(prompt))[None])
        np.testing.assert_allclose(got[row], ref[0, -1].numpy(), atol=1e-4)
        assert np.isfinite(got[row]).all()


def staggered(
    engine: Engine, prompts: list[list[int]], n: int, joins: dict[int, list[int]]
) -> dict[int, list[int]]:
    """Run prompts with joins at given decode steps; each sequence leaves as soon as it has n tokens."""
    outs: dict[int, list[int]] = {}

    def take(tokens: list) -> None:
        for t in tokens:
            outs.setdefault(int(t.seq_id), []).append(t.token_id)
        engine.release([str(i) for i, toks in outs.items() if len(toks) >= n])

    step = 0
    while len(outs) < len(prompts) or engine.batch_size:
        if step in joins:
            take(engine.prefill([NewSequence(str(i), prompts[i], GREEDY) for i in joins[step]]))
        if engine.batch_size:
            take(engine.decode())
        step += 1
    return outs


def test_batch_invariance_alone_batched_and_joining(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    rng = np.random.default_rng(7)
    texts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 4) for i in range(16)]
    prompts = [encode(engine, t)[: 3 + int(rng.integers(0, 40))] for t in texts]
    n = 24
    alone = {i: run_alone(engine, p, n) for i, p in enumerate(prompts)}
    # All 16 in one padded prefill group.
    assert staggered(engine, prompts, n, {0: list(range(16))}) == alone
    # Arriving in waves, joining a running batch mid-way and outliving their neighbours.
    waves = {0: [0, 1, 2], 3: [3, 4, 5, 6], 10: [7], 11: list(range(8, 14)), 30: [14, 15]}
    assert staggered(engine, prompts, n, waves) == alone
    assert engine.batch_size == 0


def test_join_and_leave_change_the_live_batch(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    heads, capacity, head_dim = engine.kv_shape()[1:]
    engine.prefill([NewSequence("a", [5, 6, 7], GREEDY), NewSequence("b", [8, 9], GREEDY)])
    assert engine.kv_shape() == (2, heads, capacity, head_dim)
    engine.decode()
    assert engine.lengths() == {"a": 4, "b": 3}
    engine.prefill([NewSequence("c", [10, 11, 12, 13], GREEDY)])
    assert engine.batch_size == 3
    engine.release(["a"])
    assert engine.running_ids == ["c", "b"]  # the last row moved into the freed one
    assert engine.lengths() == {"c": 4, "b": 3}
    assert engine.kv_shape() == (2, heads, capacity, head_dim)
    engine.release(["a", "b", "c"])  # releasing twice is harmless
    assert engine.batch_size == 0


def test_seeded_sampling_does_not_depend_on_the_batch(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    prompt = encode(engine, PROMPTS[0])
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    alone = run_alone(engine, prompt, 20, params)
    others = [
        NewSequence(f"o{i}", encode(engine, PROMPTS[i]), SamplingParams(temperature=1.2, seed=i))
        for i in (1, 2)
    ]
    engine.prefill(others[:1])
    engine.decode()
    out = [
        t.token_id for t in engine.prefill([NewSequence("s", prompt, params), others[1]]) if t.seq_id == "s"
    ]
    while len(out) < 20:
        out += [t.token_id for t in engine.decode() if t.seq_id == "s"]
        engine.release(["o0"])  # a neighbour leaves mid-way: rows move
    engine.release(engine.running_ids)
    assert out == alone
    assert (
        run_alone(engine, prompt, 20, SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=99)) != alone
    )


def test_stop_token_ids_end_and_min_new_tokens_holds_them_off(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    # A stop token that the plain greedy run first produces at step 2 or later (any prompt that has one).
    runs = [(p, run_alone(engine, p, 16)) for p in (encode(engine, t) for t in PROMPTS)]
    prompt, plain, at = next(
        (p, plain, i) for p, plain in runs for i in range(2, 16) if plain[i] not in plain[:i]
    )
    stop = plain[at]
    (stopped,) = generate(engine, [prompt], max_new_tokens=16, stop_token_ids=(stop,))
    assert stopped.finish_reason == "stop" and stopped.token_ids == plain[:at]
    assert stopped.text == engine.tokenizer.decode(plain[:at])
    # Until min_new_tokens the stop token is banned: the engine takes the next best token instead, the
    # request goes on, and the tokens before it are unchanged.
    (held,) = generate(engine, [prompt], max_new_tokens=16, stop_token_ids=(stop,), min_new_tokens=at + 3)
    assert held.token_ids[:at] == plain[:at] and held.token_ids[at] != stop
    assert stop not in held.token_ids[: at + 3] and len(held.token_ids) >= at + 3
    assert held.finish_reason in ("stop", "length", "eos")
    # Many stop tokens at once (every token of the plain run): none of them comes before the minimum.
    stops = tuple(set(plain))
    (many,) = generate(engine, [prompt], max_new_tokens=16, stop_token_ids=stops, min_new_tokens=9)
    assert len(many.token_ids) >= 9 and not set(many.token_ids[:9]) & set(stops)
    assert engine.batch_size == 0


def repeated_across(text: str, cut: int) -> str:
    """The longest (up to 8 characters) piece of `text` that starts before `cut` and occurs again after it.

    Taken from what this model generated, so the test holds for any training run of the demo recipe."""
    for length in range(8, 0, -1):
        for start in range(min(cut, len(text) - length + 1)):
            piece = text[start : start + length]
            if piece.strip() and text.find(piece, cut) >= 0:
                return piece
    raise AssertionError(f"no piece of {text!r} before {cut} occurs again after it")


def test_stop_strings_wait_for_min_new_tokens(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    prompt = encode(engine, PROMPTS[0])
    (plain,) = generate(engine, [prompt], max_new_tokens=24, ignore_eos=True)
    head = len(engine.tokenizer.decode(plain.token_ids[:5]))
    stop = repeated_across(plain.text, head)
    first = plain.text.find(stop)
    assert 0 <= first < head  # within the text of the first five tokens, and again after it
    (at_once,) = generate(engine, [prompt], max_new_tokens=24, ignore_eos=True, stop=(stop,))
    assert at_once.finish_reason == "stop" and at_once.text == plain.text[:first]
    # From the 6th token on only (vLLM's min_tokens): the text of the first five goes out as it is.
    (held,) = generate(engine, [prompt], max_new_tokens=24, ignore_eos=True, stop=(stop,), min_new_tokens=6)
    later = plain.text.find(stop, head)
    assert later > first and held.finish_reason == "stop" and held.text == plain.text[:later]
    assert len(held.token_ids) >= 6 and held.token_ids == plain.token_ids[: len(held.token_ids)]


def test_a_changed_standard_graph_is_refused_when_a_prompt_is_first_scored(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """The engine opens the standard graph only to score a prompt: its checksum is checked then, not at
    start, and a changed file fails that call with the file and the mismatch."""
    root = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    with (root / "model.onnx").open("ab") as f:
        f.write(b"\0")
    engine = Engine.from_bundle(load_bundle(root), EngineSettings(max_batch_size=1))
    assert generate(engine, [[5, 6, 7]], max_new_tokens=2)[0].token_ids
    with pytest.raises(BundleError) as info:
        engine.score_prompt([5, 6, 7])
    assert str(root / "model.onnx") in str(info.value) and "checksum mismatch" in str(info.value)


def test_a_truncated_serving_graph_is_refused_as_changed_not_as_unreadable(
    tiny_bundle: Path, tmp_path: Path
) -> None:
    """The serving graph is hashed before ONNX Runtime reads it: a damaged file is refused by the checksum's
    verdict, which names the file, not by what reading it would raise."""
    root = Path(shutil.copytree(tiny_bundle, tmp_path / "bundle"))
    graph = root / "model_inplace.onnx"
    graph.write_bytes(graph.read_bytes()[: graph.stat().st_size // 2])
    with pytest.raises(BundleError) as info:
        Engine.from_bundle(load_bundle(root), EngineSettings(max_batch_size=1))
    assert str(graph) in str(info.value) and "checksum mismatch" in str(info.value)


def test_prompt_logprobs_equal_pytorch_and_come_with_the_first_token(
    demo: tuple[Decoder, Engine], demo_bundle: Path
) -> None:
    model, _ = demo
    engine = Engine.from_bundle(load_bundle(demo_bundle), EngineSettings(max_batch_size=4))
    prompts = [encode(engine, text) for text in PROMPTS[:3]]
    scored = generate(engine, prompts, max_new_tokens=3, prompt_logprobs=True)
    plain = generate(engine, prompts, max_new_tokens=3)
    for prompt, got, without in zip(prompts, scored, plain, strict=True):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            logits, _ = model(ids, torch.ones_like(ids), torch.arange(len(prompt))[None])
        reference = torch.log_softmax(logits[0, :-1], dim=-1)[torch.arange(len(prompt) - 1), ids[0, 1:]]
        np.testing.assert_allclose(got.prompt_logprobs, reference.numpy(), atol=1e-4)
        assert got.token_ids == without.token_ids and not without.prompt_logprobs
    # A one-token prompt has nothing to score; an engine made without the bundle's standard graph refuses.
    assert generate(engine, [[5]], max_new_tokens=1, prompt_logprobs=True)[0].prompt_logprobs == []
    with pytest.raises(RuntimeError, match="cannot score"):
        demo[1].score_prompt(prompts[0])
    # The most likely tokens at each position: the first is the argmax, with the chosen tokens' formula.
    listed = generate(engine, prompts[:1], max_new_tokens=1, prompt_logprobs=True, prompt_top_logprobs=3)[0]
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        logits, _ = model(ids, torch.ones_like(ids), torch.arange(len(prompts[0]))[None])
    assert len(listed.prompt_top_logprobs) == len(listed.prompt_logprobs) == len(prompts[0]) - 1
    for position, (token, logprob, top) in enumerate(
        zip(prompts[0][1:], listed.prompt_logprobs, listed.prompt_top_logprobs, strict=True)
    ):
        assert len(top.token_ids) == 3 and top.logprobs == sorted(top.logprobs, reverse=True)
        assert top.token_ids[0] == int(logits[0, position].argmax()) and top.logprobs[0] >= logprob
        if top.token_ids[0] == token:
            assert top.logprobs[0] == logprob  # exactly: what the client's prompt_greedy count relies on


def test_top_logprobs_through_the_offline_api(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    prompts = [encode(engine, text) for text in PROMPTS[:3]]
    plain = generate(engine, prompts, max_new_tokens=6, include_logprobs=True)
    listed = generate(engine, prompts, max_new_tokens=6, include_logprobs=True, top_logprobs=4)
    for without, got in zip(plain, listed, strict=True):
        assert got.token_ids == without.token_ids and not without.top_logprobs
        assert len(got.top_logprobs) == len(got.token_ids)
        for token, logprob, top in zip(got.token_ids, got.logprobs, got.top_logprobs, strict=True):
            assert len(top.token_ids) == 4 and top.token_ids[0] == token  # greedy: the most likely
            assert top.logprobs == sorted(top.logprobs, reverse=True)
            assert top.logprobs[0] == logprob  # one normalizer serves both


def test_prompt_filling_the_context(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    capacity = engine.capacity
    with pytest.raises(ValueError, match="must be 1"):
        engine.prefill([NewSequence("x", [5] * capacity, GREEDY)])
    assert engine.batch_size == 0
    engine.prefill([NewSequence("x", [5] * (capacity - 1), GREEDY)])
    engine.decode()  # the last free position
    with pytest.raises(ValueError, match="filled"):
        engine.decode()
    engine.release(["x"])


def test_overfull_prefill_is_refused_without_side_effects(demo: tuple[Decoder, Engine]) -> None:
    _, engine = demo
    too_many = [NewSequence(str(i), [5, 6], GREEDY) for i in range(engine.max_batch_size + 1)]
    with pytest.raises(ValueError, match="max_batch_size"):
        engine.prefill(too_many)
    with pytest.raises(ValueError, match="already running"):
        engine.prefill([NewSequence("d", [5], GREEDY), NewSequence("d", [6], GREEDY)])
    assert engine.batch_size == 0
    with pytest.raises(RuntimeError, match="no running"):
        engine.decode()


def test_kv_device_follows_the_first_provider() -> None:
    cpu, cuda = "CPUExecutionProvider", "CUDAExecutionProvider"
    assert kv_device([cuda, cpu]) == Device("cuda", 0)
    assert kv_device(["TensorrtExecutionProvider", cuda, cpu]) == Device("cuda", 0)
    assert kv_device([cuda, cpu], device_id=1) == Device("cuda", 1)
    assert kv_device([cpu]) == Device("cpu", 0)
    assert kv_device([cpu, cuda], device_id=1) == Device("cpu", 0)  # CPU first: the cache stays on the host
    assert kv_device([]) == Device("cpu", 0)


def test_kv_buffers_are_ort_values_on_the_sessions_device(demo: tuple[Decoder, Engine]) -> None:
    model, engine = demo
    assert engine.kv_device == kv_device(engine.providers) == Device("cpu", 0)
    assert engine.kv_buffer_devices() == ["cpu"] * (2 * model.cfg.n_layers)
    engine.prefill([NewSequence("a", [5, 6, 7], GREEDY)])
    assert engine.kv_host(0, "key").shape == engine.kv_shape()
    engine.release(["a"])


def test_info_reports_the_real_kv_buffers(cached: Engine) -> None:
    info = cached.info
    assert (info.max_batch_size, info.prefix_cache_rows, info.kv_device) == (8, 3, "cpu")
    assert info.kv_bytes == cached.kv_bytes == sum(b.value.numpy().nbytes for b in cached._kv.buffers)
    assert info.vocab_size == cached.vocab_size and info.providers == tuple(cached.providers)


# The engine copies rows with numpy views in host memory and with the copy graph on a device: the second
# path runs here too, on host memory, when the views are taken away.
COPIES = ["host views", "copy graph"]


def copy_with(engine: Engine, copies: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if copies == "copy graph":
        monkeypatch.setattr(engine._kv, "_host_views", None)


@pytest.mark.parametrize("copies", COPIES)
def test_release_of_a_middle_row_moves_the_last_rows_cache(
    demo: tuple[Decoder, Engine], copies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, engine = demo
    copy_with(engine, copies, monkeypatch)
    prompts = [encode(engine, t) for t in PROMPTS[:3]]
    n = 12
    alone = [run_alone(engine, p, n) for p in prompts]
    out: dict[str, list[int]] = {}

    def take(tokens: list) -> None:
        for t in tokens:
            out.setdefault(t.seq_id, []).append(t.token_id)

    take(engine.prefill([NewSequence(str(i), p, GREEDY) for i, p in enumerate(prompts)]))
    for _ in range(4):
        take(engine.decode())
    layers = [(layer, kind) for layer in range(model.cfg.n_layers) for kind in ("key", "value")]
    before = {lk: engine.kv_host(*lk) for lk in layers}
    assert engine.running_ids == ["0", "1", "2"]
    engine.release(["1"])  # the middle row: row 2 moves into row 1
    assert engine.running_ids == ["0", "2"]
    filled = engine.lengths()["2"]
    for lk in layers:
        after = engine.kv_host(*lk)
        np.testing.assert_array_equal(after[0], before[lk][0], err_msg=str(lk))  # untouched
        # The last row's filled positions (the copy graph moves the whole row).
        np.testing.assert_array_equal(after[1][:, :filled], before[lk][2][:, :filled], err_msg=str(lk))
        if copies == "copy graph":
            np.testing.assert_array_equal(after[1], before[lk][2], err_msg=str(lk))
    assert np.any(before[(0, "key")][1] != before[(0, "key")][2])  # so the comparison above means something
    while engine.batch_size:
        take(engine.decode())
        engine.release([s for s, toks in out.items() if len(toks) >= n])
    assert out["0"] == alone[0] and out["2"] == alone[2]
    assert out["1"] == alone[1][:5]


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_copy_graph_copies_into_the_bound_buffers(dtype: type) -> None:
    shape = (3, 4, 5)
    model = copy_graph([dtype, dtype], shape)
    onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
    device = Device("cpu", 0)
    session = create_copy_session(model, device)
    rng = np.random.default_rng(0)
    values = [allocate((2, *shape), dtype, device) for _ in range(2)]
    assert all(not v.numpy().any() for v in values)  # allocate() zero-fills
    sources = [rng.standard_normal((2, *shape)).astype(dtype) for _ in values]
    for v, src in zip(values, sources, strict=True):
        v.update_inplace(src)
    row_bytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    binding = session.io_binding()
    for i, v in enumerate(values):  # row 1 -> row 0, by pointer
        binding.bind_input(f"src.{i}", "cpu", 0, dtype, shape, v.data_ptr() + row_bytes)
        binding.bind_output(f"dst.{i}", "cpu", 0, dtype, shape, v.data_ptr())
    session.run_with_iobinding(binding)
    for v, src in zip(values, sources, strict=True):
        np.testing.assert_array_equal(v.numpy(), np.stack([src[1], src[1]]))


def test_chunked_prefill_equals_whole_and_lets_the_batch_decode_in_between(
    demo: tuple[Decoder, Engine],
) -> None:
    _, engine = demo
    prompts = [encode(engine, text) for text in PROMPTS[:3]]
    long = encode(engine, PROMPTS[3] * 4)  # 4 pieces of 5 tokens or fewer
    assert len(long) > 15
    alone = {i: run_alone(engine, p, 24) for i, p in enumerate([*prompts, long])}
    out: dict[str, list[int]] = {str(i): [] for i in range(4)}

    def take(tokens: list[TokenOut]) -> None:
        for t in tokens:
            out[t.seq_id].append(t.token_id)

    take(engine.prefill([NewSequence(str(i), p, GREEDY) for i, p in enumerate(prompts)]))
    assert engine.prefill([NewSequence("3", long, GREEDY)], chunk=5) == []
    assert engine.staged_id == "3" and engine.batch_size == 3 and engine.staged_done == 5
    pieces = 1
    while engine.staged_id is not None:
        assert engine.staged_done == min(5 * pieces, len(long))
        decoded = engine.decode()
        assert sorted(t.seq_id for t in decoded) == sorted(engine.running_ids)  # the staged row is left alone
        take(decoded)
        if pieces == 2:
            engine.release(["0"])  # a running row leaves mid-prefill: the staged row moves down with it
            assert engine.kv_shape()[0] == 2
        take(engine.continue_prefill())
        pieces += 1
    assert pieces == -(-len(long) // 5) and engine.running_ids[-1] == "3" and engine.staged_done == 0
    while len(out["3"]) < 12:
        take(engine.decode())
    engine.release(engine.running_ids)
    assert out["3"] == alone[3][:12]
    for i in (1, 2):
        assert out[str(i)] == alone[i][: len(out[str(i)])]
    assert out["0"] == alone[0][: len(out["0"])]
    with pytest.raises(RuntimeError):
        engine.continue_prefill()


def test_a_background_prefill_equals_one_between_steps_and_joins_after_rows_left(
    demo: tuple[Decoder, Engine],
) -> None:
    _, engine = demo
    prompts = [encode(engine, text) for text in PROMPTS]  # 0-3 run, 4 and 5 arrive
    alone = {i: run_alone(engine, p, 24) for i, p in enumerate(prompts)}
    out: dict[str, list[int]] = {str(i): [] for i in range(6)}

    def take(tokens: list[TokenOut]) -> None:
        for t in tokens:
            out[t.seq_id].append(t.token_id)

    take(engine.prefill([NewSequence(str(i), p, GREEDY) for i, p in enumerate(prompts[:4])]))
    take(engine.decode())
    engine.begin_prefill([NewSequence(str(i), prompts[i], GREEDY) for i in (4, 5)])
    assert engine.background_ids == ["4", "5"] and engine.batch_size == 4
    with pytest.raises(RuntimeError, match="still being prefilled"):
        engine.prefill([NewSequence("6", prompts[0], GREEDY)])
    decoded = engine.decode()
    assert sorted(t.seq_id for t in decoded) == ["0", "1", "2", "3"]  # the prefilling rows are left alone
    take(decoded)
    engine.release(["1", "3", "5"])  # two rows below the group leave, and one of the group, meanwhile
    take(engine.decode())
    joined, seconds = engine.end_prefill()
    assert [t.seq_id for t in joined] == ["4"] and seconds > 0
    take(joined)
    assert engine.background_ids == [] and sorted(engine.running_ids) == ["0", "2", "4"]
    while len(out["4"]) < 12:
        take(engine.decode())
    engine.release(engine.running_ids)
    assert out["4"] == alone[4][:12]  # its rows moved down into the gap, cache and all
    for i in (0, 1, 2, 3):
        assert out[str(i)] == alone[i][: len(out[str(i)])]
    assert out["5"] == []
    with pytest.raises(RuntimeError):
        engine.end_prefill()


def test_a_background_prefill_refuses_a_prefix_cache_hit(cached: Engine) -> None:
    prompt = encode(cached, PROMPTS[2] * 2)
    cached.prefill([NewSequence("a", prompt, GREEDY)])
    cached.decode()
    with pytest.raises(ValueError, match="prefix-cache hit"):
        cached.begin_prefill([NewSequence("b", prompt, GREEDY)])
    assert cached.background_ids == [] and cached.running_ids == ["a"]


def prefill_sizes(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record (rows, tokens per row) of every graph run from now on."""
    runs: list[tuple[int, int]] = []
    real = engine._run

    def spy(rows: slice, inputs: Any) -> np.ndarray:
        runs.append(inputs.input_ids.shape)
        return real(rows, inputs)

    monkeypatch.setattr(engine, "_run", spy)
    return runs


@pytest.mark.parametrize("copies", COPIES)
def test_prefix_cache_reuses_a_finished_turn_with_the_same_tokens(
    demo: tuple[Decoder, Engine], cached: Engine, copies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, reference = demo
    copy_with(cached, copies, monkeypatch)
    first = encode(cached, PROMPTS[2])
    answer = run_alone(cached, first, 20)  # leaves: its prompt is kept (the answer was not prefilled)
    assert answer == run_alone(reference, first, 20)
    follow_up = [*first, *answer, *encode(cached, "\n    def")]  # the next turn of a chat
    kept = len(first)
    assert cached.cached_tokens(follow_up) == kept
    runs = prefill_sizes(cached, monkeypatch)
    assert run_alone(cached, follow_up, 24) == run_alone(reference, follow_up, 24)
    assert runs[0] == (1, len(follow_up) - kept)  # only the part not kept was prefilled
    # The same prompt again: everything but its last two tokens is reused (a lone one would be computed as a
    # decode step is, not as in a prefill; the last one's logits choose).
    assert cached.cached_tokens(first) == len(first) - MIN_PIECE
    runs.clear()
    assert run_alone(cached, first, 20) == answer
    assert runs[0] == (1, MIN_PIECE)
    # A prompt that shares only a beginning reuses that much; one that shares less than the minimum, nothing.
    branch = [*first[:6], *encode(cached, " = []")]
    shared = 6 + shared_prefix(follow_up[6:], branch[6:])  # the kept row now holds the follow-up's prompt
    assert cached.cached_tokens(branch) == min(shared, len(branch) - MIN_PIECE)
    assert run_alone(cached, branch, 16) == run_alone(reference, branch, 16)
    other = next(t for t in range(2, cached.spec.vocab_size) if t != first[3])
    assert cached.cached_tokens([*first[:3], *[other] * 5]) == 0


def test_prefix_cache_hits_join_a_group_and_a_chunked_prefill(
    demo: tuple[Decoder, Engine], cached: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, reference = demo
    system = encode(cached, PROMPTS[5] * 3)
    run_alone(cached, system, 8)
    tails = [encode(cached, text) for text in PROMPTS[:3]]
    prompts = [tails[0], [*system, *tails[1]], tails[2]]  # a miss, a hit, a miss in one group
    alone = [run_alone(reference, p, 12) for p in prompts]
    runs = prefill_sizes(cached, monkeypatch)
    out = staggered(cached, prompts, 12, {0: [0, 1, 2]})
    assert out == dict(enumerate(alone))
    # One padded run for the misses, one single-row run for the hit's own tokens.
    assert runs[:2] == [(2, max(len(tails[0]), len(tails[2]))), (1, len(prompts[1]) - len(system))]
    # Chunked: the pieces cover only what the cache does not hold.
    long = [*system, *encode(cached, PROMPTS[3] * 2)]
    expected = run_alone(reference, long, 10)
    cached.prefill([NewSequence("r", tails[0], GREEDY)])
    assert cached.prefill([NewSequence("c", long, GREEDY)], chunk=4) == []
    assert cached.staged_done == len(system) + next_piece(len(system), 4, len(long))
    got: list[int] = []
    while cached.staged_id is not None:
        cached.decode()
        got += [t.token_id for t in cached.continue_prefill()]
    while len(got) < 10:
        got += [t.token_id for t in cached.decode() if t.seq_id == "c"]
    cached.release(cached.running_ids)
    assert got == expected


def test_prefix_cache_batch_invariance_with_a_shared_system_prompt(
    demo: tuple[Decoder, Engine], cached: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, reference = demo
    system = encode(cached, PROMPTS[0] + "):\n")
    rng = np.random.default_rng(3)
    prompts = [[*system, *encode(cached, PROMPTS[i % 6])[: 2 + int(rng.integers(0, 8))]] for i in range(8)]
    alone = {i: run_alone(reference, p, 16) for i, p in enumerate(prompts)}
    # In waves: later ones find earlier ones running or kept, and neighbours come and go around them.
    waves = {0: [0, 1], 2: [2], 9: [3, 4], 17: [5], 20: [6, 7]}
    reused: list[int] = []
    monkeypatch.setattr(cached._prefix, "use", reused.append)  # called once for every hit
    assert staggered(cached, prompts, 16, waves) == alone
    # 2, 3 and 4 arrive while others run and copy a running row (0..7); 5, 6 and 7 find kept rows (8..10).
    assert len(reused) == 6 and all(row < 8 for row in reused[:3]) and all(row >= 8 for row in reused[3:])


def test_prefix_cache_keeps_the_most_recent_and_nothing_a_failed_step_touched(
    cached: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [encode(cached, PROMPTS[i] * 2) for i in range(5)]
    for prompt in prompts[:4]:  # four finished sequences, three rows: the first is given up
        run_alone(cached, prompt, 4)
    assert [cached.cached_tokens(p) > 0 for p in prompts[:4]] == [False, True, True, True]
    run_alone(cached, prompts[1], 4)  # used again: now the most recent
    run_alone(cached, prompts[4], 4)
    assert [cached.cached_tokens(p) > 0 for p in prompts[1:5]] == [True, False, True, True]

    cached.prefill([NewSequence("x", prompts[0], GREEDY)])
    real = cached.session.run_with_iobinding

    def fail(binding: object) -> None:
        raise RuntimeError("injected")

    monkeypatch.setattr(cached.session, "run_with_iobinding", fail)
    with pytest.raises(RuntimeError, match="injected"):
        cached.decode()
    monkeypatch.setattr(cached.session, "run_with_iobinding", real)
    cached.release(["x"])
    assert cached.cached_tokens(prompts[0]) == 0  # its row may be half written: not kept
    run_alone(cached, prompts[0], 4)
    assert cached.cached_tokens(prompts[0]) == len(prompts[0]) - MIN_PIECE  # the next one is kept again


def test_the_scoring_benchmark_times_prefill_and_scoring_for_each_length(tiny_bundle: Path) -> None:
    from bench.scenarios.scoring import measure

    results = measure(["--bundle", str(tiny_bundle), "--lengths", "4", "16", "--repeats", "2"])
    assert list(results) == [4, 16]
    assert all(r["prefill_s"] > 0 and r["scoring_s"] > 0 for r in results.values())


def test_the_beside_benchmark_runs_both_ways(tiny_bundle: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.scenarios.beside import main

    argv = ["--bundle", str(tiny_bundle), "--rows", "3", "--prompt", "5", "--every", "3", "--steps", "12"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [x.split(":")[0] for x in lines] == ["round 1", "round 2", "round 3"]
    assert all(" between " in x and " | beside " in x and "tok/s" in x for x in lines)


def test_the_scorer_runs_on_the_serving_providers_but_tensorrt() -> None:
    serving = SessionConfig(threads=3, tensorrt_options={"trt_fp16_enable": "True"})
    providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]
    scoring = scoring_session(serving, providers)
    assert scoring.providers == ("CUDAExecutionProvider", "CPUExecutionProvider")
    assert scoring.threads == 3 and not scoring.tensorrt_options


def test_a_prompt_can_start_from_a_sequence_still_running(
    demo: tuple[Decoder, Engine], cached: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, reference = demo
    system = encode(cached, PROMPTS[4] * 3)
    a, b = [*system, *encode(cached, "x")], [*system, *encode(cached, " y = 1")]
    alone = {"a": run_alone(reference, a, 10), "b": run_alone(reference, b, 10)}
    out = {"a": [cached.prefill([NewSequence("a", a, GREEDY)])[0].token_id], "b": []}
    out["a"].append(cached.decode()[0].token_id)
    shared = cached.cached_tokens(b)
    assert shared >= len(system)  # from a's row: nothing is kept yet, a still runs
    runs = prefill_sizes(cached, monkeypatch)
    out["b"].append(cached.prefill([NewSequence("b", b, GREEDY)])[0].token_id)
    assert runs == [(1, len(b) - shared)]
    while min(len(tokens) for tokens in out.values()) < 10:
        for t in cached.decode():
            out[t.seq_id].append(t.token_id)
    cached.release(["a", "b"])
    assert {k: v[:10] for k, v in out.items()} == alone  # a is undisturbed, b as if prefilled whole
