"""The decoder every supported family runs, over a flat batch of tokens, in plain torch.

One layer shape with the features the families differ by, each off by default (Llama's):
q/k/v and output biases (Qwen2, Qwen3), a per-head RMSNorm on queries and keys (Qwen3, Gemma
3), per-frequency RoPE divisors (Llama 3's scaling, GGUF's `rope_freqs`), and Gemma 3's local
layers with their own RoPE base, norms after each sublayer, tanh-GELU, scaled embeddings and
attention scale. Which family sets which, and how its checkpoints' names map onto ours, is
`service/engine/families/`.

The model sees one flat run of tokens per step (every sequence's new tokens back to back, no
batch dimension) and knows nothing about caches: each layer hands its post-RoPE Q/K/V to a
`LayerAttention` supplied by the runner, which writes K/V into the paged cache and attends.

Weights use our own fused names (see `DecoderModel.from_weights`); the loaders translate GGUF and
Hugging Face checkpoints into them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kernels.cpu import ops
from kernels.cpu.dispatch import KernelSet
from kernels.cpu.stack import ACTIVATIONS, DecoderStack, StackLayer, StackRows
from kernels.cpu.structs import CDecoderShape
from kernels.metadata import AttentionMetadata
from service.engine.quant import (
    HEAD_TYPE,
    NO_CROSSOVER,
    QUANTIZE_TO,
    DequantScratch,
    PackedEmbedding,
    PackedWeight,
    QuantLinear,
    Weight,
    dense,
    measured_max_packed_tokens,
    quantize,
    weights_name,
)


@dataclass(frozen=True, slots=True)
class AttentionFeatures:
    """How a family's attention differs from Llama's."""

    qkv_bias: bool = False  # biases on q, k and v
    output_bias: bool = False  # a bias on the attention's output projection
    qk_norm: bool = False  # an RMSNorm over each head of q and of k, before RoPE
    scale: float | None = None  # the scores' scale, where not head_dim ** -0.5 (Gemma's)


@dataclass(frozen=True, slots=True)
class SlidingWindow:
    """Keys a query may see, itself included, on the layers that slide a window (Mistral,
    Phi-3: every layer; Gemma 3: its local layers, with a RoPE base of their own)."""

    size: int
    layers: tuple[int, ...] = ()  # the layers that slide; empty: every layer
    rope_theta: float | None = None  # the sliding layers' own RoPE base

    def __post_init__(self) -> None:
        if self.size < 2:
            raise ValueError(f"a sliding window must be at least 2, got {self.size}")


@dataclass(frozen=True, slots=True)
class BlockFeatures:
    """How a family's decoder blocks differ from Llama's outside the attention (Gemma's all)."""

    activation: str = "silu"  # the MLP's gate: silu | gelu_pytorch_tanh
    sandwich_norms: bool = False  # norms after each sublayer too
    embedding_scale: float | None = None  # the embeddings scaled by this


@dataclass(slots=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # Each RoPE frequency's divisor ([head_dim / 2]): Llama 3's scaling, GGUF's rope_freqs.
    rope_freq_factors: tuple[float, ...] | None = None
    # The family's features (service/engine/families/), Llama's by default.
    attention: AttentionFeatures = AttentionFeatures()
    window: SlidingWindow | None = None  # None: every layer sees the whole context
    block: BlockFeatures = BlockFeatures()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"rms_norm_eps must be positive, got {self.rms_norm_eps}")
        factors = self.rope_freq_factors
        if factors is not None and (
            len(factors) != self.head_dim // 2 or not all(f > 0 for f in factors)
        ):
            raise ValueError(f"rope_freq_factors must be {self.head_dim // 2} positive numbers")
        if self.block.activation not in _ACTIVATIONS:
            raise ValueError(f"the activation must be one of {sorted(_ACTIVATIONS)}")
        if self.window and any(not 0 <= i < self.num_layers for i in self.window.layers):
            raise ValueError("a sliding window's layers must be layers of the model")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: it sees the whole context): every layer's
        where the window names no layers, else only theirs."""
        window = self.window
        if window is None or not window.layers:
            return (window.size if window else None,) * self.num_layers
        return tuple(window.size if i in window.layers else None for i in range(self.num_layers))

    @property
    def local_layers(self) -> tuple[int, ...]:
        """The layers that rotate with the window's own RoPE base (Gemma's local layers)."""
        if self.window is None or self.window.rope_theta is None:
            return ()
        return self.window.layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


class LayerAttention(Protocol):
    """Attention for one layer of one step, supplied by the runner.

    q: [T, num_heads, head_dim], k/v: [T, num_kv_heads, head_dim], all after RoPE, in the
    model's dtype. They are views into the layer's fused projection, so only the last dim is
    guaranteed unit-stride. Returns [T, num_heads, head_dim]. The scale is head_dim ** -0.5.
    """

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        # The CPU kernels, where the model has them: one native call for an fp32 norm on the
        # CPU, where torch's rms_norm is six ops (8.5 against 2.4 us for a row of 576).
        self.kernels: KernelSet | None = None

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            # One fused op where the reference's order of roundings cannot differ.
            if self.kernels is not None and x.device.type == "cpu":
                return ops.rms_norm(self.kernels, x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in fp32 and scale after casting back, as the reference Llama does, so that
        # bf16 runs round the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class HeadNorm(RMSNorm):
    """RMSNorm over each head of a [T, heads, head_dim] view (Qwen3's q/k norms): torch's
    op, which takes the strided view as it is; the CPU kernel's takes contiguous rows."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return super().forward(x)


# Positions the RoPE tables cover until an engine asks for more (`DecoderModel.ensure_positions`):
# a long-context model's whole tables are large (Gemma 3's four: 32,768 x 256 fp32, 134 MB).
INITIAL_ROPE_POSITIONS = 8192


def rope_tables(
    args: ModelArgs, device: torch.device, theta: float | None = None, positions: int | None = None
) -> tuple[Tensor, Tensor]:
    """cos and signed sin tables [positions, head_dim], fp32, for the rotate_half layout: the
    sin table's first half negated (see `apply_rope`). `theta`: another base than
    `args.rope_theta` (Gemma's local layers); `positions`: default the model's context, at
    most INITIAL_ROPE_POSITIONS."""
    if positions is None:
        positions = min(args.max_position_embeddings, INITIAL_ROPE_POSITIONS)
    half = torch.arange(0, args.head_dim, 2, dtype=torch.int64, device=device).float()
    inv_freq = 1.0 / ((theta or args.rope_theta) ** (half / args.head_dim))  # [D/2]
    if args.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(args.rope_freq_factors, device=device)
    t = torch.arange(positions, device=device).float()  # [P]
    freqs = torch.outer(t, inv_freq)  # [P, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
    sin = emb.sin()
    sin[:, : args.head_dim // 2].neg_()
    return emb.cos(), sin


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    # x: [T, H, D]; cos/signed_sin: [T, 1, D]
    # rotate_half(x) * sin == cat(-x2, x1) * sin == roll(x, D/2) * cat(-sin1, sin2): three
    # ops a layer instead of six on the decode hot path, the same products.
    rolled = x.roll(x.shape[-1] // 2, dims=-1)  # [T, H, D]: cat(x2, x1)
    return torch.addcmul(x * cos, rolled, signed_sin)


class Linear(nn.Linear):
    """A bias-free projection whose weight may be stored in another dtype than the
    activations: the input is cast to the weight's dtype and the output back.

    On a CPU with AVX512-BF16, bf16 weights halve the bytes a decode step reads and speed up
    the matmuls, while fp32 activations keep the attention on the fast fp32 path (why:
    docs/perf-history.md, "Engine: `benchmarks/engine_step.py` with dense dtypes"). With equal
    dtypes the casts are no-ops.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = args.num_heads
        self.num_kv_heads = args.num_kv_heads
        self.head_dim = args.head_dim
        self.q_size = args.q_size
        self.kv_size = args.kv_size
        # One matmul for Q, K and V: fewer kernel launches per layer on the decode hot path.
        self.qkv: Linear | QuantLinear = Linear(args.hidden_size, args.q_size + 2 * args.kv_size)
        self.o_proj: Linear | QuantLinear = Linear(args.q_size, args.hidden_size)
        # Apart from the projection, so that a packed one (QuantLinear) takes them too.
        self.qkv_bias: nn.Parameter | None = None
        if args.attention.qkv_bias:
            self.qkv_bias = nn.Parameter(torch.empty(args.q_size + 2 * args.kv_size))
        self.o_bias: nn.Parameter | None = None
        if args.attention.output_bias:
            self.o_bias = nn.Parameter(torch.empty(args.hidden_size))
        # The runner's attention scales by head_dim ** -0.5; another scale pre-scales q.
        self.q_scale = 1.0
        if args.attention.scale is not None:
            self.q_scale = args.attention.scale / args.head_dim**-0.5
        self.q_norm: HeadNorm | None = None
        self.k_norm: HeadNorm | None = None
        if args.attention.qk_norm:
            self.q_norm = HeadNorm(args.head_dim, args.rms_norm_eps)
            self.k_norm = HeadNorm(args.head_dim, args.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: LayerAttention) -> Tensor:
        # x: [T, hidden]; cos/sin: [T, 1, D]
        t = x.shape[0]
        qkv = self.qkv(x)  # [T, (H + 2 KV) * D]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        qk_size = self.q_size + self.kv_size
        # Q and K rotate together: one RoPE pass instead of two.
        qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                [self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])], 1
            )
        qk = apply_rope(qk, cos, sin)  # [T, H + KV, D]
        q = qk[:, : self.num_heads]  # [T, H, D]
        if self.q_scale != 1.0:
            q = q * self.q_scale
        k = qk[:, self.num_heads :]  # [T, KV, D]
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)  # [T, KV, D]
        out = attention(self.layer, q, k, v)  # [T, H, D]
        y: Tensor = self.o_proj(out.reshape(t, self.q_size))  # [T, hidden]
        if self.o_bias is not None:
            y = y + self.o_bias
        return y


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")


_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class MLP(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.act = _ACTIVATIONS[args.block.activation]
        self.silu = args.block.activation == "silu"
        self.gate_up: Linear | QuantLinear = Linear(args.hidden_size, 2 * args.intermediate_size)
        self.down: Linear | QuantLinear = Linear(args.intermediate_size, args.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [T, I] each
        act = F.silu(gate, inplace=True) if self.silu else self.act(gate)
        y: Tensor = self.down(act.mul_(up))  # [T, hidden]
        return y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer)
        self.mlp_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)
        self.post_attn_norm: RMSNorm | None = None
        self.post_mlp_norm: RMSNorm | None = None
        if args.block.sandwich_norms:
            self.post_attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
            self.post_mlp_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: LayerAttention) -> Tensor:
        # In place: x is this forward's own residual stream (never the caller's tensor).
        y = self.attn(self.attn_norm(x), cos, sin, attention)  # [T, hidden]
        if self.post_attn_norm is not None:
            y = self.post_attn_norm(y)
        x = x.add_(y)
        y = self.mlp(self.mlp_norm(x))  # [T, hidden]
        if self.post_mlp_norm is not None:
            y = self.post_mlp_norm(y)
        return x.add_(y)  # [T, hidden]


class DecoderModel(nn.Module):
    """Weights: `embed_tokens.weight`, `norm.weight`, `lm_head.weight` (untied only), and per
    layer `layers.{i}.{attn_norm.weight, attn.qkv.weight, attn.o_proj.weight, mlp_norm.weight,
    mlp.gate_up.weight, mlp.down.weight}`, with the family's features `attn.qkv_bias`
    (`AttentionFeatures.qkv_bias`), `attn.o_bias` (`output_bias`) and
    `attn.{q_norm,k_norm}.weight` (`qk_norm`). `qkv` rows are [q; k; v] with Q/K in the
    Hugging Face (rotate_half) layout; `gate_up` rows are [gate; up].
    """

    cos_table: Tensor
    sin_table: Tensor
    activation_dtype: torch.dtype = torch.float32  # set by `from_weights`
    kernels: KernelSet | None = None  # the CPU kernels, where the model runs on them

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        # Weights come from `from_weights`; skip nn.Embedding's normal_ init, which on the meta
        # device imports torch._dynamo (~4 s).
        self.embed_tokens: nn.Embedding | PackedEmbedding = nn.Embedding(
            args.vocab_size,
            args.hidden_size,
            _weight=torch.empty(args.vocab_size, args.hidden_size),
        )
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head: Linear | QuantLinear | None = None
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.hidden_size, args.vocab_size)
        # On the CPU even under a meta-device context: derived from args, never loaded, and
        # computing them on meta imports torch._dynamo (~4 s). Not persistent: checkpoints
        # never carry them.
        cos, sin = rope_tables(args, torch.device("cpu"))
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)
        self.local_tables: tuple[Tensor, Tensor] | None = None
        if args.window is not None and args.window.rope_theta is not None:
            self.local_tables = rope_tables(args, torch.device("cpu"), args.window.rope_theta)

    @classmethod
    def from_weights(
        cls,
        args: ModelArgs,
        weights: Mapping[str, Weight],
        dtype: torch.dtype,
        device: torch.device,
        *,
        weight_dtype: torch.dtype | None = None,
        kernels: KernelSet | None = None,
        max_packed_tokens: int | None = None,
        dense_dtype: torch.dtype = torch.float32,
        threads: int = 1,
        regroup_rows: bool = False,
    ) -> DecoderModel:
        """Build the model around `weights` (our names) without a throwaway random init.

        `dtype` is the activations'; `weight_dtype` (default: the same) is that of the
        matmul weights: the projections, the MLP, the embedding and the LM head. Norm weights
        and RoPE tables follow the activations.

        A packed `weight_dtype` (torch.uint4: int4, torch.int8: int8; see `quant.py`) puts
        every projection in a `QuantLinear` over the CPU `kernels`: weights already packed
        (a GGUF's blocks, as the loader hands them over) are kept as they are, dense ones
        quantized (Q4_1 for int4, Q8_0 for int8; the LM head and embedding to Q8_0 in both:
        they decide the tokens). The embeddings are looked up in the LM head's own weight
        when they are tied. No dense copy of any matmul weight is kept.

        Steps of more than `max_packed_tokens` rows (default: this CPU's crossover, timed
        once per process on the first layer by `quant.measured_max_packed_tokens`)
        dequantize each weight into one shared scratch buffer and run a dense GEMM in
        `dense_dtype` (bf16 where the CPU has fast bf16 matmuls, fp32 where not): prefill
        chunks and mixed steps, where the GEMV is slower. `threads` 2 splits every native
        product with the CPU kernels' helper thread. `regroup_rows` regroups the matmuls'
        Q8_0 and K-type weights eight rows at a time (`PackedWeight.regrouped`; not an
        embedding that no LM head shares).
        """
        with torch.device("meta"):
            model = cls(args)
        model.activation_dtype = dtype
        packed = weight_dtype in QUANTIZE_TO
        if packed and kernels is None:
            raise ValueError("packed weights need the CPU kernels (kernels/cpu): none here")
        matmul_dtype = dtype if packed else weight_dtype or dtype
        model.kernels = kernels if device.type == "cpu" else None
        scratch = DequantScratch(dense_dtype if dense_dtype == torch.bfloat16 else torch.float32)
        state: dict[str, Tensor] = {}
        linears: dict[str, QuantLinear] = {}

        def packed_weight(w: Weight, head: bool) -> PackedWeight:
            if isinstance(w, PackedWeight):
                return w
            assert weight_dtype is not None
            return quantize(w, HEAD_TYPE if head else QUANTIZE_TO[weight_dtype])

        for name, w in weights.items():
            prefix = name.rpartition(".")[0]
            owner = model.get_submodule(prefix)
            if packed and isinstance(owner, nn.Linear | nn.Embedding):
                assert kernels is not None
                head = not isinstance(owner, Linear) or prefix == "lm_head"
                weight = packed_weight(w, head)
                lookup_only = isinstance(owner, nn.Embedding) and not args.tie_word_embeddings
                if regroup_rows and not lookup_only:
                    weight = weight.regrouped(kernels)
                linear = QuantLinear(weight, kernels, scratch=scratch, threads=threads)
                module: nn.Module = linear
                if isinstance(owner, nn.Embedding):
                    if args.tie_word_embeddings:
                        model.lm_head = linear
                    (table,) = linear.weight.parts
                    module = PackedEmbedding(table, kernels, dtype)
                else:
                    linears[prefix] = linear
                parent, _, attr = prefix.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, module)
                continue
            is_matmul = isinstance(owner, nn.Linear | nn.Embedding)
            state[name] = dense(w).to(device=device, dtype=matmul_dtype if is_matmul else dtype)
        model.load_state_dict(state, strict=True, assign=True)
        model.requires_grad_(False)  # inference only: no autograd bookkeeping outside no_grad
        for norm in model.modules():
            if isinstance(norm, RMSNorm) and not isinstance(norm, HeadNorm):
                norm.kernels = model.kernels
        if linears:
            assert kernels is not None
            first = _layer_projections(model.layers[0])
            limit = max_packed_tokens
            if kernels.batch_invariant:  # never torch's dense matmul: each row as if alone
                limit = NO_CROSSOVER
            elif limit is None:
                layer = [p.weight for p in first]
                limit = measured_max_packed_tokens(layer, kernels, scratch.dtype, threads)
            for linear in linears.values():
                linear.max_packed_tokens = limit
            if isinstance(model.lm_head, QuantLinear):
                model.lm_head.max_packed_tokens = limit
        # The reference Llama casts cos/sin to the activations' dtype; so do we.
        model.cos_table = model.cos_table.to(device=device, dtype=dtype)
        model.sin_table = model.sin_table.to(device=device, dtype=dtype)
        if model.local_tables is not None:
            model.local_tables = tuple(  # type: ignore[assignment]
                t.to(device=device, dtype=dtype) for t in model.local_tables
            )
        return model.eval()

    @property
    def weights_name(self) -> str:
        """The layers' matmul weights: their GGUF types where packed ("Q4_1", "Q4_K+Q6_K"),
        else as `--weights` names dense ones: bf16, fp32, fp16."""
        projections = [p for layer in self.layers for p in _layer_projections(layer)]
        if projections:
            return weights_name([kind for p in projections for kind in p.kinds])
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        qkv = first.attn.qkv
        assert isinstance(qkv, Linear)
        return _DENSE_NAMES[qkv.weight.dtype]

    @property
    def packed(self) -> bool:
        return bool(_layer_projections(self.layers[0]))

    @property
    def dense_weight_dtype(self) -> torch.dtype:
        """The dtype the dense matmuls read: the weights' own, or that of the scratch packed
        weights are dequantized into for large steps (bf16, or fp32 without fast bf16)."""
        first = _layer_projections(self.layers[0])
        if first and first[0].scratch is not None:
            return first[0].scratch.dtype
        assert isinstance(self.embed_tokens, nn.Embedding)
        return self.embed_tokens.weight.dtype

    @property
    def weights_description(self) -> str:
        """For the start-up log: the format, and where packed, which kernel runs when."""
        first = _layer_projections(self.layers[0])
        if not first:
            return self.weights_name
        head = self.lm_head
        head_kinds = (
            f"; LM head {weights_name(head.kinds)}" if isinstance(head, QuantLinear) else ""
        )
        scratch = first[0].scratch
        assert scratch is not None and self.kernels is not None
        return (
            f"{self.weights_name} blocks (native GEMV, {self.kernels.describe()} kernels, up"
            f" to {first[0].max_packed_tokens} rows a step; dequantized to"
            f" {_DENSE_NAMES[scratch.dtype]} above{head_kinds})"
        )

    def forward(self, input_ids: Tensor, positions: Tensor, attention: LayerAttention) -> Tensor:
        # input_ids, positions: [T] int64 -> hidden [T, hidden], after the final norm.
        # NOTE: positions must be within the RoPE tables: the engine grows them to its
        # max_model_len (`ensure_positions`).
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if (scale := self.args.block.embedding_scale) is not None:  # in the weights' dtype
            x = x * torch.tensor(scale, dtype=x.dtype)
        x = x.to(self.activation_dtype)
        cos = self.cos_table[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin_table[positions].unsqueeze(1)  # [T, 1, D]
        local = (cos, sin)
        if self.local_tables is not None:
            local = tuple(t[positions].unsqueeze(1) for t in self.local_tables)  # type: ignore[assignment]
        for i, layer in enumerate(self.layers):
            layer_cos, layer_sin = local if i in self.args.local_layers else (cos, sin)
            x = layer(x, layer_cos, layer_sin, attention)  # [T, hidden]
        hidden: Tensor = self.norm(x)  # [T, hidden]
        return hidden

    def native_decoder_stack(
        self,
        caches: Sequence[tuple[Tensor, Tensor]],
        threads: int = 1,
        layer_groups: Sequence[int] | None = None,
    ) -> DecoderStack | None:
        """Every layer of a step in one native call (`forward_natively`), where this model can
        take it: packed projections, fp32 activations, and contiguous CPU caches (fp32, fp16 or
        bf16) with heads the kernels take. `layer_groups`: each layer's KV group, where the
        sliding-window layers' caches are in pools of their own (the runner's; default one
        pool). None elsewhere: the layers then run op by op through `forward`."""
        if not _runs_natively(self, caches):
            return None
        assert self.kernels is not None
        a = self.args
        shape = CDecoderShape(
            num_layers=a.num_layers,
            hidden=a.hidden_size,
            intermediate=a.intermediate_size,
            num_q_heads=a.num_heads,
            num_kv_heads=a.num_kv_heads,
            head_dim=a.head_dim,
            rms_norm_eps=a.rms_norm_eps,
            # The op-by-op path pre-scales q by `q_scale` under head_dim ** -0.5: the same
            # product up to an fp32 rounding.
            scale=a.attention.scale if a.attention.scale is not None else a.head_dim**-0.5,
            activation=ACTIVATIONS[a.block.activation],
            batch_invariant=int(self.kernels.batch_invariant),
        )
        groups = layer_groups or (0,) * a.num_layers
        local_rope = 1 if self.local_tables is not None else 0
        layers = []
        for i, (layer, (key_cache, value_cache)) in enumerate(
            zip(self.layers, caches, strict=True)
        ):
            assert isinstance(layer, DecoderLayer)
            attn = layer.attn
            layers.append(
                StackLayer(
                    projections=tuple(p.weight.parts for p in _layer_projections(layer)),
                    attn_norm=layer.attn_norm.weight,
                    mlp_norm=layer.mlp_norm.weight,
                    key_cache=key_cache,
                    value_cache=value_cache,
                    qkv_bias=attn.qkv_bias,
                    o_bias=attn.o_bias,
                    q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                    k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                    post_attn_norm=_norm_weight(layer.post_attn_norm),
                    post_mlp_norm=_norm_weight(layer.post_mlp_norm),
                    group=groups[i],
                    rope=local_rope if i in a.local_layers else 0,
                    window=a.layer_windows[i],
                )
            )
        return DecoderStack(self.kernels, shape, layers, threads)

    def forward_natively(
        self,
        input_ids: Tensor,
        positions: Tensor,
        stack: DecoderStack,
        metas: Sequence[AttentionMetadata],
    ) -> Tensor:
        """`forward`, its layers in one call of `stack`: the same arithmetic, without the ~25
        torch ops a layer. `metas`: the step's metadata of each KV group the stack's layers
        read (one, or the full and the window layers'). [T] -> [T, hidden]."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        if (scale := self.args.block.embedding_scale) is not None:  # as `forward` scales it
            x = x * torch.tensor(scale, dtype=x.dtype)
        x = x.to(self.activation_dtype).contiguous()
        tables = [(self.cos_table, self.sin_table)]
        if self.local_tables is not None:
            tables.append(self.local_tables)
        ropes = [
            (cos.index_select(0, positions), sin.index_select(0, positions)) for cos, sin in tables
        ]  # [T, D] each
        hidden: Tensor = self.norm(stack(x, ropes, StackRows.of(metas, positions)))
        return hidden  # [T, hidden]

    def ensure_positions(self, positions: int) -> None:
        """Grow the RoPE tables to cover `positions` (at most the model's context); never
        shrinks them, so that every engine sharing this model keeps the positions it uses."""
        positions = min(positions, self.args.max_position_embeddings)
        if positions <= self.cos_table.shape[0]:
            return
        device, dtype = self.cos_table.device, self.cos_table.dtype

        def grown(theta: float | None) -> tuple[Tensor, Tensor]:
            cos, sin = rope_tables(self.args, torch.device("cpu"), theta, positions)
            return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)

        self.cos_table, self.sin_table = grown(None)
        if self.local_tables is not None:
            assert self.args.window is not None
            self.local_tables = grown(self.args.window.rope_theta)

    def weight_bytes(self) -> int:
        """Bytes the weights hold: dense parameters, and packed weights' blocks as stored (a
        tied embedding and LM head counted once); RoPE tables and work buffers not."""
        held: dict[int, int] = {
            p.data_ptr(): p.numel() * p.element_size() for p in self.parameters()
        }
        for module in self.modules():
            weight = getattr(module, "weight", None)
            if isinstance(weight, PackedWeight):
                held |= {b.data.data_ptr(): b.data.numel() for b in weight.parts}
            elif isinstance(module, PackedEmbedding):
                held[module.weight.data.data_ptr()] = module.weight.data.numel()
        return sum(held.values())

    def compute_logits(self, hidden: Tensor) -> Tensor:
        # hidden: [N, hidden] -> logits [N, vocab] fp32
        if isinstance(self.lm_head, QuantLinear):
            logits: Tensor = self.lm_head(hidden)
            return logits.float()
        if self.lm_head is not None:
            weight = self.lm_head.weight
        else:
            # A packed model's LM head is a QuantLinear, tied or not: a tied one is dense.
            assert isinstance(self.embed_tokens, nn.Embedding)
            weight = self.embed_tokens.weight
        return F.linear(hidden.to(weight.dtype), weight).float()


_DENSE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def _runs_natively(model: DecoderModel, caches: Sequence[tuple[Tensor, Tensor]]) -> bool:
    if model.kernels is None or model.activation_dtype != torch.float32:
        return False
    if len(caches) != model.args.num_layers:
        return False
    head_dim, heads = model.args.head_dim, (model.args.num_heads, model.args.num_kv_heads)
    if head_dim % 16 or head_dim > ops.MAX_HEAD_DIM or heads[0] % heads[1]:
        return False
    if any(
        c.device.type != "cpu" or c.dtype not in ops.ELEMENT_TYPES or not c.is_contiguous()
        for pair in caches
        for c in pair
    ):
        return False
    return all(len(_layer_projections(layer)) == 4 for layer in model.layers)


def _norm_weight(norm: RMSNorm | None) -> Tensor | None:
    return None if norm is None else norm.weight


def _layer_projections(layer: nn.Module) -> tuple[QuantLinear, ...]:
    """qkv, o_proj, gate_up, down (those that are packed): the stack's table's order."""
    assert isinstance(layer, DecoderLayer)
    projections = (layer.attn.qkv, layer.attn.o_proj, layer.mlp.gate_up, layer.mlp.down)
    return tuple(p for p in projections if isinstance(p, QuantLinear))
