"""Qwen2 and Qwen2.5 (and the DeepSeek-R1 distills built on them): Llama's layers with biases
on q, k and v."""

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


def qwen2_hf_args(config: Mapping[str, Any]) -> ModelArgs:
    refuse_qwen_windows(config, "qwen2")
    return hf_args(config, attention=AttentionFeatures(qkv_bias=True))


def qwen2_gguf_args(gguf: GGUFSource) -> ModelArgs:
    return gguf_args(gguf, attention=AttentionFeatures(qkv_bias=True))


FAMILY = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_args=qwen2_hf_args,
    hf_layer=hf_llama_layer,
    gguf=GGUFFormat("qwen2", qwen2_gguf_args, gguf_layer),
)
