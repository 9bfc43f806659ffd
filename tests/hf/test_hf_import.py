"""Hugging Face import: tiny random transformers models of every family, saved and read back.

For each family (tests/support/hf_models.py builds the models; nothing is downloaded):
(a) our PyTorch decoder's logits equal transformers' within 1e-4, on full prompts and on KV-cache decode
    steps of a left-padded batch fed transformers' greedy tokens;
(b) the in-place ONNX serving graph, run with bound KV buffers as the engine runs it, makes the same 20
    greedy tokens as transformers' generate, its logits within 1e-4.
Then the checkpoint forms (sharded, bf16, transformers 4 config.json), the tokenizer files, and every bad
input's one-line error.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hf_models import (
    GPT_OSS_YARN,
    PROMPTS,
    WORDS,
    Run,
    build,
    gpt2_config,
    gpt_oss_config,
    hf_greedy_batch,
    llama_config,
    max_diff,
    mistral_config,
    mixtral_config,
    olmoe_config,
    qwen2_config,
    qwen3_config,
    qwen3_moe_config,
    rewrite_config,
    run_inplace,
    save_tokenizer,
    to_transformers4_form,
    torch_forced,
    train_bpe,
)
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from export.hf_import import (
    SUPPORTED_ARCHITECTURES,
    HFImportError,
    decoder_config,
    import_checkpoint,
    load_tokenizer,
)
from export.model import Decoder, DecoderConfig, rope_frequencies
from export.moe import ExpertsConfig
from export.onnx_inplace import build_inplace_graph

TOL = 1e-4
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # wavelengths of head_dim 16, theta 5000: 6 to 13000
    "rope_theta": 5000.0,
}
CASES: dict[str, Callable[[], PretrainedConfig]] = {
    "llama-gqa2": lambda: llama_config(),
    "llama-llama3-rope-biases-tied": lambda: llama_config(
        rope_parameters=LLAMA3_ROPE, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
    ),
    "llama-linear-rope-kv1": lambda: llama_config(
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}, num_key_value_heads=1
    ),
    "mistral-window8": lambda: mistral_config(),
    "qwen2-biases-tied": lambda: qwen2_config(),
    "qwen2-every-layer-sliding": lambda: qwen2_config(
        use_sliding_window=True, sliding_window=8, max_window_layers=0
    ),
    "qwen3-qk-norm-head-dim32-kv1": lambda: qwen3_config(),
    "gpt2": lambda: gpt2_config(),
    "qwen3-moe-norm-topk-dense-layer1": lambda: qwen3_moe_config(mlp_only_layers=[1]),
    "olmoe-whole-qk-norm": lambda: olmoe_config(),
    "mixtral-window8": lambda: mixtral_config(sliding_window=8),
    "gpt-oss-yarn-sinks-window8": lambda: gpt_oss_config(
        layer_types=["sliding_attention", "full_attention"], sliding_window=8
    ),
}


def _imported(config: PretrainedConfig, folder: Path, **build_args: Any) -> tuple[PreTrainedModel, Decoder]:
    hf = build(config, folder, **build_args)
    return hf, import_checkpoint(folder).model


@torch.no_grad()
def _full_forward_diff(hf: PreTrainedModel, model: Decoder) -> float:
    diffs = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        ours, _ = model(ids, torch.ones_like(ids), torch.arange(len(p))[None])
        diffs.append(float((hf(ids).logits - ours).abs().max()))
    return max(diffs)


def _assert_same_run(ref: Run, got: Run, what: str) -> None:
    assert np.array_equal(got.tokens, ref.tokens), f"{what}: greedy tokens differ"
    diff = max_diff(ref.logits, got.logits)
    assert diff <= TOL, f"{what}: max |logits diff| {diff:.2e}"


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[PreTrainedModel, Decoder, Run]]:
    """Each case's transformers model, our import of it, and transformers' greedy run (built once)."""
    out = {}
    for name, make in CASES.items():
        hf, model = _imported(make(), tmp_path_factory.mktemp(name))
        out[name] = (hf, model, hf_greedy_batch(hf, PROMPTS))
    return out


@pytest.mark.parametrize("case", CASES)
def test_pytorch_decoder_matches_transformers(
    case: str, generated: dict[str, tuple[PreTrainedModel, Decoder, Run]]
) -> None:
    hf, model, ref = generated[case]
    assert _full_forward_diff(hf, model) <= TOL
    # Left-padded batch, prefill then KV-cache decode steps fed transformers' tokens.
    _assert_same_run(ref, torch_forced(model, PROMPTS, ref.tokens), "pytorch")


@pytest.mark.parametrize("case", CASES)
def test_inplace_graph_matches_transformers_generate(
    case: str, generated: dict[str, tuple[PreTrainedModel, Decoder, Run]]
) -> None:
    _, model, ref = generated[case]
    _assert_same_run(ref, run_inplace(build_inplace_graph(model), model.cfg, PROMPTS), "in-place graph")


def test_imported_configs_have_the_families_blocks(
    generated: dict[str, tuple[PreTrainedModel, Decoder, Run]],
) -> None:
    cfg = {name: model.cfg for name, (_, model, _) in generated.items()}
    llama = cfg["llama-gqa2"]
    assert (llama.norm, llama.activation, llama.positions, llama.kv_heads) == ("rms", "swiglu", "rotary", 2)
    assert not (llama.qkv_bias or llama.out_bias or llama.mlp_bias or llama.tie_embeddings)
    scaled = cfg["llama-llama3-rope-biases-tied"]
    assert (scaled.rope_scaling, scaled.rope_factor, scaled.rope_original_context) == ("llama3", 8.0, 32)
    assert scaled.qkv_bias and scaled.out_bias and scaled.mlp_bias and scaled.tie_embeddings
    assert (cfg["llama-linear-rope-kv1"].rope_scaling, cfg["llama-linear-rope-kv1"].kv_heads) == ("linear", 1)
    assert cfg["mistral-window8"].sliding_window == cfg["qwen2-every-layer-sliding"].sliding_window == 8
    assert cfg["qwen2-biases-tied"].sliding_window == 0
    qwen2 = cfg["qwen2-biases-tied"]
    assert qwen2.qkv_bias and not qwen2.out_bias and qwen2.tie_embeddings
    qwen3 = cfg["qwen3-qk-norm-head-dim32-kv1"]
    assert qwen3.qk_norm and (qwen3.head_dim, qwen3.q_dim, qwen3.d_model) == (32, 128, 64)
    gpt2 = cfg["gpt2"]
    assert (gpt2.norm, gpt2.activation, gpt2.positions) == ("layer", "gelu_tanh", "learned")
    qwen3_moe = cfg["qwen3-moe-norm-topk-dense-layer1"]
    assert qwen3_moe.experts == ExpertsConfig(8, 2, 32, "softmax_topk_norm", (1,))
    assert qwen3_moe.qk_norm and qwen3_moe.qk_norm_scope == "head" and qwen3_moe.d_ff == 96
    olmoe = cfg["olmoe-whole-qk-norm"]
    assert olmoe.experts == ExpertsConfig(8, 2, 32, "softmax_topk") and olmoe.qk_norm_scope == "projection"
    mixtral = cfg["mixtral-window8"]
    assert mixtral.experts == ExpertsConfig(8, 2, 32, "softmax_topk_norm") and mixtral.sliding_window == 8
    assert DecoderConfig.from_dict(json.loads(json.dumps(qwen3_moe.to_dict()))) == qwen3_moe
    gpt_oss = cfg["gpt-oss-yarn-sinks-window8"]
    assert gpt_oss.experts == ExpertsConfig(
        8, 2, 32, "topk_softmax", activation="swiglu_clamped", swiglu_limit=1.5, bias=True
    )
    assert gpt_oss.attention_sinks and gpt_oss.qkv_bias and gpt_oss.out_bias
    assert [layer.window for layer in gpt_oss.layer_attention] == [8, 0]
    assert (gpt_oss.rope_scaling, gpt_oss.rope_factor, gpt_oss.rope_original_context) == ("yarn", 4.0, 32)
    # The KV cache of a grouped-query model holds the key/value heads only.
    _, model, _ = generated["qwen3-qk-norm-head-dim32-kv1"]
    ids = torch.tensor([PROMPTS[0]])
    _, presents = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
    assert presents[0][0].shape == (1, 1, ids.shape[1], 32)


def test_the_sliding_window_and_rope_scaling_are_what_the_tokens_depend_on(
    generated: dict[str, tuple[PreTrainedModel, Decoder, Run]],
) -> None:
    """The controls: without the window, or without the llama3 scaling, the same weights give other tokens,
    so the matches above do test them (the sequences run well past the window of 8)."""
    for case, plain in (
        ("mistral-window8", {"sliding_window": 0}),
        ("llama-llama3-rope-biases-tied", {"rope_scaling": "none"}),
    ):
        _, model, ref = generated[case]
        other = Decoder(DecoderConfig(**{**model.cfg.to_dict(), **plain})).eval()
        other.load_state_dict(model.state_dict())
        assert not np.array_equal(torch_forced(other, PROMPTS, ref.tokens).tokens, ref.tokens), case


def test_the_experts_routing_is_what_the_tokens_depend_on(
    generated: dict[str, tuple[PreTrainedModel, Decoder, Run]],
) -> None:
    """The controls of the mixtures of experts: the top-k weights normalized the other way, one expert fewer
    per token, or gpt-oss's SwiGLU unclamped give other tokens; so do gpt-oss without its attention sinks or
    without YaRN."""
    for case, change in (
        ("qwen3-moe-norm-topk-dense-layer1", {"routing": "softmax_topk"}),
        ("olmoe-whole-qk-norm", {"routing": "softmax_topk_norm"}),
        ("mixtral-window8", {"top_k": 1}),
        ("gpt-oss-yarn-sinks-window8", {"swiglu_limit": 100.0}),
    ):
        _, model, ref = generated[case]
        assert model.cfg.experts is not None
        experts = replace(model.cfg.experts, **change)
        other = Decoder(replace(model.cfg, experts=experts)).eval()
        other.load_state_dict(model.state_dict())
        assert not np.array_equal(torch_forced(other, PROMPTS, ref.tokens).tokens, ref.tokens), case
    _, model, ref = generated["gpt-oss-yarn-sinks-window8"]
    for plain in ({"attention_sinks": False}, {"rope_scaling": "none", "rope_attention_factor": 1.0}):
        other = Decoder(replace(model.cfg, **plain)).eval()
        other.load_state_dict(model.state_dict(), strict=False)  # without sinks: no sinks to load
        assert not np.array_equal(torch_forced(other, PROMPTS, ref.tokens).tokens, ref.tokens), plain


@pytest.mark.parametrize(
    ("rope", "fields"),
    [
        (LLAMA3_ROPE, {"rope_scaling": "llama3", "rope_factor": 8.0, "rope_original_context": 32}),
        (
            {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
            {"rope_scaling": "linear", "rope_factor": 4.0},
        ),
        (
            GPT_OSS_YARN,
            {
                "rope_scaling": "yarn",
                "rope_factor": 4.0,
                "rope_original_context": 32,
                "rope_truncate": False,
                "rope_attention_factor": 0.1 * math.log(4.0) + 1,
            },
        ),
        (
            {**GPT_OSS_YARN, "truncate": True, "beta_fast": 16.0, "beta_slow": 2.0},
            {
                "rope_scaling": "yarn",
                "rope_factor": 4.0,
                "rope_original_context": 32,
                "rope_beta_fast": 16.0,
                "rope_beta_slow": 2.0,
                "rope_attention_factor": 0.1 * math.log(4.0) + 1,
            },
        ),
    ],
    ids=["llama3", "linear", "yarn", "yarn-truncated"],
)
def test_rope_frequencies_equal_transformers(rope: dict[str, Any], fields: dict[str, Any]) -> None:
    hf_config = llama_config(rope_parameters=dict(rope))
    hf_inv, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config, "cpu")
    cfg = DecoderConfig(
        vocab_size=8,
        context_length=128,
        d_model=64,
        n_layers=1,
        n_heads=4,
        d_ff=8,
        positions="rotary",
        rope_theta=5000.0,
        **fields,
    )
    assert scaling == pytest.approx(cfg.rope_attention_factor, rel=1e-12)
    assert torch.allclose(rope_frequencies(cfg), hf_inv, rtol=1e-6, atol=0)


# -- checkpoint forms --------------------------------------------------------------------------------------


def test_sharded_bf16_checkpoint(tmp_path: Path) -> None:
    hf, model = _imported(
        llama_config(rope_parameters=LLAMA3_ROPE), tmp_path, dtype=torch.bfloat16, max_shard_size="40KB"
    )
    shards = sorted(p.name for p in tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "model.safetensors.index.json").is_file()
    assert {t.dtype for t in load_file(str(tmp_path / shards[0])).values()} == {torch.bfloat16}
    assert import_checkpoint(tmp_path).source_dtype == "bfloat16"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    ref = hf_greedy_batch(hf, PROMPTS)
    _assert_same_run(ref, torch_forced(model, PROMPTS, ref.tokens), "pytorch, bf16 shards")


@pytest.mark.parametrize(
    "make",
    [
        lambda: llama_config(rope_parameters=LLAMA3_ROPE),
        lambda: llama_config(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0}),
        lambda: mistral_config(),
        lambda: gpt2_config(),
    ],
    ids=["llama3", "linear", "mistral", "gpt2"],
)
def test_transformers4_config_form_reads_as_the_transformers5_form(
    make: Callable[[], PretrainedConfig], tmp_path: Path
) -> None:
    build(make(), tmp_path)
    five = decoder_config(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in written or written["model_type"] == "gpt2"
    rewrite_config(tmp_path, to_transformers4_form)
    four = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in four and "torch_dtype" in four
    assert decoder_config(tmp_path) == five


def test_transformers4_rope_scaling_with_the_old_type_key(tmp_path: Path) -> None:
    build(llama_config(), tmp_path)
    rewrite_config(
        tmp_path,
        lambda c: {**to_transformers4_form(c), "rope_scaling": {"type": "linear", "factor": 2.0}},
    )
    cfg = decoder_config(tmp_path)[1]
    assert (cfg.rope_scaling, cfg.rope_factor, cfg.rope_theta) == ("linear", 2.0, 5000.0)


def test_gpt2_checkpoint_without_the_transformer_prefix(tmp_path: Path) -> None:
    """The original GPT-2 files name tensors without "transformer." and carry the causal-mask buffers (and
    some tied checkpoints a copy of the embedding as lm_head.weight)."""
    hf = build(gpt2_config(), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    renamed = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    renamed |= {f"h.{i}.attn.bias": torch.ones(1, 1, 4, 4) for i in range(2)}
    renamed |= {"h.0.attn.masked_bias": torch.tensor(-1e4), "lm_head.weight": renamed["wte.weight"].clone()}
    save_file(renamed, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = import_checkpoint(tmp_path).model
    assert _full_forward_diff(hf, model) <= TOL


# -- tokenizer ---------------------------------------------------------------------------------------------

TEXTS = ("the of and 12", "is for on that with", " 7 be")


@pytest.fixture(scope="module")
def bpe() -> Any:
    return train_bpe()


def test_tokenizer_as_transformers_applies_it(bpe: Any, tmp_path: Path) -> None:
    build(llama_config(), tmp_path)
    template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    save_tokenizer(bpe, tmp_path, chat_template=template, add_bos_token=True)
    # transformers 5 writes the BOS into tokenizer.json's post-processor, not into tokenizer_config.json.
    assert "add_bos_token" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3], "bos_token_id": 1}))
    tok = import_checkpoint(tmp_path).tokenizer
    assert tok is not None
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert tok.tokenizer.encode(text).ids == hf(text).input_ids
    assert tok.adds_bos and tok.bos_token_id == 1
    assert tok.eos_token_ids == (2, 3)  # generation_config.json's list, as in Llama 3
    assert tok.pad_token_id == 3
    assert tok.chat_template == template  # from chat_template.jinja
    assert tok.source.name == "tokenizer.json"


@pytest.mark.parametrize("bos_in_tokenizer_json", [True, False])
def test_tokenizer_json_decides_bos_not_tokenizer_config(
    bpe: Any, tmp_path: Path, bos_in_tokenizer_json: bool
) -> None:
    """transformers 4 checkpoints say add_bos_token in tokenizer_config.json (Llama 2); transformers 5 drops
    it when there is a tokenizer.json, whose post-processor alone decides."""
    build(llama_config(), tmp_path)
    save_tokenizer(bpe, tmp_path, add_bos_token=bos_in_tokenizer_json)
    config_path = tmp_path / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config |= {"add_bos_token": not bos_in_tokenizer_json, "chat_template": "{{ messages }}"}
    config_path.write_text(json.dumps(tokenizer_config))
    (tmp_path / "generation_config.json").unlink()
    tok = load_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in TEXTS:
        assert tok.tokenizer.encode(text).ids == hf(text).input_ids
    assert tok.adds_bos is bos_in_tokenizer_json
    assert tok.eos_token_ids == (2,)  # config.json's, without generation_config.json
    assert tok.chat_template == "{{ messages }}"  # from tokenizer_config.json


def test_sentencepiece_only_folder(tmp_path: Path) -> None:
    build(llama_config(), tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\xff" * 16)
    try:
        import sentencepiece  # noqa: F401
    except ImportError:
        with pytest.raises(HFImportError, match=r"tokenizer\.model: .*needs 'sentencepiece'"):
            import_checkpoint(tmp_path)
    else:  # a garbage model: transformers' converter fails, and says so on one line
        with pytest.raises(HFImportError, match=r"tokenizer\.model: transformers could not convert it"):
            import_checkpoint(tmp_path)


def test_sentencepiece_tokenizer_is_converted_as_transformers_does(tmp_path: Path) -> None:
    """A Llama 2 style folder with only tokenizer.model (skipped where sentencepiece is not installed)."""
    spm = pytest.importorskip("sentencepiece")
    build(llama_config(), tmp_path)
    model = io.BytesIO()
    lines = [" ".join(words) for words in np.random.default_rng(0).choice(WORDS, size=(3000, 8))]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=300,
        model_type="bpe",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        byte_fallback=True,
        minloglevel=2,
    )
    (tmp_path / "tokenizer.model").write_bytes(model.getvalue())
    tokenizer_config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "bos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"eos_token": "</s>"}))
    tok = load_tokenizer(tmp_path)
    hf = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in (*TEXTS, "héllo wörld"):  # byte fallback for the accents
        assert tok.tokenizer.encode(text).ids == hf(text).input_ids
    assert tok.adds_bos and tok.source.name == "tokenizer.model"


# -- errors ------------------------------------------------------------------------------------------------


def _error(folder: Path) -> str:
    with pytest.raises(HFImportError) as info:
        import_checkpoint(folder)
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.fixture
def llama_folder(tmp_path: Path) -> Path:
    build(llama_config(), tmp_path)
    return tmp_path


def test_unsupported_architecture(llama_folder: Path) -> None:
    rewrite_config(llama_folder, lambda c: {**c, "architectures": ["FalconForCausalLM"]})
    message = _error(llama_folder)
    assert "config.json" in message and "'FalconForCausalLM' is not supported" in message
    assert all(name in message for name in SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su"])
def test_sequence_length_dependent_rope_is_refused(llama_folder: Path, rope_type: str) -> None:
    rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 5000.0}
    rewrite_config(llama_folder, lambda c: {**c, "rope_parameters": rope})
    message = _error(llama_folder)
    assert f"RoPE type {rope_type!r} is not supported" in message and "sequence length" in message


def test_missing_and_bin_only_weights(llama_folder: Path) -> None:
    (llama_folder / "model.safetensors").unlink()
    assert "model.safetensors: not found" in _error(llama_folder)
    (llama_folder / "pytorch_model.bin").write_bytes(b"")
    assert "convert them to safetensors" in _error(llama_folder)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(llama_folder: Path, damage: str) -> None:
    path = llama_folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x07" * 64)
    message = _error(llama_folder)
    assert "model.safetensors: not a readable safetensors file" in message and "download it again" in message


def test_missing_tensor(llama_folder: Path) -> None:
    path = llama_folder / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    message = _error(llama_folder)
    assert "lack 'model.layers.1.mlp.up_proj.weight'" in message and "config does not match" in message


def test_unexpected_tensor(llama_folder: Path) -> None:
    path = llama_folder / "model.safetensors"
    tensors = load_file(str(path)) | {"model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    save_file(tensors, str(path), metadata={"format": "pt"})
    assert "unexpected tensor 'model.layers.0.self_attn.q_norm.weight'" in _error(llama_folder)


def test_misshaped_tensor(llama_folder: Path) -> None:
    rewrite_config(llama_folder, lambda c: {**c, "intermediate_size": 80})
    message = _error(llama_folder)
    assert (
        "model.safetensors: model.layers.0.mlp.gate_proj.weight + model.layers.0.mlp.up_proj.weight"
        in message
    )
    assert "gives shape [192, 64] where config.json implies [160, 64]" in message


def test_missing_shard(tmp_path: Path) -> None:
    build(llama_config(), tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    message = _error(tmp_path)
    assert f"{shard.name}: shard listed in model.safetensors.index.json is missing" in message


def test_missing_or_broken_config(llama_folder: Path) -> None:
    config = llama_folder / "config.json"
    config.write_text("{not json")
    assert "config.json: not valid JSON" in _error(llama_folder)
    config.unlink()
    assert "config.json: file not found" in _error(llama_folder)
    assert "not a directory" in _error(llama_folder / "nowhere")


def test_unsupported_settings_are_refused(llama_folder: Path) -> None:
    rewrite_config(llama_folder, lambda c: {**c, "hidden_act": "gelu"})
    assert "hidden_act 'gelu' is not supported" in _error(llama_folder)
    rewrite_config(llama_folder, lambda c: {**c, "hidden_act": "silu", "num_key_value_heads": 3})
    assert "not a valid LlamaForCausalLM configuration: n_kv_heads (3) must divide n_heads (4)" in _error(
        llama_folder
    )


def test_layers_mixing_full_and_sliding_attention_are_refused(tmp_path: Path) -> None:
    build(qwen2_config(use_sliding_window=True, sliding_window=8, max_window_layers=1), tmp_path)
    assert "layers mixing full and sliding-window attention" in _error(tmp_path)


def test_tokenizer_with_no_vocabulary_is_refused(tmp_path: Path) -> None:
    """A tokenizer.json holding only its special tokens (what a failed SentencePiece conversion writes)."""
    from tokenizers import Tokenizer
    from tokenizers.models import BPE

    build(llama_config(), tmp_path)
    empty = Tokenizer(BPE(vocab={"<unk>": 0, "<s>": 1, "</s>": 2}, merges=[], byte_fallback=True))
    empty.add_special_tokens(["<unk>", "<s>", "</s>"])
    empty.save(str(tmp_path / "tokenizer.json"))
    message = _error(tmp_path)
    assert "tokenizer.json: encodes text to special tokens only (its vocabulary has 3 entries)" in message
    assert "download it again" in message and "tokenizer.model" not in message
    (tmp_path / "tokenizer.model").write_bytes(b"")  # a SentencePiece file beside it: say to convert that
    assert "or delete it so that tokenizer.model is converted" in _error(tmp_path)


def test_tokenizer_larger_than_the_model(bpe: Any, tmp_path: Path) -> None:
    build(llama_config(vocab_size=200), tmp_path)
    save_tokenizer(bpe, tmp_path)
    (tmp_path / "generation_config.json").unlink()
    assert "tokenizer.json: the tokenizer has 300 ids but the model's vocab_size is 200" in _error(tmp_path)
