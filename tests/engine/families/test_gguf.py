"""The families' GGUF layouts through their readers: a tiny model written as a GGUF the way
llama.cpp's converter writes one (a llama's Q and K rows interleaved per head, Llama 3's scaling
as the `rope_freqs` tensor; Qwen's biases and q/k norms as they are) loads as the same model as
its Hugging Face directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.families.family import llama3_rope_factors
from service.engine.loader import LoadedModel, load_model
from tests.engine.families.test_families import LLAMA3_ROPE, SHAPE
from tests.gguf_files import write_gguf_from_hf
from tests.tiny_model import ContiguousAttention, make_tiny_family

CPU = torch.device("cpu")


def _logits(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    model = loaded.model
    attention = ContiguousAttention(loaded.args.num_layers)
    return model.compute_logits(model(ids, torch.arange(ids.shape[0]), attention))


@pytest.mark.parametrize(
    ("model_type", "config"),
    [
        ("llama", {"rope_parameters": LLAMA3_ROPE}),
        ("qwen2", {"tie_word_embeddings": True}),
        ("qwen3", {}),
        ("qwen3", {"attention_bias": True}),
        ("phi3", {"sliding_window": 27}),
    ],
    ids=["llama3-rope", "qwen2", "qwen3", "qwen3-bias", "phi3"],
)
@torch.inference_mode()
def test_a_gguf_is_the_same_model_as_its_hugging_face_directory(
    tmp_path: Path, model_type: str, config: dict[str, Any]
) -> None:
    directory = make_tiny_family(tmp_path / "hf", model_type, SHAPE | config)
    from_hf = load_model(directory, torch.float32, CPU)
    factors = None
    if model_type == "llama":
        factors = llama3_rope_factors(
            SHAPE["head_dim"], LLAMA3_ROPE["rope_theta"], factor=LLAMA3_ROPE["factor"],
            low_freq_factor=LLAMA3_ROPE["low_freq_factor"],
            high_freq_factor=LLAMA3_ROPE["high_freq_factor"],
            original_context=LLAMA3_ROPE["original_max_position_embeddings"],
        )  # fmt: skip
    path = write_gguf_from_hf(directory, tmp_path / "tiny.gguf", model_type, rope_freqs=factors)
    from_gguf = load_model(path, torch.float32, CPU)
    assert from_gguf.family == from_hf.family == model_type
    assert from_gguf.args == from_hf.args or (
        from_gguf.args.rope_freq_factors == pytest.approx(from_hf.args.rope_freq_factors)
    )
    if factors is not None:
        assert from_hf.args.rope_freq_factors is not None
        assert len(set(from_hf.args.rope_freq_factors)) > 2  # kept, blended and stretched
    ids = torch.randint(17, 49152, (90,), generator=torch.Generator().manual_seed(3))
    expected = _logits(from_hf, ids)
    assert float((_logits(from_gguf, ids) - expected).abs().max() / expected.abs().max()) <= 1e-5
