"""Batched sampling: logit bias, penalties (presence, frequency, repetition), bad words, tokens
held back until min_tokens, grammar masks (structured output), greedy, temperature, top-k,
top-p, min-p, per-request seeds, log-probabilities.

One pass over the batch with tensor ops and a single device-to-host copy of the chosen ids.
Random rows use the exponential-race trick (argmax of p / E with E ~ Exp(1) is a draw from p),
so a row with its own seed only needs its own noise vector, not its own sampling call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from service.engine.grammar import apply_bitmask
from service.engine.params import SamplingParams


@dataclass(slots=True)
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # per-request seed; None: the engine's generator
    # The sample's tokens so far (prompt, then answer), where a penalty reads them.
    token_ids: Sequence[int] = ()
    num_prompt_tokens: int = 0
    blocked: frozenset[int] = frozenset()  # ids it may not pick now (stop ids, min_tokens)
    # The ids its grammar allows now, one bit each (grammar.TokenBitmasks); None: any.
    allowed: torch.Tensor | None = None


@dataclass(slots=True)
class SampledToken:
    token_id: int
    # (token id, log-probability) of the chosen token, then the top `params.logprobs`.
    logprobs: list[tuple[int, float]] | None


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)

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
        unmasked = logits
        if any(r.params.bad_words for r in rows):
            logits = _without_bad_words(logits, rows)
        if any(r.blocked for r in rows):
            logits = _without_blocked(logits, rows)
        if any(r.allowed is not None for r in rows):
            logits = _within_grammar(logits, unmasked, rows)
        chosen = logits.argmax(dim=-1)  # [S] greedy for all; random rows overwritten below
        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if random_rows:
            idx = torch.tensor(random_rows, device=logits.device)
            chosen[idx] = self._sample(logits[idx], [rows[i] for i in random_rows])
        ids: list[int] = chosen.tolist()
        wants_logprobs = [r.params.logprobs is not None for r in rows]
        if not any(wants_logprobs):
            return [SampledToken(t, None) for t in ids]
        return self._with_logprobs(raw, chosen, rows, ids)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        # logits: [R, V]
        temps = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        logits = logits / temps[:, None]
        top_ks = [r.params.top_k for r in rows]
        top_ps = [r.params.top_p for r in rows]
        if any(top_ks) or any(p < 1.0 for p in top_ps):
            logits = _top_k_top_p(logits, top_ks, top_ps)
        probs = torch.softmax(logits, dim=-1)  # [R, V]
        if any(r.params.min_p > 0.0 for r in rows):
            min_p = torch.tensor([r.params.min_p for r in rows], device=probs.device)
            floor = min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [R, 1]
            probs = probs.masked_fill(probs < floor, 0.0)  # the likeliest always stays
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(
                len(unseeded), probs.shape[1], device=probs.device
            ).exponential_(generator=self._generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)

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
    repetition over every token seen (prompt and answer), then frequency and presence over
    the answer's. Only the logits of tokens seen are read and written (a few hundred a row,
    not the vocabulary): each (row, token) pair is one flat index into the logits, counted
    once for the whole batch."""
    vocab = logits.shape[1]
    answer_keys: list[int] = []
    seen_keys: list[int] = []
    for i, r in enumerate(rows):
        if not r.params.penalized:
            continue
        base = i * vocab
        answer = [base + t for t in r.token_ids[r.num_prompt_tokens :] if t < vocab]
        answer_keys += answer
        if r.params.repetition_penalty != 1.0:
            seen_keys += answer
            seen_keys += [base + t for t in r.token_ids[: r.num_prompt_tokens] if t < vocab]
    out = logits.clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    device = logits.device

    def per_key(name: str, keys: torch.Tensor) -> torch.Tensor:
        by_row = torch.tensor([getattr(r.params, name) for r in rows], dtype=out.dtype)
        return by_row.to(device)[keys // vocab]

    if seen_keys:
        seen = torch.unique(torch.tensor(seen_keys, dtype=torch.int64, device=device))
        values, repetition = flat[seen], per_key("repetition_penalty", seen)
        flat[seen] = torch.where(values > 0, values / repetition, values * repetition)
    if answer_keys:
        answers = torch.tensor(answer_keys, dtype=torch.int64, device=device)
        keys, counts = torch.unique(answers, return_counts=True)
        penalty = per_key("frequency_penalty", keys) * counts + per_key("presence_penalty", keys)
        flat.index_add_(0, keys, -penalty)
    return out


def _without_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` with each bad word's last token at -inf in every row whose tokens
    end with the rest of the word (a one-token word: always)."""
    vocab = logits.shape[1]
    pairs = []
    for i, r in enumerate(rows):
        answered = len(r.token_ids) - r.num_prompt_tokens
        for word in r.params.bad_words:
            *head, last = word
            # only the answer's last len(head) tokens are read (not a copy of the answer)
            ends_with_head = not head or (
                answered >= len(head) and list(r.token_ids[-len(head) :]) == head
            )
            if last < vocab and ends_with_head:
                pairs.append((i, last))
    return _with_minus_inf(logits, pairs)


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


def _without_blocked(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` with each row's blocked ids at -inf (its stop ids before
    min_tokens)."""
    vocab = logits.shape[1]
    return _with_minus_inf(
        logits, [(i, t) for i, r in enumerate(rows) for t in r.blocked if t < vocab]
    )


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
