"""Phi-3 and Phi-3.5 mini: Llama's layer with q, k and v in one projection (`qkv_proj`, our own
layout already) and gate and up in one (`gate_up_proj`, [gate; up] as ours).

Its 4k-context checkpoints slide a 2,047-key window on every layer; the 128k ones' `longrope`
scaling is refused by name. Its GGUF files keep both fusions (`attn_qkv`, and `ffn_up` holding
gate and up).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from service.engine.families.family import (
    Family,
    GGUFFormat,
    GGUFSource,
    TakeTensor,
    TakeWeight,
    UnsupportedModelError,
    gguf_args,
    hf_args,
    hf_sliding_window,
)
from service.engine.model import ModelArgs, SlidingWindow
from service.engine.quant import Weight


def phi3_hf_args(config: Mapping[str, Any]) -> ModelArgs:
    return hf_args(config, window=hf_sliding_window(config))


# Ours <- (Hugging Face's, llama.cpp's) name of each tensor of a layer. llama.cpp keeps both
# fusions as Hugging Face has them: `ffn_up` is [gate; up].
_LAYER_NAMES = {
    "attn_norm.weight": ("input_layernorm.weight", "attn_norm.weight"),
    "attn.qkv.weight": ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
    "attn.o_proj.weight": ("self_attn.o_proj.weight", "attn_output.weight"),
    "mlp_norm.weight": ("post_attention_layernorm.weight", "ffn_norm.weight"),
    "mlp.gate_up.weight": ("mlp.gate_up_proj.weight", "ffn_up.weight"),
    "mlp.down.weight": ("mlp.down_proj.weight", "ffn_down.weight"),
}


def phi3_hf_layer(take: TakeTensor, args: ModelArgs) -> dict[str, Tensor]:
    return {ours: take(hf) for ours, (hf, _) in _LAYER_NAMES.items()}


def phi3_gguf_args(gguf: GGUFSource) -> ModelArgs:
    if gguf.has_tensor("rope_factors_long.weight"):
        raise UnsupportedModelError("Phi-3's longrope scaling (rope_factors_long) is not supported")
    window = int(gguf.field("attention.sliding_window", 0))
    return gguf_args(gguf, window=SlidingWindow(window) if window else None)


def phi3_gguf_layer(take: TakeWeight, args: ModelArgs) -> dict[str, Weight]:
    return {ours: take(gguf) for ours, (_, gguf) in _LAYER_NAMES.items()}


FAMILY = Family(
    name="phi3",
    hf_model_types=("phi3",),
    hf_args=phi3_hf_args,
    hf_layer=phi3_hf_layer,
    gguf=GGUFFormat("phi3", phi3_gguf_args, phi3_gguf_layer),
)
