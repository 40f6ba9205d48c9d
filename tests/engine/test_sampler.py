"""The batched sampler: logit bias per row, greedy and random rows in one pass, raw
log-probabilities."""

from __future__ import annotations

import pytest
import torch

from service.engine.params import SamplingParams
from service.engine.sampler import Sampler, SamplingRow

V = 8


def row(**params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), None)  # type: ignore[arg-type]


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


@pytest.fixture
def sampler() -> Sampler:
    return Sampler(torch.device("cpu"), seed=0)


def test_logit_bias_steers_its_own_row_only(sampler: Sampler) -> None:
    x = logits([5.0] + [0.0] * (V - 1), [5.0] + [0.0] * (V - 1))
    out = sampler(x, [row(temperature=0, logit_bias=((3, 100.0),)), row(temperature=0)])
    assert [t.token_id for t in out] == [3, 0]


def test_a_bias_of_minus_100_bans_a_token_for_greedy_and_random_rows(sampler: Sampler) -> None:
    x = logits(*[[9.0, 1.0] + [-50.0] * (V - 2)] * 4)
    banned = {"logit_bias": ((0, -100.0),)}
    rows = [row(temperature=0, **banned), row(temperature=1.0, seed=1, **banned)] * 2
    for _ in range(20):
        assert all(t.token_id == 1 for t in sampler(x, rows))


def test_log_probabilities_are_reported_without_the_bias(sampler: Sampler) -> None:
    x = logits([2.0, 1.0] + [0.0] * (V - 2))
    (out,) = sampler(x, [row(temperature=0, logprobs=1, logit_bias=((1, 10.0),))])
    assert out.token_id == 1
    assert out.logprobs is not None
    raw = torch.log_softmax(x[0], dim=-1)
    assert out.logprobs[0] == (1, pytest.approx(raw[1].item()))
    assert out.logprobs[1] == (0, pytest.approx(raw[0].item()))  # the unbiased top token


def test_a_bias_past_the_vocabulary_is_skipped_and_the_input_left_alone(
    sampler: Sampler,
) -> None:
    x = logits([1.0, 3.0] + [0.0] * (V - 2))
    before = x.clone()
    out = sampler(x, [row(temperature=0, logit_bias=((V + 5, 100.0), (0, 5.0)))])
    assert out[0].token_id == 0
    assert torch.equal(x, before)


@pytest.mark.parametrize("bias", [((-1, 1.0),), ((0, 101.0),), ((0, -100.5),)])
def test_logit_bias_is_validated(bias: tuple[tuple[int, float], ...]) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)
