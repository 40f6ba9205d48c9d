"""The model families pagechat serves: one module each, over the one decoder (`model.py`).

A family says which checkpoints are its own (Hugging Face `model_type`, GGUF
`general.architecture`), reads their configuration into `ModelArgs` (switching on the decoder's
features it uses) and maps their tensor names onto ours, layer by layer. Nothing else changes per
family: the engine, scheduler, KV cache, kernels and service see one `DecoderModel`.

Adding a family is a module here with a `FAMILY`, a line in `FAMILIES`, a row in docs/models.md
and its case in tests/engine/families/ (a tiny random-weight model built by transformers from the
family's own config, checked against transformers).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from service.engine.families import gemma3, llama, mistral, phi3, qwen2, qwen3
from service.engine.families.family import Family, UnsupportedModelError

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    phi3.FAMILY,
    gemma3.FAMILY,
)

__all__ = ["FAMILIES", "Family", "UnsupportedModelError", "family_of_gguf", "family_of_hf"]


def family_of_hf(config: Mapping[str, Any]) -> Family:
    """The family of a Hugging Face `config.json`, by its `model_type`."""
    model_type = config.get("model_type")
    for family in FAMILIES:
        if model_type in family.hf_model_types:
            return family
    known = ", ".join(t for f in FAMILIES for t in f.hf_model_types)
    archs = config.get("architectures") or []
    raise UnsupportedModelError(
        f"unsupported model_type {model_type!r} ({', '.join(archs) or 'no architectures'});"
        f" supported: {known} (docs/models.md)"
    )


def family_of_gguf(architecture: str) -> Family:
    """The family of a GGUF file, by its `general.architecture`."""
    for family in FAMILIES:
        if family.gguf is not None and architecture == family.gguf.architecture:
            return family
    for family in FAMILIES:
        if architecture in (family.name, *family.hf_model_types):  # served from HF files only
            raise UnsupportedModelError(
                f"GGUF architecture {architecture!r} is served from its Hugging Face directory"
                " only, not yet from a GGUF file (docs/models.md)"
            )
    known = ", ".join(f.gguf.architecture for f in FAMILIES if f.gguf is not None)
    raise UnsupportedModelError(
        f"unsupported GGUF architecture {architecture!r}; supported: {known} (docs/models.md)"
    )
