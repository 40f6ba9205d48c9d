"""Batched sampling: logit bias, penalties (presence, frequency, repetition), bad words, tokens
held back until min_tokens, grammar masks (structured output), greedy, temperature, top-k,
top-p, min-p, per-request seeds, log-probabilities.

One pass over the batch and a single device-to-host copy of the chosen ids. Random rows invert
their cumulative distribution at one uniform each, so a row with its own seed only needs one
number from its own generator, not its own sampling call. On the CPU, with the CPU kernels,
one native call (kernels/cpu/src/sample.c) applies the grammar masks, the temperature and
min_p and draws every row; elsewhere tensor ops do the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kernels.cpu import ops
from kernels.cpu.dispatch import KernelSet
from service.engine.grammar import apply_bitmask
from service.engine.params import SamplingParams
from service.engine.token_counts import TokenCounts


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # per-request seed; None: the engine's generator
    # The sample's tokens so far (prompt, then answer), where a bad word reads them.
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    counts: TokenCounts | None = None  # what the penalties read (params.penalized)
    blocked: frozenset[int] = frozenset()  # ids it may not pick now (stop ids, min_tokens)
    # The ids its grammar allows now, one bit each (grammar.TokenBitmasks); None: any.
    allowed: torch.Tensor | None = None


@dataclass(slots=True)
class SampledToken:
    token_id: int
    # (token id, log-probability) of the chosen token, then the top `params.logprobs`.
    logprobs: list[tuple[int, float]] | None


class Sampler:
    def __init__(self, device: torch.device, seed: int, kernels: KernelSet | None = None) -> None:
        # kernels: the CPU kernels, which pick the rows of CPU logits in one call
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._kernels = kernels if device.type == "cpu" else None

    def new_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        # logits: [S, V] float32, one row per entry of `rows`
        assert logits.shape[0] == len(rows)
        raw = logits  # what log-probabilities are reported from
        if any(r.params.logit_bias for r in rows):
            logits = _with_logit_bias(logits, rows)
        if any(r.params.penalized for r in rows):
            logits = _with_penalties(logits, rows)
        # (row, id) pairs the row may not pick: bad words' last tokens, blocked ids
        bans = _bad_word_bans(rows, logits.shape[1]) + _blocked_bans(rows, logits.shape[1])
        if self._kernels is not None and logits.dtype == torch.float32:
            chosen = self._pick_native(self._kernels, logits, rows, bans)
        else:
            chosen = self._pick(logits, rows, bans)
        ids: list[int] = chosen.tolist()
        wants_logprobs = [r.params.logprobs is not None for r in rows]
        if not any(wants_logprobs):
            return [SampledToken(t, None) for t in ids]
        return self._with_logprobs(raw, chosen, rows, ids)

    def _pick(
        self, logits: torch.Tensor, rows: list[SamplingRow], bans: list[tuple[int, int]]
    ) -> torch.Tensor:
        """[S] ids by tensor ops: greedy rows' argmax, random rows' draws."""
        unmasked = logits
        if bans:
            logits = _with_minus_inf(logits, bans)
        if any(r.allowed is not None for r in rows):
            logits = _within_grammar(logits, unmasked, rows)
        chosen = logits.argmax(dim=-1)  # [S] greedy for all; random rows overwritten below
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            chosen[idx] = self._sample(logits[idx], [rows[i] for i in random_rows])
        return chosen

    def _pick_native(
        self,
        kernels: KernelSet,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        bans: list[tuple[int, int]],
    ) -> torch.Tensor:
        """[S] ids from the CPU kernels. Every mask is a bit cleared in the row's bitmask
        (no copy of the logits; a word of 32 forbidden ids costs nothing); top-k and top-p
        rows are cut by tensor ops first. The grammar wins where the bans leave its row
        nothing: that row is drawn again under its grammar's bits alone, at the same
        uniform."""
        grammar_bits = _bitmask_rows(rows, logits.shape[1])
        bits = _without_bits(grammar_bits, bans) if bans else grammar_bits
        uniforms = self._uniforms(rows)
        chosen = _draw_native(kernels, logits, rows, bits, uniforms)
        emptied = (chosen < 0).nonzero().flatten().tolist()
        if emptied and bans:
            index = torch.tensor(emptied)
            chosen[index] = _draw_native(
                kernels, logits[index], [rows[i] for i in emptied], grammar_bits[index],
                uniforms[index],
            )  # fmt: skip
        if emptied and bool((chosen < 0).any()):
            # A row nothing allows (no grammar leaves that): its likeliest id, as argmax would.
            chosen = torch.where(chosen >= 0, chosen, logits.argmax(dim=-1))
        return chosen

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """One draw per row by inverting its cumulative distribution at a single uniform: the
        cost is a few passes over the vocabulary, with one random number a row (drawing noise
        for every id, as the exponential race does, cost ~25 ns an id on a CPU: 40-70 ms a
        step at 32 rows of 49k ids, more than the forward)."""
        # logits: [R, V]
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = logits / temps[:, None]
        top_ks = [r.params.top_k for r in rows]
        top_ps = [r.params.top_p for r in rows]
        if any(top_ks) or any(p < 1.0 for p in top_ps):
            logits = _top_k_top_p(logits, top_ks, top_ps)
        # Unnormalized probabilities with the likeliest at 1, so min_p is a plain floor.
        weights = torch.exp(logits - logits.amax(dim=-1, keepdim=True))  # [R, V]
        if any(r.params.min_p > 0.0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=weights.device)
            weights = weights.masked_fill(weights < min_p[:, None], 0.0)
        # float64: in float32 the sum's last ulps would be wider than the tail's probabilities.
        cdf = weights.cumsum(dim=-1, dtype=torch.float64)  # [R, V]
        target = self._uniforms(rows) * cdf[:, -1]  # [R], in [0, total)
        # The first id whose cumulative weight passes the target: never one of weight 0 (its
        # sum equals its predecessor's). Rounding can put target at the total; the likeliest
        # id then (a chance of about 1e-16).
        chosen = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
        return torch.where(chosen < cdf.shape[1], chosen, weights.argmax(dim=-1))

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """[R] float64 in [0, 1), one per random row (a greedy row's 0 draws nothing): a
        seeded row's from its own generator, so its answer does not depend on what else is
        in the batch; the rest from the engine's."""
        device = self.device
        out = torch.zeros(len(rows), dtype=torch.float64, device=device)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None and not r.params.greedy]
        if unseeded:
            out[unseeded] = torch.rand(
                len(unseeded), dtype=torch.float64, device=device, generator=self._generator
            )
        for i, r in enumerate(rows):
            if r.generator is not None and not r.params.greedy:
                out[i] = torch.rand(1, dtype=torch.float64, device=device, generator=r.generator)
        return out

    def _with_logprobs(
        self,
        logits: torch.Tensor,
        chosen: torch.Tensor,
        rows: list[SamplingRow],
        ids: list[int],
    ) -> list[SampledToken]:
        logprobs = torch.log_softmax(logits, dim=-1)  # [S, V]
        k = max(r.params.logprobs or 0 for r in rows)
        top_lp, top_id = logprobs.topk(max(k, 1), dim=-1)  # [S, k]
        chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1).tolist()
        top_lp_host, top_id_host = top_lp.tolist(), top_id.tolist()
        out = []
        for i, r in enumerate(rows):
            if r.params.logprobs is None:
                out.append(SampledToken(ids[i], None))
                continue
            n = r.params.logprobs
            pairs = [(ids[i], chosen_lp[i])]
            pairs += list(zip(top_id_host[i][:n], top_lp_host[i][:n], strict=True))
            out.append(SampledToken(ids[i], pairs))
        return out


def _bitmask_rows(rows: list[SamplingRow], vocab: int) -> torch.Tensor:
    """[S, ceil(vocab / 32)] int32: each row's grammar bits (ids past its bitmask's width
    forbidden), all ones where it has none."""
    words = (vocab + 31) // 32
    out = torch.full((len(rows), words), -1, dtype=torch.int32)
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    if constrained:
        bits = torch.stack([rows[i].allowed for i in constrained])  # type: ignore[misc]
        width = min(words, bits.shape[1])
        out[constrained] = torch.nn.functional.pad(bits[:, :width], (0, words - width))
    return out


def _draw_native(
    kernels: KernelSet,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    bitmask: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """[R] ids (-1 where a row allows nothing) from one call of the CPU kernels."""
    temps = [0.0 if r.params.greedy else r.params.temperature for r in rows]
    nucleus = [
        i for i, r in enumerate(rows)
        if not r.params.greedy and (r.params.top_k or r.params.top_p < 1.0)
    ]  # fmt: skip
    if nucleus:  # top-k and top-p count only what the grammar allows: masked, then cut
        index = torch.tensor(nucleus)
        cut = apply_bitmask(logits[index], list(range(len(nucleus))), bitmask[index])
        cut = cut / torch.tensor([temps[i] for i in nucleus])[:, None]
        logits = logits.index_copy(
            0, index, _top_k_top_p(cut, [rows[i].params.top_k for i in nucleus],
                                   [rows[i].params.top_p for i in nucleus]),
        )  # fmt: skip
        for i in nucleus:
            temps[i] = 1.0  # already divided
    return ops.sample(
        kernels, logits, bitmask, torch.tensor(temps, dtype=torch.float32),
        torch.tensor([r.params.min_p for r in rows], dtype=torch.float32), uniforms,
    )  # fmt: skip


def _with_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` with each row's biases added: one scatter for the whole batch.
    Ids past the vocabulary are skipped (the API refuses them; the step must not fail)."""
    vocab = logits.shape[1]
    pairs = [
        (i, token, bias)
        for i, r in enumerate(rows)
        for token, bias in r.params.logit_bias
        if token < vocab
    ]
    if not pairs:
        return logits
    row_ids, token_ids, biases = zip(*pairs, strict=True)
    index = (
        torch.tensor(row_ids, device=logits.device),
        torch.tensor(token_ids, device=logits.device),
    )
    values = torch.tensor(biases, device=logits.device, dtype=logits.dtype)
    return logits.index_put(index, values, accumulate=True)  # [S, V], a new tensor


def _with_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` with each penalized row's penalties applied, as vLLM applies them:
    repetition over every id seen (prompt and answer), then frequency and presence over the
    answer's. Only the logits of ids seen are read and written (a few hundred a row, not the
    vocabulary), each (row, id) one flat index into the logits; the rows' `TokenCounts`
    already hold their distinct ids, so the batch's are one concatenation, not a pass over
    each sequence's tokens."""
    vocab = logits.shape[1]
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    penalized = [(i, r.params, r.counts) for i, r in enumerate(rows) if r.params.penalized]
    repeating = [
        (i, p, c) for i, p, c in penalized if c is not None and p.repetition_penalty != 1.0
    ]
    if repeating:
        keys, part, _ = _flat_keys([(i, c.seen) for i, _, c in repeating], vocab)
        penalty = torch.tensor([p.repetition_penalty for _, p, _ in repeating])[part]
        keys, penalty = keys.to(out.device), penalty.to(out.device, out.dtype)
        values = flat[keys]
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)
    counting = [
        (i, p, c) for i, p, c in penalized
        if c is not None and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0)
    ]  # fmt: skip
    if counting:
        keys, part, kept = _flat_keys([(i, c.answer_ids) for i, _, c in counting], vocab)
        counts = torch.from_numpy(np.concatenate([c.answer_counts for _, _, c in counting]))
        frequency = torch.tensor([p.frequency_penalty for _, p, _ in counting])[part]
        presence = torch.tensor([p.presence_penalty for _, p, _ in counting])[part]
        penalty = frequency * counts[kept] + presence
        flat.index_add_(0, keys.to(out.device), -penalty.to(out.device, out.dtype))
    return out


def _flat_keys(
    parts: list[tuple[int, np.ndarray]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For (row, distinct ids) parts: (row * vocab + id for each id under vocab, the part
    each came from, which of the concatenated ids those are)."""
    ids = torch.from_numpy(np.concatenate([ids for _, ids in parts]))
    lengths = torch.tensor([len(ids) for _, ids in parts])
    part = torch.repeat_interleave(torch.arange(len(parts)), lengths)
    kept = ids < vocab  # an id past the logits' width (the API refuses them) is skipped
    row_base = torch.tensor([row * vocab for row, _ in parts])
    return (ids + row_base[part])[kept], part[kept], kept


def _bad_word_bans(rows: list[SamplingRow], vocab: int) -> list[tuple[int, int]]:
    """(row, id): each bad word's last token in every row whose tokens end with the rest of
    the word (a one-token word: always)."""
    pairs = []
    for i, r in enumerate(rows):
        if not r.params.bad_words:
            continue
        answered = len(r.token_ids) - r.num_prompt_tokens
        for word in r.params.bad_words:
            *head, last = word
            # only the answer's last len(head) tokens are read (not a copy of the answer)
            ends_with_head = not head or (
                answered >= len(head) and list(r.token_ids[-len(head) :]) == head
            )
            if last < vocab and ends_with_head:
                pairs.append((i, last))
    return pairs


def _blocked_bans(rows: list[SamplingRow], vocab: int) -> list[tuple[int, int]]:
    """(row, id): each row's blocked ids (its stop ids before min_tokens)."""
    return [(i, t) for i, r in enumerate(rows) for t in r.blocked if t < vocab]


def _without_bits(bitmask: torch.Tensor, bans: list[tuple[int, int]]) -> torch.Tensor:
    """A copy of `bitmask` with each (row, id)'s bit cleared."""
    out = bitmask.numpy().copy()
    row_ids, token_ids = np.array(bans, dtype=np.int64).T
    keep = ~(np.int64(1) << (token_ids & 31))  # a word's other 31 bits
    np.bitwise_and.at(out, (row_ids, token_ids >> 5), keep.astype(np.int32))  # repeats too
    return torch.from_numpy(out)


def _within_grammar(
    logits: torch.Tensor, unmasked: torch.Tensor, rows: list[SamplingRow]
) -> torch.Tensor:
    """A copy of `logits` with what each constrained row's grammar forbids at -inf. The
    grammar wins over the other masks: a row they would leave with nothing (the end held back
    by min_tokens where the grammar allows only the end; a bad word the grammar requires)
    takes its grammar's ids from `unmasked`, the logits before those masks."""
    constrained = [i for i, r in enumerate(rows) if r.allowed is not None]
    bitmask = torch.stack([rows[i].allowed for i in constrained])  # type: ignore[misc]
    out = apply_bitmask(logits, constrained, bitmask)
    if logits is unmasked:  # no other mask: the grammar always leaves an id (the end, at last)
        return out
    emptied = (out[constrained].amax(dim=-1) == float("-inf")).nonzero().flatten().tolist()
    if emptied:
        rows_emptied = [constrained[j] for j in emptied]
        out[rows_emptied] = apply_bitmask(unmasked, rows_emptied, bitmask[emptied])[rows_emptied]
    return out


def _with_minus_inf(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    out = logits.clone()
    if pairs:
        row_ids, token_ids = zip(*pairs, strict=True)
        out[
            torch.tensor(row_ids, device=logits.device),
            torch.tensor(token_ids, device=logits.device),
        ] = float("-inf")
    return out


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask everything outside each row's top-k and top-p nucleus with -inf."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [R, V]
    k = torch.tensor([k if 0 < k < vocab else vocab for k in top_ks], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)
    drop = ranks[None, :] >= k[:, None]
    p = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep a token if the mass before it is below top_p: the top token always survives.
    drop |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
