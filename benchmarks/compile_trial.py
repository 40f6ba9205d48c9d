"""Does torch.compile (inductor on the CPU) pay for the decode step? One decoder layer's
blocks of the default model, eager against compiled, at the decode batch sizes, one thread.

Times the two blocks around the attention (the attention itself reads the paged cache
through the runner's per-step plan, which changes shape every step): the norm and the fused
QKV projection with RoPE, and the output projection, norm, MLP and both residuals. Reported:
the compile time of each shape and the median thread CPU time of each block, eager and
compiled, alternating.

    .venv/bin/python -m benchmarks.compile_trial [--batch 1 8 32] [--weights int4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from service.engine.loader import load_model
from service.engine.model import DecoderLayer, apply_rope
from service.engine.plan import WEIGHT_FORMATS

Block = Callable[[torch.Tensor], torch.Tensor]


def blocks(layer: DecoderLayer, cos: torch.Tensor, sin: torch.Tensor) -> dict[str, Block]:
    attn = layer.attn
    qk = attn.q_size + attn.kv_size

    def qkv_rope(x: torch.Tensor) -> torch.Tensor:
        qkv = attn.qkv(layer.attn_norm(x))  # [T, (H + 2 KV) * D]
        heads = qkv[:, :qk].view(x.shape[0], -1, attn.head_dim)
        return apply_rope(heads, cos, sin)

    def out_mlp(x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = x + attn.o_proj(x)  # stands in for the attention's output
        out: torch.Tensor = y + layer.mlp(layer.mlp_norm(y))
        return out

    return {"norm + qkv + rope": qkv_rope, "o_proj + norm + mlp": out_mlp}


def median_us(block: Block, x: torch.Tensor, repeats: int) -> float:
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.thread_time()
            block(x)
            times.append(time.thread_time() - start)
    return 1e6 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--weights", default="int4", choices=sorted(WEIGHT_FORMATS))
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = load_model(
        None, torch.float32, torch.device("cpu"), weight_dtype=WEIGHT_FORMATS[args.weights]
    ).model
    layer = model.layers[3]
    assert isinstance(layer, DecoderLayer)
    print(f"compile_trial: {model.weights_description}, 1 torch thread")
    print("| block | batch | compile s | eager us | compiled us | compiled / eager |")
    print("|---|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, model.args.hidden_size, generator=gen)
        positions = torch.arange(100, 100 + batch)
        cos = model.cos_table[positions].unsqueeze(1)
        sin = model.sin_table[positions].unsqueeze(1)
        for name, block in blocks(layer, cos, sin).items():
            compiled = torch.compile(block, dynamic=False)
            start = time.perf_counter()
            with torch.inference_mode():
                compiled(x)
            compile_s = time.perf_counter() - start
            eager = min(median_us(block, x, args.repeats) for _ in range(3))
            fast = min(median_us(compiled, x, args.repeats) for _ in range(3))
            print(
                f"| {name} | {batch} | {compile_s:.1f} | {eager:.0f} | {fast:.0f} | "
                f"{fast / eager:.2f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
