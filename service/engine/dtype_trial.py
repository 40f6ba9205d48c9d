"""The CPU dtype trial: which dtypes dense weights and activations run in on this CPU.

With `dtype` and `weight_dtype` auto on a CPU with dense weights, EngineConfig asks
`fastest_cpu_dtypes` for the activations' (and the KV cache's) dtype and the matmul weights':
all fp32, bf16 weights under fp32 activations, or all bf16, whichever runs a decode-sized
slice of the model fastest here, timed once per process at start-up. The right choice
differs between CPUs (why: docs/perf-history.md, "Measured before the project" and
"Engine: `benchmarks/engine_step.py` with dense dtypes").
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from typing import NamedTuple

import torch


class CpuDtypes(NamedTuple):
    activations: torch.dtype
    weights: torch.dtype


# SmolLM2-135M's per-layer matmuls as (out, in): qkv, o_proj, gate_up, down.
_LAYER_MATMULS = ((960, 576), (576, 576), (3072, 576), (576, 1536))

# From the most precise to the least: a later one is taken only if clearly faster.
CPU_CHOICES = (
    CpuDtypes(torch.float32, torch.float32),
    CpuDtypes(torch.float32, torch.bfloat16),
    CpuDtypes(torch.bfloat16, torch.bfloat16),
)


@functools.cache
def fastest_cpu_dtypes() -> CpuDtypes:
    """The dtypes under which this CPU runs a decode-sized slice of the model fastest.

    The slice is one decoder layer of a decode step at batch 32: the default model's four
    projections (with the casts they need when the weights' dtype is not the activations')
    and the attention of 32 sequences over 256 cached tokens (SDPA with a mask and GQA, as the
    torch backend runs it). A matmul alone misleads: a CPU whose bf16 matmuls are fast may
    run bf16 attention slowly, and bf16 weights under fp32 activations then win
    (docs/perf-history.md, "Engine: `benchmarks/engine_step.py` with dense dtypes"). A less
    precise choice must beat the one before it by 20%.

    Trials alternate between the choices and the best of each counts, so a neighbour's load
    on a shared machine does not decide. With one torch thread (the engine's default) the
    trials count this thread's CPU time, which time spent descheduled does not inflate.
    """
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 576, generator=gen)  # [B, hidden]
    h = torch.randn(32, 1536, generator=gen)  # [B, intermediate]
    # One decoder layer's matmuls in the default model's shapes: qkv, o_proj, gate_up, down.
    weights = [torch.randn(n, k, generator=gen) for n, k in _LAYER_MATMULS]
    q = torch.randn(32, 9, 1, 64, generator=gen)  # [B, Hq, 1, D]
    kv = torch.randn(32, 3, 256, 64, generator=gen)  # [B, Hkv, C, D]
    mask = torch.ones(32, 1, 1, 256, dtype=torch.bool)
    F = torch.nn.functional

    def layer(
        x: torch.Tensor, h: torch.Tensor, ws: list[torch.Tensor], q: torch.Tensor, kv: torch.Tensor
    ) -> None:
        for w in ws:
            inp = x if w.shape[1] == x.shape[1] else h  # `down` reads the MLP's hidden
            F.linear(inp.to(w.dtype), w).to(inp.dtype)
        F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)

    best = dict.fromkeys(CPU_CHOICES, float("inf"))
    for _ in range(3):
        for choice in best:
            act = choice.activations
            ws = [w.to(choice.weights) for w in weights]
            args = (x.to(act), h.to(act), ws, q.to(act), kv.to(act))
            layer(*args)
            start = clock()
            for _ in range(2):
                layer(*args)
            best[choice] = min(best[choice], clock() - start)
    return pick_cpu_dtypes(best)


def pick_cpu_dtypes(times: Mapping[CpuDtypes, float]) -> CpuDtypes:
    """From the most precise choice on, move to the next only where it is 20% faster than the
    one held: a small gain is not worth the rounding."""
    chosen = CPU_CHOICES[0]
    for choice in CPU_CHOICES[1:]:
        if times[choice] < 0.8 * times[chosen]:
            chosen = choice
    return chosen
