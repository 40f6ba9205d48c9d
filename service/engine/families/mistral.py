"""Mistral and Ministral: Llama's layers with a sliding attention window.

The window is `sliding_window` keys, the query's own included (transformers' mask), applied by
the paged attention on every layer; Mistral 7B v0.3 and Nemo have none.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.engine.families.family import Family, hf_args, hf_llama_layer, hf_sliding_window
from service.engine.model import ModelArgs


def mistral_hf_args(config: Mapping[str, Any]) -> ModelArgs:
    return hf_args(config, window=hf_sliding_window(config))


FAMILY = Family(
    name="mistral",
    hf_model_types=("mistral", "ministral"),
    hf_args=mistral_hf_args,
    hf_layer=hf_llama_layer,
)
