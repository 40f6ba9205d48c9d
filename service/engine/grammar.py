"""Constrained decoding: answers that must match a JSON Schema, a regular expression, one of
a list of choices, or a grammar.

llguidance does the matching (chosen over xgrammar on measurements: benchmarks/
grammar_backends.py and docs/perf.md; it has no dependencies, compiles a schema in about a
millisecond where xgrammar's slow cases take hundreds, and its token masks stay fast without
a per-vocabulary cache). One `GrammarCompiler` per engine owns the tokenizer's trie and a cache
of compiled grammars keyed by what was asked; each sequence owns a `GrammarMatcher`, copied
from the cached one, that follows its answer token by token; a sample forked from another
(n > 1) copies its parent's. `TokenBitmasks` fills the batch's allowed-token bitmasks right after
the forward is launched (beside it, on a GPU); the sampler adds them to the logits before
anything is picked.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import torch

from service.engine.grammar_specs import JSON_OPTIONS as JSON_OPTIONS  # benchmarks read it
from service.engine.grammar_specs import grammar_text, one_line
from service.engine.params import StructuredOutput
from service.engine.tokenizer import Tokenizer
from service.engine.values import GrammarError

_CACHE_SIZE = 256
# llguidance's own limits at their defaults, but for its messages: without the parser's state
# and the grammar's text, which are the engine's insides (and can be long).
_LIMITS = llguidance.LLParserLimits(verbose_errors=False)
# NOTE (probe): llguidance meets some of its limits only a few tokens into an answer (a row
# of more Earley items than it keeps, a forced run too long to compute, a regex's lexer
# outgrowing its states), and a grammar that matches no text at all shows only when its first
# mask is computed. A compiled grammar is followed this many tokens from its start, along the
# first token it allows each time, so that those are refused before any answer begins.
PROBE_TOKENS = 8


class GrammarMatcher:
    """One sample's place in its grammar."""

    __slots__ = ("_matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def fork(self) -> GrammarMatcher:
        return GrammarMatcher(self._matcher.deep_copy())

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (the mask
        makes that impossible; the matcher is then in an error state)."""
        return bool(self._matcher.consume_token(token_id))

    @property
    def is_finished(self) -> bool:
        """The answer is over: the grammar allows nothing more (or the end was sampled), or
        the matcher broke (a token it refused), after which its masks would allow nothing."""
        return bool(self._matcher.is_stopped() or self._matcher.is_error())

    @property
    def error(self) -> str | None:
        """Why the matcher broke (one line, bounded: fit for a log line or a client)."""
        return one_line(self._matcher.get_error(), 200) if self._matcher.is_error() else None


class GrammarCompiler:
    """The tokenizer as llguidance sees it, and compiled grammars by what was asked.

    Thread-safe: the API checks a request's grammar (and so compiles it) before the engine
    takes the request; the engine then only copies the cached matcher."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        # vocab_size: the logits' width, which the matchers' masks cover
        self._tokenizer = llguidance.LLTokenizer(
            tokenizer.backend_json(),
            n_vocab=vocab_size,
            eos_token=list(tokenizer.eos_token_ids),
        )
        self._eos = frozenset(tokenizer.eos_token_ids)
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, structured: StructuredOutput) -> None:
        """GrammarError if `structured` cannot be constrained."""
        self._compiled(structured)

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        return GrammarMatcher(self._compiled(structured).deep_copy())

    def _compiled(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        with self._lock:
            if (hit := self._cache.get(structured)) is not None:
                self._cache.move_to_end(structured)
                return hit
        # Compiling drops the GIL (llguidance); two threads compiling one grammar at once
        # only do the work twice.
        grammar = grammar_text(structured)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise GrammarError(one_line(matcher.get_error()))
        if (problem := self._probe(matcher)) is not None:
            raise GrammarError(problem)
        with self._lock:
            self._cache[structured] = matcher
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def _probe(self, matcher: llguidance.LLMatcher) -> str | None:
        """What keeps a copy of `matcher` from following its grammar PROBE_TOKENS tokens
        from the start (NOTE (probe)); None: nothing."""
        probe = matcher.deep_copy()
        for step in range(PROBE_TOKENS):
            allowed = torch.frombuffer(bytearray(probe.compute_bitmask()), dtype=torch.uint8)
            if probe.is_error():
                return _limit_message(probe.get_error(), step)
            bits = (allowed[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [bytes, 8]
            ids = [i for i in bits.flatten().nonzero().flatten().tolist() if i not in self._eos]
            if not ids:  # only the end is allowed
                if step == 0 and not probe.is_accepting():
                    return "no text matches it"
                return None
            if not probe.consume_token(ids[0]):
                return _limit_message(probe.get_error(), step)
        return None


def _limit_message(error: str, step: int) -> str:
    """llguidance's message for a grammar it cannot follow `step` tokens in."""
    if step == 0 and "NoExtensionBias" in error:  # its first mask allows not even the end
        return "no text matches it"
    where = "from its start" if step == 0 else f"{step} tokens into an answer"
    return f"the grammar engine cannot follow it {where}: {one_line(error, 200)}"


class TokenBitmasks:
    """The batch's allowed tokens, one bit per vocabulary id (llguidance's layout: 32 ids to
    an int32).

    Filled on the engine thread right after the forward is launched: on a GPU the forward is
    still running then (its launch returns at once), so the masks cost nothing there; on a
    CPU the forward has finished, and the fill (tens of microseconds a sequence) adds to the
    step. A large batch on a machine with cores to spare fills in parallel on llguidance's
    own threads; a small one, or a small machine, one after another, since idle parallel
    workers spinning beside the CPU forward slowed it measurably (a fill's cost a sequence:
    docs/perf-history.md, structured output)."""

    PARALLEL_FROM = 16  # sequences; and only with at least 8 cores

    def __init__(self, vocab_size: int, max_rows: int) -> None:
        self.words = (vocab_size + 31) // 32
        self._bitmask = torch.full((max_rows, self.words), -1, dtype=torch.int32)
        self._parallel = (os.cpu_count() or 1) >= 8
        self._executor: llguidance.LLExecutor | None = None

    def fill(self, matchers: Sequence[GrammarMatcher]) -> torch.Tensor:
        """Row i for matchers[i]: the [len(matchers), words] rows (a view, valid until the
        next fill)."""
        count = len(matchers)
        if count > self._bitmask.shape[0]:
            self._bitmask = torch.full((count, self.words), -1, dtype=torch.int32)
        rows = self._bitmask[:count]
        row_bytes = self.words * 4
        if self._parallel and count >= self.PARALLEL_FROM:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            pairs = [(m._matcher, i) for i, m in enumerate(matchers)]
            self._executor.unsafe_compute_mask_ptr(
                pairs, rows.data_ptr(), row_bytes, self._bitmask.shape[0]
            )
        else:
            base = rows.data_ptr()
            for i, m in enumerate(matchers):
                m._matcher.unsafe_compute_mask_ptr(base + i * row_bytes, row_bytes)
        return rows


_BYTE_MASKS: dict[torch.device, torch.Tensor] = {}


def _byte_masks(device: torch.device) -> torch.Tensor:
    """[256, 8] float: for each byte of a bitmask, 0 where its bit allows the id, -inf where
    not. Adding a row of these is the cheapest way to mask logits measured here (a
    masked_fill over the vocabulary is 4x slower on the CPU)."""
    if device not in _BYTE_MASKS:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        _BYTE_MASKS[device] = torch.where(bits.bool(), 0.0, float("-inf")).to(device)
    return _BYTE_MASKS[device]


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of `logits` with every id that bitmask row j forbids at -inf in row rows[j];
    ids past the bitmask's width (a padded vocabulary) are forbidden too.

    NOTE: the int32 words are read as bytes, least significant first: bit i of word w is id
    32 w + i on a little-endian machine, which every machine this runs on is."""
    vocab = logits.shape[1]
    words = bitmask.to(logits.device, non_blocking=True)  # [R, W] int32
    add = _byte_masks(logits.device)[words.view(torch.uint8).long()].view(len(rows), -1)
    if add.shape[1] < vocab:
        add = torch.nn.functional.pad(add, (0, vocab - add.shape[1]), value=float("-inf"))
    add = add[:, :vocab].to(logits.dtype)
    if rows == list(range(logits.shape[0])):
        return logits + add
    index = torch.tensor(rows, device=logits.device)
    out = logits.clone()
    out[index] = logits[index] + add
    return out
