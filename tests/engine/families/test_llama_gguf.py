"""Llama's GGUF layout through the family's reader: a tiny Llama 3.1-scaled model written as a
GGUF the way llama.cpp's converter writes one (Q and K rows interleaved per head, the scaling
as the `rope_freqs` tensor) loads as the same model as its Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from service.engine.families.family import llama3_rope_factors
from service.engine.loader import default_model_path, load_model, open_gguf
from tests.engine.families.test_families import LLAMA3_ROPE, SHAPE
from tests.tiny_model import ContiguousAttention, make_tiny_family

CPU = torch.device("cpu")


def _interleave_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of Q and K rows (what the family's reader undoes)."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_llama_gguf(directory: Path, path: Path) -> Path:
    """The Hugging Face Llama in `directory` as a llama GGUF (fp32 tensors), the bundled model's
    tokenizer metadata copied over."""
    weights = {
        k.removeprefix("model."): v.numpy()
        for k, v in load_file(directory / "model.safetensors").items()
    }
    writer = gguf.GGUFWriter(path, "llama")
    heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim = SHAPE["head_dim"]
    writer.add_context_length(SHAPE["max_position_embeddings"])
    writer.add_embedding_length(SHAPE["hidden_size"])
    writer.add_block_count(SHAPE["num_hidden_layers"])
    writer.add_feed_forward_length(SHAPE["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(LLAMA3_ROPE["rope_theta"])
    writer.add_layer_norm_rms_eps(SHAPE["rms_norm_eps"])
    bundled = open_gguf(default_model_path())
    for key in ("model", "pre", "tokens", "token_type", "merges", "eos_token_id", "bos_token_id"):
        field = bundled.get_field(f"tokenizer.ggml.{key}")
        assert field is not None
        value = field.contents()
        writer.add_key_value(
            f"tokenizer.ggml.{key}", value, gguf.GGUFValueType(field.types[0]),
            sub_type=gguf.GGUFValueType(field.types[-1]) if len(field.types) > 1 else None,
        )  # fmt: skip
    factors = llama3_rope_factors(
        head_dim, LLAMA3_ROPE["rope_theta"], factor=LLAMA3_ROPE["factor"],
        low_freq_factor=LLAMA3_ROPE["low_freq_factor"],
        high_freq_factor=LLAMA3_ROPE["high_freq_factor"],
        original_context=LLAMA3_ROPE["original_max_position_embeddings"],
    )  # fmt: skip
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    writer.add_tensor("token_embd.weight", weights.pop("embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", weights.pop("norm.weight"))
    writer.add_tensor("output.weight", weights.pop("lm_head.weight"))
    names = {
        "input_layernorm": "attn_norm", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for i in range(SHAPE["num_hidden_layers"]):
        q = weights.pop(f"layers.{i}.self_attn.q_proj.weight")
        k = weights.pop(f"layers.{i}.self_attn.k_proj.weight")
        writer.add_tensor(f"blk.{i}.attn_q.weight", _interleave_rope(q, heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _interleave_rope(k, kv_heads))
        for theirs, ours in names.items():
            writer.add_tensor(f"blk.{i}.{ours}.weight", weights.pop(f"layers.{i}.{theirs}.weight"))
    assert not weights, sorted(weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@torch.inference_mode()
def test_a_llama3_scaled_gguf_is_the_same_model_as_its_hugging_face_directory(
    tmp_path: Path,
) -> None:
    config = SHAPE | {"rope_parameters": LLAMA3_ROPE}
    directory = make_tiny_family(tmp_path / "hf", "llama", config)
    from_hf = load_model(directory, torch.float32, CPU)
    from_gguf = load_model(write_llama_gguf(directory, tmp_path / "tiny.gguf"), torch.float32, CPU)
    assert from_gguf.family == "llama"
    assert from_gguf.args.rope_freq_factors == pytest.approx(from_hf.args.rope_freq_factors)
    assert from_hf.args.rope_freq_factors is not None
    assert len(set(from_hf.args.rope_freq_factors)) > 2  # kept, blended and stretched
    ids = torch.randint(17, 49152, (90,), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(90)
    logits = [
        m.model.compute_logits(m.model(ids, positions, ContiguousAttention(m.args.num_layers)))
        for m in (from_hf, from_gguf)
    ]
    assert float((logits[0] - logits[1]).abs().max() / logits[0].abs().max()) <= 1e-5
