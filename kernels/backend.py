"""Attention backends: one interface, a torch reference (CPU) and Triton kernels (GPU).

The runner calls `plan` once per step, then per layer `write_kv` and `attend` (with the layer's
sliding window, if it has one: the query sees only that many keys, its own included); block moves
(`copy_blocks` for copy-on-write, `swap_blocks` between the device and CPU pools) run between
steps. Pools are `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`; a layer's K cache
is `pool[layer, 0]`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kernels import reference
from kernels.cpu import ops
from kernels.cpu.dispatch import KernelSet
from kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str

    def plan(self, meta: AttentionMetadata) -> Any: ...

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: Any,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor: ...

    def copy_blocks(self, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None: ...

    def swap_blocks(
        self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None: ...


class TorchBackend:
    """The pure-torch reference; the production path on the CPU, where decode rows read the
    paged cache in place through the CPU kernels (`kernels.cpu.ops.paged_decode`: no
    gathered K/V copy, no padded SDPA, so faster; by how much is not measured in
    docs/perf.md) when `kernels` are given and the activations are fp32."""

    name = "torch"

    def __init__(self, kernels: KernelSet | None = None) -> None:
        self.kernels = kernels

    def plan(self, meta: AttentionMetadata) -> reference.TorchAttentionPlan:
        return reference.plan_attention(meta)

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        reference.write_kv(key, value, key_cache, value_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        plan: Any,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        decode = None
        if self.kernels is not None and _native_decode_applies(query, key_cache):
            decode = _NativeDecode(self.kernels)
        windowed = plan.windowed(window)
        return reference.paged_attention(query, key_cache, value_cache, windowed, scale, decode)

    def copy_blocks(self, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        reference.copy_blocks(pool, src, dst)

    def swap_blocks(
        self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        reference.swap_blocks(src_pool, dst_pool, src, dst)


def _native_decode_applies(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    d = key_cache.shape[-1]
    return (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and key_cache.dtype in ops.ELEMENT_TYPES
        and key_cache.is_contiguous()
        and d % 16 == 0
        and d <= ops.MAX_HEAD_DIM
    )


class _NativeDecode:
    """The decode rows' attention through the CPU kernels, in reference.DecodeAttention's
    shape."""

    def __init__(self, kernels: KernelSet) -> None:
        self.kernels = kernels

    def __call__(
        self,
        query: torch.Tensor,  # [Bd, Hq, D]
        key_cache: torch.Tensor,  # [N, bs, Hkv, D]
        value_cache: torch.Tensor,
        g: reference.DecodeGroup,
        scale: float,
    ) -> torch.Tensor:  # [Bd, Hq, D]
        slots = g.slots.view(g.seq_lens.shape[0], -1)  # [Bd, C]
        return ops.paged_decode(
            self.kernels, query, key_cache, value_cache, slots, g.seq_lens, scale
        )


def get_backend(
    name: str, device: torch.device, kernels: KernelSet | None = None
) -> AttentionBackend:
    """`auto` picks Triton on CUDA and the torch reference elsewhere (with the CPU
    `kernels`, where given, for the decode rows)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend(kernels if device.type == "cpu" else None)
    if name == "triton":
        from kernels.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r} (expected auto, torch or triton)")
