"""Llama (1, 2, 3.x) and SmolLM: the decoder's plain shape, with Llama 3's RoPE scaling.

GGUF: llama.cpp's converter interleaves each head's two RoPE halves of Q and K (for GPT-J style
rotation); the layer map undoes it. Llama 3's scaling arrives as the `rope_freqs` tensor there,
as `rope_parameters` (`rope_type: llama3`) in a config.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from service.engine.families.family import (
    Family,
    GGUFFormat,
    GGUFSource,
    TakeWeight,
    gguf_args,
    hf_args,
    hf_llama_layer,
)
from service.engine.model import AttentionFeatures, ModelArgs
from service.engine.quant import Weight, cat_rows, map_rows


def llama_hf_args(config: Mapping[str, Any]) -> ModelArgs:
    bias = bool(config.get("attention_bias"))  # on q, k, v and o alike
    return hf_args(config, attention=AttentionFeatures(qkv_bias=bias, output_bias=bias))


def llama_gguf_args(gguf: GGUFSource) -> ModelArgs:
    factors = None
    if gguf.has_tensor("rope_freqs.weight"):  # Llama 3's scaling, as the converter stores it
        factors = tuple(float(f) for f in gguf.take_dense("rope_freqs.weight"))
    return gguf_args(gguf, rope_freq_factors=factors)


def llama_gguf_layer(take: TakeWeight, args: ModelArgs) -> dict[str, Weight]:
    # Un-permuting reorders rows (outputs), which carry their groups' scales with them.
    q = map_rows(take("attn_q.weight"), lambda w: unpermute_rope(w, args.num_heads))
    k = map_rows(take("attn_k.weight"), lambda w: unpermute_rope(w, args.num_kv_heads))
    return {
        "attn_norm.weight": take("attn_norm.weight"),
        "attn.qkv.weight": cat_rows([q, k, take("attn_v.weight")]),
        "attn.o_proj.weight": take("attn_output.weight"),
        "mlp_norm.weight": take("ffn_norm.weight"),
        "mlp.gate_up.weight": cat_rows([take("ffn_gate.weight"), take("ffn_up.weight")]),
        "mlp.down.weight": take("ffn_down.weight"),
    }


def unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter interleaves each head's two RoPE halves for GPT-J style rope;
    undo it to get the rotate_half layout the model uses."""
    d_out, d_in = w.shape
    return w.reshape(n_heads, d_out // n_heads // 2, 2, d_in).transpose(1, 2).reshape(d_out, d_in)


FAMILY = Family(
    name="llama",
    hf_model_types=("llama",),
    hf_args=llama_hf_args,
    hf_layer=hf_llama_layer,
    gguf=GGUFFormat("llama", llama_gguf_args, llama_gguf_layer),
)
