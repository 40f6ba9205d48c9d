"""KV tier settings: which backends, how large, how blocks are stored."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from service.settings import setting

# Storage options (record.CODECS): raw K/V bytes; int8 with a scale per token and head; either
# of them zstd-compressed.
CODEC_NAMES = ("raw", "int8", "zstd", "int8-zstd")


@dataclass(slots=True)
class KVTierConfig:
    """The third tier's settings: `pagechat serve --kv-tier-*` options and PAGECHAT_KV_TIER_*
    variables (service.server.options, the `kv_tier` group). The tier is on when a directory or
    a Redis URL is given."""

    directory: Path | None = setting(
        None,
        "a local directory: one file per block (`{tag}/{hash[:2]}/{hash}.kvb`), written to a"
        " temporary file and renamed, so a reader sees a whole record or none; not fsynced (a"
        " record cut short by a power loss fails its checks). Several processes may share it",
    )
    directory_mb: int = setting(
        4096,
        "the directory's byte cap in MiB: past it the least recently used files (by mtime, which"
        " reads refresh, so the order survives restarts) are deleted",
    )
    redis_url: str | None = setting(
        None,
        "a Redis for blocks (`redis://`, `rediss://`, `unix://`); may be the sessions' Redis"
        " or, better for memory, an instance of its own. Replicas sharing it resume each"
        " other's conversations. It holds conversations' K/V: give it the sessions' protection",
    )
    redis_mb: int = setting(
        4096,
        "the Redis backend's byte cap in MiB over every block under the prefix, shared by all"
        " replicas writing there; past it the least recently used are deleted (a Lua script"
        " per write)",
    )
    redis_prefix: str = setting(
        "pagechat:kv:",
        "the tier's Redis keys: `{prefix}{tag}/{hash}` per block, and `{prefix}lru`,"
        " `{prefix}sizes`, `{prefix}bytes` for the cap",
    )
    ttl_s: int = setting(
        7 * 24 * 3600, "seconds a Redis tier block lives after its last write or read"
    )
    codec: str = setting(
        "raw",
        "how blocks are stored: raw (the pool's bytes: loaded K/V are exactly the computed"
        " ones) | int8 (one float32 scale per token, layer, K/V and head: ~3.8x smaller than"
        " fp32) | zstd | int8-zstd. A reader decodes any of them; docs/perf-history.md has"
        " each one's measured bytes and greedy answers",
    )
    max_pending_mb: int = setting(
        256,
        "encoded bytes waiting to be written; a write past it is dropped, so the engine thread"
        " never waits on storage",
    )
    load_timeout_s: float = setting(
        10.0, "seconds a prompt waits for tier blocks before its prefix is recomputed"
    )
    io_timeout_s: float = setting(
        2.0, "Redis socket timeout: a stalled server costs a read at most this"
    )
    retry_after_s: float = setting(
        5.0, "after a backend fails, seconds it is left alone before it is tried again"
    )

    def __post_init__(self) -> None:
        if self.directory is None and self.redis_url is None:
            raise ValueError("a KV tier needs a directory or a Redis URL (or both)")
        if self.directory is not None:
            self.directory = Path(self.directory)
        if self.codec not in CODEC_NAMES:
            raise ValueError(f"kv tier codec must be one of {', '.join(CODEC_NAMES)}")
        for name in ("directory_mb", "redis_mb", "ttl_s", "max_pending_mb"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv tier {name} must be >= 1")
        for name in ("load_timeout_s", "io_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"kv tier {name} must be > 0")
        if self.retry_after_s < 0:
            raise ValueError("kv tier retry_after_s must be >= 0")
