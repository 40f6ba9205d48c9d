"""Qwen2 and Qwen2.5 (and the DeepSeek-R1 distills built on them): Llama's layers with biases
on q, k and v."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.engine.families.family import (
    Family,
    UnsupportedModelError,
    hf_args,
    hf_llama_layer,
)
from service.engine.model import ModelArgs


def qwen2_hf_args(config: Mapping[str, Any]) -> ModelArgs:
    # Qwen2 configs carry a sliding_window that only use_sliding_window switches on (on the
    # layers from max_window_layers); no released checkpoint switches it on.
    if config.get("use_sliding_window"):
        raise UnsupportedModelError("use_sliding_window=true is not supported for qwen2")
    return hf_args(config, attention_bias=True)


FAMILY = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    hf_args=qwen2_hf_args,
    hf_layer=hf_llama_layer,
)
