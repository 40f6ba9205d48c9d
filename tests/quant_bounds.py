"""Error bounds of the packed kernels, shared by the kernel and the engine tests."""

from __future__ import annotations

import torch


def int8_input_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x w^T| for the VNNI int4 kernel (kernels/native.c), x [M, K] and the weight it
    holds w [N, K]. Each input goes in as two int8 digits per group of 32, off by at most
    dx / 508 with dx = max|x| / 127 its group's step, so per output
    sum_g dx_g / 508 * sum_(k in g) |w_k|; plus fp32 summation. [M, N]."""
    m, k = x.shape
    x, w = x.double(), w.double()
    step = x.abs().view(m, k // 32, 32).amax(-1) / 127  # [M, G]
    per_group = w.abs().view(w.shape[0], k // 32, 32).sum(-1)  # [N, G]
    rounding = (step / 508) @ per_group.T * (1 + 1e-5)
    return rounding + k * 2.0**-24 * (x.abs() @ w.abs().T) + 1e-6
