"""The native decoder stack: a decode step's layers in one call (model.native_decoder_stack),
against the same layers op by op, on one, two and three threads, in every KV cache dtype, for
weights whose fused projections mix GGUF types, for every family's features (biases, q/k norms,
sliding windows, Gemma 3's local layers in pools of their own), and where it must not run."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kernels.cpu import dispatch
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.formats import WeightType, random_blocks
from kernels.cpu.stack import StackRows
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel, load_model
from service.engine.model import DecoderModel, ModelArgs
from service.engine.quant import INT4, PackedEmbedding, PackedWeight, Weight, cat_rows
from service.engine.runner import ModelRunner, StepInputs
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import assert_same_greedy, greedy, run
from tests.tiny_model import gguf_tokenizer, make_tiny_family, make_tiny_llama

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernels() -> KernelSet:
    chosen = dispatch.select("auto")
    assert chosen is not None, "the CPU kernels did not build"
    return chosen


# The op-by-op path multiplies through the native product at every row count, as the stack
# does, so the two differ only in what the stack does itself: left to the start-up trial, a
# machine where the dense path won (dequantize, then torch's GEMM) summed random K-type blocks
# whose scales and mins nearly cancel in another order (4e-4 apart on one Intel Xeon). The
# dense path's own agreement is test_model's.
NATIVE_AT_EVERY_SIZE = 4096


@pytest.fixture(scope="module")
def tiny_int4(tiny_model_dir: Path, kernels: KernelSet) -> LoadedModel:
    return load_model(
        tiny_model_dir, torch.float32, CPU, weight_dtype=INT4, kernels=kernels,
        max_packed_tokens=NATIVE_AT_EVERY_SIZE,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mixed_types(kernels: KernelSet) -> LoadedModel:
    """A random model of hidden 256 whose weights are GGUF blocks as a Q4_K_M file mixes
    them: Q and K in Q4_K, V and down in Q6_K, o_proj in Q5_K, gate in Q5_0, up in Q8_0."""
    return _mixed_types(kernels)


@pytest.fixture(scope="module")
def mixed_types_int8(kernels: KernelSet) -> LoadedModel:
    """`mixed_types` with int8 inputs in its products, its K-type rows regrouped eight at a
    time for them (as `weight_layout` auto loads them)."""
    return _mixed_types(kernels.with_matmul_inputs("int8"), regroup_rows=True)


def _mixed_types(kernels: KernelSet, regroup_rows: bool = False) -> LoadedModel:
    args = ModelArgs(
        vocab_size=gguf_tokenizer().vocab_size, hidden_size=256, intermediate_size=512,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=512,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)

    def blocks(kind: WeightType, n: int, k: int) -> PackedWeight:
        return PackedWeight((random_blocks(kind, n, k, gen),))

    weights: dict[str, Weight] = {
        "embed_tokens.weight": blocks(WeightType.Q8_0, args.vocab_size, 256),
        "norm.weight": torch.rand(256, generator=gen) + 0.5,
        "lm_head.weight": blocks(WeightType.Q6_K, args.vocab_size, 256),
    }
    for i in range(args.num_layers):
        qkv = [blocks(WeightType.Q4_K, 256, 256), blocks(WeightType.Q4_K, 128, 256)]
        qkv.append(blocks(WeightType.Q6_K, 128, 256))
        gate_up = [blocks(WeightType.Q5_0, 512, 256), blocks(WeightType.Q8_0, 512, 256)]
        weights |= {
            f"layers.{i}.attn_norm.weight": torch.rand(256, generator=gen) + 0.5,
            f"layers.{i}.mlp_norm.weight": torch.rand(256, generator=gen) + 0.5,
            f"layers.{i}.attn.qkv.weight": _cat(qkv),
            f"layers.{i}.attn.o_proj.weight": blocks(WeightType.Q5_K, 256, 256),
            f"layers.{i}.mlp.gate_up.weight": _cat(gate_up),
            f"layers.{i}.mlp.down.weight": blocks(WeightType.Q6_K, 256, 512),
        }
    model = DecoderModel.from_weights(
        args, weights, torch.float32, CPU, weight_dtype=torch.int8, kernels=kernels,
        max_packed_tokens=NATIVE_AT_EVERY_SIZE, regroup_rows=regroup_rows,
    )  # fmt: skip
    return LoadedModel(model, args, gguf_tokenizer(), "mixed-types@test", "mixed-types", "llama")


def test_regrouped_rows_answer_with_the_stored_rows_bits(
    make_engine: EngineFactory, mixed_types_int8: LoadedModel, kernels: KernelSet
) -> None:
    # Q, K (Q4_K), V, down, the LM head (Q6_K), o (Q5_K) and up (Q8_0) regrouped eight rows
    # at a time; gate (Q5_0) and the embedding (a lookup) as stored: every logit the same bits
    # as with every weight as stored, in decode steps of one to three rows and prefill chunks.
    qkv, down, o_proj, gate_up = _layer_weights(mixed_types_int8)
    regrouped = [p.rows_x8 for w in (qkv, down, o_proj, gate_up) for p in w.parts]
    assert regrouped == [True] * 5 + [False, True]
    embedding = mixed_types_int8.model.embed_tokens
    assert isinstance(embedding, PackedEmbedding) and not embedding.weight.rows_x8
    stored = _mixed_types(kernels.with_matmul_inputs("int8"))
    assert not any(p.rows_x8 for w in _layer_weights(stored) for p in w.parts)
    prompts = {"a": [(7 * j) % 300 + 5 for j in range(40)], "b": [11, 12, 13], "c": [9] * 20}
    answers = [
        run(make_engine(loaded=loaded), prompts, greedy(24), join_at={"c": 3})
        for loaded in (mixed_types_int8, stored)
    ]
    for rid in prompts:
        assert answers[0][rid].token_ids == answers[1][rid].token_ids
        assert answers[0][rid].margins == answers[1][rid].margins


def _layer_weights(loaded: LoadedModel) -> list[PackedWeight]:
    layer = loaded.model.layers[0]
    return [
        w.weight for w in (layer.attn.qkv, layer.mlp.down, layer.attn.o_proj, layer.mlp.gate_up)
    ]


# Tiny random models of each family in tests/engine/families' shape (heads of 16), packed as
# `--weights int8` packs them. Windows far shorter than the prompts below and not multiples
# of the 16-token blocks.
FAMILY_SHAPE = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
)  # fmt: skip
FAMILY_MODELS: dict[str, tuple[str, dict[str, object]]] = {
    "qwen2": ("qwen2", {}),  # biases on q, k and v
    "qwen3": ("qwen3", {"attention_bias": True}),  # q/k norms; biases on q, k, v and o
    "mistral": ("mistral", {"sliding_window": 8}),
    "phi3": ("phi3", {"sliding_window": 13}),
    # Two local layers (a window, their own RoPE base) and a global one; norms after each
    # sublayer, tanh-GELU, scaled embeddings, an attention scale not head_dim ** -0.5.
    "gemma3": (
        "gemma3_text",
        {
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "sliding_window": 8,
            "query_pre_attn_scalar": 32,
        },
    ),
}
# Each family's model, and Gemma 3's with its window layers' K/V in the one pool of the rest.
FAMILY_CASES = [*FAMILY_MODELS, "gemma3-one-pool"]


@pytest.fixture(scope="module")
def packed_family(
    kernels: KernelSet, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], LoadedModel]:
    """A family's packed model by FAMILY_MODELS' name, each built once."""

    @functools.cache
    def build(name: str) -> LoadedModel:
        model_type, config = FAMILY_MODELS[name]
        directory = make_tiny_family(
            tmp_path_factory.mktemp(name) / "model", model_type, FAMILY_SHAPE | config
        )
        return load_model(
            directory, torch.float32, CPU, weight_dtype=torch.int8, kernels=kernels,
            max_packed_tokens=NATIVE_AT_EVERY_SIZE,
        )  # fmt: skip

    return build


def _family_engine(
    make_engine: EngineFactory,
    packed_family: Callable[[str], LoadedModel],
    case: str,
    **settings: object,
) -> LLMEngine:
    name, _, one_pool = case.partition("-")
    engine = make_engine(loaded=packed_family(name), window_pools=not one_pool, **settings)
    runner = engine.runner
    assert runner.decoder_stack is not None
    # Gemma 3's window layers read their own pool, block tables and slots (window_blocks.py).
    assert runner.decoder_stack.shape.groups == len(runner.pools) == 1 + (case == "gemma3")
    return engine


def _cat(parts: list[PackedWeight]) -> PackedWeight:
    out = cat_rows(parts)
    assert isinstance(out, PackedWeight)
    return out


Forward = Callable[[StepInputs], torch.Tensor]
STACK_THREADS = (1, 2, 3)


@dataclass(frozen=True, slots=True)
class Compared:
    """One native step run both ways."""

    rows: int  # sequences in the step
    context: int  # its longest context
    chunk: bool  # a prefill chunk among its rows
    rel: float  # the largest of each thread count's difference, over the largest |hidden|
    same_bits: bool  # two and three threads gave the same bits as one


def _compare_paths(runner: ModelRunner, seen: list[Compared]) -> Forward:
    """A forward that runs each native step both ways on the same inputs (op by op first;
    the stack then writes the same slots again), recording each in `seen`."""
    forward = runner.forward
    stack = runner.decoder_stack
    assert stack is not None

    def both(inputs: StepInputs) -> torch.Tensor:
        if not inputs.native:
            return forward(inputs)
        inputs.native = False
        inputs.plan = runner.backend.plan(inputs.meta)
        if inputs.window_meta is not None:
            inputs.window_plan = runner.backend.plan(inputs.window_meta)
        op_by_op = forward(inputs).clone()
        inputs.native = True
        # three threads on two cores too: the helpers take turns, the shares are the same
        outputs = []
        for threads in STACK_THREADS:
            stack.threads = threads
            outputs.append(forward(inputs).clone())
        one = outputs[0]
        rel = float(max((out - op_by_op).abs().max() for out in outputs))
        meta = inputs.meta
        seen.append(
            Compared(
                rows=meta.num_seqs,
                context=meta.max_seq_len,
                chunk=meta.max_query_len > 1,
                rel=rel / float(op_by_op.abs().max()),
                same_bits=all(torch.equal(one, out) for out in outputs[1:]),
            )
        )
        return outputs[-1]

    return both


def _run_both_ways(engine: LLMEngine) -> list[Compared]:
    """Batches of decode rows and prefill chunks through `engine`, each native step run both
    ways: what each compared, having checked that every kind of step was among them."""
    runner = engine.runner
    assert runner.decoder_stack is not None
    seen: list[Compared] = []
    runner.forward = _compare_paths(runner, seen)  # type: ignore[method-assign]
    prompts = {f"r{i}": [(7 * i + j) % 400 + 17 for j in range(5 + 9 * i)] for i in range(5)}
    run(engine, prompts, greedy(12), join_at={"r3": 4, "r4": 7})
    run(engine, {"alone": [(3 * j) % 400 + 17 for j in range(90)]}, greedy(4))
    # chunks that sample nothing (128 tokens a step): the LM head gets no rows
    run(engine, {"long": [(5 * j) % 400 + 17 for j in range(300)]}, greedy(2))
    assert {s.rows for s in seen} >= {1, 3, 5}  # one sequence, and several
    assert any(s.chunk for s in seen) and any(not s.chunk for s in seen)  # prefill and decode
    # A lone decoding sequence of 64 positions or more: two threads split its context, and
    # of 96 or more, three.
    assert any(s.rows == 1 and 64 <= s.context < 96 and not s.chunk for s in seen)
    assert any(s.rows == 1 and s.context >= 96 and not s.chunk for s in seen)
    # The helper threads change no bit, but where a lone row's context ranges are merged.
    assert all(s.same_bits for s in seen if s.chunk or s.rows > 1 or s.context < 64)
    return seen


def _bound(engine: LLMEngine, cache: str) -> float:
    """How far apart the two paths may be, relative to the largest |hidden|."""
    kernels = engine.runner.model.kernels
    assert kernels is not None
    if kernels.matmul_inputs == "int8":
        # Both paths quantize their inputs per 32, and an input an fp32 rounding apart from a
        # rounding boundary of its int8 value moves by a step: 1/254 of its block's largest.
        return 2e-2
    if kernels.chosen["gemv"] == "amx":
        # The tile unit's products are within 2^-16 of |x| |w|, not of the sum: an fp32-sized
        # change in an input can move a bf16 split, and this model's random K-type blocks
        # nearly cancel (1.2e-3 after a 300-token prompt's chunks on a Xeon with AMX).
        return 4e-3
    # The same fp32 arithmetic in another order (a 1% change in SiLU shows as 4e-2); a K or V
    # element one ulp from a 16-bit rounding boundary may round the other way (bf16: 2^-8).
    return {"float32": 3e-4, "float16": 1e-3}.get(cache, 4e-3)


@pytest.mark.parametrize("cache", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny_int4", "mixed_types", "mixed_types_int8"])
def test_decode_steps_run_the_stack_and_match_the_layers_op_by_op(
    make_engine: EngineFactory, request: pytest.FixtureRequest, model: str, cache: str
) -> None:
    engine = make_engine(loaded=request.getfixturevalue(model), kv_cache_dtype=cache)
    seen = _run_both_ways(engine)
    bound = _bound(engine, cache)
    if model == "mixed_types":
        # Its random K-type blocks' scales and mins nearly cancel, so its hidden states amplify
        # an input's fp32 rounding (the prompt's attention is torch's flash kernel op by op,
        # the stack's own in the stack): 2e-4 to 4.4e-4 with an fp32 cache across versions.
        bound = max(bound, 1e-3)
    assert max(s.rel for s in seen) < bound


@pytest.mark.parametrize("cache", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", FAMILY_CASES)
def test_every_familys_steps_run_the_stack_and_match_its_layers_op_by_op(
    make_engine: EngineFactory,
    packed_family: Callable[[str], LoadedModel],
    case: str,
    cache: str,
) -> None:
    engine = _family_engine(make_engine, packed_family, case, kv_cache_dtype=cache)
    seen = _run_both_ways(engine)
    assert max(s.rel for s in seen) < _bound(engine, cache)


@pytest.mark.parametrize("case", FAMILY_CASES)
def test_every_family_answers_and_fills_its_pools_as_its_layers_op_by_op(
    make_engine: EngineFactory, packed_family: Callable[[str], LoadedModel], case: str
) -> None:
    """Greedy answers past every window, batched, with every pool's K/V (the window layers'
    own included) as the op-by-op path writes them."""
    native_engine = _family_engine(make_engine, packed_family, case)
    torch_engine = _family_engine(make_engine, packed_family, case)
    torch_engine.runner.decoder_stack = None  # every step op by op
    prompts = {"a": list(range(40, 75)), "b": [(11 * j) % 400 + 17 for j in range(50)]}
    got = run(native_engine, prompts, greedy(24), join_at={"b": 3})
    want = run(torch_engine, prompts, greedy(24), join_at={"b": 3})
    assert assert_same_greedy(want, got) == 0  # not even a near-tie apart
    for mine, theirs in zip(native_engine.runner.pools, torch_engine.runner.pools, strict=True):
        assert torch.allclose(mine.device, theirs.device, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("cache", ["float32", "float16"])
def test_the_stack_writes_the_cache_the_layers_would(
    make_engine: EngineFactory, tiny_int4: LoadedModel, cache: str
) -> None:
    native_engine = make_engine(loaded=tiny_int4, kv_cache_dtype=cache)
    torch_engine = make_engine(loaded=tiny_int4, kv_cache_dtype=cache)
    torch_engine.runner.decoder_stack = None  # every step op by op
    prompt = {"r": list(range(40, 75))}
    got = run(native_engine, prompt, greedy(10))
    want = run(torch_engine, prompt, greedy(10))
    assert got["r"].token_ids == want["r"].token_ids
    pools = native_engine.runner.device_pool, torch_engine.runner.device_pool
    assert pools[0].dtype == getattr(torch, cache)
    assert torch.allclose(*(p.float() for p in pools), rtol=1e-3, atol=1e-3)  # decode K/V too


def test_a_slot_or_block_outside_the_pool_is_refused_before_any_write(
    make_engine: EngineFactory, tiny_int4: LoadedModel
) -> None:
    engine = make_engine(loaded=tiny_int4)
    runner = engine.runner
    stack = runner.decoder_stack
    assert stack is not None
    forward = runner.forward
    refused: list[bool] = []

    def with_a_bad_slot_first(inputs: StepInputs) -> torch.Tensor:
        if inputs.native and inputs.meta.max_query_len == 1:  # a decode step: one row
            blocks = runner.device_pool.shape[2]
            meta = inputs.meta
            outside = blocks * runner.block_size
            bad_slot = dataclasses.replace(meta, slot_mapping=torch.tensor([outside]))
            bad_block = dataclasses.replace(meta, block_tables=meta.block_tables + blocks)
            before = runner.device_pool.clone()
            x = torch.zeros(1, tiny_int4.args.hidden_size)
            cos = torch.zeros(1, tiny_int4.args.head_dim)
            for bad in (bad_slot, bad_block):  # a write, and a read, outside the pool
                with pytest.raises(ValueError, match="outside the KV pool"):
                    stack(x, [(cos, cos)], StackRows.of([bad], inputs.positions))
            refused.append(torch.equal(runner.device_pool, before))
        return forward(inputs)

    runner.forward = with_a_bad_slot_first  # type: ignore[method-assign]
    run(engine, {"r": list(range(20, 30))}, greedy(3))
    assert refused and all(refused)  # refused, and nothing written


def test_a_window_slot_or_block_outside_the_window_pool_is_refused_before_any_write(
    make_engine: EngineFactory, packed_family: Callable[[str], LoadedModel]
) -> None:
    """Each group's rows against its own pool: slots and blocks inside the full pool but past
    the (smaller) window pool are refused."""
    engine = _family_engine(
        make_engine, packed_family, "gemma3", block_size=8, max_num_seqs=2,
        num_device_blocks=None, kv_cache_mb=1,
    )  # fmt: skip
    runner = engine.runner
    stack = runner.decoder_stack
    assert stack is not None
    full, window = (pools.device for pools in runner.pools)
    assert window.shape[2] < full.shape[2]
    args = engine.runner.model.args
    forward = runner.forward
    refused: list[bool] = []

    def with_bad_window_rows_first(inputs: StepInputs) -> torch.Tensor:
        if inputs.native and inputs.meta.max_query_len == 1:
            meta, window_meta = inputs.meta, inputs.window_meta
            assert window_meta is not None
            blocks = window.shape[2]
            bad_slot = dataclasses.replace(
                window_meta, slot_mapping=torch.tensor([blocks * runner.block_size])
            )
            last = (window_meta.seq_lens_host[0] - 1) // runner.block_size  # its own block
            tables = window_meta.block_tables.clone()
            tables[0, last] = blocks
            bad_block = dataclasses.replace(window_meta, block_tables=tables)
            before = [full.clone(), window.clone()]
            x = torch.zeros(1, args.hidden_size)
            cos = torch.zeros(1, args.head_dim)
            for bad in (bad_slot, bad_block):
                with pytest.raises(ValueError, match="outside the KV pool"):
                    stack(x, [(cos, cos)] * 2, StackRows.of([meta, bad], inputs.positions))
            refused.append(torch.equal(full, before[0]) and torch.equal(window, before[1]))
        return forward(inputs)

    runner.forward = with_bad_window_rows_first  # type: ignore[method-assign]
    run(engine, {"r": list(range(20, 50))}, greedy(3))
    assert refused and all(refused)


def test_no_stack_where_its_kernels_do_not_apply(
    make_engine: EngineFactory,
    tiny_model: LoadedModel,
    tiny_int4: LoadedModel,
    tmp_path: Path,
    kernels: KernelSet,
) -> None:
    assert make_engine(loaded=tiny_model).runner.decoder_stack is None  # fp32 weights
    # Heads of 8: the kernels take head sizes in multiples of 16.
    narrow = make_tiny_llama(tmp_path / "narrow", num_heads=8, num_kv_heads=4)
    narrow_int4 = load_model(narrow, torch.float32, CPU, weight_dtype=INT4, kernels=kernels)
    assert make_engine(loaded=narrow_int4).runner.decoder_stack is None
    engine = make_engine(loaded=tiny_int4)
    assert engine.runner.decoder_stack is not None
    runs = engine.runner._runs_natively
    assert runs([1, 1], [900, 9000]) and runs([5, 1], [40, 8192])  # decode; short contexts
    assert not runs([5, 1], [8193, 30])  # a prefill chunk's context over the limit
    assert not runs([600, 600], [600, 600])  # more rows than the stack takes
