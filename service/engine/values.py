"""The engine's values: what crosses the seam between the engine and the service.

Requests go in with a `CacheScope`; `RequestOutput`s, a `FinishReason` and the errors come
out; `EngineStats` and `KVSnapshot` describe the engine to /v1/stats, /metrics,
/v1/kv and the page maps. The service (`service/api`, `service/sessions`) imports the engine
only through this module, `serving` (the interface) and `params` (`SamplingParams`);
tests/test_import_graph.py holds it to that. A leaf: the standard library and msgspec only,
so a value never drags the engine's machinery (torch, the block manager) along.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

# Errors


class RequestError(ValueError):
    """A request the engine cannot serve as given (too long, duplicate id, ...)."""


class GrammarError(ValueError):
    """A structured output that cannot be constrained (a schema, regex or grammar the matcher
    rejects): the message says which part and why."""


class EngineDeadError(RuntimeError):
    """The engine has stopped, or failed: no request can be served."""


class KVInvariantError(RuntimeError):
    """The pools' accounting is off: a block leaked, is in two places, or its ref count is
    not its holders'. A bug, never a client's doing."""


# A request


class CacheScope(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who may find a request's blocks in the prefix cache.

    NOTE (cache scopes): a prompt that hits the cache reveals, through `cached_tokens` and
    time to first token, that someone computed the same tokens before; so a block is shared
    only among those allowed to learn that. Block i (tokens [i*bs, (i+1)*bs)) is hashed in
      the engine's namespace         with no scope, or a shared block of salt "";
      namespace + salt               a shared block: `private` is None, or the block lies
                                     wholly inside the first `shared_tokens` tokens;
      namespace + salt + private     any other block.
    Requests with different salts (tenants) share nothing. Within a salt, sessions (`private`
    ids) share only the blocks wholly inside the shared part (the chat template's fixed
    prefix and the system prompt): a block reaching one token past it holds K/V of that
    token, so it is private. With a `shared_key` (a digest of the whole shared part) the
    shared blocks are hashed under it too, so they are found only by a session whose whole
    shared part is the same: a shared hit tells a session that someone in its salt used the
    same system prompt, and nothing about one that merely begins alike (else a system prompt
    could be read block by block). `None` and `CacheScope()` hash as before scopes existed,
    so page maps stored earlier stay valid, and the shared blocks of a default-salt scope
    without a key are the ones unscoped requests find.
    The chain is unchanged: a block's hash covers its parent's, so it names every token before
    it whatever namespaces they were hashed in; a namespace narrows who can find a block, never
    what its K/V hold. Two sessions sending the same message compute and keep it twice.
    Salt and id are length-prefixed after tags, so no (salt, private) pair spells another's
    or the engine's own namespace.
    """

    salt: str = ""  # tenant (API key, cache_salt): different salts share nothing
    private: str | None = None  # e.g. a session id: blocks past `shared_tokens` are its own
    shared_tokens: int = 0  # leading prompt tokens that may be shared within the salt
    shared_key: str = ""  # a digest of those tokens: only the same whole shared part shares

    def __post_init__(self) -> None:
        if self.shared_tokens < 0:
            raise ValueError("shared_tokens must be >= 0")
        if self.private == "":
            raise ValueError("private must be a non-empty id, or None to share everything")


class FinishReason(enum.Enum):
    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    # The answer's grammar broke off: the matcher met one of its limits mid-answer (the
    # probe catches most before an answer starts: service/engine/grammar.py). The text so far
    # does not match; `RequestOutput.error` says why.
    ERROR = "error"


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sample of a request."""

    request_id: str
    index: int  # sample index, 0..n-1
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    logprobs: list[list[tuple[int, float]]] | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens found in the device prefix cache
    num_swapped_in_tokens: int  # prompt tokens brought back from the CPU pool
    num_loaded_tokens: int  # prompt tokens loaded from the third tier (service/engine/kvtier)
    num_output_tokens: int
    # When the request was first admitted (time.monotonic()); queue time ends here.
    first_scheduled_time: float | None = None
    error: str | None = None  # why it ended, with finish_reason ERROR


# The engine's shape


@dataclass(slots=True, frozen=True)
class EngineLimits:
    max_model_len: int  # the longest sequence, prompt + answer (capped by the model's context)
    block_size: int  # tokens per KV block: page maps count in these
    num_device_blocks: int
    num_cpu_blocks: int


@dataclass(slots=True, frozen=True)
class EnginePrecision:
    # the layers' matmul weights: their GGUF types where packed ("Q4_1", "Q4_K+Q6_K"), else
    # fp32 | bf16 | fp16
    weights: str
    weight_dtype: str  # the dense matmul weights' dtype ("bfloat16")
    activation_dtype: str  # the activations'
    kv_cache_dtype: str = ""  # the KV cache's ("float16"); "" where it is the activations'
    # Threads of the native decode stack (decode steps' layers in one native call); 0 where
    # decode steps run op by op.
    decode_threads: int = 0
    # The CPU kernels' version ("avx512", "avx2 (gemv generic)"); "" where none run.
    cpu_kernels: str = ""


# The variables the server sets for every render: a request's template kwargs cannot replace
# them (the contents' sentinels, the tools' text and the turn structure are the server's).
TEMPLATE_RESERVED = frozenset(
    {"messages", "add_generation_prompt", "bos_token", "eos_token", "tools", "documents",
     "raise_exception", "continue_final_message"}
)  # fmt: skip


class TextTokenizer(Protocol):
    """What the service asks of the model's tokenizer (`engine/tokenizer.py` `Tokenizer`):
    prompts are built and token ids checked with it, and /tokenize's ids shown; an answer's
    decoding stays on the engine thread."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...  # the ids that end a turn

    def encode(self, text: str) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str: ...

    def id_to_token(self, token_id: int) -> str | None: ...  # the vocabulary's own string

    def token_to_id(self, token: str) -> int | None: ...  # a token of the vocabulary, or None

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...


# Its counters: /v1/stats and /metrics


@dataclass(slots=True)
class PoolUsage:
    total: int
    free: int
    cached: int
    in_use: int


@dataclass(slots=True)
class BlockStats:
    device: PoolUsage
    cpu: PoolUsage
    prefix_queries: int  # prompt tokens looked up in the prefix cache
    prefix_hits: int  # of which found on the device
    prefix_cpu_hits: int  # of which found in the CPU pool and swapped back in
    prefix_tier_hits: int  # of which loaded from the third tier
    blocks_swapped_out: int
    blocks_swapped_in: int
    blocks_copied: int  # copy-on-write
    blocks_dropped: int  # cached content lost for lack of room
    # A model with sliding-window layers keeps theirs in pools of their own
    # (service/engine/window_blocks.py); `device` and `cpu` are then the full-attention layers'.
    window_device: PoolUsage | None = None
    window_cpu: PoolUsage | None = None


@dataclass(slots=True)
class StepTiming:
    """Seconds spent per phase of `step`, summed since the engine started.

    Only `forward` is model work; the rest is the engine's own overhead.
    """

    schedule: float = 0.0
    prepare: float = 0.0  # block moves, input tensors, attention plan
    forward: float = 0.0
    grammar: float = 0.0  # filling the grammar masks (on a GPU, beside the forward)
    sample: float = 0.0
    postprocess: float = 0.0  # detokenize, stop checks, free finished sequences

    @property
    def total(self) -> float:
        return (
            self.schedule + self.prepare + self.forward + self.grammar + self.sample
            + self.postprocess
        )  # fmt: skip

    @property
    def overhead_share(self) -> float:
        return 1.0 - self.forward / self.total if self.total else 0.0


@dataclass(slots=True, frozen=True)
class BackendStats:
    name: str
    entries: int
    bytes: int
    cap_bytes: int
    available: bool  # False while it is left alone after a failure


@dataclass(slots=True, frozen=True)
class KVTierStats:
    codec: str
    backends: list[BackendStats]
    blocks_written: int
    bytes_written: int  # encoded record bytes
    writes_dropped: int  # blocks not written: the write queue was full, or no backend was up
    write_errors: int
    pending_writes: int  # blocks queued, not yet written
    loads: int  # load requests (one per prompt that missed both pools)
    loads_timed_out: int
    blocks_loaded: int  # found, checked and handed to the engine
    blocks_missed: int  # asked for and not found
    blocks_rejected: dict[str, int]  # by reason: malformed, foreign, truncated, checksum
    read_errors: int
    write_seconds: float  # the writer thread's time encoding and storing
    read_seconds: float  # the reader thread's time fetching and decoding


@dataclass(slots=True)
class EngineStats:
    blocks: BlockStats
    num_waiting: int
    num_running: int
    num_swapped: int
    preemptions_swap: int
    preemptions_recompute: int
    steps: int
    # Every answered request's prompt, once, cached or not (vLLM's prompt_tokens); not those
    # of prefill-only requests (max_tokens 0), which only fill the cache.
    prompt_tokens: int
    prompt_tokens_computed: int
    tokens_generated: int
    timing: StepTiming
    kv_tier: KVTierStats | None = None  # None: no third tier


# Where blocks are: /v1/kv and page maps


class Tier(enum.Enum):
    DEVICE = "device"
    CPU = "cpu"


class SlotState(enum.IntEnum):
    """What one physical slot holds, for page-map views (`BlockManager.slot_states`)."""

    FREE = 0
    IN_USE = 1  # in one sequence's block table
    SHARED = 2  # in several tables: a shared prefix or forked samples (copy-on-write)
    CACHED = 3  # no holder; kept under its content hash for a later prefix hit


@dataclass(slots=True, frozen=True)
class SequencePages:
    """One live sequence's block table: (tier, slot) of each of its blocks, in order."""

    request_id: str
    sample_index: int
    status: str  # waiting, running or swapped
    num_tokens: int
    num_computed_tokens: int
    blocks: list[tuple[Tier, int]]


@dataclass(slots=True, frozen=True)
class KVSnapshot:
    """Who holds which KV slot right now: both tiers slot by slot, and the live tables."""

    block_size: int
    device: list[SlotState]
    cpu: list[SlotState]
    sequences: list[SequencePages]
    num_sequences: int  # live sequences in all; `sequences` may list only the first ones
