"""benchmarks/synthetic.py: random-weight models of real shapes, and their made-up tokenizer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.synthetic import (
    SHAPES,
    build,
    parameter_count,
    random_weights,
    synthetic_tokenizer,
    weight_read_bytes,
)
from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.model import DecoderModel
from service.sessions.prompt import ChatFormat
from tests.engine.greedy import greedy, run

CPU = torch.device("cpu")


def test_each_shape_has_the_parameter_count_of_the_model_it_is_named_after() -> None:
    # The published sizes: SmolLM2-135M, Llama 3.2 1B (tied), Llama 3 8B.
    assert parameter_count(SHAPES["smollm2-135m"]) == 134_515_008
    assert parameter_count(SHAPES["llama-3.2-1b"]) == 1_235_814_400
    assert parameter_count(SHAPES["llama-3-8b"]) == 8_030_261_248
    eight_b = SHAPES["llama-3-8b"]
    assert (eight_b.num_layers, eight_b.num_heads, eight_b.num_kv_heads, eight_b.head_dim) == (
        32, 32, 8, 128,
    )  # fmt: skip
    assert (eight_b.hidden_size, eight_b.intermediate_size, eight_b.vocab_size) == (
        4096, 14336, 128256,
    )  # fmt: skip


def test_random_weights_fill_every_parameter_in_the_shapes_the_model_takes() -> None:
    loaded = build("tiny", device=CPU, dtype=torch.bfloat16, seed=1)
    args = loaded.args
    params = dict(loaded.model.named_parameters())
    assert sum(p.numel() for p in params.values()) == parameter_count(args)
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    qkv = params["layers.0.attn.qkv.weight"]
    assert qkv.shape == (args.q_size + 2 * args.kv_size, args.hidden_size)
    assert params["layers.1.mlp.down.weight"].shape == (args.hidden_size, args.intermediate_size)
    # Scaled by fan-in: a projection keeps its input's scale.
    assert 0.8 < float(qkv.float().std()) * args.hidden_size**0.5 < 1.2
    assert torch.equal(qkv, build("tiny", device=CPU, dtype=torch.bfloat16, seed=1)
                       .model.get_parameter("layers.0.attn.qkv.weight"))  # fmt: skip
    other = random_weights(args, device=CPU, dtype=torch.bfloat16, seed=2)
    assert not torch.equal(qkv, other["layers.0.attn.qkv.weight"])
    assert "random weights" in loaded.name


def test_a_decode_step_reads_every_weight_but_an_untied_embedding() -> None:
    untied = build("tiny", device=CPU, dtype=torch.float32).model
    total = sum(p.numel() * p.element_size() for p in untied.parameters())
    embedding = untied.embed_tokens.weight
    assert weight_read_bytes(untied) == total - embedding.numel() * 4
    tied_args = dataclasses.replace(SHAPES["tiny"], tie_word_embeddings=True)
    weights = random_weights(tied_args, device=CPU, dtype=torch.float32)
    tied = DecoderModel.from_weights(tied_args, weights, torch.float32, CPU)
    assert weight_read_bytes(tied) == sum(p.numel() * 4 for p in tied.parameters())


def test_the_tokenizer_round_trips_ascii_and_decodes_every_id_to_text() -> None:
    tok = synthetic_tokenizer(1000)
    assert tok.vocab_size == 1000
    text = "Session 3: tell me about {the moon}!\nOK?"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert tok.decode(tok.encode("café")) == "caf<unk>"  # an unknown character
    assert all(tok.decode([i]) for i in range(3, 1000))
    assert tok.encode("<|im_end|>") != [tok.eos_token_ids[0]]  # user text is never special
    chat = ChatFormat(tok)  # the service's checks of a chat template pass
    prompt = chat.first_prompt("Be brief.", "Hi")
    assert tok.decode(prompt) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    with pytest.raises(ValueError):
        synthetic_tokenizer(50)


def test_an_engine_serves_a_synthetic_model_and_leaves_its_pools_balanced() -> None:
    loaded = build("tiny", device=CPU, dtype=torch.float32)
    config = EngineConfig(device="cpu", num_device_blocks=64, num_cpu_blocks=8, max_model_len=256)
    engine = LLMEngine(config, loaded=loaded)
    out = run(engine, {"a": list(range(100, 140)), "b": list(range(900, 905))}, greedy(8))
    assert [len(g.token_ids) for g in out.values()] == [8, 8]
    assert all(g.text for g in out.values())
    engine.check_balanced()
