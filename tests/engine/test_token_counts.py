"""TokenCounts: the distinct ids a sample's penalties read, kept a token at a time."""

from __future__ import annotations

from collections import Counter

import numpy as np

from service.engine.token_counts import TokenCounts


def test_it_holds_the_distinct_ids_seen_and_the_answers_counts_past_its_first_room() -> None:
    prompt = [5, 5, 9, *range(100, 190)]
    answer = [7, 5, 7, *range(1000, 1040), 7]
    counts = TokenCounts(prompt)
    for token in answer:
        counts.add(token)
    assert sorted(counts.seen.tolist()) == sorted(set(prompt) | set(answer))
    got = dict(zip(counts.answer_ids.tolist(), counts.answer_counts.tolist(), strict=True))
    assert got == {t: float(n) for t, n in Counter(answer).items()}
    assert counts.answer_counts.dtype == np.float32 and counts.seen.dtype == np.int64


def test_built_at_once_or_a_token_at_a_time_it_is_the_same() -> None:
    prompt, answer = [3, 1, 3], [2, 2, 1, 8]
    grown = TokenCounts(prompt)
    for token in answer:
        grown.add(token)
    whole = TokenCounts(prompt, answer)
    assert whole.seen.tolist() == grown.seen.tolist()
    assert whole.answer_ids.tolist() == grown.answer_ids.tolist()
    assert whole.answer_counts.tolist() == grown.answer_counts.tolist()


def test_a_copy_goes_its_own_way() -> None:
    """A fork's counts start as its parent's; what either samples next is its own."""
    parent = TokenCounts([1, 2], [3])
    child = parent.copy()
    child.add(4)
    child.add(3)
    parent.add(9)
    assert parent.seen.tolist() == [1, 2, 3, 9] and child.seen.tolist() == [1, 2, 3, 4]
    assert parent.answer_counts.tolist() == [1.0, 1.0]
    assert dict(zip(child.answer_ids.tolist(), child.answer_counts.tolist(), strict=True)) == {
        3: 2.0,
        4: 1.0,
    }
