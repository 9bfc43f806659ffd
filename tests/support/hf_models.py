"""Tiny random Hugging Face checkpoints built in the test (no downloads), and the loops that run them.

Each family's model is built from a config object with a fixed seed and initializer_range 0.2 (0.02 gives
near-flat logits, so greedy would flip on rounding noise), its norm weights, biases and attention sinks moved
away from 1 and 0 (a mapping that dropped them would still pass otherwise), and saved with `save_pretrained`.

`run_inplace` drives the in-place serving graph the way serve/engine.py does: one [B, Hkv, capacity, Dh]
OrtValue per layer and kind, bound as both the past input and the present output; right-padded prefill,
then one token per row per decode step.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SiglipVisionConfig,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from export.model import Decoder, DecoderConfig
from serve.engine.lora import token_slots

VOCAB = 320
CONTEXT = 128
STEPS = 20  # greedy tokens compared
INIT_RANGE = 0.2
SEED = 0
# Prompts of different lengths (token ids), so the batch is padded.
PROMPTS = ((5, 17, 42, 99, 3, 250, 7), (11, 300, 64), tuple(range(20, 48)))

_COMMON = {
    "vocab_size": VOCAB,
    "max_position_embeddings": CONTEXT,
    "initializer_range": INIT_RANGE,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_LLAMA_SHAPE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def llama_config(**changes: Any) -> LlamaConfig:
    return LlamaConfig(**{**_COMMON, **_LLAMA_SHAPE, "rope_theta": 5000.0, **changes})


def mistral_config(**changes: Any) -> MistralConfig:
    return MistralConfig(**{**_COMMON, **_LLAMA_SHAPE, "sliding_window": 8, **changes})


def qwen2_config(**changes: Any) -> Qwen2Config:
    return Qwen2Config(**{**_COMMON, **_LLAMA_SHAPE, "tie_word_embeddings": True, **changes})


def qwen3_config(**changes: Any) -> Qwen3Config:
    # head_dim 32 with 4 heads: q is 128 wide on a hidden size of 64.
    return Qwen3Config(**{**_COMMON, **_LLAMA_SHAPE, "head_dim": 32, "num_key_value_heads": 1, **changes})


# Mixtures of experts: 8 experts of width 32, top 2 (Qwen3-MoE: a dense layer too, of width 96).
_MOE_SHAPE = {**_LLAMA_SHAPE, "num_experts_per_tok": 2, "intermediate_size": 32}


def qwen3_moe_config(**changes: Any) -> Qwen3MoeConfig:
    shape = {**_MOE_SHAPE, "intermediate_size": 96, "moe_intermediate_size": 32, "num_experts": 8}
    return Qwen3MoeConfig(**{**_COMMON, **shape, "head_dim": 32, "norm_topk_prob": True, **changes})


def olmoe_config(**changes: Any) -> OlmoeConfig:
    return OlmoeConfig(**{**_COMMON, **_MOE_SHAPE, "num_experts": 8, "pad_token_id": 0, **changes})


def mixtral_config(**changes: Any) -> MixtralConfig:
    return MixtralConfig(**{**_COMMON, **_MOE_SHAPE, "num_local_experts": 8, "rope_theta": 5000.0, **changes})


# gpt-oss: YaRN over an original context of 32 (factor 4), head_dim 16; every layer full attention unless
# the test gives layer_types (its checkpoints alternate sliding and full layers).
GPT_OSS_YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "rope_theta": 5000.0,
}


def gpt_oss_config(**changes: Any) -> GptOssConfig:
    shape = {**_MOE_SHAPE, "num_local_experts": 8, "head_dim": 16, "swiglu_limit": 1.5}
    full = {"layer_types": ["full_attention"] * 2, "rope_parameters": dict(GPT_OSS_YARN)}
    return GptOssConfig(**{**_COMMON, **shape, **full, **changes})


def gpt2_config(**changes: Any) -> GPT2Config:
    base = {
        "vocab_size": VOCAB,
        "n_positions": CONTEXT,
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "initializer_range": INIT_RANGE,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return GPT2Config(**{**base, **changes})


# The dense families of three layers: Gemma's windows of 8 and its mix of sliding and global layers, and
# SmolLM3's layers without rotary, take effect well within the prompts and the 20 greedy steps.
_DENSE_SHAPE = {**_LLAMA_SHAPE, "num_hidden_layers": 3}
# Gemma 3: two local layers (their own RoPE base) then a global one (linear scaling), in transformers 5's
# form of the per-layer-type RoPE.
GEMMA3_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
}


# Both Gemmas: heads of 16, a window of 8, query_pre_attn_scalar other than head_dim.
_GEMMA = {**_COMMON, **_DENSE_SHAPE, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24}


def gemma3_config(**changes: Any) -> Gemma3TextConfig:
    layer_types = ["sliding_attention", "sliding_attention", "full_attention"]
    return Gemma3TextConfig(
        **{**_GEMMA, "layer_types": layer_types, "rope_parameters": GEMMA3_ROPE, "pad_token_id": 0, **changes}
    )


def gemma3_vlm_config(tie_word_embeddings: bool = True, **text_changes: Any) -> Gemma3Config:
    """Gemma 3's multimodal form around gemma3_config's text stack: a SigLIP tower of one layer (two 14-pixel
    patches a side, pooled to four image tokens), the image token ids past the text vocabulary."""
    text = gemma3_config(tie_word_embeddings=tie_word_embeddings, **text_changes)
    vision = SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    return Gemma3Config(
        text_config=text.to_dict(),
        vision_config=vision.to_dict(),
        mm_tokens_per_image=4,
        image_token_index=VOCAB,
        boi_token_index=VOCAB + 1,
        eoi_token_index=VOCAB + 2,
        tie_word_embeddings=tie_word_embeddings,
    )


def gemma2_config(**changes: Any) -> Gemma2Config:
    # Soft caps near the scores' and logits' size, so that capping changes them.
    caps = {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0}
    return Gemma2Config(**{**_GEMMA, **caps, "pad_token_id": 0, **changes})


def phi3_config(**changes: Any) -> Phi3Config:
    # Two heads of 32, RoPE on the first 16 features of each (ONNX Runtime rotates multiples of 16).
    return Phi3Config(
        **{
            **_COMMON,
            **_DENSE_SHAPE,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "partial_rotary_factor": 0.5,
            "pad_token_id": 0,
            **changes,
        }
    )


# Phi-3.5 / Phi-4-mini's longrope on phi3_config's 16 rotated features: 8 short and 8 long factors, the two
# sets different and none of them 1 (the original context is the config's original_max_position_embeddings).
PHI3_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "short_factor": [1.0 + 0.3 * i for i in range(8)],
    "long_factor": [2.0 + i for i in range(8)],
}


def smollm3_config(**changes: Any) -> SmolLM3Config:
    return SmolLM3Config(
        **{**_COMMON, **_DENSE_SHAPE, "no_rope_layer_interval": 2, "pad_token_id": 0, **changes}
    )


def granite_config(**changes: Any) -> GraniteConfig:
    multipliers = {"embedding_multiplier": 3.0, "attention_multiplier": 0.1, "residual_multiplier": 0.5}
    return GraniteConfig(**{**_COMMON, **_DENSE_SHAPE, **multipliers, "logits_scaling": 2.0, **changes})


def olmo2_config(**changes: Any) -> Olmo2Config:
    return Olmo2Config(**{**_COMMON, **_DENSE_SHAPE, "pad_token_id": 0, **changes})


MODEL_CLASSES: dict[type[PretrainedConfig], type[PreTrainedModel]] = {
    LlamaConfig: LlamaForCausalLM,
    MistralConfig: MistralForCausalLM,
    Qwen2Config: Qwen2ForCausalLM,
    Qwen3Config: Qwen3ForCausalLM,
    GPT2Config: GPT2LMHeadModel,
    Gemma3TextConfig: Gemma3ForCausalLM,
    Gemma3Config: Gemma3ForConditionalGeneration,
    Gemma2Config: Gemma2ForCausalLM,
    Phi3Config: Phi3ForCausalLM,
    SmolLM3Config: SmolLM3ForCausalLM,
    GraniteConfig: GraniteForCausalLM,
    Olmo2Config: Olmo2ForCausalLM,
    Qwen3MoeConfig: Qwen3MoeForCausalLM,
    OlmoeConfig: OlmoeForCausalLM,
    MixtralConfig: MixtralForCausalLM,
    GptOssConfig: GptOssForCausalLM,
}


@torch.no_grad()
def perturb_norms_and_biases(model: torch.nn.Module, seed: int = SEED) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith((".bias", "_bias", ".sinks")):  # gpt-oss: its experts' biases, its sinks
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        elif p.ndim == 1 and ("norm" in name or "ln_" in name):
            p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=gen))


def build(
    config: PretrainedConfig,
    folder: Path,
    seed: int = SEED,
    dtype: torch.dtype | None = None,
    max_shard_size: str | None = None,
) -> PreTrainedModel:
    """A random model of `config` saved in `folder` (in `dtype`, shards of `max_shard_size`), returned in
    fp32 eval mode with exactly the saved weights (of a bf16 checkpoint: the bf16 weights upcast)."""
    torch.manual_seed(seed)
    model = MODEL_CLASSES[type(config)](config).eval()
    perturb_norms_and_biases(model, seed)
    if dtype is not None:
        model = model.to(dtype)
    kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    if dtype is None:
        return model
    # Loaded back in fp32 as a user would: casting the model in memory would also round its RoPE frequency
    # buffer to bf16 (transformers recomputes it on loading).
    return type(model).from_pretrained(folder, dtype=torch.float32).eval()


def rewrite_config(folder: Path, edit: Any) -> None:
    """Apply `edit(dict) -> dict` to folder/config.json."""
    path = folder / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text())), indent=2))


def to_transformers4_form(config: dict[str, Any]) -> dict[str, Any]:
    """config.json as transformers 4 wrote it: rope_theta and rope_scaling at the top level, torch_dtype."""
    out = dict(config)
    rope = dict(out.pop("rope_parameters", None) or {})
    if "rope_theta" in rope:
        out["rope_theta"] = rope.pop("rope_theta")
    kind = rope.get("rope_type", "default")
    out["rope_scaling"] = None if kind == "default" else rope
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    return out


def gemma3_transformers4_form(config: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's config.json as transformers 4 wrote it: rope_theta and rope_scaling of the global layers
    and rope_local_base_freq at the top level, torch_dtype."""
    out = dict(config)
    rope = out.pop("rope_parameters")
    full = dict(rope["full_attention"])
    out["rope_theta"] = full.pop("rope_theta")
    out["rope_scaling"] = full
    out["rope_local_base_freq"] = rope["sliding_attention"]["rope_theta"]
    if "dtype" in out:  # a multimodal config's text_config has none of its own
        out["torch_dtype"] = out.pop("dtype")
    return out


# -- tokenizers --------------------------------------------------------------------------------------------

WORDS = (
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "this",
    "be",
    "are",
    "or",
    "an",
    "it",
    "not",
    "which",
)


# Qwen2's pre-tokenizer (one digit a piece), which transformers 5's Qwen2Tokenizer rebuilds whatever
# tokenizer.json says; Qwen's own tokenizer.json has it too.
QWEN_PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def train_bpe(
    vocab_size: int = 300, specials: Sequence[str] = ("<unk>", "<s>", "</s>", "<pad>"), qwen: bool = False
) -> Tokenizer:
    """A byte-level BPE trained on a few thousand synthetic lines, the special tokens first (ids 0, 1...);
    `qwen`: with Qwen2's normalizer and pre-tokenizer."""
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(WORDS, size=8)) + f" {i}" for i in range(3000)]
    tok = Tokenizer(models.BPE(unk_token="<unk>" if "<unk>" in specials else None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if qwen:
        tok.normalizer = normalizers.NFC()
        split = pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(lines, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, folder: Path, **kwargs: Any) -> PreTrainedTokenizerFast:
    """Save as transformers does: tokenizer.json + tokenizer_config.json (+ chat_template.jinja)."""
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        **kwargs,
    )
    hf.save_pretrained(folder)
    return hf


@dataclass(frozen=True)
class Family:
    """A family's tiny model with a tokenizer shaped like its own: its special tokens (ids 0, 1, ...), whether
    encoding a text adds BOS, and a chat template in its style."""

    name: str
    config: Any  # (**changes) -> PretrainedConfig, with bos/eos ids of `specials`
    specials: tuple[str, ...]
    bos: str | None
    eos: str
    pad: str | None
    unk: str | None
    adds_bos: bool
    chat_template: str

    def make_config(self, **changes: Any) -> PretrainedConfig:
        ids = {"bos_token_id": self.id(self.bos), "eos_token_id": self.id(self.eos)}
        if self.pad is not None:
            ids["pad_token_id"] = self.id(self.pad)
        return self.config(**{**ids, **changes})  # type: ignore[no-any-return]

    def id(self, token: str | None) -> int | None:
        return None if token is None else self.specials.index(token)

    def save_tokenizer(self, folder: Path) -> PreTrainedTokenizerFast:
        """The family's tokenizer beside its model, saved as transformers does."""
        hf = PreTrainedTokenizerFast(
            tokenizer_object=train_bpe(specials=self.specials, qwen=self.name.startswith("qwen")),
            bos_token=self.bos,
            eos_token=self.eos,
            unk_token=self.unk,
            pad_token=self.pad,
            chat_template=self.chat_template,
            add_bos_token=self.adds_bos,
        )
        hf.save_pretrained(folder)
        return hf


_LLAMA_CHAT = "{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_CHATML_TOKENS = (None, "<|im_end|>", "<|endoftext|>", None, False)  # bos, eos, pad, unk, adds BOS
# The dense families' templates, written in each family's layout and with the Jinja it uses: Gemma's "model"
# turns with the system prompt folded into the first user turn (Gemma 2 refuses a system turn), Phi-3's
# <|role|> tags, SmolLM3's metadata system turn with today's date and a reasoning mode, Granite's roles
# with its date line, OLMo 2's tags with EOS after each answer.
_GEMMA_CHAT = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{- message['content'] | trim }}<end_of_turn>\n"
    "{%- endfor -%}{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)
_GEMMA2_CHAT = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    + _GEMMA_CHAT.removeprefix("{{ bos_token }}")
)
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
_GEMMA_TOKENS = ("<bos>", "<end_of_turn>", "<pad>", "<unk>", True)  # bos, eos, pad, unk, adds BOS
_PHI3_CHAT = (
    "{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
_SMOLLM3_CHAT = (
    "{%- set ns = namespace(system='', think=true) -%}"
    "{%- if messages[0].role == 'system' -%}{%- set ns.system = messages[0].content -%}"
    "{%- if '/no_think' in ns.system -%}{%- set ns.think = false -%}{%- endif -%}"
    "{%- set ns.system = ns.system | replace('/no_think', '') | replace('/think', '') | trim -%}{%- endif -%}"
    "<|im_start|>system\n## Metadata\n\nToday Date: {{ strftime_now('%d %B %Y') }}\n"
    "Reasoning Mode: {{ '/think' if ns.think else '/no_think' }}\n\n## Custom Instructions\n\n"
    "{{ ns.system }}<|im_end|>\n"
    "{%- for message in messages if message.role != 'system' -%}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if not ns.think %}<think>\n\n</think>\n{% endif -%}{%- endif -%}"
)
_GRANITE_CHAT = (
    "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}"
    "{%- set loop_messages = messages[1:] %}{%- else %}"
    "{%- set system_message = \"Today's Date: \" + strftime_now('%B %d, %Y') + '.\\nYou are Granite.' %}"
    "{%- set loop_messages = messages %}{%- endif %}"
    "{{- '<|start_of_role|>system<|end_of_role|>' + system_message + '<|end_of_text|>\n' }}"
    "{%- for message in loop_messages %}"
    "{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] }}"
    "{{- '<|end_of_text|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_of_role|>assistant<|end_of_role|>' }}{%- endif %}"
)
_OLMO2_CHAT = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>\n' + message['content'] + eos_token }}"
    "{% if not loop.last %}{{ '\n' }}{% endif %}{% endif %}"
    "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}"
)
FAMILIES = {
    f.name: f
    for f in (
        Family(
            "llama", llama_config, ("<unk>", "<s>", "</s>"), "<s>", "</s>", None, "<unk>", True, _LLAMA_CHAT
        ),
        Family(
            "mistral",
            mistral_config,
            ("<unk>", "<s>", "</s>"),
            "<s>",
            "</s>",
            None,
            "<unk>",
            True,
            _LLAMA_CHAT,
        ),
        Family(
            "qwen2", qwen2_config, _QWEN_SPECIALS, None, "<|im_end|>", "<|endoftext|>", None, False, _CHATML
        ),
        Family(
            "qwen3", qwen3_config, _QWEN_SPECIALS, None, "<|im_end|>", "<|endoftext|>", None, False, _CHATML
        ),
        Family(
            "qwen3-moe",
            qwen3_moe_config,
            _QWEN_SPECIALS,
            None,
            "<|im_end|>",
            "<|endoftext|>",
            None,
            False,
            _CHATML,
        ),
        Family(
            "gpt2",
            gpt2_config,
            ("<|endoftext|>",),
            "<|endoftext|>",
            "<|endoftext|>",
            None,
            "<|endoftext|>",
            False,
            "{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}",
        ),
        Family("gemma3", gemma3_config, _GEMMA_SPECIALS, *_GEMMA_TOKENS, _GEMMA_CHAT),
        Family("gemma2", gemma2_config, _GEMMA_SPECIALS, *_GEMMA_TOKENS, _GEMMA2_CHAT),
        Family(
            "phi3",
            phi3_config,
            ("<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"),
            "<s>",
            "<|end|>",
            "<|endoftext|>",
            "<unk>",
            False,
            _PHI3_CHAT,
        ),
        Family("smollm3", smollm3_config, _QWEN_SPECIALS, *_CHATML_TOKENS, _SMOLLM3_CHAT),
        Family(
            "granite",
            granite_config,
            ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"),
            "<|end_of_text|>",
            "<|end_of_text|>",
            "<|end_of_text|>",
            None,
            False,
            _GRANITE_CHAT,
        ),
        Family(
            "olmo2",
            olmo2_config,
            ("<|endoftext|>", "<|pad|>"),
            "<|endoftext|>",
            "<|endoftext|>",
            "<|pad|>",
            None,
            False,
            _OLMO2_CHAT,
        ),
    )
}


# -- running the graphs ------------------------------------------------------------------------------------


@dataclass
class Run:
    tokens: np.ndarray  # [B, STEPS] greedy tokens
    logits: list[np.ndarray]  # STEPS x [B, V]: the logits each token was chosen from


@torch.no_grad()
def hf_greedy(model: PreTrainedModel, prompt: Sequence[int], steps: int = STEPS) -> Run:
    """transformers' generate, greedy, never stopping at EOS; logits before any processor."""
    ids = torch.tensor([list(prompt)])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].numpy()[None]
    return Run(tokens, [x.float().numpy() for x in out.logits])


def hf_greedy_batch(model: PreTrainedModel, prompts: Sequence[Sequence[int]], steps: int = STEPS) -> Run:
    runs = [hf_greedy(model, p, steps) for p in prompts]
    return Run(
        np.concatenate([r.tokens for r in runs]),
        [np.concatenate([r.logits[t] for r in runs]) for t in range(steps)],
    )


@torch.no_grad()
def torch_forced(model: Decoder, prompts: Sequence[Sequence[int]], forced: np.ndarray) -> Run:
    """Our decoder on a left-padded batch: prefill, then decode steps fed `forced` [B, steps] (teacher
    forcing on the reference's tokens, so each step's logits compare like for like)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits, past = model(ids, mask, positions)
    seen = [logits[:, -1].numpy()]
    own = [logits[:, -1].argmax(-1).numpy()]
    for t in range(forced.shape[1] - 1):
        token = torch.from_numpy(forced[:, t : t + 1]).long()
        mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=torch.long)], dim=1)
        positions = mask.sum(-1, keepdim=True) - 1
        logits, past = model(token, mask, positions, past)
        seen.append(logits[:, -1].numpy())
        own.append(logits[:, -1].argmax(-1).numpy())
    return Run(np.stack(own, 1), seen)


def run_inplace(
    graph: onnx.ModelProto,
    cfg: DecoderConfig,
    prompts: Sequence[Sequence[int]],
    steps: int = STEPS,
    lora: tuple[Mapping[str, np.ndarray], tuple[int, int], int] | None = None,
) -> Run:
    """The serving graph with bound in-place KV buffers, as serve/engine.py runs it: its own greedy tokens.
    `lora`: a LoRA graph's weight inputs of a span of slots (LoraSlots.span), the span, and the slot every
    token runs with."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
    batch, capacity = len(prompts), cfg.context_length
    shape = (batch, cfg.kv_heads, capacity, cfg.head_dim)
    buffers = {
        f"{kind}.{i}": ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32))
        for i in range(cfg.n_layers)
        for kind in ("key", "value")
    }
    binding = session.io_binding()
    binding.bind_output("logits")  # the first output: copy_outputs_to_cpu()[0]
    for name, value in buffers.items():
        binding.bind_ortvalue_input(f"past_{name}", value)
        binding.bind_ortvalue_output(f"present_{name}", value)

    lens = np.array([len(p) for p in prompts], np.int64)
    width = int(lens.max())
    ids = np.zeros((batch, width), np.int64)
    for row, p in enumerate(prompts):
        ids[row, : len(p)] = p
    feed = {
        "input_ids": ids,
        "position_ids": np.broadcast_to(np.arange(width, dtype=np.int64), (batch, width)).copy(),
        "seqlens_k": (lens - 1).astype(np.int32),
        "total_sequence_length": np.array(width, np.int32),
        "last_index": lens - 1,
    }
    tokens, seen = [], []
    for t in range(steps):
        if t:
            feed = {
                "input_ids": tokens[-1][:, None].astype(np.int64),
                "position_ids": lens[:, None].copy(),
                "seqlens_k": lens.astype(np.int32),
                "total_sequence_length": np.array(int(lens.max()) + 1, np.int32),
                "last_index": np.zeros(batch, np.int64),
            }
            lens = lens + 1
        if lora is not None:
            batch, seq = feed["input_ids"].shape
            inputs, span, slot = lora
            feed = {**inputs, **feed, **token_slots(np.full(batch, slot), seq, span)}
        feed = {name: np.ascontiguousarray(array) for name, array in feed.items()}  # alive until run
        for name, array in feed.items():
            binding.bind_cpu_input(name, array)
        session.run_with_iobinding(binding)
        logits = binding.copy_outputs_to_cpu()[0]
        seen.append(logits)
        tokens.append(logits.argmax(-1))
    return Run(np.stack(tokens, 1), seen)


def max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))
