"""Import a local Hugging Face checkpoint folder into the decoder of export/model.py.

A folder as `save_pretrained` or a hub download writes it: config.json, model.safetensors (or shards listed by
model.safetensors.index.json), generation_config.json, tokenizer.json (or a SentencePiece tokenizer.model),
tokenizer_config.json, chat_template.jinja. Nothing is downloaded, and transformers' modules are not used:
config.json becomes a DecoderConfig, and the tensors are mapped onto the decoder's own state dict.

Families (`SUPPORTED_ARCHITECTURES`):
- Llama, Mistral, Qwen2, Qwen3: RMSNorm, SwiGLU MLP, RoPE (default, linear or llama3 scaling), grouped-query
  attention; Llama's attention_bias / mlp_bias, Qwen2's q/k/v biases, Qwen3's per-head q/k RMSNorm and own
  head_dim, Mistral's sliding window;
- GPT-2: learned positions, LayerNorm with bias, tanh-approximated GELU, Conv1D weights ([in, out], so
  transposed here);
- mixtures of experts (export/moe.py), Llama-like attention with sparse SwiGLU feed-forward layers:
  Qwen3-MoE (Qwen3's attention; norm_topk_prob; dense layers by mlp_only_layers and decoder_sparse_step),
  OLMoE (q/k RMSNorm over the whole projection, not per head; norm_topk_prob), Mixtral (Mistral's
  attention; top-k weights renormalized), gpt-oss (attention sinks and biases, YaRN, every layer sliding or
  every layer full; softmax over the top-k logits, clamped SwiGLU, expert biases; experts dense or MXFP4);
- Gemma 2 and 3 (text): GeGLU, norms before and after each sublayer, Gemma's (1 + w) RMSNorm read as RMSNorm
  with weight 1 + w (the same float32 product), the embedding times sqrt(hidden_size), query_pre_attn_scalar,
  sliding-window and global layers interleaved (Gemma 3's local layers with a RoPE base of their own), Gemma
  2's attention and final-logit soft-capping, Gemma 3's per-head q/k norms; Gemma 3's multimodal checkpoints
  (Gemma3ForConditionalGeneration) as their text stack, the vision tower left out;
- Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, partial rotary, longrope (see below);
- SmolLM3: layers without rotary (no_rope_layers); Granite: embedding, attention and residual multipliers,
  logits scaling; OLMo 2: norms after attention and MLP only, q/k norms over the whole projection.
config.json may be in transformers 4 form (rope_theta and rope_scaling at the top level, torch_dtype) or 5
(rope_parameters with rope_theta inside, dtype). RoPE: default, linear, llama3 and YaRN (fixed tables, scaled
by its attention factor), and Phi-3's longrope (Phi-3's only scaling, also under its first names "su" and
"yarn", as transformers reads them; it refuses the others for Phi-3, and so does the import); types whose
tables depend on the sequence length (dynamic, ...) are refused by name: the graphs precompute one cos/sin
table. A longrope model keeps its whole context (max_position_embeddings) in one table whose rows before
original_max_position_embeddings rotate by the short factors and the rows from it on by the long ones, both
times the attention factor: a token's rotation depends on its position alone. That is transformers' model fed
one token per call with its KV cache (each call picks the factors by its last position). transformers differs
in two places, both past the original context: one forward call over positions on both sides of it rotates all
of them by the long factors, and Phi-3's generate drops its cache when the sequence first outgrows the
original context and recomputes it all with the long factors; the KV cache here keeps each position's rotation
as it was first computed.

Every problem with the folder is an `HFImportError`: one line naming the file, the problem and what to do.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import reprlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from export.lora import PROJECTIONS, AdapterNames, projection_features
from export.model import Decoder, DecoderConfig, LayerAttention
from export.moe import ExpertsConfig, Routing
from export.mxfp4 import dequantize_mxfp4

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "OlmoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM")
LLAMA_LIKE = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    *MOE_ARCHITECTURES,
)
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
DENSE_FAMILIES = (*GEMMA, "Phi3ForCausalLM", "SmolLM3ForCausalLM", "GraniteForCausalLM", "Olmo2ForCausalLM")
# Multimodal checkpoints whose text stack imports as the text-only architecture (the vision tower left out).
TEXT_STACK_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}
SUPPORTED_ARCHITECTURES = (*LLAMA_LIKE, "GPT2LMHeadModel", *DENSE_FAMILIES, *TEXT_STACK_OF)
# Families whose attention is that of another one here.
ATTENTION_OF = {
    "Qwen3MoeForCausalLM": "Qwen3ForCausalLM",
    "MixtralForCausalLM": "MistralForCausalLM",
    "OlmoeForCausalLM": "LlamaForCausalLM",
    "GptOssForCausalLM": "LlamaForCausalLM",
}
QK_NORM = ("Qwen3ForCausalLM", "OlmoeForCausalLM")  # of the attention families (OLMoE: whole projections)
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
# Scalings whose cos/sin depend on the current sequence length (or switch tables past a length).
LENGTH_DEPENDENT_ROPE = ("dynamic", "su", "ntk")
# Phi-3's RoPE types as transformers 4.43+ and 5 read them: its first long-context checkpoints
# (Phi-3-mini-128k, Phi-3-medium-128k) name longrope "su", and its first modeling code also took "yarn"
# with the same short and long factors; both are longrope, and every other scaling is refused for Phi-3.
PHI3_ROPE_TYPES = {"default": "default", "longrope": "longrope", "su": "longrope", "yarn": "longrope"}
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MXFP4_SUFFIXES = ("_blocks", "_scales")  # gpt-oss's MXFP4 expert weights (export/mxfp4.py)

CONFIG_FILE = "config.json"
MISMATCH = "the config does not match the weights; use the config.json that came with them"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
SENTENCEPIECE_FILE = "tokenizer.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"

log = logging.getLogger("textgen.hf_import")


class HFImportError(Exception):
    """A Hugging Face folder this importer cannot read: `str()` is one line naming the file and what to do."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
        self.problem = problem


@dataclass(frozen=True)
class HFTokenizer:
    """What the bundle writer needs of a checkpoint's tokenizer, read as transformers would apply it."""

    tokenizer: Tokenizer  # encode(text) adds the special tokens the HF tokenizer adds (add_special_tokens)
    eos_token_ids: tuple[int, ...]  # any of them ends a generation (Llama 3 lists several)
    bos_token_id: int | None
    adds_bos: bool  # whether encoding a text prepends bos_token_id
    pad_token_id: int | None
    chat_template: str | None  # Jinja source, as transformers' apply_chat_template takes it
    source: Path  # the file the vocabulary came from


@dataclass(frozen=True)
class HFCheckpoint:
    architecture: str  # e.g. "LlamaForCausalLM"
    config: DecoderConfig
    model: Decoder  # fp32, eval mode, CPU
    tokenizer: HFTokenizer | None  # None when the folder has no tokenizer files
    source_dtype: str | None  # config.json's dtype / torch_dtype (the weights are upcast to float32)


# -- where the folder is: a path, or a hub id in the local cache --------------------------------------------

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache as huggingface_hub finds it: $HF_HUB_CACHE, else $HF_HOME/hub, else
    ~/.cache/huggingface/hub (read now, not when huggingface_hub was imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or str(Path("~/.cache/huggingface"))
    return Path(home).expanduser() / "hub"


def locate_model(spec: str | Path) -> Path:
    """A local model folder: `spec` itself if it is a directory, else the snapshot of the hub id `spec` in
    the local Hugging Face cache. Nothing is downloaded: an id not in the cache is refused with the command
    that fetches it."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise HFImportError(path, "not a directory; give the folder that holds config.json, or a hub id")
    text = str(spec)
    if not HUB_ID.match(text):
        raise HFImportError(path, "no such folder; give the folder that holds config.json, or a hub id")
    cache = hub_cache_dir()
    fetch = f"fetch it first with: huggingface-cli download {text} (or: hf download {text})"
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        raise HFImportError(
            path, f"no such folder, and huggingface_hub is not installed to look {text!r} up in the cache"
        ) from None
    try:
        found = try_to_load_from_cache(text, CONFIG_FILE, cache_dir=cache)
    except Exception as exc:  # an id huggingface_hub refuses (HFValidationError), an unreadable cache
        raise HFImportError(path, f"no such folder, and not a hub id in the cache ({exc}); {fetch}") from exc
    if isinstance(found, str):
        return Path(found).parent
    raise HFImportError(
        path, f"no such folder, and {text!r} is not in the Hugging Face cache ({cache}); {fetch}"
    )


# -- config.json -> DecoderConfig --------------------------------------------------------------------------


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise HFImportError(path, "file not found; a Hugging Face model folder needs it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HFImportError(path, f"not valid JSON ({exc}); download the file again") from exc
    if not isinstance(data, dict):
        raise HFImportError(path, f"expected a JSON object, found {type(data).__name__}")
    return data


def hf_architecture(config: dict[str, Any], path: Path) -> str:
    architectures = config.get("architectures") or []
    if not isinstance(architectures, list) or len(architectures) != 1:
        raise HFImportError(path, f"'architectures' must name one class, found {architectures!r}")
    name = architectures[0]
    if name not in SUPPORTED_ARCHITECTURES:
        raise HFImportError(
            path, f"architecture {name!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(name)


class _Fields:
    """Typed reads of config.json values, each failure an HFImportError naming the key."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        self.config = config
        self.path = path

    def has(self, key: str) -> bool:
        return self.config.get(key) is not None

    def integer(self, key: str, default: int | None = None) -> int:
        value = self.config.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise HFImportError(self.path, f"{key!r} must be a positive integer, found {value!r}")
        return value

    def number(self, key: str, default: float) -> float:
        value = self.config.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            raise HFImportError(self.path, f"{key!r} must be a number, found {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, bool):
            raise HFImportError(self.path, f"{key!r} must be true or false, found {value!r}")
        return value

    def refuse(self, problem: str) -> HFImportError:
        return HFImportError(self.path, problem)


def _rope_params(f: _Fields) -> dict[str, Any]:
    """The RoPE parameters in either form: transformers 5's rope_parameters (rope_theta inside), or
    transformers 4's rope_scaling (whose type key was once "type"), the same for every layer type."""
    params = f.config.get("rope_parameters") or f.config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise f.refuse(f"RoPE parameters must be an object, found {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):  # one dict per layer type
        distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(distinct) != 1:
            raise f.refuse(f"RoPE parameters differ between layer types ({', '.join(params)}); not supported")
        params = next(iter(params.values()))
    return params


def _rope_fields(
    f: _Fields,
    context_length: int,
    params: dict[str, Any] | None = None,
    theta: float = 10000.0,
    phi3: bool = False,
) -> dict[str, Any]:
    """The DecoderConfig's RoPE fields from `params` (default: _rope_params), the base read from them, else
    from the top-level rope_theta, else `theta`. longrope only for Phi-3, which reads PHI3_ROPE_TYPES."""
    params = _rope_params(f) if params is None else params
    named = params.get("rope_type", params.get("type")) or "default"
    kind = PHI3_ROPE_TYPES.get(named, "") if phi3 else named
    if kind not in ROPE_TYPES or (kind == "longrope" and not phi3):
        if phi3:
            supported = ", ".join(f"{t} (longrope)" if v != t else t for t, v in PHI3_ROPE_TYPES.items())
            raise f.refuse(f"RoPE type {named!r} is not supported for Phi-3; supported: {supported}")
        why = " (its tables depend on the sequence length)" if kind in LENGTH_DEPENDENT_ROPE else ""
        if kind == "longrope":
            why = " for this family (its tables depend on the sequence length)"
        supported = ", ".join(t for t in ROPE_TYPES if t != "longrope")
        raise f.refuse(f"RoPE type {kind!r} is not supported{why}; supported: {supported}")
    p = _Fields(params, f.path)
    fields: dict[str, Any] = {"rope_theta": p.number("rope_theta", f.number("rope_theta", theta))}
    partial = p.number("partial_rotary_factor", f.number("partial_rotary_factor", 1.0))
    if partial != 1.0:
        fields["rotary_dim"] = int(_head_dim(f) * partial)
    if kind == "linear":
        fields |= {"rope_scaling": "linear", "rope_factor": p.number("factor", 1.0)}
    elif kind == "llama3":
        fields |= {
            "rope_scaling": "llama3",
            "rope_factor": p.number("factor", 8.0),
            "rope_low_freq_factor": p.number("low_freq_factor", 1.0),
            "rope_high_freq_factor": p.number("high_freq_factor", 4.0),
            "rope_original_context": p.integer("original_max_position_embeddings", context_length),
        }
    elif kind == "longrope":
        original = p.integer(
            "original_max_position_embeddings", f.integer("original_max_position_embeddings")
        )
        factor = p.number("factor", context_length / original)
        default_attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        pairs = int(_head_dim(f) * partial) // 2
        fields |= {
            "rope_scaling": "longrope",
            "rope_short_factors": _longrope_factors(f, params, "short_factor", pairs),
            "rope_long_factors": _longrope_factors(f, params, "long_factor", pairs),
            "rope_original_context": original,
            "rope_attention_factor": p.number("attention_factor", default_attention),
        }
    elif kind == "yarn":
        original = p.integer("original_max_position_embeddings", context_length)
        factor = p.number("factor", context_length / original)
        truncate = params.get("truncate", True)
        if not isinstance(truncate, bool):
            raise f.refuse(f"RoPE 'truncate' must be true or false, found {truncate!r}")
        fields |= {
            "rope_scaling": "yarn",
            "rope_factor": factor,
            "rope_original_context": original,
            "rope_beta_fast": p.number("beta_fast", 32.0) or 32.0,
            "rope_beta_slow": p.number("beta_slow", 1.0) or 1.0,
            "rope_truncate": truncate,
            "rope_attention_factor": _yarn_attention_factor(p, factor),
        }
    return fields


def _head_dim(f: _Fields) -> int:
    return (
        f.integer("head_dim")
        if f.has("head_dim")
        else f.integer("hidden_size") // f.integer("num_attention_heads")
    )


def _longrope_factors(f: _Fields, params: dict[str, Any], key: str, pairs: int) -> tuple[float, ...]:
    """longrope's short_factor or long_factor: one positive number per rotated pair of the head dim."""
    factors = params.get(key)
    if (
        not isinstance(factors, list)
        or len(factors) != pairs
        or not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in factors)
    ):
        found = reprlib.repr(factors)  # Phi-4-mini's lists have 48 numbers: the line stays short
        raise f.refuse(f"longrope needs {key} as a list of {pairs} positive numbers, found {found}")
    return tuple(float(v) for v in factors)


def _yarn_attention_factor(p: _Fields, factor: float) -> float:
    """The scale of YaRN's cos and sin: attention_factor if given, else from the factor (and mscale /
    mscale_all_dim where both are), as transformers' _compute_yarn_parameters."""
    if p.has("attention_factor"):
        return p.number("attention_factor", 1.0)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if p.config.get("mscale") and p.config.get("mscale_all_dim"):
        return mscale(factor, p.number("mscale", 1.0)) / mscale(factor, p.number("mscale_all_dim", 1.0))
    return mscale(factor)


def _sliding_window(f: _Fields, architecture: str, n_layers: int) -> int:
    """Mistral (and Mixtral): every layer attends within sliding_window (null: no window). Qwen2/3 (and
    Qwen3-MoE): only when use_sliding_window, and then only if every layer slides (mixed layer types are
    refused)."""
    architecture = ATTENTION_OF.get(architecture, architecture)
    if architecture == "MistralForCausalLM":
        return f.integer("sliding_window") if f.has("sliding_window") else 0
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") or not f.flag(
        "use_sliding_window", False
    ):
        types = f.config.get("layer_types") or []
        if any(t != "full_attention" for t in types):
            raise f.refuse(f"layer_types {sorted(set(types))} are not supported: only full_attention here")
        return 0
    window = f.integer("sliding_window")
    types = f.config.get("layer_types") or [
        "sliding_attention" if i >= f.integer("max_window_layers", 28) else "full_attention"
        for i in range(n_layers)
    ]
    if set(types) == {"full_attention"}:
        return 0
    if set(types) != {"sliding_attention"}:
        raise f.refuse(
            "layers mixing full and sliding-window attention (use_sliding_window with max_window_layers "
            f"{f.config.get('max_window_layers')}) are not supported"
        )
    return window


def _gpt_oss_layers(f: _Fields, n_layers: int) -> tuple[LayerAttention, ...]:
    """gpt-oss's layer_types: sliding-window layers (of sliding_window keys) and full ones, which its
    checkpoints alternate."""
    types = _layer_types(f, n_layers, ["full_attention"] * n_layers)
    window = f.integer("sliding_window") if "sliding_attention" in types else 0
    return tuple(
        LayerAttention(window=window) if t == "sliding_attention" else LayerAttention() for t in types
    )


def _llama_like_config(f: _Fields, architecture: str) -> DecoderConfig:
    act = f.config.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise f.refuse(f"hidden_act {act!r} is not supported for {architecture} (silu only: SwiGLU)")
    if f.has("clip_qkv"):
        raise f.refuse(f"clip_qkv {f.config['clip_qkv']!r} is not supported (q, k and v unclipped only)")
    family = ATTENTION_OF.get(architecture, architecture)
    gpt_oss = architecture == "GptOssForCausalLM"
    d_model, n_heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    n_layers, context = f.integer("num_hidden_layers"), f.integer("max_position_embeddings")
    head_dim = f.integer("head_dim") if f.has("head_dim") else d_model // n_heads
    if family == "Qwen2ForCausalLM":  # q/k/v with biases, o_proj without, always
        qkv_bias, out_bias, mlp_bias = True, False, False
    elif family == "MistralForCausalLM":
        qkv_bias = out_bias = mlp_bias = False
    else:  # Llama, Qwen3, OLMoE, Qwen3-MoE
        qkv_bias = out_bias = f.flag("attention_bias", False)
        mlp_bias = architecture == "LlamaForCausalLM" and f.flag("mlp_bias", False)
    return DecoderConfig(
        vocab_size=f.integer("vocab_size"),
        context_length=context,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=f.integer("intermediate_size"),
        positions="rotary",
        activation="swiglu",
        tie_embeddings=f.flag("tie_word_embeddings", False),
        layer_norm_eps=f.number("rms_norm_eps", 1e-6),
        norm="rms",
        n_kv_heads=f.integer("num_key_value_heads", n_heads),
        explicit_head_dim=0 if head_dim * n_heads == d_model else head_dim,
        qkv_bias=qkv_bias,
        out_bias=out_bias,
        mlp_bias=mlp_bias,
        qk_norm=architecture in QK_NORM or family in QK_NORM,
        qk_norm_scope="projection" if architecture == "OlmoeForCausalLM" else "head",
        sliding_window=0 if gpt_oss else _sliding_window(f, architecture, n_layers),
        layer_attention=_gpt_oss_layers(f, n_layers) if gpt_oss else (),
        experts=_experts_config(f, architecture, n_layers) if architecture in MOE_ARCHITECTURES else None,
        attention_sinks=gpt_oss,
        **_rope_fields(f, context),
    )


def _experts_config(f: _Fields, architecture: str, n_layers: int) -> ExpertsConfig:
    """The experts of a MoE family: how many (num_experts, or num_local_experts as Mixtral and transformers 5
    write it), top-k, each one's width, how the top-k weights are normalized, and which layers stay dense."""
    n_experts = f.integer("num_experts") if f.has("num_experts") else f.integer("num_local_experts")
    routing: Routing = "softmax_topk"
    if architecture == "MixtralForCausalLM" or f.flag("norm_topk_prob", False):
        routing = "softmax_topk_norm"
    if architecture == "GptOssForCausalLM":  # softmax over the top-k logits; clamped SwiGLU; biases
        return ExpertsConfig(
            n_experts=n_experts,
            top_k=f.integer("num_experts_per_tok"),
            d_ff=f.integer("intermediate_size"),
            routing="topk_softmax",
            activation="swiglu_clamped",
            swiglu_alpha=f.number("swiglu_alpha", 1.702),
            swiglu_limit=f.number("swiglu_limit", 7.0),
            bias=True,
        )
    dense: set[int] = set()
    width = "intermediate_size"
    if architecture == "Qwen3MoeForCausalLM":  # as Qwen3MoeDecoderLayer chooses its MLP
        width = "moe_intermediate_size"
        only = f.config.get("mlp_only_layers") or []
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise f.refuse(f"'mlp_only_layers' must be a list of layer indices, found {only!r}")
        step = f.integer("decoder_sparse_step", 1)
        dense = {i for i in range(n_layers) if i in only or (i + 1) % step}
    return ExpertsConfig(
        n_experts=n_experts,
        top_k=f.integer("num_experts_per_tok"),
        d_ff=f.integer(width),
        routing=routing,
        dense_layers=tuple(sorted(dense)),
    )


def _rotary_fields(f: _Fields, activations: dict[str, str], act_key: str, tied: bool) -> dict[str, Any]:
    """What every RMSNorm, gated-MLP, RoPE family reads alike (the families below)."""
    act = f.config.get(act_key) or f.config.get("hidden_act")
    if act not in activations:
        raise f.refuse(f"{act_key} {act!r} is not supported; supported: {', '.join(activations)}")
    d_model, n_heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    head_dim = f.integer("head_dim") if f.has("head_dim") else d_model // n_heads
    return {
        "vocab_size": f.integer("vocab_size"),
        "context_length": f.integer("max_position_embeddings"),
        "d_model": d_model,
        "n_layers": f.integer("num_hidden_layers"),
        "n_heads": n_heads,
        "d_ff": f.integer("intermediate_size"),
        "positions": "rotary",
        "activation": activations[act],
        "tie_embeddings": f.flag("tie_word_embeddings", tied),
        "layer_norm_eps": f.number("rms_norm_eps", 1e-6),
        "norm": "rms",
        "n_kv_heads": f.integer("num_key_value_heads", n_heads),
        "explicit_head_dim": 0 if head_dim * n_heads == d_model else head_dim,
        "mlp_bias": f.flag("mlp_bias", False),
    }


SILU = {"silu": "swiglu", "swish": "swiglu"}
LAYER_TYPES = ("full_attention", "sliding_attention")


def _layer_types(f: _Fields, n_layers: int, default: list[str]) -> list[str]:
    types = f.config.get("layer_types") or default
    if not isinstance(types, list) or len(types) != n_layers or any(t not in LAYER_TYPES for t in types):
        raise f.refuse(f"layer_types must list {n_layers} of {', '.join(LAYER_TYPES)}, found {types!r}")
    return types


def _gemma_config(f: _Fields, architecture: str) -> DecoderConfig:
    """Gemma 2 and 3: layer_types (default: Gemma 2 every other layer sliding, Gemma 3 five of each six),
    Gemma 3's local layers with their own RoPE base (rope_parameters["sliding_attention"], or transformers
    4's rope_local_base_freq)."""
    if f.flag("use_bidirectional_attention", False):
        raise f.refuse("bidirectional attention (an embedding model) is not a decoder")
    fields = _rotary_fields(f, {"gelu_pytorch_tanh": "geglu"}, "hidden_activation", tied=True)
    n_layers = fields["n_layers"]
    gemma3 = architecture == "Gemma3ForCausalLM"
    every = f.integer("sliding_window_pattern", 6) if gemma3 else 2
    types = _layer_types(
        f, n_layers, ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    )
    params = f.config.get("rope_parameters")
    local_theta = 0.0
    if isinstance(params, dict) and "full_attention" in params:  # transformers 5, one dict per layer type
        local = params.get("sliding_attention") or {}
        if (local.get("rope_type") or "default") != "default":
            raise f.refuse(f"RoPE of the sliding-window layers must be default, found {local!r}")
        local_theta = _Fields(local, f.path).number("rope_theta", 10000.0)
        rope = _rope_fields(f, fields["context_length"], params["full_attention"], 1e6 if gemma3 else 1e4)
    else:
        rope = _rope_fields(f, fields["context_length"], theta=1e6 if gemma3 else 1e4)
        if gemma3:
            local_theta = f.number("rope_local_base_freq", 10000.0)
    if local_theta == rope["rope_theta"] and rope.get("rope_scaling", "none") == "none":
        local_theta = 0.0  # the same RoPE as the global layers: one table
    window = f.integer("sliding_window") if "sliding_attention" in types else 0
    layers = tuple(
        LayerAttention(window=window, rope_theta=local_theta)
        if t == "sliding_attention"
        else LayerAttention()
        for t in types
    )
    scalar = f.number("query_pre_attn_scalar", 256)
    return DecoderConfig(
        **fields,
        qkv_bias=f.flag("attention_bias", False),
        out_bias=f.flag("attention_bias", False),
        qk_norm=gemma3,
        layer_attention=layers,
        norm_placement="sandwich",
        embedding_scale=float(torch.tensor(fields["d_model"] ** 0.5)),  # rounded to float32, as Gemma's
        attn_scale=scalar**-0.5,
        # transformers' Gemma 3 attention takes no soft cap, whatever attn_logit_softcapping says.
        attn_softcap=0.0 if gemma3 else f.number("attn_logit_softcapping", 0.0),
        logit_softcap=f.number("final_logit_softcapping", 0.0),
        **rope,
    )


def _phi3_config(f: _Fields) -> DecoderConfig:
    """Phi-3 and Phi-4-mini: a window on every layer when sliding_window is set, partial rotary, longrope."""
    fields = _rotary_fields(f, SILU, "hidden_act", tied=False)
    fields["mlp_bias"] = False
    bias = f.flag("attention_bias", False)
    rope = _rope_fields(f, fields["context_length"], phi3=True)
    window = f.integer("sliding_window") if f.has("sliding_window") else 0
    return DecoderConfig(
        **{**fields, **rope},
        qkv_bias=bias,
        out_bias=bias,
        sliding_window=window if window < fields["context_length"] else 0,
    )


def _smollm3_config(f: _Fields) -> DecoderConfig:
    """SmolLM3: no_rope_layers (1: RoPE, 0: none; default every no_rope_layer_interval-th layer without)."""
    fields = _rotary_fields(f, SILU, "hidden_act", tied=True)
    n_layers = fields["n_layers"]
    interval = f.integer("no_rope_layer_interval", 4)
    uses = f.config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n_layers)]
    if not isinstance(uses, list) or len(uses) != n_layers or any(u not in (0, 1) for u in uses):
        raise f.refuse(f"no_rope_layers must list {n_layers} of 0 and 1, found {uses!r}")
    window = (
        f.integer("sliding_window") if f.flag("use_sliding_window", False) and f.has("sliding_window") else 0
    )
    types = _layer_types(
        f, n_layers, ["sliding_attention" if window and not u else "full_attention" for u in uses]
    )
    bias = f.flag("attention_bias", False)
    return DecoderConfig(
        **fields,
        qkv_bias=bias,
        out_bias=bias,
        layer_attention=tuple(
            LayerAttention(window=window if t == "sliding_attention" else 0, rotary=bool(u))
            for t, u in zip(types, uses, strict=True)
        ),
        **_rope_fields(f, fields["context_length"]),
    )


def _granite_config(f: _Fields) -> DecoderConfig:
    """Granite: Llama with embedding_multiplier, attention_multiplier (the score scale),
    residual_multiplier and logits divided by logits_scaling."""
    fields = _rotary_fields(f, SILU, "hidden_act", tied=True)
    bias = f.flag("attention_bias", False)
    return DecoderConfig(
        **fields,
        qkv_bias=bias,
        out_bias=bias,
        embedding_scale=f.number("embedding_multiplier", 1.0),
        attn_scale=f.number("attention_multiplier", 1.0),
        residual_scale=f.number("residual_multiplier", 1.0),
        logit_scale=1.0 / f.number("logits_scaling", 1.0),
        **_rope_fields(f, fields["context_length"]),
    )


def _olmo2_config(f: _Fields) -> DecoderConfig:
    """OLMo 2: norms after attention and after the MLP only, q/k RMSNorm over the whole projections."""
    fields = _rotary_fields(f, SILU, "hidden_act", tied=False)
    bias = f.flag("attention_bias", False)
    return DecoderConfig(
        **fields,
        qkv_bias=bias,
        out_bias=bias,
        qk_norm=True,
        qk_norm_scope="projection",
        norm_placement="post",
        **_rope_fields(f, fields["context_length"]),
    )


def _family_config(f: _Fields, architecture: str) -> DecoderConfig:
    if architecture == "GPT2LMHeadModel":
        return _gpt2_config(f)
    if architecture in GEMMA:
        return _gemma_config(f, architecture)
    dense: dict[str, Callable[[_Fields], DecoderConfig]] = {
        "Phi3ForCausalLM": _phi3_config,
        "SmolLM3ForCausalLM": _smollm3_config,
        "GraniteForCausalLM": _granite_config,
        "Olmo2ForCausalLM": _olmo2_config,
    }
    if architecture in dense:
        return dense[architecture](f)
    return _llama_like_config(f, architecture)


GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


def _gpt2_config(f: _Fields) -> DecoderConfig:
    act = f.config.get("activation_function", "gelu_new")
    if act not in GPT2_ACTIVATIONS:
        raise f.refuse(
            f"activation_function {act!r} is not supported; supported: {', '.join(GPT2_ACTIVATIONS)}"
        )
    if f.flag("scale_attn_by_inverse_layer_idx", False) or not f.flag("scale_attn_weights", True):
        raise f.refuse("GPT-2 attention scaled otherwise than by 1/sqrt(head_dim) is not supported")
    if f.flag("add_cross_attention", False):
        raise f.refuse("GPT-2 with cross-attention is not a decoder-only model")
    d_model = f.integer("n_embd")
    return DecoderConfig(
        vocab_size=f.integer("vocab_size"),
        context_length=f.integer("n_positions"),
        d_model=d_model,
        n_layers=f.integer("n_layer"),
        n_heads=f.integer("n_head"),
        d_ff=f.integer("n_inner", 4 * d_model),
        positions="learned",
        activation=GPT2_ACTIVATIONS[act],  # type: ignore[arg-type]
        tie_embeddings=f.flag("tie_word_embeddings", True),
        layer_norm_eps=f.number("layer_norm_epsilon", 1e-5),
    )


# Gemma3TextConfig's defaults of what the decoder reads: the published multimodal checkpoints' text_config
# lists only the values that differ from them (Gemma 3 4B: its sizes, layer count, window and RoPE scaling).
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
}


def _text_stack_fields(config: dict[str, Any], path: Path) -> _Fields:
    """A multimodal config's text_config, as transformers completes it. Whether the head is tied to the
    embedding is the top-level tie_word_embeddings (the one transformers 5 reads), else the text config's;
    final_logit_softcapping is dropped: Gemma3ForConditionalGeneration never caps its logits (the text-only
    Gemma3ForCausalLM does)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise HFImportError(path, f"'text_config' must be an object (the language model's), found {text!r}")
    tied = config.get("tie_word_embeddings")
    if tied is None:
        tied = text.get("tie_word_embeddings", True)
    return _Fields(
        {**GEMMA3_TEXT_DEFAULTS, **text, "tie_word_embeddings": tied, "final_logit_softcapping": None}, path
    )


def decoder_config(folder: Path | str) -> tuple[str, DecoderConfig]:
    """The architecture named in folder/config.json and the DecoderConfig of its model (of a multimodal
    checkpoint: of its text stack)."""
    path = Path(folder) / CONFIG_FILE
    config = read_json(path)
    architecture = hf_architecture(config, path)
    text_only = TEXT_STACK_OF.get(architecture)
    f = _Fields(config, path) if text_only is None else _text_stack_fields(config, path)
    try:
        cfg = _family_config(f, text_only or architecture)
    except ValueError as exc:  # DecoderConfig's own validation: values that do not fit together
        if isinstance(exc, HFImportError):
            raise
        raise HFImportError(path, f"not a valid {architecture} configuration: {exc}") from exc
    return architecture, cfg


# -- safetensors -> the decoder's state dict ---------------------------------------------------------------


@dataclass(frozen=True)
class _Source:
    """How one tensor of the decoder is made of checkpoint tensors (concatenated on dim 0, or transposed)."""

    names: tuple[str, ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor]


def _one(name: str) -> _Source:
    return _Source((name,), lambda ts: ts[0])


def _concat(*names: str) -> _Source:
    return _Source(names, lambda ts: torch.cat(ts, dim=0))


def _plus_one(name: str) -> _Source:  # Gemma's RMSNorm multiplies by (1 + weight)
    return _Source((name,), lambda ts: ts[0] + 1.0)


def _transposed(name: str) -> _Source:  # GPT-2's Conv1D keeps [in, out]; nn.Linear [out, in]
    return _Source((name,), lambda ts: ts[0].t().contiguous())


# Our norms -> the checkpoint's names, by the config's norm placement (Llama's post_attention_layernorm is the
# norm before the MLP; Gemma's and OLMo 2's is the norm after attention).
NORM_NAMES = {
    "pre": {"ln_attn": "input_layernorm", "ln_ffn": "post_attention_layernorm"},
    "sandwich": {
        "ln_attn": "input_layernorm",
        "ln_attn_out": "post_attention_layernorm",
        "ln_ffn": "pre_feedforward_layernorm",
        "ln_ffn_out": "post_feedforward_layernorm",
    },
    "post": {"ln_attn_out": "post_attention_layernorm", "ln_ffn_out": "post_feedforward_layernorm"},
}


def _llama_like_sources(cfg: DecoderConfig, architecture: str, mxfp4: bool = False) -> dict[str, _Source]:
    """Llama's tensor names, and the other families' as they differ: Phi-3's fused projections, Gemma's
    (1 + w) norms, the norms of cfg.norm_placement."""
    norm = _plus_one if architecture in GEMMA else _one
    sources = {"tok_emb.weight": _one("model.embed_tokens.weight"), "ln_f.weight": norm("model.norm.weight")}
    if not cfg.tie_embeddings:
        sources["lm_head.weight"] = _one("lm_head.weight")
    fused = architecture == "Phi3ForCausalLM"
    for i in range(cfg.n_layers):
        hf, ours = f"model.layers.{i}", f"blocks.{i}"
        attn = f"{hf}.self_attn"
        mlp = f"{hf}.mlp"
        sources |= {
            f"{ours}.{our_norm}.weight": norm(f"{hf}.{their_norm}.weight")
            for our_norm, their_norm in NORM_NAMES[cfg.norm_placement].items()
        }
        sources |= {
            f"{ours}.attn.qkv.weight": _one(f"{attn}.qkv_proj.weight")
            if fused
            else _concat(*(f"{attn}.{p}_proj.weight" for p in "qkv")),
            f"{ours}.attn.out.weight": _one(f"{attn}.o_proj.weight"),
        }
        if cfg.attention_sinks:
            sources[f"{ours}.attn.sinks"] = _one(f"{attn}.sinks")
        if architecture == "GptOssForCausalLM":
            sources |= _gpt_oss_experts_sources(f"{hf}.mlp", f"{ours}.ffn", mxfp4)
        elif cfg.sparse(i):
            sources |= _experts_sources(cfg, architecture, hf, f"{ours}.ffn")
        else:
            sources |= {
                f"{ours}.ffn.up.weight": _one(f"{mlp}.gate_up_proj.weight")
                if fused
                else _concat(f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"),
                f"{ours}.ffn.down.weight": _one(f"{mlp}.down_proj.weight"),
            }
        if cfg.qkv_bias:
            sources[f"{ours}.attn.qkv.bias"] = (
                _one(f"{attn}.qkv_proj.bias") if fused else _concat(*(f"{attn}.{p}_proj.bias" for p in "qkv"))
            )
        if cfg.out_bias:
            sources[f"{ours}.attn.out.bias"] = _one(f"{attn}.o_proj.bias")
        if cfg.mlp_bias:
            sources[f"{ours}.ffn.up.bias"] = _concat(f"{mlp}.gate_proj.bias", f"{mlp}.up_proj.bias")
            sources[f"{ours}.ffn.down.bias"] = _one(f"{mlp}.down_proj.bias")
        if cfg.qk_norm:
            sources[f"{ours}.attn.q_norm.weight"] = norm(f"{attn}.q_norm.weight")
            sources[f"{ours}.attn.k_norm.weight"] = norm(f"{attn}.k_norm.weight")
    return sources


def _experts_sources(cfg: DecoderConfig, architecture: str, hf: str, ours: str) -> dict[str, _Source]:
    """One sparse layer's router and experts: the checkpoint's per-expert [F, D] gate and up stacked as our
    [E, 2F, D] up ([gate; up] per expert), its [D, F] downs as our [E, D, F] down."""
    assert cfg.experts is not None
    n = cfg.experts.n_experts
    if architecture == "MixtralForCausalLM":
        moe = f"{hf}.block_sparse_moe"
        gate, up, down = (f"{moe}.experts.{{}}.{w}.weight" for w in ("w1", "w3", "w2"))
    else:  # Qwen3-MoE, OLMoE
        moe = f"{hf}.mlp"
        gate, up, down = (f"{moe}.experts.{{}}.{w}_proj.weight" for w in ("gate", "up", "down"))
    pairs = tuple(name for e in range(n) for name in (gate.format(e), up.format(e)))
    return {
        f"{ours}.router.weight": _one(f"{moe}.gate.weight"),
        f"{ours}.up": _Source(
            pairs, lambda ts: torch.stack([torch.cat(ts[j : j + 2]) for j in range(0, len(ts), 2)])
        ),
        f"{ours}.down": _Source(tuple(down.format(e) for e in range(n)), torch.stack),
    }


def _deinterleaved(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's fused gate/up alternate along dim 1 (gate, up, gate, ...): ours are [gate; up]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _gpt_oss_experts_sources(mlp: str, ours: str, mxfp4: bool) -> dict[str, _Source]:
    """gpt-oss's router (with a bias) and its experts, fused in the checkpoint: gate_up_proj [E, D, 2F] and
    down_proj [E, F, D] with biases, or, in its published MXFP4 form, *_blocks / *_scales holding the
    weights as [E, 2F, D] and [E, D, F] (export/mxfp4.py), read exactly."""
    experts = f"{mlp}.experts"
    sources = {
        f"{ours}.router.weight": _one(f"{mlp}.router.weight"),
        f"{ours}.router.bias": _one(f"{mlp}.router.bias"),
        f"{ours}.up_bias": _Source((f"{experts}.gate_up_proj_bias",), lambda ts: _deinterleaved(ts[0])),
        f"{ours}.down_bias": _one(f"{experts}.down_proj_bias"),
    }
    if mxfp4:
        gate_up = tuple(f"{experts}.gate_up_proj_{part}" for part in ("blocks", "scales"))
        down = tuple(f"{experts}.down_proj_{part}" for part in ("blocks", "scales"))
        sources[f"{ours}.up"] = _Source(gate_up, lambda ts: _deinterleaved(dequantize_mxfp4(*ts)))
        sources[f"{ours}.down"] = _Source(down, lambda ts: dequantize_mxfp4(*ts))
    else:
        sources[f"{ours}.up"] = _Source(
            (f"{experts}.gate_up_proj",), lambda ts: _deinterleaved(ts[0].transpose(1, 2))
        )
        sources[f"{ours}.down"] = _Source(
            (f"{experts}.down_proj",), lambda ts: ts[0].transpose(1, 2).contiguous()
        )
    return sources


def _gpt2_sources(cfg: DecoderConfig, prefix: str) -> dict[str, _Source]:
    t = prefix
    sources = {
        "tok_emb.weight": _one(f"{t}wte.weight"),
        "pos_emb.weight": _one(f"{t}wpe.weight"),
        "ln_f.weight": _one(f"{t}ln_f.weight"),
        "ln_f.bias": _one(f"{t}ln_f.bias"),
    }
    if not cfg.tie_embeddings:
        sources["lm_head.weight"] = _one("lm_head.weight")
    for i in range(cfg.n_layers):
        hf, ours = f"{t}h.{i}", f"blocks.{i}"
        for kind in ("weight", "bias"):
            sources[f"{ours}.ln_attn.{kind}"] = _one(f"{hf}.ln_1.{kind}")
            sources[f"{ours}.ln_ffn.{kind}"] = _one(f"{hf}.ln_2.{kind}")
        sources |= {
            f"{ours}.attn.qkv.weight": _transposed(f"{hf}.attn.c_attn.weight"),
            f"{ours}.attn.qkv.bias": _one(f"{hf}.attn.c_attn.bias"),
            f"{ours}.attn.out.weight": _transposed(f"{hf}.attn.c_proj.weight"),
            f"{ours}.attn.out.bias": _one(f"{hf}.attn.c_proj.bias"),
            f"{ours}.ffn.up.weight": _transposed(f"{hf}.mlp.c_fc.weight"),
            f"{ours}.ffn.up.bias": _one(f"{hf}.mlp.c_fc.bias"),
            f"{ours}.ffn.down.weight": _transposed(f"{hf}.mlp.c_proj.weight"),
            f"{ours}.ffn.down.bias": _one(f"{hf}.mlp.c_proj.bias"),
        }
    return sources


# Where a multimodal checkpoint keeps its text stack: transformers 5's modules (model.language_model.*, the
# head at the top), and the layout transformers 4 saved and 5 still writes (language_model.model.*).
TEXT_STACK_PREFIXES = {
    "model.language_model.": ("model.language_model.", "lm_head.weight"),
    "language_model.model.": ("language_model.model.", "language_model.lm_head.weight"),
}
# The multimodal checkpoints' tensors the text stack does not use: the vision tower and its projection.
NOT_TEXT_STACK = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def _text_stack_sources(sources: dict[str, _Source], names: list[str]) -> dict[str, _Source]:
    """The text-only model's sources renamed to where the multimodal checkpoint holds them (by its names)."""
    stack, head = next(
        (v for k, v in TEXT_STACK_PREFIXES.items() if any(n.startswith(k) for n in names)),
        TEXT_STACK_PREFIXES["model.language_model."],
    )

    def renamed(name: str) -> str:
        return head if name == "lm_head.weight" else stack + name.removeprefix("model.")

    return {ours: replace(src, names=tuple(map(renamed, src.names))) for ours, src in sources.items()}


def _sources(cfg: DecoderConfig, architecture: str, names: list[str]) -> dict[str, _Source]:
    """Each tensor of ours -> the checkpoint tensors it is made of, by the architecture (and, for GPT-2's
    prefix, gpt-oss's MXFP4 experts and a multimodal checkpoint's text stack, the checkpoint's names)."""
    if architecture == "GPT2LMHeadModel":
        # GPT-2 checkpoints exist with and without the base model's "transformer." prefix.
        prefix = "transformer." if any(n.startswith("transformer.") for n in names) else ""
        return _gpt2_sources(cfg, prefix)
    mxfp4 = any(n.endswith(MXFP4_SUFFIXES) for n in names)
    sources = _llama_like_sources(cfg, TEXT_STACK_OF.get(architecture, architecture), mxfp4)
    return _text_stack_sources(sources, names) if architecture in TEXT_STACK_OF else sources


def checkpoint_modules(cfg: DecoderConfig, architecture: str) -> dict[str, list[tuple[str, int]]]:
    """Each projection of ours -> the checkpoint's modules it is made of, with their output features: the
    names a peft adapter of the checkpoint gives its weights (export/lora.py). GPT-2's are those of
    GPT2LMHeadModel, under "transformer." whichever way its file names them; a multimodal model's those of
    its transformers 5 modules (model.language_model.*)."""
    sources = _sources(cfg, architecture, ["transformer.", "model.language_model."])
    modules: dict[str, list[tuple[str, int]]] = {}
    for i in range(cfg.n_layers):
        for projection in PROJECTIONS:
            if cfg.sparse(i) and projection.startswith("ffn."):  # the experts take no LoRA branch
                continue
            names = [n.removesuffix(".weight") for n in sources[f"blocks.{i}.{projection}.weight"].names]
            total = projection_features(cfg, projection)
            sizes = {3: [cfg.q_dim, cfg.kv_dim, cfg.kv_dim], 2: [total // 2] * 2}.get(len(names), [total])
            modules[f"blocks.{i}.{projection}"] = list(zip(names, sizes, strict=True))
    return modules


def adapter_names(architecture: str) -> AdapterNames:
    """What a peft adapter of the checkpoint may name besides checkpoint_modules: a multimodal checkpoint's
    vision tower and projection (peft's target_modules match their q_proj, fc1, ... too), left out as the
    import leaves them out, and transformers 4's names of its text stack (language_model.model.*)."""
    if architecture not in TEXT_STACK_OF:
        return AdapterNames()
    return AdapterNames(NOT_TEXT_STACK, {"language_model.model.": "model.language_model."})


def _ignored(name: str, cfg: DecoderConfig, architecture: str) -> bool:
    """Checkpoint tensors that are not weights of ours: older transformers saved RoPE frequencies and GPT-2's
    causal-mask buffers (attn.bias, attn.masked_bias) with the weights, a tied model's file may still
    hold lm_head.weight (transformers ties it to the embedding all the same), and a multimodal checkpoint
    holds its vision tower."""
    if cfg.tie_embeddings and name in ("lm_head.weight", "language_model.lm_head.weight"):
        return True
    if architecture in TEXT_STACK_OF and name.startswith(NOT_TEXT_STACK):
        return True
    return name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"))


def weight_files(folder: Path) -> dict[Path, list[str] | None]:
    """The safetensors files to read, each with the tensor names the index assigns it (None: all it holds)."""
    index_path = folder / WEIGHTS_INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise HFImportError(
                index_path, "no 'weight_map' of tensor names to shard files; download it again"
            )
        files: dict[Path, list[str] | None] = {}
        for name, file in weight_map.items():
            if not isinstance(file, str) or Path(file).name != file:
                raise HFImportError(
                    index_path, f"tensor {name!r} maps to {file!r}, not a file name beside it"
                )
            names = files.setdefault(folder / file, [])
            assert names is not None
            names.append(name)
        for path in files:
            if not path.is_file():
                raise HFImportError(path, f"shard listed in {WEIGHTS_INDEX_FILE} is missing; download it")
        return files
    single = folder / WEIGHTS_FILE
    if single.is_file():
        return {single: None}
    if any(folder.glob("pytorch_model*.bin")):
        raise HFImportError(
            single,
            "not found, only PyTorch .bin weights: convert them to safetensors (load the model in "
            "transformers and save_pretrained it, or download the repository's model.safetensors)",
        )
    raise HFImportError(
        single, f"not found (nor {WEIGHTS_INDEX_FILE}); download the model's safetensors weights"
    )


def _read_shard(path: Path, names: list[str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of one safetensors file (memory-mapped) upcast to float32."""
    try:
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for name in names if names is not None else sorted(present):
                if name not in present:
                    listed = f"tensor {name!r} listed in {WEIGHTS_INDEX_FILE}"
                    raise HFImportError(path, f"{listed} is not in this shard; download it again")
                tensor = f.get_tensor(name)
                if tensor.dtype == torch.uint8 and name.endswith(MXFP4_SUFFIXES):
                    yield name, tensor  # MXFP4 codes and scales, dequantized when combined
                    continue
                if tensor.dtype not in FLOAT_DTYPES:
                    raise HFImportError(
                        path,
                        f"tensor {name!r} is {tensor.dtype}; only float32/bfloat16/float16 weights are "
                        "supported (not quantized checkpoints)",
                    )
                yield name, tensor.to(torch.float32)
    except HFImportError:
        raise
    except Exception as exc:  # safetensors raises SafetensorError, OSError, ... for damaged files
        raise HFImportError(
            path, f"not a readable safetensors file ({type(exc).__name__}: {exc}); download it again"
        ) from exc


# Families whose tensor names decide the mapping: GPT-2's prefix, gpt-oss's dense or MXFP4 experts, where a
# multimodal checkpoint keeps its text stack.
NAMES_DECIDE = ("GPT2LMHeadModel", "GptOssForCausalLM", *TEXT_STACK_OF)


def _tensor_names(files: dict[Path, list[str] | None]) -> list[str]:
    """The checkpoint's tensor names: the index's, or the single file's."""
    names = [n for listed in files.values() if listed is not None for n in listed]
    if names:
        return names
    path = next(iter(files))
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as exc:  # as _read_shard says it
        raise HFImportError(
            path, f"not a readable safetensors file ({type(exc).__name__}: {exc}); download it again"
        ) from exc


def load_state_dict(folder: Path | str, architecture: str, cfg: DecoderConfig) -> dict[str, torch.Tensor]:
    """The decoder's state dict from the folder's safetensors, shard by shard: each tensor of ours is built
    (and its sources dropped) as soon as the shards read so far hold all its sources."""
    folder = Path(folder)
    files = weight_files(folder)
    config_path = folder / CONFIG_FILE
    sources = _sources(cfg, architecture, _tensor_names(files) if architecture in NAMES_DECIDE else [])
    with torch.device("meta"):
        expected = {k: v.shape for k, v in Decoder(cfg).state_dict().items()}
    wanted = {name for src in sources.values() for name in src.names}
    pending = dict(sources)
    loaded: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    state: dict[str, torch.Tensor] = {}
    for path, names in files.items():
        for name, tensor in _read_shard(path, names):
            if name not in wanted:
                if _ignored(name, cfg, architecture):
                    continue
                raise HFImportError(
                    path,
                    f"unexpected tensor {name!r} for {architecture} as {CONFIG_FILE} says: {MISMATCH}",
                )
            loaded[name], origin[name] = tensor, path
        for target, src in list(pending.items()):
            if all(n in loaded for n in src.names):
                state[target] = _combined(
                    src, [loaded.pop(n) for n in src.names], expected[target], target, origin
                )
                del pending[target]
    if pending:
        missing = sorted(n for src in pending.values() for n in src.names if n not in loaded)
        shown = ", ".join(repr(n) for n in missing[:3]) + (
            f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        )
        where = ", ".join(p.name for p in files)
        raise HFImportError(
            config_path,
            f"the weights ({where}) lack {shown}, which {CONFIG_FILE} implies: {MISMATCH}",
        )
    if cfg.tie_embeddings:
        state["lm_head.weight"] = state["tok_emb.weight"]
    return state


def _combined(
    src: _Source, parts: list[torch.Tensor], shape: torch.Size, target: str, origin: dict[str, Path]
) -> torch.Tensor:
    """The tensor of ours made of `parts`, if it has the shape the config implies."""
    try:
        tensor = src.combine(parts)
    except RuntimeError:  # parts that do not even concatenate
        tensor = None
    if tensor is not None and tensor.shape == shape:
        return tensor
    names = " + ".join(src.names)
    if tensor is None:
        found = f"{names} have shapes {[list(p.shape) for p in parts]}, which do not concatenate"
    else:
        found = f"{names} gives shape {list(tensor.shape)}"
    raise HFImportError(
        origin[src.names[0]], f"{found} where {CONFIG_FILE} implies {list(shape)} (for {target}): {MISMATCH}"
    )


def load_model(folder: Path | str) -> tuple[str, Decoder]:
    """The folder's model as our Decoder (fp32, eval, CPU): built on the meta device, then given the
    checkpoint's tensors, so no memory goes to a random initialisation first."""
    architecture, cfg = decoder_config(folder)
    if architecture in TEXT_STACK_OF:
        log.warning(
            "%s: %s imports as a text-only %s: its vision tower is left out (images are not served)",
            folder,
            architecture,
            TEXT_STACK_OF[architecture],
        )
    state = load_state_dict(folder, architecture, cfg)
    with torch.device("meta"):
        model = Decoder(cfg)
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.tok_emb.weight
    model.make_tables()
    return architecture, model.eval()


# -- the tokenizer -----------------------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token of tokenizer_config.json: a string, or an AddedToken dict with its "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, bool):
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return tuple(value)
    return ()


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    """chat_template.jinja (how transformers 5 saves it), else tokenizer_config.json's chat_template: a
    string, or a list of named templates of which "default" is the chat template."""
    jinja = folder / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _sentencepiece_tokenizer(folder: Path) -> Tokenizer:
    """A tokenizer.model-only folder, converted by transformers (its converter needs `sentencepiece`)."""
    path = folder / SENTENCEPIECE_FILE
    try:
        import sentencepiece  # noqa: F401
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise HFImportError(
            path,
            f"only a SentencePiece tokenizer, and converting it needs {exc.name!r}: pip install "
            "sentencepiece transformers, or add the repository's tokenizer.json",
        ) from exc
    try:
        hf = AutoTokenizer.from_pretrained(str(folder))
        backend = hf.backend_tokenizer
    except Exception as exc:
        raise HFImportError(path, f"transformers could not convert it ({type(exc).__name__}: {exc})") from exc
    return Tokenizer.from_str(backend.to_str())


def _check_encodes_text(tokenizer: Tokenizer, source: Path) -> None:
    """A tokenizer that turns text into special tokens alone (a tokenizer.json written with an empty
    vocabulary, as a failed conversion leaves it) would export a model nobody can prompt: refuse it here,
    not as a puzzling error later."""
    probe = tokenizer.encode("Hello, world")
    if not any(special == 0 for special in probe.special_tokens_mask):
        fix = "download it again"
        if source.name == TOKENIZER_FILE and (source.parent / SENTENCEPIECE_FILE).is_file():
            fix += f", or delete it so that {SENTENCEPIECE_FILE} is converted"
        raise HFImportError(
            source,
            f"encodes text to special tokens only (its vocabulary has {tokenizer.get_vocab_size()} "
            f"entries): a broken tokenizer file; {fix}",
        )


def load_tokenizer(folder: Path | str) -> HFTokenizer:
    """The folder's tokenizer with its special-token behaviour as transformers applies it:

    - the vocabulary from tokenizer.json (or tokenizer.model, converted);
    - BOS/EOS added on encoding by tokenizer.json's post-processor alone: transformers (5.24) drops
      tokenizer_config.json's add_bos_token / add_eos_token when a tokenizer.json is there;
    - EOS ids from generation_config.json (a list in Llama 3), else config.json, else the eos_token.
    """
    folder = Path(folder)
    tokenizer_config = (
        read_json(folder / TOKENIZER_CONFIG_FILE) if (folder / TOKENIZER_CONFIG_FILE).is_file() else {}
    )
    source = folder / TOKENIZER_FILE
    if source.is_file():
        try:
            tokenizer = Tokenizer.from_file(str(source))
        except Exception as exc:  # tokenizers raises a bare Exception for malformed files
            raise HFImportError(source, f"not a readable tokenizers file ({exc}); download it again") from exc
    elif (folder / SENTENCEPIECE_FILE).is_file():
        source = folder / SENTENCEPIECE_FILE
        tokenizer = _sentencepiece_tokenizer(folder)
    else:
        raise HFImportError(source, f"not found (nor {SENTENCEPIECE_FILE}); the folder has no tokenizer")

    def token_id(key: str) -> int | None:
        text = _token_text(tokenizer_config.get(key))
        return None if text is None else tokenizer.token_to_id(text)

    config = read_json(folder / CONFIG_FILE) if (folder / CONFIG_FILE).is_file() else {}
    generation = (
        read_json(folder / GENERATION_CONFIG_FILE) if (folder / GENERATION_CONFIG_FILE).is_file() else {}
    )
    bos_id = token_id("bos_token")
    if bos_id is None:
        bos_id = next(iter(_ids(generation.get("bos_token_id")) or _ids(config.get("bos_token_id"))), None)
    eos_ids = _ids(generation.get("eos_token_id")) or _ids(config.get("eos_token_id"))
    eos_from_tokenizer = token_id("eos_token")
    if not eos_ids and eos_from_tokenizer is not None:
        eos_ids = (eos_from_tokenizer,)
    pad_id = token_id("pad_token")
    if pad_id is None:
        pad_id = next(iter(_ids(generation.get("pad_token_id")) or _ids(config.get("pad_token_id"))), None)
    model_vocab = config.get("vocab_size")
    vocab = model_vocab if isinstance(model_vocab, int) else tokenizer.get_vocab_size()
    for name, ids in (("EOS", eos_ids), ("BOS", (bos_id,) if bos_id is not None else ())):
        if any(not 0 <= i < vocab for i in ids):
            raise HFImportError(source, f"{name} token ids {list(ids)} lie outside the vocabulary of {vocab}")

    _check_encodes_text(tokenizer, source)
    probe = tokenizer.encode("a")
    adds_bos = bool(probe.ids) and probe.ids[0] == bos_id and probe.special_tokens_mask[0] == 1
    return HFTokenizer(
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        bos_token_id=bos_id,
        adds_bos=adds_bos,
        pad_token_id=pad_id,
        chat_template=_chat_template(folder, tokenizer_config),
        source=source,
    )


def import_checkpoint(folder: Path | str) -> HFCheckpoint:
    """Everything the exporter needs of a local Hugging Face folder; raises HFImportError."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFImportError(folder, "not a directory; give the folder that holds config.json")
    architecture, model = load_model(folder)
    has_tokenizer = (folder / TOKENIZER_FILE).is_file() or (folder / SENTENCEPIECE_FILE).is_file()
    tokenizer = load_tokenizer(folder) if has_tokenizer else None
    if tokenizer is not None and tokenizer.tokenizer.get_vocab_size() > model.cfg.vocab_size:
        raise HFImportError(
            tokenizer.source,
            f"the tokenizer has {tokenizer.tokenizer.get_vocab_size()} ids but the model's vocab_size is "
            f"{model.cfg.vocab_size}: the tokenizer is not this model's",
        )
    config = read_json(folder / CONFIG_FILE)
    dtype = config.get("dtype", config.get("torch_dtype"))
    return HFCheckpoint(
        architecture=architecture,
        config=model.cfg,
        model=model,
        tokenizer=tokenizer,
        source_dtype=dtype if isinstance(dtype, str) else None,
    )
