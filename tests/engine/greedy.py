"""Running requests through an LLMEngine and comparing greedy outputs token for token.

"Identical" means the same token ids. The one tolerated exception: batched matmuls round
differently, so a divergence is accepted at a position where the reference's top two logits
differ by less than NEAR_TIE, and nowhere else; the tokens after it are then not compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from service.engine.params import SamplingParams

if TYPE_CHECKING:  # run() only drives one: the API tests compare answers without torch
    from service.engine.engine import LLMEngine

NEAR_TIE = 1e-3
# A float16 KV cache (the CPU's default) moves logits more than batch shapes do: against the
# fp32 model with an fp32 cache it moved the bundled model's top-two margins by up to 0.017
# on the chat prompts of test_engine_real_model, so between the two a near-tie is under 0.03.
KV16_NEAR_TIE = 0.03
# Paths that round to bf16 (dense bf16 weights) move logits by far more: against fp32, bf16
# dense weights parted from the bundled model's greedy answers at margins up to 0.047
# (docs/perf-history.md, "Packed weights (`--weights auto | int4 | int8`), 2026-12-02, AVX512
# EPYC (before the stack)"), so between such paths a near-tie is a margin under 0.1.
BF16_NEAR_TIE = 0.1


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    margins: list[float] = field(default_factory=list)  # top-1 minus top-2 logit per token
    text: str = ""
    finish_reason: str | None = None


def greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=2)


def run(
    engine: LLMEngine,
    prompts: dict[str, list[int]],
    params: SamplingParams,
    join_at: dict[str, int] | None = None,
    max_steps: int = 20_000,
    on_step: Callable[[], None] | None = None,
) -> dict[str, Generated]:
    """Add each request at its step (default 0), step until all finish, collect the outputs;
    `on_step` looks at the engine after every step."""
    join_at = join_at or {}
    pending = sorted(prompts, key=lambda rid: join_at.get(rid, 0))
    results = {rid: Generated() for rid in prompts}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and join_at.get(pending[0], 0) <= step:
            rid = pending.pop(0)
            engine.add_request(rid, prompts[rid], params)
        for out in engine.step():
            got = results[out.request_id]
            got.token_ids += out.new_token_ids
            got.text += out.new_text
            for pairs in out.logprobs or []:
                # pairs: chosen, then the top two by log-probability
                got.margins.append(pairs[1][1] - pairs[2][1])
            if out.finished:
                got.finish_reason = out.finish_reason.value if out.finish_reason else None
        if on_step is not None:
            on_step()
        step += 1
        assert step < max_steps, "engine made no progress"
    return results


class Greedy(Protocol):
    """A greedy answer as compared here: an engine's (Generated) or a client's (Answer)."""

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def margins(self) -> list[float]: ...  # top-1 minus top-2 logit per token


def assert_same_answer(
    reference: Greedy, other: Greedy, near_tie: float = NEAR_TIE, name: str = "answer"
) -> bool:
    """Assert token-for-token equality (a near-tie excepted); whether a near-tie forgave."""
    for i, (a, b) in enumerate(zip(reference.token_ids, other.token_ids, strict=False)):
        if a != b:
            margin = reference.margins[i]
            assert margin < near_tie, (
                f"{name}: token {i} differs ({a} vs {b}) with a top-2 logit margin of "
                f"{margin:.2e}, not a near-tie"
            )
            return True
    assert len(reference.token_ids) == len(other.token_ids), f"{name}: lengths differ"
    return False


def assert_same_greedy(
    reference: dict[str, Generated], other: dict[str, Generated], near_tie: float = NEAR_TIE
) -> int:
    """Assert token-for-token equality (near-ties excepted); return how many near-ties forgave."""
    assert reference.keys() == other.keys()
    return sum(
        assert_same_answer(ref, other[rid], near_tie, name=rid) for rid, ref in reference.items()
    )
