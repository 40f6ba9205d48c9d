"""What the penalties read of a sample's tokens, kept up to date one token at a time.

The sampler applies presence, frequency and repetition penalties to the ids a sample has seen,
not to its whole vocabulary; reading those ids from the token list every step would cost a pass
over the prompt and the answer per sequence per step. A `TokenCounts` keeps them as the sample
grows instead: the distinct ids seen (prompt and answer; repetition), the answer's distinct ids
and how often each came (frequency, presence), in arrays the sampler concatenates for the whole
batch with one call. One per penalized sequence, owned by it (forks copy their parent's).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class TokenCounts:
    __slots__ = ("_answer_counts", "_answer_ids", "_answer_slot", "_seen", "_seen_ids")

    def __init__(self, prompt: Sequence[int], answer: Sequence[int] = ()) -> None:
        self._seen_ids: set[int] = set()
        self._seen = np.empty(64, dtype=np.int64)  # _seen_ids in arrival order, then room
        self._answer_slot: dict[int, int] = {}  # an answer id -> its place in the two below
        self._answer_ids = np.empty(16, dtype=np.int64)
        self._answer_counts = np.empty(16, dtype=np.float32)
        for token_id in prompt:
            self._see(token_id)
        for token_id in answer:
            self.add(token_id)

    def add(self, token_id: int) -> None:
        """An answer token, just sampled."""
        self._see(token_id)
        slot = self._answer_slot.get(token_id)
        if slot is None:
            slot = len(self._answer_slot)
            self._answer_slot[token_id] = slot
            if slot == len(self._answer_ids):
                self._answer_ids = _grown(self._answer_ids)
                self._answer_counts = _grown(self._answer_counts)
            self._answer_ids[slot] = token_id
            self._answer_counts[slot] = 0.0
        self._answer_counts[slot] += 1.0

    @property
    def seen(self) -> np.ndarray:
        """[n] int64: every distinct id of the prompt and the answer (a view)."""
        return self._seen[: len(self._seen_ids)]

    @property
    def answer_ids(self) -> np.ndarray:
        """[m] int64: the answer's distinct ids (a view)."""
        return self._answer_ids[: len(self._answer_slot)]

    @property
    def answer_counts(self) -> np.ndarray:
        """[m] float32: how often each of `answer_ids` came (a view)."""
        return self._answer_counts[: len(self._answer_slot)]

    def copy(self) -> TokenCounts:
        twin = TokenCounts(())
        twin._seen_ids = set(self._seen_ids)
        twin._seen = self._seen.copy()
        twin._answer_slot = dict(self._answer_slot)
        twin._answer_ids = self._answer_ids.copy()
        twin._answer_counts = self._answer_counts.copy()
        return twin

    def _see(self, token_id: int) -> None:
        if token_id in self._seen_ids:
            return
        slot = len(self._seen_ids)
        self._seen_ids.add(token_id)
        if slot == len(self._seen):
            self._seen = _grown(self._seen)
        self._seen[slot] = token_id


def _grown(array: np.ndarray) -> np.ndarray:
    """`array` in twice the room, its values first."""
    out = np.empty(2 * len(array), dtype=array.dtype)
    out[: len(array)] = array
    return out
