"""Tests for `benchmarks/side_channel.py`: its statistics on samples with known answers, and a
small run against a real server on the tiny model."""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.side_channel import (
    Probe,
    TwoSampleTest,
    accuracy_at,
    best_threshold,
    held_out_accuracy,
    kolmogorov_q,
    kolmogorov_smirnov,
    main,
    mann_whitney_u,
    report,
)
from tests.tiny_model import make_tiny_llama


def pairs_u(x: list[float], y: list[float]) -> float:
    """U by its definition: pairs where x's value is the larger, ties counting a half."""
    return sum((a > b) + 0.5 * (a == b) for a in x for b in y)


# ---------------------------------------------------------------------- Mann-Whitney U


def test_mann_whitney_of_fully_separated_samples_matches_the_textbook_value() -> None:
    test = mann_whitney_u([1, 2, 3], [4, 5, 6])
    assert test.statistic == 0
    # z = (|0 - 4.5| - 0.5) / sqrt(3 * 3 * 7 / 12); scipy's asymptotic p-value is 0.0808556.
    assert test.p_value == pytest.approx(0.0808556, abs=1e-6)
    assert mann_whitney_u([4, 5, 6], [1, 2, 3]).p_value == pytest.approx(0.0808556, abs=1e-6)


def test_mann_whitney_u_counts_pairs_with_ties_as_halves() -> None:
    rng = random.Random(1)
    for _ in range(20):
        x = [float(rng.randint(0, 5)) for _ in range(rng.randint(1, 12))]
        y = [float(rng.randint(0, 5)) for _ in range(rng.randint(1, 12))]
        test = mann_whitney_u(x, y)
        assert test.statistic == pairs_u(x, y)
        assert 0.0 < test.p_value <= 1.0
        assert mann_whitney_u(y, x).p_value == pytest.approx(test.p_value)


def test_mann_whitney_tells_shifted_samples_apart() -> None:
    rng = random.Random(2)
    base = [rng.gauss(0, 1) for _ in range(100)]
    assert mann_whitney_u(base, [rng.gauss(1, 1) for _ in range(100)]).p_value < 1e-6
    assert mann_whitney_u([3.0, 3.0], [3.0, 3.0, 3.0]).p_value == 1.0


@pytest.mark.parametrize("test", [mann_whitney_u, kolmogorov_smirnov])
def test_p_values_are_calibrated_on_samples_of_one_distribution(
    test: Callable[[list[float], list[float]], TwoSampleTest],
) -> None:
    """Under the null hypothesis about 5% of p-values fall below 0.05 (KS's asymptotic
    p-value is a little conservative at 50 a side)."""
    rng = random.Random(5)
    trials = 400
    rejected = sum(
        test([rng.gauss(0, 1) for _ in range(50)], [rng.gauss(0, 1) for _ in range(50)]).p_value
        < 0.05
        for _ in range(trials)
    )
    assert 0.015 < rejected / trials < 0.085


# ---------------------------------------------------------------------- Kolmogorov-Smirnov


def test_kolmogorov_q_matches_the_tabulated_distribution() -> None:
    assert kolmogorov_q(1.0) == pytest.approx(0.2700, abs=1e-4)
    assert kolmogorov_q(1.3581) == pytest.approx(0.05, abs=1e-4)  # the 5% critical value
    assert kolmogorov_q(1.6276) == pytest.approx(0.01, abs=1e-4)
    assert kolmogorov_q(0.1) == 1.0


def test_kolmogorov_smirnov_d_is_the_largest_gap_between_the_two_cdfs() -> None:
    assert kolmogorov_smirnov([1, 2, 3], [4, 5, 6]).statistic == 1.0
    assert kolmogorov_smirnov([1, 2, 3, 4], [3, 4, 5, 6]).statistic == 0.5
    same = kolmogorov_smirnov([1, 2, 3], [3, 2, 1])
    assert (same.statistic, same.p_value) == (0.0, 1.0)
    rng = random.Random(3)
    base = [rng.gauss(0, 1) for _ in range(200)]
    assert kolmogorov_smirnov(base, [rng.gauss(1, 1) for _ in range(200)]).p_value < 1e-6


# ---------------------------------------------------------------------- the attacker's threshold


def test_best_threshold_separates_fast_hits_from_slow_misses() -> None:
    assert best_threshold([1, 2, 3], [4, 5, 6]) == (3.5, 1.0)
    # Hits slower than misses: calling anything fast a hit only does worse than calling nothing.
    assert best_threshold([4, 5, 6], [1, 2, 3]) == (-math.inf, 0.5)
    # Overlap: at 2.5, hits 1, 2 and misses 3, 4, 6 are right; only hit 5 is wrong.
    threshold, accuracy = best_threshold([1, 2, 5], [3, 4, 6])
    assert (threshold, accuracy) == (2.5, pytest.approx(5 / 6))
    assert accuracy_at([1, 2, 5], [3, 4, 6], threshold) == accuracy


def test_held_out_accuracy_is_one_for_separated_samples_and_about_a_half_without_signal() -> None:
    rng = random.Random(4)
    assert (
        held_out_accuracy([rng.random() for _ in range(50)], [rng.random() + 2 for _ in range(50)])
        == 1.0
    )
    noise = held_out_accuracy(
        [rng.random() for _ in range(100)], [rng.random() for _ in range(100)]
    )
    assert 0.35 < noise < 0.65
    # In-sample, the best threshold on pure noise looks better than chance: why both are shown.
    assert (
        best_threshold([rng.random() for _ in range(100)], [rng.random() for _ in range(100)])[1]
        > 0.5
    )


def test_report_puts_hits_and_misses_side_by_side() -> None:
    probes = [
        Probe(hit=True, prompt_tokens=40, cached_tokens=32, swapped_in_tokens=0, ttft_s=0.010),
        Probe(hit=False, prompt_tokens=40, cached_tokens=16, swapped_in_tokens=0, ttft_s=0.030),
        Probe(hit=True, prompt_tokens=40, cached_tokens=32, swapped_in_tokens=0, ttft_s=0.012),
        Probe(hit=False, prompt_tokens=40, cached_tokens=16, swapped_in_tokens=0, ttft_s=0.020),
    ]
    r = report("made-up", [], probes)
    assert (r.cached_tokens_hit, r.cached_tokens_miss) == (32, 16)
    assert (r.ttft_p50_hit_ms, r.ttft_p50_miss_ms) == (pytest.approx(11), pytest.approx(25))
    assert (r.mann_whitney_u, r.ks_d) == (0, 1.0)
    assert r.ttft_accuracy_in_sample == r.cached_tokens_accuracy == 1.0
    with pytest.raises(ValueError, match="each kind"):
        report("hits only", [], probes[::2])


# ---------------------------------------------------------------------- a real server


@pytest.mark.server
def test_a_small_run_against_a_real_server(tmp_path: Path) -> None:
    """Global sharing shows every should-hit probe in `cached_tokens`; the default scope
    shows hits and misses alike."""
    model = make_tiny_llama(tmp_path / "tiny")
    common = ["--probes", "10", "--secret-words", "40", "--model", str(model), "--dtype", "float32"]
    leaky, default = main([*common, "--compare"])
    assert leaky.label == "global" and default.label == "default"
    assert leaky.prompt_tokens_hit == leaky.prompt_tokens_miss
    assert leaky.cached_tokens_hit > leaky.cached_tokens_miss
    assert leaky.cached_tokens_accuracy == 1.0
    assert default.cached_tokens_hit == default.cached_tokens_miss > 0  # the system prompt


@pytest.mark.server
def test_a_system_prompt_that_begins_like_anothers_finds_none_of_its_blocks(
    tmp_path: Path,
) -> None:
    """The secret in the victim's system prompt, the attacker's sharing its first half: with
    global sharing the hits show in `cached_tokens`; by default hits and misses alike find
    nothing, not even the template's prefix."""
    model = make_tiny_llama(tmp_path / "tiny")
    common = ["--probes", "8", "--secret-words", "40", "--model", str(model), "--dtype", "float32"]
    leaky, default = main([*common, "--compare", "--target", "system-prefix"])
    assert leaky.cached_tokens_hit > leaky.cached_tokens_miss
    assert default.cached_tokens_hit == default.cached_tokens_miss == 0
