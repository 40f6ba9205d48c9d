"""DecoderModel on a flat batch of tokens, checked against transformers' LlamaForCausalLM."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import LlamaForCausalLM

from kernels.cpu import dispatch
from kernels.cpu.formats import WeightType
from service.engine.loader import LoadedModel, load_model
from service.engine.model import DecoderModel, ModelArgs, SlidingWindow
from service.engine.quant import PackedEmbedding, QuantLinear
from tests.tiny_model import ContiguousAttention, dequantized_reference, make_tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[LoadedModel, LlamaForCausalLM]:
    tied: bool = request.param
    directory = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", tie_word_embeddings=tied)
    ours = load_model(directory, torch.float32, CPU)
    ref = LlamaForCausalLM.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return ours, ref


def _tokens(n: int, seed: int = 0) -> Tensor:
    return torch.randint(0, 49152, (n,), generator=torch.Generator().manual_seed(seed))


def _rel_error(ours: Tensor, ref: Tensor) -> float:
    return float((ours - ref).abs().max() / ref.abs().max())


@torch.inference_mode()
def test_logits_match_transformers_through_prefill_then_decode(
    tiny: tuple[LoadedModel, LlamaForCausalLM],
) -> None:
    ours, ref = tiny
    ids = _tokens(24)
    expected = ref(ids[None]).logits[0]  # [S, V]
    model = ours.model
    attention = ContiguousAttention(ours.args.num_layers)
    prefill = 16
    hidden = model(ids[:prefill], torch.arange(prefill), attention)  # [16, hidden]
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    for pos in range(prefill):
        assert _rel_error(logits[pos], expected[pos]) <= 1e-4, pos
    for pos in range(prefill, len(ids)):
        hidden = model(ids[pos : pos + 1], torch.tensor([pos]), attention)  # [1, hidden]
        assert _rel_error(model.compute_logits(hidden)[0], expected[pos]) <= 1e-4, pos


@torch.inference_mode()
def test_chunked_prefill_gives_the_same_logits_as_one_prefill(
    tiny: tuple[LoadedModel, LlamaForCausalLM],
) -> None:
    model = tiny[0].model
    ids = _tokens(13, seed=1)
    whole = model.compute_logits(model(ids, torch.arange(13), ContiguousAttention(2)))
    attention = ContiguousAttention(2)
    chunks = []
    for start, end in ((0, 5), (5, 10), (10, 13)):
        chunks.append(
            model.compute_logits(model(ids[start:end], torch.arange(start, end), attention))
        )
    assert _rel_error(torch.cat(chunks), whole) <= 1e-5


class _SegmentAttention:
    """Causal attention within each sequence of a flat batch (what the runner provides)."""

    def __init__(self, seq_ids: Tensor, positions: Tensor) -> None:
        same = seq_ids[:, None] == seq_ids[None, :]  # [T, T]
        self.mask = same & (positions[None, :] <= positions[:, None])  # [T, T]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=self.mask,
            enable_gqa=True,
        )
        return out.transpose(0, 1)  # [T, H, D]


@torch.inference_mode()
def test_sequences_in_one_flat_batch_do_not_interact(
    tiny: tuple[LoadedModel, LlamaForCausalLM],
) -> None:
    model = tiny[0].model
    a, b = _tokens(7, seed=2), _tokens(4, seed=3)
    alone_a = model.compute_logits(model(a, torch.arange(7), ContiguousAttention(2)))
    alone_b = model.compute_logits(model(b, torch.arange(4), ContiguousAttention(2)))
    positions = torch.cat([torch.arange(7), torch.arange(4)])
    seq_ids = torch.tensor([0] * 7 + [1] * 4)
    hidden = model(torch.cat([a, b]), positions, _SegmentAttention(seq_ids, positions))
    together = model.compute_logits(hidden)
    assert _rel_error(together, torch.cat([alone_a, alone_b])) <= 1e-5


def test_layer_attention_gets_post_rope_heads_for_every_layer_in_order(
    tiny: tuple[LoadedModel, LlamaForCausalLM],
) -> None:
    args = tiny[0].args
    calls: list[int] = []
    inner = ContiguousAttention(args.num_layers)

    def recording(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        assert q.shape == (5, args.num_heads, args.head_dim)
        assert k.shape == v.shape == (5, args.num_kv_heads, args.head_dim)
        assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        calls.append(layer)
        return inner(layer, q, k, v)

    with torch.inference_mode():
        hidden = tiny[0].model(_tokens(5), torch.arange(5), recording)
    assert hidden.shape == (5, args.hidden_size)
    assert calls == list(range(args.num_layers))


@torch.inference_mode()
def test_bf16_model_returns_float32_logits_close_to_fp32(
    tiny: tuple[LoadedModel, LlamaForCausalLM], tmp_path: Path
) -> None:
    fp32 = tiny[0].model
    directory = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=fp32.lm_head is None)
    bf16 = load_model(directory, torch.bfloat16, CPU).model
    assert bf16.embed_tokens.weight.dtype == torch.bfloat16
    ids = _tokens(9, seed=4)
    low = bf16.compute_logits(bf16(ids, torch.arange(9), ContiguousAttention(2)))
    high = fp32.compute_logits(fp32(ids, torch.arange(9), ContiguousAttention(2)))
    assert low.dtype == torch.float32
    assert _rel_error(low, high) < 0.05


@torch.inference_mode()
def test_bf16_weights_under_fp32_activations_stay_close_to_fp32(
    tiny: tuple[LoadedModel, LlamaForCausalLM], tmp_path: Path
) -> None:
    """The mixed CPU mode: matmuls read bf16 weights; hidden states, norms, RoPE and the
    attention (so the KV cache) stay fp32."""
    fp32 = tiny[0].model
    directory = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=fp32.lm_head is None)
    mixed = load_model(directory, torch.float32, CPU, weight_dtype=torch.bfloat16).model
    matmuls = {n for n, m in mixed.named_modules() if isinstance(m, torch.nn.Linear)}
    for name, param in mixed.named_parameters():
        is_matmul = name.rpartition(".")[0] in matmuls or name.startswith("embed_tokens.")
        assert param.dtype == (torch.bfloat16 if is_matmul else torch.float32), name
    attention = ContiguousAttention(2)
    ids = _tokens(9, seed=4)
    hidden = mixed(ids, torch.arange(9), attention)
    assert hidden.dtype == torch.float32
    cached = attention.keys[0]
    assert cached is not None and cached.dtype == torch.float32
    low = mixed.compute_logits(hidden)
    high = fp32.compute_logits(fp32(ids, torch.arange(9), ContiguousAttention(2)))
    assert low.dtype == torch.float32
    assert 0 < _rel_error(low, high) < 0.05  # rounded, but only by the weights


def test_tied_model_projects_logits_through_its_embedding(
    tiny: tuple[LoadedModel, LlamaForCausalLM],
) -> None:
    loaded = tiny[0]
    names = {name for name, _ in loaded.model.named_parameters()}
    assert ("lm_head.weight" in names) == (not loaded.args.tie_word_embeddings)


def _args(**overrides: object) -> ModelArgs:
    fields: dict[str, object] = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
    }
    fields.update(overrides)
    return ModelArgs(**fields)  # type: ignore[arg-type]


def test_model_args_accept_a_valid_gqa_shape() -> None:
    args = _args()
    assert (args.q_size, args.kv_size) == (64, 32)


@pytest.mark.parametrize(
    "overrides",
    [
        {"num_kv_heads": 3},
        {"head_dim": 15},
        {"num_layers": 0},
        {"vocab_size": 10.0},
        {"rope_theta": 0.0},
        {"rms_norm_eps": -1e-5},
    ],
)
def test_model_args_reject_inconsistent_shapes(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        _args(**overrides)


@pytest.mark.parametrize(
    ("weight_dtype", "kind"), [(torch.uint4, WeightType.Q4_1), (torch.int8, WeightType.Q8_0)]
)
@pytest.mark.parametrize("max_packed_tokens", [64, 0], ids=["gemv", "dense"])
@torch.inference_mode()
def test_a_hf_model_quantized_at_load_time_packs_every_projection(
    tiny: tuple[LoadedModel, LlamaForCausalLM],
    tmp_path: Path,
    weight_dtype: torch.dtype,
    kind: WeightType,
    max_packed_tokens: int,
) -> None:
    """int4 quantizes each projection to Q4_1 blocks and int8 to Q8_0; the LM head is Q8_0
    in both, and the embeddings are looked up in its rows when they are tied. Through the
    GEMV or the dense path, the logits are the dequantized weights' in fp32."""
    loaded = tiny[0]
    tied = loaded.model.lm_head is None
    directory = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=tied)
    kernels = dispatch.select("auto")
    packed = load_model(
        directory, torch.float32, CPU, weight_dtype=weight_dtype, kernels=kernels,
        max_packed_tokens=max_packed_tokens,
    ).model  # fmt: skip
    projections = [m for m in packed.modules() if isinstance(m, QuantLinear)]
    kinds = [m.kinds for m in projections]
    assert kinds == [(kind,)] * (4 * loaded.args.num_layers) + [(WeightType.Q8_0,)]
    assert isinstance(packed.lm_head, QuantLinear)
    assert isinstance(packed.embed_tokens, PackedEmbedding)
    if tied:
        assert packed.embed_tokens.weight is packed.lm_head.weight.parts[0]  # one table
    assert packed.weights_name == kind.name
    reference = dequantized_reference(loaded, kind)
    ids = _tokens(9, seed=4)
    low = packed.compute_logits(packed(ids, torch.arange(9), ContiguousAttention(2)))
    high = reference.compute_logits(reference(ids, torch.arange(9), ContiguousAttention(2)))
    assert low.dtype == torch.float32
    assert _rel_error(low, high) < 1e-5  # fp32 roundings in another order


def test_packed_weights_need_the_cpu_kernels(tiny: tuple[LoadedModel, LlamaForCausalLM]) -> None:
    loaded = tiny[0]
    with pytest.raises(ValueError, match="need the CPU kernels"):
        DecoderModel.from_weights(
            loaded.args, dict(loaded.model.state_dict()), torch.float32, CPU,
            weight_dtype=torch.int8,
        )  # fmt: skip


def test_rope_tables_start_short_and_grow_to_what_an_engine_asks_never_shrinking() -> None:
    """A long-context model holds INITIAL_ROPE_POSITIONS rows until an engine asks for more;
    the grown tables are the same values the whole-context ones would hold, the local layers'
    (Gemma's own base) too."""
    from service.engine.model import INITIAL_ROPE_POSITIONS, rope_tables

    args = ModelArgs(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
        num_kv_heads=1, head_dim=16, max_position_embeddings=4 * INITIAL_ROPE_POSITIONS,
        window=SlidingWindow(8, layers=(0,), rope_theta=500.0),
    )  # fmt: skip
    with torch.device("meta"):
        model = DecoderModel(args)
    assert model.cos_table.shape == (INITIAL_ROPE_POSITIONS, 16)
    model.ensure_positions(INITIAL_ROPE_POSITIONS + 5)
    model.ensure_positions(10)  # another engine's shorter context keeps the longer tables
    assert model.local_tables is not None
    for table, theta in ((model.cos_table, None), (model.local_tables[0], 500.0)):
        whole, _ = rope_tables(args, torch.device("cpu"), theta, args.max_position_embeddings)
        assert table.shape == (INITIAL_ROPE_POSITIONS + 5, 16)
        assert torch.equal(table, whole[: INITIAL_ROPE_POSITIONS + 5])
    model.ensure_positions(10 * args.max_position_embeddings)  # capped at the model's context
    assert model.sin_table.shape[0] == args.max_position_embeddings
