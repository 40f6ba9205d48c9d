"""Gemma 3 (text: 270M, 1B; `gemma3_text`): local and global layers, each kind with its own
RoPE base, q/k norms, norms before and after each sublayer, a gated tanh-GELU MLP, embeddings
scaled by sqrt(hidden), the attention scaled by `query_pre_attn_scalar`, and norms that scale
by (1 + weight). The local layers slide a window (`ModelArgs.layer_windows`). The multimodal
checkpoints (`gemma3`, 4B and up) are refused.
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
    TokenizerQuirks,
    UnsupportedModelError,
    gguf_args,
    gguf_layer,
    hf_args,
    hf_llama_layer,
)
from service.engine.model import AttentionFeatures, BlockFeatures, ModelArgs, SlidingWindow
from service.engine.quant import Weight

# What llama.cpp's converter leaves out of a gemma3 GGUF and llama.cpp itself assumes: every
# sixth layer is global, the rest local with RoPE base 10,000.
GGUF_LAYER_PATTERN = 6
GGUF_LOCAL_ROPE_BASE = 10000.0
# llama.cpp's one exception to the attention scale of 1 / sqrt(key_length): the 27B (62
# layers) scales by 1 / sqrt(hidden / heads), as its query_pre_attn_scalar says.
GGUF_27B_LAYERS = 62


def _rope_base(rope: Mapping[str, Any], kind: str) -> float:
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedModelError(
            f"RoPE scaling {rope.get('rope_type')!r} on gemma3's {kind} layers is not supported"
        )
    return float(rope["rope_theta"])


def gemma3_hf_args(config: Mapping[str, Any]) -> ModelArgs:
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if config.get(cap) is not None:
            raise UnsupportedModelError(f"{cap} is not supported")
    if config.get("use_bidirectional_attention"):
        raise UnsupportedModelError("use_bidirectional_attention=true is not supported")
    per_kind = config.get("rope_parameters") or {}
    if "full_attention" in per_kind:  # transformers 5: a RoPE per kind of layer
        global_theta = _rope_base(per_kind["full_attention"], "global")
        local_theta = _rope_base(per_kind["sliding_attention"], "local")
    else:  # earlier: rope_theta, rope_scaling and rope_local_base_freq
        global_theta = _rope_base(
            {"rope_theta": config.get("rope_theta", 1e6), **(config.get("rope_scaling") or {})},
            "global",
        )
        local_theta = float(config.get("rope_local_base_freq", 10000.0))
    layers = int(config["num_hidden_layers"])
    kinds = config.get("layer_types") or [
        "full_attention" if (i + 1) % int(config.get("sliding_window_pattern", 6)) == 0
        else "sliding_attention"
        for i in range(layers)
    ]  # fmt: skip
    hidden = int(config["hidden_size"])
    return hf_args(
        config,
        rope=(global_theta, None),
        attention=AttentionFeatures(
            qk_norm=True, scale=float(config["query_pre_attn_scalar"]) ** -0.5
        ),
        window=SlidingWindow(
            int(config["sliding_window"]),
            layers=tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention"),
            rope_theta=local_theta,
        ),
        block=BlockFeatures(sandwich_norms=True, embedding_scale=hidden**0.5),
    )


def gemma3_hf_layer(take: TakeTensor, args: ModelArgs) -> dict[str, Tensor]:
    # Llama's names, the norms around the MLP renamed (`input_layernorm` is still ours
    # `attn_norm`), plus the two norms after the sublayers.
    renamed = {"post_attention_layernorm.weight": "pre_feedforward_layernorm.weight"}
    ours = hf_llama_layer(lambda name: take(renamed.get(name, name)), args)
    ours["post_attn_norm.weight"] = take("post_attention_layernorm.weight")
    ours["post_mlp_norm.weight"] = take("post_feedforward_layernorm.weight")
    return ours


def gemma3_gguf_args(gguf: GGUFSource) -> ModelArgs:
    layers = int(gguf.field("block_count"))
    hidden = int(gguf.field("embedding_length"))
    heads = int(gguf.field("attention.head_count"))
    head_dim = int(gguf.field("attention.key_length"))
    pre_attention = hidden // heads if layers == GGUF_27B_LAYERS else head_dim
    return gguf_args(
        gguf,
        attention=AttentionFeatures(qk_norm=True, scale=pre_attention**-0.5),
        window=SlidingWindow(
            int(gguf.field("attention.sliding_window")),
            layers=tuple(
                i for i in range(layers) if i % GGUF_LAYER_PATTERN < GGUF_LAYER_PATTERN - 1
            ),
            rope_theta=GGUF_LOCAL_ROPE_BASE,
        ),
        block=BlockFeatures(
            activation="gelu_pytorch_tanh", sandwich_norms=True, embedding_scale=hidden**0.5
        ),
    )


def gemma3_gguf_layer(take: TakeWeight, args: ModelArgs) -> dict[str, Weight]:
    # Q and K rows as Hugging Face stores them; the norms already (1 + weight).
    ours = gguf_layer(take, args)
    ours["post_attn_norm.weight"] = take("post_attention_norm.weight")
    ours["post_mlp_norm.weight"] = take("post_ffw_norm.weight")
    return ours


# Gemma's turns: `<start_of_turn>user` / `<start_of_turn>model`, each closed by `<end_of_turn>`;
# no system role: a system message opens the first user turn, followed by a blank line. Contents
# are trimmed, as Gemma's own template trims them (the system message's too, here, so that it is
# spliced back like every other content: see `Tokenizer.apply_chat_template`).
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages and messages[0]['role'] == 'system' -%}
{%- set first_user_prefix = messages[0]['content'] | trim + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}
{{- message['content'] | trim }}{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}
"""

# A Gemma GGUF's tokenizer (llama.cpp's converter keeps SentencePiece's vocabulary as is).
GGUF_TOKENIZER = TokenizerQuirks(
    merges_in_vocabulary_order=True,
    spaces_stored_as_spaces=True,
    space_prefix=False,
    chat_template=CHAT_TEMPLATE,
    template_tokens=("<start_of_turn>", "<end_of_turn>"),
)


FAMILY = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    hf_args=gemma3_hf_args,
    hf_layer=gemma3_hf_layer,
    gguf=GGUFFormat("gemma3", gemma3_gguf_args, gemma3_gguf_layer, GGUF_TOKENIZER),
    hf_norm_offset=1.0,
)
