"""`pagechat serve` options. Each defaults to a PAGECHAT_* environment variable (the option's
name in capitals, dashes as underscores: --kv-cache-mb <- PAGECHAT_KV_CACHE_MB), then to the
built-in default. Kept free of the web stack so that building the CLI parser stays cheap.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service.api.config import Limits, ServerConfig
from service.engine.config import EngineConfig, PreemptionMode


def _env_name(option: str) -> str:
    return "PAGECHAT_" + option.upper().replace("-", "_")


def _option(
    parser: argparse.ArgumentParser,
    name: str,
    kind: Callable[[str], Any],
    default: Any,
    help_text: str,
) -> None:
    env = os.environ.get(_env_name(name))
    value = kind(env) if env is not None else default
    parser.add_argument(
        f"--{name}", type=kind, default=value, help=f"{help_text} [{_env_name(name)}; {default}]"
    )


def _flag(parser: argparse.ArgumentParser, name: str, help_text: str) -> None:
    env = os.environ.get(_env_name(name), "")
    default = env.lower() in ("1", "true", "yes")
    parser.add_argument(
        f"--{name}", action="store_true", default=default, help=f"{help_text} [{_env_name(name)}]"
    )


def _names(value: str) -> tuple[str, ...]:
    """A comma-separated list: "a, b," -> ("a", "b")."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    e, lim = EngineConfig(), Limits()
    opt = _option
    opt(parser, "host", str, "127.0.0.1", "interface to listen on")
    opt(parser, "port", int, 8000, "port (0: any free port)")
    opt(parser, "uds", str, None, "listen on this Unix socket instead of --host/--port")
    opt(parser, "model", str, None, "GGUF file or HF directory (default: bundled SmolLM2-135M)")
    opt(
        parser,
        "dtype",
        str,
        e.dtype,
        "activations and KV cache: auto (bf16 on CUDA; timed on the CPU) | float32 | bfloat16"
        " | float16",
    )
    opt(
        parser,
        "weight-dtype",
        str,
        e.weight_dtype,
        "matmul weights: auto (timed on the CPU with --dtype auto, else as --dtype) | float32"
        " | bfloat16 | float16",
    )
    opt(
        parser,
        "weights",
        str,
        e.weights,
        "matmul weights' format: auto (as --weight-dtype) | fp32 | bf16 | int8 | int4 (packed,"
        " CPU; a GGUF's Q4_0/Q4_1 served as stored)",
    )
    opt(parser, "device", str, e.device, "auto | cpu | cuda[:N]")
    opt(parser, "attention-backend", str, e.attention_backend, "auto | torch | triton")
    opt(parser, "kv-cache-mb", int, e.kv_cache_mb, "device KV cache size")
    opt(parser, "num-device-blocks", int, None, "device KV blocks (overrides --kv-cache-mb)")
    opt(parser, "swap-space-mb", int, e.swap_space_mb, "CPU swap pool size")
    opt(parser, "num-cpu-blocks", int, None, "CPU KV blocks (overrides --swap-space-mb)")
    opt(parser, "block-size", int, e.block_size, "tokens per KV block")
    opt(parser, "max-model-len", int, e.max_model_len, "context length (prompt + answer)")
    opt(parser, "max-num-seqs", int, e.max_num_seqs, "sequences per engine step")
    opt(parser, "max-num-batched-tokens", int, e.max_num_batched_tokens, "tokens per step")
    opt(parser, "preemption-mode", str, e.preemption_mode.value, "swap | recompute")
    _flag(parser, "no-prefix-caching", "disable the prefix cache")
    _flag(parser, "no-cuda-graphs", "run decode steps eagerly: capture no CUDA graphs")
    opt(
        parser,
        "prefix-cache-scope",
        str,
        "session",
        "session: sessions share only system-prompt blocks | global: sessions share all",
    )
    opt(parser, "redis-url", str, None, "Redis server (default: embedded, under --data-dir)")
    opt(parser, "redis-prefix", str, "pagechat:", "prefix of every Redis key")
    opt(parser, "data-dir", Path, Path("data"), "where the embedded Redis persists")
    opt(parser, "replica-id", str, socket.gethostname(), "this replica's name in page maps")
    opt(parser, "max-connections", int, lim.max_connections, "open WebSockets")
    opt(parser, "max-inflight-turns", int, lim.max_inflight_turns, "answers queued or running")
    opt(parser, "max-frame-bytes", int, lim.max_frame_bytes, "largest frame a client may send")
    opt(parser, "ws-max-size", int, lim.ws_max_size, "frames over this close the connection")
    opt(parser, "max-message-chars", int, lim.max_message_chars, "user message length")
    opt(parser, "default-max-tokens", int, lim.default_max_tokens, "max_tokens when not given")
    opt(parser, "max-tokens-limit", int, lim.max_tokens, "the most max_tokens may be")
    opt(parser, "session-ttl", int, lim.session_ttl_s, "seconds a session lives after its use")
    opt(parser, "drain-timeout", float, lim.drain_timeout_s, "seconds answers get at shutdown")
    opt(
        parser,
        "send-queue-frames",
        int,
        lim.send_queue_frames,
        "frames queued for a slow client before it is dropped",
    )
    opt(
        parser,
        "send-timeout",
        float,
        lim.send_timeout_s,
        "seconds a client may leave a frame unread before it is dropped",
    )
    opt(
        parser,
        "api-keys-file",
        Path,
        None,
        "API keys, one `KEY TENANT [admin]` a line (docs/protocol.md); none: all open",
    )
    opt(
        parser,
        "allowed-origins",
        _names,
        (),
        "comma-separated origins whose pages may open /v1/chat besides this server's ('*': any)",
    )
    opt(
        parser,
        "trusted-proxies",
        _names,
        (),
        "comma-separated proxy addresses or networks whose X-Forwarded-For names the client",
    )
    opt(
        parser,
        "served-model-name",
        _names,
        (),
        "comma-separated model names the OpenAI API answers to, the first listed"
        " (default: the model's id)",
    )
    opt(
        parser,
        "cors-allowed-origins",
        _names,
        (),
        "comma-separated origins whose pages may call the HTTP API (CORS; '*': any); none: off",
    )
    opt(parser, "log-level", str, "info", "debug | info | warning | error")
    _flag(parser, "access-log", "log every HTTP request and WebSocket")


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    engine = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        weights=args.weights,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        num_device_blocks=args.num_device_blocks,
        kv_cache_mb=args.kv_cache_mb,
        num_cpu_blocks=args.num_cpu_blocks,
        swap_space_mb=args.swap_space_mb,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        preemption_mode=PreemptionMode(args.preemption_mode),
        cuda_graphs=not args.no_cuda_graphs,
    )
    limits = Limits(
        max_connections=args.max_connections,
        max_inflight_turns=args.max_inflight_turns,
        max_frame_bytes=args.max_frame_bytes,
        ws_max_size=args.ws_max_size,
        max_message_chars=args.max_message_chars,
        default_max_tokens=args.default_max_tokens,
        max_tokens=args.max_tokens_limit,
        session_ttl_s=args.session_ttl,
        drain_timeout_s=args.drain_timeout,
        send_queue_frames=args.send_queue_frames,
        send_timeout_s=args.send_timeout,
    )
    return ServerConfig(
        host=args.host,
        port=args.port,
        uds=args.uds,
        redis_url=args.redis_url,
        redis_prefix=args.redis_prefix,
        data_dir=args.data_dir,
        replica_id=args.replica_id,
        engine=engine,
        limits=limits,
        access_log=args.access_log,
        prefix_cache_scope=args.prefix_cache_scope,
        api_keys_file=args.api_keys_file,
        allowed_origins=args.allowed_origins,
        trusted_proxies=args.trusted_proxies,
        served_model_names=args.served_model_name,
        cors_allowed_origins=args.cors_allowed_origins,
    )
