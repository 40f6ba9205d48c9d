"""Inputs for the sampling kernel (kernels/cpu/src/sample.c) and the float64 reference its
picks are checked against, shared by the library's tests and the harness's (arm64, ASan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SampleCase:
    logits: torch.Tensor  # [R, V] fp32
    allowed: torch.Tensor  # [R, W] int32
    temperatures: torch.Tensor  # [R] fp32
    min_p: torch.Tensor  # [R] fp32
    uniforms: torch.Tensor  # [R] float64


def sample_case(seed: int) -> SampleCase:
    """12 rows of 1,000 ids (not a multiple of 32) with the edges: ids past the bitmask's
    width, -inf and NaN logits, a row with nothing allowed, one whose allowed ids are all
    -inf, greedy rows with a tie, min_p, temperatures from 1e-3 to 100, uniforms of 0 and
    the largest double below 1."""
    gen = torch.Generator().manual_seed(seed)
    rows, vocab = 12, 1000
    x = torch.randn(rows, vocab, generator=gen) * 4
    allowed = torch.randint(-(2**31), 2**31, (rows, 32), generator=gen).to(torch.int32)
    temps = torch.tensor([1.0, 0.7, 0.0, 1e-3, 100.0, 1.0, 0.0, 1.3, 1.0, 0.9, 1.0, 0.5])
    min_p = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    uniforms = torch.rand(rows, generator=gen, dtype=torch.float64)
    uniforms[0], uniforms[1] = 0.0, 1.0 - 2.0**-53
    allowed[1] = -1  # every id, 1,000 of the 1,024 bits
    allowed[2, 5:] = 0  # greedy among the first 160 only: the largest logits later are out
    x[3, 10:20] = float("-inf")
    x[4, 100:110] = float("nan")
    allowed[7] = 0  # nothing allowed
    allowed[8] = 0
    allowed[8, 2] = -1
    x[8, 64:96] = float("-inf")  # allowed, but all -inf: nothing
    x[6, 300] = x[6, 700] = float(x[6].max()) + 1.0  # a tie: the first
    allowed[6] = -1
    allowed[9, :31] = 0  # only the last word, 8 ids of it inside the vocabulary
    allowed[10, 1::2] = 0  # every other word
    return SampleCase(x, allowed, temps, min_p, uniforms)


def allowed_ids(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """[V] bool: bit j of word w allows id 32 w + j; ids past the words are not allowed."""
    words = bits.to(torch.int64) & 0xFFFFFFFF
    expanded = (words[:, None] >> torch.arange(32)) & 1
    flat = expanded.flatten().bool()
    out = torch.zeros(vocab, dtype=torch.bool)
    out[: min(vocab, flat.numel())] = flat[:vocab]
    return out


def check_picks(case: SampleCase, picks: torch.Tensor) -> None:
    """Each pick is what the float64 reference makes of its row: -1 where nothing finite is
    allowed; at temperature 0 the first id of the largest allowed logit; else an id of
    weight > 0 whose cumulative interval holds the uniform (to 1e-6)."""
    for r in range(case.logits.shape[0]):
        x = case.logits[r].double()
        ok = allowed_ids(case.allowed[r], x.numel()) & (x > float("-inf"))  # NaN: False
        chosen = int(picks[r])
        if not ok.any():
            assert chosen == -1, r
            continue
        assert 0 <= chosen < x.numel() and ok[chosen], (r, chosen)
        peak = x[ok].max()
        if case.temperatures[r] <= 0:
            assert chosen == int(((x == peak) & ok).nonzero()[0]), r
            continue
        weights = torch.where(ok, torch.exp((x - peak) / float(case.temperatures[r])), 0.0)
        weights[weights < float(case.min_p[r])] = 0.0
        cdf = torch.cumsum(weights, 0) / weights.sum()
        start = float(cdf[chosen - 1]) if chosen else 0.0
        uniform = float(case.uniforms[r])
        assert weights[chosen] > 0, r
        assert start - 1e-6 <= uniform < float(cdf[chosen]) + 1e-6, (r, chosen, uniform)
