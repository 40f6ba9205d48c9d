"""Attention backends: one interface, a torch reference (CPU) and Triton kernels (GPU).

The runner calls `plan` once per step, then per layer `write_kv` and `attend`; block moves
(`copy_blocks` for copy-on-write, `swap_blocks` between the device and CPU pools) run between
steps. Pools are `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`; a layer's K cache
is `pool[layer, 0]`.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kernels import reference
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
    ) -> torch.Tensor: ...

    def copy_blocks(self, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None: ...

    def swap_blocks(
        self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None: ...


class TorchBackend:
    """The pure-torch reference; the production path on the CPU."""

    name = "torch"

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
    ) -> torch.Tensor:
        return reference.paged_attention(query, key_cache, value_cache, plan, scale)

    def copy_blocks(self, pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        reference.copy_blocks(pool, src, dst)

    def swap_blocks(
        self, src_pool: torch.Tensor, dst_pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor
    ) -> None:
        reference.swap_blocks(src_pool, dst_pool, src, dst)


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` picks Triton on CUDA and the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "triton":
        from kernels.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r} (expected auto, torch or triton)")
