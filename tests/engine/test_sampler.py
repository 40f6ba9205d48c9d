"""The batched sampler: logit bias per row, greedy and random rows in one pass, raw
log-probabilities; each behaviour through both ways of picking (tensor ops, and the CPU
kernels' one call), and both against a float64 reference of the draw."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu import dispatch
from service.engine.params import SamplingParams
from service.engine.sampler import Sampler, SamplingRow, _top_k_top_p, _with_penalties
from service.engine.token_counts import TokenCounts

V = 8


def row(**params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), None)  # type: ignore[arg-type]


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


PATHS = ["tensor ops", "cpu kernels"]


def make_sampler(path: str, seed: int = 0) -> Sampler:
    if path == "tensor ops":
        return Sampler(torch.device("cpu"), seed=seed)
    kernels = dispatch.select("auto")
    if kernels is None:
        pytest.fail("the CPU kernel library did not build: the suite needs a C compiler")
    return Sampler(torch.device("cpu"), seed=seed, kernels=kernels)


@pytest.fixture(params=PATHS)
def sampler(request: pytest.FixtureRequest) -> Sampler:
    return make_sampler(request.param)


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


# ---------------------------------------------------------------------- top-k and top-p


def kept(masked: torch.Tensor) -> list[list[int]]:
    """Per row, the token ids the mask leaves (finite logits), in id order."""
    return [torch.isfinite(r).nonzero().flatten().tolist() for r in masked]


def test_top_k_keeps_the_k_largest_logits_of_each_row() -> None:
    x = logits([0.0, 3.0, 1.0, 2.0, -1.0, 0.5, 4.0, -2.0], [9.0, 8.0, 7.0, 6.0, 5, 4, 3, 2])
    assert kept(_top_k_top_p(x, [3, 1], [1.0, 1.0])) == [[1, 3, 6], [0]]
    # 0 is off, and so is a k past the vocabulary.
    assert kept(_top_k_top_p(x, [0, V + 5], [1.0, 1.0])) == [list(range(V))] * 2


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_p_and_always_the_top_token() -> None:
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]  # already sorted, ids 0..4
    x = torch.tensor([probs] * 4).log()
    # The mass before each token: 0, .5, .7, .85, .95. A token stays while that is below p.
    masked = _top_k_top_p(x, [0, 0, 0, 0], [0.5, 0.51, 0.9, 0.01])
    assert kept(masked) == [[0], [0, 1], [0, 1, 2, 3], [0]]
    # What is kept keeps its logit: the mask only removes.
    assert torch.equal(masked[2, :4], x[2, :4])


def test_top_p_counts_mass_after_top_k_has_cut() -> None:
    x = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # Alone, top-p 0.5 keeps two: the mass before the second is 0.4. Within the top 2 the
    # mass is renormalized to 4/7 and 3/7, and 4/7 already reaches 0.5.
    assert kept(_top_k_top_p(x, [0], [0.5])) == [[0, 1]]
    assert kept(_top_k_top_p(x, [2], [0.5])) == [[0]]
    assert kept(_top_k_top_p(x, [2], [0.6])) == [[0, 1]]


def test_random_draws_never_leave_the_mask(sampler: Sampler) -> None:
    x = logits([0.0, 3.0, 1.0, 2.0, -1.0, 0.5, 4.0, -2.0])
    drawn = {sampler(x, [row(temperature=2.0, top_k=3)])[0].token_id for _ in range(200)} | {
        sampler(x, [row(temperature=2.0, top_p=0.3)])[0].token_id for _ in range(50)
    }
    assert drawn <= {1, 3, 6}
    assert 1 in drawn  # a temperature of 2 reaches past the top token


def seen(params: dict[str, object], prompt: list[int], answer: list[int]) -> SamplingRow:
    return SamplingRow(
        SamplingParams(**params),  # type: ignore[arg-type]
        None,
        token_ids=[*prompt, *answer],
        num_prompt_tokens=len(prompt),
        counts=TokenCounts(prompt, answer),
    )


def test_penalties_apply_per_row_as_openai_and_vllm_define_them() -> None:
    x = logits([2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0], [2.0, -2.0, 1.0, 0.5, 0, 0, 0, 0])
    rows = [
        # presence 0.5 and frequency 0.25 over the answer (2, 2, 3); the prompt's 0 untouched
        seen({"presence_penalty": 0.5, "frequency_penalty": 0.25}, [0], [2, 2, 3]),
        # repetition 2 over prompt and answer: a positive logit halved, a negative doubled
        seen({"repetition_penalty": 2.0}, [0, 1], [3]),
    ]
    out = _with_penalties(x, rows)
    assert out[0].tolist() == pytest.approx(
        [2.0, -2.0, 1.0 - 0.5 - 0.5, 0.5 - 0.5 - 0.25, 0, 0, 0, 0]
    )
    assert out[1].tolist() == pytest.approx([1.0, -4.0, 1.0, 0.25, 0, 0, 0, 0])
    assert x[0, 2] == 1.0  # the input is left alone


def test_an_unpenalized_row_in_a_penalized_batch_is_untouched(sampler: Sampler) -> None:
    x = logits([3.0, 2.9] + [0.0] * (V - 2), [3.0, 2.9] + [0.0] * (V - 2))
    rows = [seen({"temperature": 0, "frequency_penalty": 1.0}, [], [0]), row(temperature=0)]
    assert [t.token_id for t in sampler(x, rows)] == [1, 0]


def test_blocked_ids_are_never_picked_greedy_or_random(sampler: Sampler) -> None:
    x = logits(*[[9.0, 1.0] + [-50.0] * (V - 2)] * 2)
    blocked = frozenset({0})
    rows = [
        SamplingRow(SamplingParams(temperature=0), None, blocked=blocked),
        SamplingRow(SamplingParams(temperature=1.0, seed=3), None, blocked=blocked),
    ]
    for _ in range(20):
        assert [t.token_id for t in sampler(x, rows)] == [1, 1]


def test_min_p_keeps_only_tokens_near_the_likeliest(sampler: Sampler) -> None:
    # probabilities ~0.46, 0.31, 0.17, ...: min_p 0.5 keeps the first two only
    x = logits([2.0, 1.6, 1.0] + [-1.0] * (V - 3))
    picks = {t.token_id for _ in range(200) for t in sampler(x, [row(temperature=1.0, min_p=0.5)])}
    assert picks == {0, 1}


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"presence_penalty": 2.1}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ],
)
def test_penalties_are_validated(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)  # type: ignore[arg-type]


def bitmask(*allowed_rows: set[int], vocab: int = V) -> torch.Tensor:
    """llguidance's layout: bit i of int32 word w allows id 32 w + i."""
    words = (vocab + 31) // 32
    out = torch.zeros(len(allowed_rows), words, dtype=torch.int64)
    for r, allowed in enumerate(allowed_rows):
        for t in allowed:
            out[r, t // 32] |= 1 << (t % 32)
    return out.to(torch.int32)  # (bit 31 wraps to the sign, as in llguidance's masks)


def test_a_grammar_mask_keeps_exactly_its_allowed_ids_in_its_own_row(sampler: Sampler) -> None:
    x = torch.randn(3, 40)
    masks = bitmask({1, 31, 33}, {0}, vocab=40)
    rows = [
        SamplingRow(SamplingParams(temperature=1.0, seed=2), None, allowed=masks[0]),
        row(temperature=0),
        SamplingRow(SamplingParams(temperature=0), None, allowed=masks[1]),
    ]
    picked = [sampler(x, rows) for _ in range(30)]
    assert {p[0].token_id for p in picked} <= {1, 31, 33}
    assert {p[1].token_id for p in picked} == {int(x[1].argmax())}  # unconstrained: untouched
    assert {p[2].token_id for p in picked} == {0}


def test_ids_past_the_masks_width_are_forbidden() -> None:
    """A padded vocabulary (logits wider than the tokenizer's ids) never leaks a padding id."""
    from service.engine.grammar import apply_bitmask

    x = torch.zeros(1, 70)
    x[0, 65] = 10.0
    out = apply_bitmask(x, [0], bitmask({3}, vocab=40))
    assert out[0].argmax() == 3 and torch.isneginf(out[0, 40:]).all()


def test_the_grammar_wins_where_the_other_masks_would_leave_nothing(sampler: Sampler) -> None:
    """min_tokens blocks the end id and a bad word bans another; the grammar allows only those
    two: the row picks from the grammar's ids rather than from nothing."""
    x = logits([0.0, 1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 0.0])
    params = SamplingParams(temperature=0, bad_words=((3,),))
    rows = [SamplingRow(params, None, blocked=frozenset({2}), allowed=bitmask({2, 3})[0])]
    assert sampler(x, rows)[0].token_id == 3
    free = SamplingRow(params, None, blocked=frozenset({2}), allowed=bitmask({1, 2, 3})[0])
    assert sampler(x, [free])[0].token_id == 1  # where the grammar leaves a choice, both hold


def test_bad_words_ban_their_last_token_only_where_the_rest_precedes_it(sampler: Sampler) -> None:
    """[5] is banned everywhere; [6, 7] only right after a 6."""
    x = logits([0.0] * 5 + [9.0, 0.0, 8.0])
    params = SamplingParams(temperature=0, bad_words=((5,), (6, 7)))

    def pick(answer: list[int]) -> int:
        r = SamplingRow(params, None, token_ids=[1, 2, *answer], num_prompt_tokens=2)
        return sampler(x, [r])[0].token_id

    assert pick([]) == 7
    assert pick([6]) not in (5, 7)
    assert pick([6, 1]) == 7


def reference_penalties(
    logits: torch.Tensor, prompt: list[int], answer: list[int], params: SamplingParams
) -> torch.Tensor:
    """vLLM's apply_penalties for one row, written plainly: repetition over every token seen,
    then frequency (per occurrence) and presence (once) over the answer's."""
    out = logits.clone()
    for token in set(prompt) | set(answer):
        value = out[token]
        out[token] = (
            value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        )
    for token in set(answer):
        out[token] -= params.frequency_penalty * answer.count(token) + params.presence_penalty
    return out


@pytest.mark.parametrize("seed", range(20))
def test_penalties_match_a_plain_reference_on_random_rows(seed: int) -> None:
    rng = torch.Generator().manual_seed(seed)
    vocab, rows_n = 50, 4
    x = torch.randn(rows_n, vocab, generator=rng) * 3
    rows, expected = [], []
    for r in range(rows_n):
        prompt = torch.randint(
            0, vocab, (int(torch.randint(0, 12, (1,), generator=rng)),), generator=rng
        ).tolist()
        answer = torch.randint(
            0, vocab, (int(torch.randint(0, 20, (1,), generator=rng)),), generator=rng
        ).tolist()
        pick = torch.rand(3, generator=rng).tolist()
        params = SamplingParams(
            presence_penalty=round(4 * pick[0] - 2, 2),
            frequency_penalty=round(4 * pick[1] - 2, 2),
            repetition_penalty=round(0.5 + 1.5 * pick[2], 2),
        )
        counts = TokenCounts(prompt)
        for token in answer:  # as the engine keeps them: a token at a time
            counts.add(token)
        if r % 2:
            counts = counts.copy()  # as a fork takes them
        rows.append(SamplingRow(params, None, num_prompt_tokens=len(prompt), counts=counts))
        expected.append(reference_penalties(x[r], prompt, answer, params))
    assert torch.allclose(_with_penalties(x, rows), torch.stack(expected), atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
def test_each_draw_is_the_id_whose_cumulative_interval_holds_its_uniform(path: str) -> None:
    """Inverse-CDF sampling checked draw by draw against float64: a seeded row's uniform is
    the first double its generator gives; the chosen id's interval [cdf before it, cdf at
    it) holds that uniform (to 1e-6, the float32 logits' rounding)."""
    gen = torch.Generator().manual_seed(11)
    sampler = make_sampler(path)
    vocab = 1000
    for trial in range(60):
        x = torch.randn(vocab, generator=gen) * 4
        allowed = set(torch.randperm(vocab, generator=gen)[: 1 + trial * 15].tolist())
        temperature, min_p = (0.5, 0.7, 1.0, 1.6)[trial % 4], (0.0, 0.0, 0.05)[trial % 3]
        seed = 1000 + trial
        params = SamplingParams(temperature=temperature, min_p=min_p, seed=seed)
        masks = bitmask(allowed, vocab=vocab)
        rows = [SamplingRow(params, sampler.new_generator(seed), allowed=masks[0])]
        chosen = sampler(x[None], rows)[0].token_id
        uniform = float(torch.rand(1, dtype=torch.float64, generator=sampler.new_generator(seed)))
        z = x.double() / temperature
        ids = sorted(allowed)
        weights = torch.zeros_like(z)
        weights[ids] = torch.exp(z[ids] - z[ids].max())
        weights[weights < min_p] = 0.0
        cdf = torch.cumsum(weights, 0) / weights.sum()
        start = float(cdf[chosen - 1]) if chosen else 0.0
        assert chosen in allowed and weights[chosen] > 0
        assert start - 1e-6 <= uniform < float(cdf[chosen]) + 1e-6, (trial, chosen)


@pytest.mark.parametrize("path", PATHS)
def test_draws_follow_the_softmax_at_their_temperature(path: str) -> None:
    """4,000 draws of the engine's generator (no seed) over 6 ids at temperature 0.8: each
    id's share within 5 standard deviations of its probability (a fixed seed: the same
    counts every run)."""
    sampler = make_sampler(path, seed=5)
    x = logits([1.0, 0.5, 0.0, -0.5, 2.0, -9.0, 0.2, 1.5])
    masks = bitmask({0, 1, 2, 3, 4, 6})
    probs = torch.zeros(V, dtype=torch.float64)
    ids = [0, 1, 2, 3, 4, 6]
    probs[ids] = torch.softmax(x[0, ids].double() / 0.8, 0)
    rows = [SamplingRow(SamplingParams(temperature=0.8), None, allowed=masks[0])] * 40
    counts = torch.zeros(V, dtype=torch.float64)
    for _ in range(100):
        for token in sampler(x.expand(40, V).contiguous(), rows):
            counts[token.token_id] += 1
    n = counts.sum()
    spread = 5 * torch.sqrt(n * probs * (1 - probs)) + 1
    assert counts[5] == 0 and counts[7] == 0  # not allowed
    assert ((counts - n * probs).abs() <= spread).all(), (counts, n * probs)


def test_both_paths_pick_the_same_ids_for_the_same_seeds() -> None:
    """The tensor ops and the CPU kernels invert the same distribution at the same uniform:
    32 seeded rows of a real vocabulary's width, with grammar masks, min_p, top-k, top-p and
    greedy rows, agree id for id (a disagreement needs a uniform within ~1e-7 of an
    interval's end)."""
    gen = torch.Generator().manual_seed(3)
    vocab = 49152
    x = torch.randn(32, vocab, generator=gen) * 3
    masks = torch.randint(-(2**31), 2**31, (32, vocab // 32), generator=gen).to(torch.int32)
    masks[8:16, 40:] = 0  # sparse: the first 1,280 ids only
    picks = []
    for path in PATHS:
        sampler = make_sampler(path)
        rows = []
        for i in range(32):
            params = SamplingParams(
                temperature=0.0 if i % 8 == 7 else 0.6 + 0.1 * (i % 5), seed=i,
                min_p=0.05 if i % 4 == 1 else 0.0, top_k=20 if i % 6 == 2 else 0,
                top_p=0.9 if i % 6 == 3 else 1.0,
            )  # fmt: skip
            allowed = masks[i] if i % 3 else None
            rows.append(SamplingRow(params, sampler.new_generator(i), allowed=allowed))
        picks.append([t.token_id for t in sampler(x, rows)])
    assert picks[0] == picks[1]


def test_bans_on_a_words_sign_bit_and_two_in_one_word_all_hold(sampler: Sampler) -> None:
    """Ids 31 and 63 are bit 31 of their words (the int32's sign); 33 and 34 share a word."""
    x = torch.full((2, 70), -5.0)
    x[:, [31, 33, 34, 63]] = 5.0
    x[:, 40] = 4.0
    rows = [
        SamplingRow(SamplingParams(temperature=0), None, blocked=frozenset({31, 33, 34, 63})),
        SamplingRow(
            SamplingParams(temperature=1.0, seed=4, bad_words=((31,), (33,), (34,), (63,))), None
        ),
    ]
    for _ in range(20):
        picked = [t.token_id for t in sampler(x, rows)]
        assert picked[0] == 40 and picked[1] not in (31, 33, 34, 63)
