"""The registry's refusals: what a family cannot serve is named in one line, from the
configuration alone."""

from __future__ import annotations

from typing import Any

import pytest

from service.engine.families import UnsupportedModelError, family_of_gguf, family_of_hf

BASE = dict(
    vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)  # fmt: skip
GEMMA3 = BASE | dict(
    model_type="gemma3_text", query_pre_attn_scalar=16, sliding_window=64,
    hidden_activation="gelu_pytorch_tanh",
)  # fmt: skip


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (BASE | {"model_type": "gpt2", "architectures": ["GPT2"]}, r"'gpt2' \(GPT2\); supported"),
        (BASE | {"model_type": "gemma3"}, "unsupported model_type 'gemma3'"),
        (BASE | {"model_type": "qwen2", "use_sliding_window": True}, "use_sliding_window"),
        (BASE | {"model_type": "qwen3", "use_sliding_window": True}, "use_sliding_window"),
        (BASE | {"model_type": "phi3", "rope_scaling": {"type": "longrope"}}, "'longrope'"),
        (BASE | {"model_type": "phi3", "partial_rotary_factor": 0.75}, "partial rotary"),
        (BASE | {"model_type": "llama", "hidden_act": "relu"}, "hidden_act 'relu'"),
        (GEMMA3 | {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        (
            GEMMA3 | {"rope_parameters": {
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            }},
            "'linear' on gemma3's global layers",
        ),
    ],
)  # fmt: skip
def test_what_a_family_cannot_serve_is_named(config: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        family_of_hf(config).hf_args(config)


def test_gemma3_reads_its_layer_kinds_from_either_config_style() -> None:
    new = GEMMA3 | {"layer_types": ["sliding_attention", "full_attention"]}
    old = GEMMA3 | {"sliding_window_pattern": 2, "rope_theta": 1e6, "rope_local_base_freq": 1e4}
    for config in (new, old):
        args = family_of_hf(config).hf_args(config)
        assert args.window is not None
        assert args.window.layers == (0,) and args.window.rope_theta == 1e4
        assert args.layer_windows == (64, None) and args.attention.scale == 16**-0.5


def test_an_unknown_gguf_architecture_names_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match="supported: llama"):
        family_of_gguf("rwkv6")
