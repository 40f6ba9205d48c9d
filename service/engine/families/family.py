"""What a family is (`Family`), and the configuration readers most families share."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from service.engine.model import BlockFeatures, ModelArgs, SlidingWindow
from service.engine.quant import Weight, cat_rows, dense


class UnsupportedModelError(ValueError):
    """The checkpoint is readable but asks for something the decoder does not implement; the
    message names it (the architecture, a tensor, an option) in one line."""


# One layer's tensor by its name in the checkpoint, within the layer ("self_attn.q_proj.weight",
# "attn_q.weight"), taken out of what is left to load: a tensor nobody takes is an error.
TakeTensor = Callable[[str], Tensor]
TakeWeight = Callable[[str], Weight]


class GGUFSource(Protocol):
    """A GGUF file as a family's reader sees it: metadata under the architecture's prefix."""

    architecture: str

    def field(self, key: str, default: Any = None) -> Any:
        """`{architecture}.{key}` ("block_count"), or a full key ("general.name"); without a
        default a missing key is an error."""
        ...

    def has_tensor(self, name: str) -> bool: ...

    def take_dense(self, name: str) -> Tensor:
        """A model-level tensor (not a layer's), dequantized to fp32."""
        ...


@dataclass(frozen=True, slots=True)
class TokenizerQuirks:
    """How a family's GGUF files store their tokenizer apart from what llama.cpp's converter
    writes for most (service/engine/tokenizer.py rebuilds it from the file with these)."""

    # A SentencePiece vocabulary with no usable scores or merges: SentencePiece's BPE lists
    # its tokens in the order it learned them, so earlier tokens merge first (Gemma's).
    merges_in_vocabulary_order: bool = False
    # Tokens of spaces stored as spaces, which the model never sees ("\u2581" by then).
    spaces_stored_as_spaces: bool = False
    # A space before the text: None as the file says (`add_space_prefix`), else this.
    space_prefix: bool | None = None
    # The chat template for a file that carries none (as llama.cpp falls back on its built-in
    # ones), used only where the vocabulary holds each of `template_tokens` as a token.
    chat_template: str | None = None
    template_tokens: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GGUFFormat:
    architecture: str  # general.architecture
    args: Callable[[GGUFSource], ModelArgs]
    layer: Callable[[TakeWeight, ModelArgs], dict[str, Weight]]  # ours <- one layer's
    tokenizer: TokenizerQuirks = TokenizerQuirks()


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    hf_model_types: tuple[str, ...]  # config.json's model_type
    hf_args: Callable[[Mapping[str, Any]], ModelArgs]
    hf_layer: Callable[[TakeTensor, ModelArgs], dict[str, Tensor]]  # ours <- one layer's
    gguf: GGUFFormat | None = None  # None: served from Hugging Face files only
    # Added to every RMSNorm weight of a Hugging Face checkpoint: Gemma's norms scale by
    # (1 + weight), ours by the weight (GGUF files store the sum already).
    hf_norm_offset: float = 0.0


# -- Hugging Face configuration --------------------------------------------------------------


def hf_args(
    config: Mapping[str, Any],
    *,
    rope: tuple[float, tuple[float, ...] | None] | None = None,
    **features: Any,
) -> ModelArgs:
    """The fields every family's config.json spells alike, checked for what the decoder lacks,
    plus the family's `features` (ModelArgs fields); `rope` (base, divisors) where the family
    reads its own."""
    if config.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    act = config.get("hidden_act") or config.get("hidden_activation") or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise UnsupportedModelError(
            f"hidden_act {act!r} is not supported (silu, gelu_pytorch_tanh)"
        )
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, factors = rope if rope is not None else hf_rope(config, head_dim)
    block: BlockFeatures = features.pop("block", BlockFeatures())
    return ModelArgs(
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rope_theta=theta,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_freq_factors=factors,
        block=dataclasses.replace(block, activation=act),
        **features,
    )


def hf_rope(config: Mapping[str, Any], head_dim: int) -> tuple[float, tuple[float, ...] | None]:
    """RoPE's base and per-frequency divisors from a config.json: transformers 5 writes
    `rope_parameters`, earlier versions `rope_theta` and `rope_scaling`."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings ({partial}) are not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in rope]
        if missing:
            raise UnsupportedModelError(f"llama3 RoPE scaling without {', '.join(missing)}")
        return theta, llama3_rope_factors(
            head_dim,
            theta,
            factor=float(rope["factor"]),
            low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_context=int(rope["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"RoPE scaling {kind!r} is not supported (default, llama3)")


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    *,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> tuple[float, ...]:
    """Llama 3.1's RoPE scaling as divisors of the base frequencies: wavelengths shorter than
    the original context over `high_freq_factor` are kept, those longer than it over
    `low_freq_factor` stretched by `factor`, those between blended (the GGUF converter stores
    the same divisors as `rope_freqs`)."""
    low_wavelen = original_context / low_freq_factor
    high_wavelen = original_context / high_freq_factor
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor
            )
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


def refuse_qwen_windows(config: Mapping[str, Any], family: str) -> None:
    """Qwen configs carry a sliding_window that only use_sliding_window switches on (on the
    layers from max_window_layers); no released checkpoint switches it on."""
    if config.get("use_sliding_window"):
        raise UnsupportedModelError(f"use_sliding_window=true is not supported for {family}")


# -- GGUF metadata ---------------------------------------------------------------------------


def gguf_args(gguf: GGUFSource, **features: Any) -> ModelArgs:
    """The `{architecture}.*` keys llama.cpp's converter writes alike for every family, plus the
    family's `features`."""
    scaling = gguf.field("rope.scaling.type", "none")
    if scaling != "none":
        raise UnsupportedModelError(f"RoPE scaling {scaling!r} is not supported")
    hidden = int(gguf.field("embedding_length"))
    heads = int(gguf.field("attention.head_count"))
    head_dim = int(gguf.field("attention.key_length", hidden // heads))
    if int(gguf.field("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    vocab = gguf.field("vocab_size", 0) or len(gguf.field("tokenizer.ggml.tokens"))
    return ModelArgs(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf.field("feed_forward_length")),
        num_layers=int(gguf.field("block_count")),
        num_heads=heads,
        num_kv_heads=int(gguf.field("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rope_theta=float(gguf.field("rope.freq_base", 10000.0)),
        rms_norm_eps=float(gguf.field("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(gguf.field("context_length")),
        tie_word_embeddings=not gguf.has_tensor("output.weight"),
        **features,
    )


def gguf_layer(take: TakeWeight, args: ModelArgs) -> dict[str, Weight]:
    """llama.cpp's layer names for the families whose Q and K rows it stores as Hugging Face
    does (all but llama's, which it interleaves: `llama.py`), with their biases and q/k norms."""
    ours = {
        "attn_norm.weight": take("attn_norm.weight"),
        "attn.qkv.weight": cat_rows([take(f"attn_{p}.weight") for p in "qkv"]),
        "attn.o_proj.weight": take("attn_output.weight"),
        "mlp_norm.weight": take("ffn_norm.weight"),
        "mlp.gate_up.weight": cat_rows([take("ffn_gate.weight"), take("ffn_up.weight")]),
        "mlp.down.weight": take("ffn_down.weight"),
    }
    if args.attention.qkv_bias:
        ours["attn.qkv_bias"] = torch.cat([dense(take(f"attn_{p}.bias")) for p in "qkv"])
    if args.attention.output_bias:
        ours["attn.o_bias"] = dense(take("attn_output.bias"))
    if args.attention.qk_norm:
        ours["attn.q_norm.weight"] = take("attn_q_norm.weight")
        ours["attn.k_norm.weight"] = take("attn_k_norm.weight")
    return ours


def hf_sliding_window(config: Mapping[str, Any]) -> SlidingWindow | None:
    """A window on every layer, where config.json sets one."""
    window = config.get("sliding_window")
    return None if window is None else SlidingWindow(int(window))


def hf_llama_layer(take: TakeTensor, args: ModelArgs) -> dict[str, Tensor]:
    """Llama's layer names (q/k/v, gate/up split), which most families keep; their q/k/v
    biases, o's and q/k norms where the family has them (`ModelArgs.attention`)."""
    ours = {
        "attn_norm.weight": take("input_layernorm.weight"),
        "attn.qkv.weight": torch.cat([take(f"self_attn.{p}_proj.weight") for p in "qkv"]),
        "attn.o_proj.weight": take("self_attn.o_proj.weight"),
        "mlp_norm.weight": take("post_attention_layernorm.weight"),
        "mlp.gate_up.weight": torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")]),
        "mlp.down.weight": take("mlp.down_proj.weight"),
    }
    if args.attention.qkv_bias:
        ours["attn.qkv_bias"] = torch.cat([take(f"self_attn.{p}_proj.bias") for p in "qkv"])
    if args.attention.output_bias:
        ours["attn.o_bias"] = take("self_attn.o_proj.bias")
    if args.attention.qk_norm:
        ours["attn.q_norm.weight"] = take("self_attn.q_norm.weight")
        ours["attn.k_norm.weight"] = take("self_attn.k_norm.weight")
    return ours
