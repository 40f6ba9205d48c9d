"""Qwen3 (dense): Llama's layers with an RMSNorm over each head of q and k before RoPE, and
q/k/v/o biases where the config asks (`attention_bias`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.engine.families.family import (
    Family,
    GGUFFormat,
    GGUFSource,
    gguf_args,
    gguf_layer,
    hf_args,
    hf_llama_layer,
    refuse_qwen_windows,
)
from service.engine.model import AttentionFeatures, ModelArgs


def qwen3_hf_args(config: Mapping[str, Any]) -> ModelArgs:
    refuse_qwen_windows(config, "qwen3")
    bias = bool(config.get("attention_bias"))  # on q, k, v and o alike
    return hf_args(config, attention=_attention(bias))


def qwen3_gguf_args(gguf: GGUFSource) -> ModelArgs:
    bias = gguf.has_tensor("blk.0.attn_q.bias")
    return gguf_args(gguf, attention=_attention(bias))


def _attention(bias: bool) -> AttentionFeatures:
    return AttentionFeatures(qk_norm=True, qkv_bias=bias, output_bias=bias)


FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_args=qwen3_hf_args,
    hf_layer=hf_llama_layer,
    gguf=GGUFFormat("qwen3", qwen3_gguf_args, gguf_layer),
)
