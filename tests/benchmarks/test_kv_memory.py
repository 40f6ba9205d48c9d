"""Tests for `benchmarks/kv_memory.py`: the small-size run is deterministic and shows the claims."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks import kv_memory


@pytest.fixture(scope="module")
def small() -> dict[str, Any]:
    return kv_memory.run_size(small=True)


def test_small_run_figures_are_identical_twice(small: dict[str, Any]) -> None:
    assert kv_memory.run_size(small=True) == small


def test_paged_keeps_reserved_slots_full_and_contiguous_does_not(small: dict[str, Any]) -> None:
    rows = {r["allocator"]: r for r in small["allocators"]}
    assert rows["paged-16"]["utilization"] >= 0.96
    assert rows["paged-8"]["utilization"] >= rows["paged-16"]["utilization"]
    assert rows["paged-16"]["utilization"] >= rows["paged-32"]["utilization"]
    assert rows["contiguous"]["utilization"] < 0.5
    assert rows["contiguous"]["utilization"] < rows["oracle"]["utilization"] < 1.0
    assert rows["oracle"]["internal_fragmentation"] == 0.0
    for r in rows.values():
        parts = r["utilization"] + r["internal_fragmentation"] + r["reserved_for_later"]
        assert parts == pytest.approx(1.0)


def test_paged_fits_three_times_the_sequences(small: dict[str, Any]) -> None:
    rows = {r["allocator"]: r for r in small["allocators"]}
    contiguous = rows["contiguous"]
    assert contiguous["peak_running"] == 8192 // 2048
    assert rows["paged-16"]["mean_running_saturated"] >= 3 * contiguous["mean_running_saturated"]


def test_shared_system_prompt_is_stored_about_once(small: dict[str, Any]) -> None:
    by_users = {s["users"]: s for s in small["shared_prompt"]}
    assert by_users[32]["vs_ideal"] <= 1.05
    assert by_users[32]["unshared_prompt_blocks"] > 4 * by_users[32]["shared_prompt_blocks"]
    assert by_users[1]["saved"] == 0.0


def test_parallel_samples_share_their_prompt(small: dict[str, Any]) -> None:
    peak = {(p["allocator"], p["case"]): p["peak_blocks"] for p in small["parallel_sampling"]}
    # A 256-token prompt (16 blocks) once, and 4 answers of 128 tokens (8 blocks each).
    assert peak["paged-16", "n=4"] == 16 + 4 * 8
    assert peak["paged-16, no prefix cache", "4 requests"] == 4 * (16 + 8)
    assert peak["contiguous", "n=4"] == 4 * 2048 // 16
