"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

from typing import Literal

import msgspec

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# An answer's length when its request names none: the engine's, the CLI's and the server's
# (`Limits.default_max_tokens`, which an operator may change), one number.
DEFAULT_MAX_TOKENS = 512


# How deep a JSON Schema (or any JSON a request hands on to be walked) may nest: deeper than
# any model's schema, and far short of what would exhaust a recursive walk of it.
MAX_SCHEMA_DEPTH = 100

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an answer must match (service/engine/grammar.py constrains it). `spec` by `kind`:
    "json", a JSON Schema's text; "json_object", unused (any JSON object); "regex", a regular
    expression (Rust's syntax; the whole answer matches); "choice", a JSON list of the strings
    allowed; "grammar", a Lark grammar (llguidance's dialect) or a GBNF one (llama.cpp's,
    told by its `::=`)."""

    kind: StructuredKind
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How to pick tokens and when to stop. temperature == 0 means greedy.

    `n` samples share the prompt's KV blocks; sample i draws from seed + i when a seed is given.
    """

    # 0: prefill only: compute and cache the prompt, generate nothing
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 disables top-k
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many top log-probabilities per token
    # (token id, bias) pairs added to the logits before any choice (OpenAI's logit_bias);
    # log-probabilities are reported without them, as vLLM reports raw ones.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's penalties on the answer's tokens so far: minus presence_penalty for a token
    # that has appeared, minus frequency_penalty per time it has. vLLM's repetition_penalty
    # over the prompt's and the answer's tokens: a positive logit divided by it, a negative one
    # multiplied. Each keeps an answer from looping; log-probabilities are reported without.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # vLLM's: drop tokens less likely than min_p times the likeliest (after temperature), and
    # let no stop token or stop string end the answer before min_tokens tokens.
    min_p: float = 0.0
    min_tokens: int = 0
    # vLLM's bad_words, as token sequences (the API tokenizes each word with and without a
    # leading space): a sequence's last token is never picked where it would complete it.
    bad_words: tuple[tuple[int, ...], ...] = ()
    # The answer must match this; the sampler picks only tokens that keep it matching, and
    # the answer ends where the grammar does.
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if self.max_tokens == 0 and self.n != 1:
            raise ValueError("a prefill-only request (max_tokens 0) takes n == 1")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError("temperature must be in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0 (0 disables it)")
        if not 1 <= self.n <= 16:
            raise ValueError("n must be in 1..16")
        # Sample i of n draws from seed + i; every one of them must be a 64-bit seed.
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
            raise ValueError(
                f"seed must be in {INT64_MIN}..{INT64_MAX - (self.n - 1)} (n = {self.n})"
            )
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError("logprobs must be in 0..20")
        for token, bias in self.logit_bias:
            if token < 0 or not -100.0 <= bias <= 100.0:
                raise ValueError("logit_bias maps token ids >= 0 to biases in [-100, 100]")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2]")
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError("repetition_penalty must be in (0, 2] (1 is none)")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError("min_p must be in [0, 1]")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError("min_tokens must be in 0..max_tokens")
        if any(not word or min(word) < 0 for word in self.bad_words):
            raise ValueError("bad_words are non-empty sequences of token ids >= 0")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty reads the tokens so far."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
