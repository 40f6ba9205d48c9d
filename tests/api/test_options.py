"""`pagechat serve` options: command line over PAGECHAT_* environment over defaults."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from service.api.options import add_arguments, config_from_args
from service.engine.config import PreemptionMode


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults_are_the_embedded_setup() -> None:
    config = config_from_args(parse())
    assert config.redis_url is None and config.data_dir == Path("data")
    assert config.engine.model is None and config.engine.dtype == "auto"
    assert config.engine.enable_prefix_caching
    assert (config.host, config.port) == ("127.0.0.1", 8000)


def test_environment_then_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGECHAT_KV_CACHE_MB", "64")
    monkeypatch.setenv("PAGECHAT_REDIS_URL", "redis://example:6379/1")
    monkeypatch.setenv("PAGECHAT_NO_PREFIX_CACHING", "1")
    config = config_from_args(parse("--kv-cache-mb", "128", "--max-connections", "3"))
    assert config.engine.kv_cache_mb == 128  # the command line wins
    assert config.redis_url == "redis://example:6379/1"
    assert not config.engine.enable_prefix_caching
    assert config.limits.max_connections == 3


def test_limits_and_engine_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        config_from_args(parse("--max-connections", "0"))
    with pytest.raises(ValueError):
        config_from_args(parse("--default-max-tokens", "900", "--max-tokens-limit", "100"))
    assert config_from_args(parse("--preemption-mode", "recompute")).engine.preemption_mode is (
        PreemptionMode.RECOMPUTE
    )


def test_no_cuda_graphs_turns_the_decode_graphs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args(parse()).engine.cuda_graphs
    assert not config_from_args(parse("--no-cuda-graphs")).engine.cuda_graphs
    monkeypatch.setenv("PAGECHAT_NO_CUDA_GRAPHS", "1")
    assert not config_from_args(parse()).engine.cuda_graphs
