"""`pagechat serve` options (service/server/options.py): one option and one environment variable
per config field, command line over environment over defaults, and docs/config.md's tables
written from the same fields."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import pytest

from service.engine.config import PreemptionMode
from service.server.config import ServerConfig
from service.server.options import (
    GROUPS,
    NESTED,
    PREFIX,
    RENAMED,
    Option,
    add_arguments,
    all_options,
    config_from_args,
    options,
    with_tables,
)
from service.settings import setting

CONFIG_MD = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def parse(*argv: str) -> argparse.Namespace:
    return parser().parse_args(argv)


def test_defaults_are_the_embedded_setup() -> None:
    config = config_from_args(parse())
    assert config.redis_url is None and config.data_dir == Path("data")
    assert config.engine.model is None and config.engine.dtype == "auto"
    assert config.engine.enable_prefix_caching
    assert (config.host, config.port) == ("127.0.0.1", 8000)


def test_environment_then_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGECHAT_KV_CACHE_MB", "64")
    monkeypatch.setenv("PAGECHAT_REDIS_URL", "redis://example:6379/1")
    monkeypatch.setenv("PAGECHAT_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("PAGECHAT_MAX_CONNECTIONS", "")  # set to nothing: unset
    config = config_from_args(parse("--kv-cache-mb", "128", "--drain-timeout-s", "2.5"))
    assert config.engine.kv_cache_mb == 128  # the command line wins
    assert config.redis_url == "redis://example:6379/1"
    assert not config.engine.enable_prefix_caching
    assert config.limits.drain_timeout_s == 2.5
    assert config.limits.max_connections == 512
    assert config_from_args(parse("--enable-prefix-caching")).engine.enable_prefix_caching


def test_limits_and_engine_settings_are_validated() -> None:
    with pytest.raises(ValueError):
        config_from_args(parse("--max-connections", "0"))
    with pytest.raises(ValueError):
        config_from_args(parse("--default-max-tokens", "900", "--max-tokens", "100"))
    assert config_from_args(parse("--preemption-mode", "recompute")).engine.preemption_mode is (
        PreemptionMode.RECOMPUTE
    )
    with pytest.raises(SystemExit):  # not one of the enum's values
        parse("--preemption-mode", "sometimes")


def test_every_config_field_has_exactly_one_option_and_one_environment_variable() -> None:
    actions = [a for a in parser()._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
    by_field: dict[str, list[argparse.Action]] = {}
    for action in actions:
        by_field.setdefault(action.dest, []).append(action)
    fields = {o.dest: o for o in all_options()}  # the tier's fields carry its prefix
    assert set(by_field) == set(fields), "an option with no field, or a field with no option"
    for name, found in by_field.items():
        (action,) = found
        option = fields[name]
        assert name == PREFIX.get(option.group, "") + option.name
        flag = "--" + name.replace("_", "-")
        expected = [flag, f"--no-{flag[2:]}"] if option.is_bool else [flag]
        assert action.option_strings == expected
        assert option.env == "PAGECHAT_" + name.upper()
        assert option.help, f"{name} has no help text: make it with service.settings.setting"
        assert action.help is not None and f"[{option.env}; " in action.help
    for group, cls in GROUPS.items():
        names = {f for f in cls.__dataclass_fields__ if f not in NESTED.get(group, ())}
        assert names == {o.name for o in options(group)}


def sample(option: Option) -> tuple[str, Any]:
    """Text for the option's environment variable that differs from its default, and the
    value it should parse to."""
    if option.is_bool:
        return ("false", False) if option.default else ("true", True)
    if option.choices:
        text = next(c for c in option.choices if c != getattr(option.default, "value", None))
        text = text if text != option.default else option.choices[-1]
        return text, text
    if option.parse is int:
        return "3", 3
    if option.parse is float:
        return "2.5", 2.5
    if option.parse is Path:
        return "/tmp/pagechat-sample", Path("/tmp/pagechat-sample")
    if option.parse is str:
        return "sample-value", "sample-value"
    return " a, b ,", ("a", "b")  # a comma-separated list


def test_each_environment_variable_sets_its_field(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {}
    for option in all_options():
        text, value = sample(option)
        monkeypatch.setenv(option.env, text)
        expected[option.dest] = value
    args = parse()
    assert {name: getattr(args, name) for name in expected} == expected


def test_old_spellings_still_work_and_say_they_are_deprecated(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parse(
        *("--max-tokens-limit", "100", "--default-max-tokens", "50", "--session-ttl", "60"),
        *("--drain-timeout", "1.5", "--send-timeout", "2", "--no-prefix-caching"),
    )
    config = config_from_args(args)
    assert (config.limits.max_tokens, config.limits.session_ttl_s) == (100, 60)
    assert (config.limits.drain_timeout_s, config.limits.send_timeout_s) == (1.5, 2.0)
    assert not config.engine.enable_prefix_caching
    warned = capsys.readouterr().err
    for old in RENAMED:
        assert f"{old} is deprecated" in warned
    monkeypatch.setenv("PAGECHAT_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("PAGECHAT_SESSION_TTL", "90")
    config = config_from_args(parse())
    assert not config.engine.enable_prefix_caching and config.limits.session_ttl_s == 90
    assert "PAGECHAT_SESSION_TTL is deprecated; use PAGECHAT_SESSION_TTL_S" in (
        capsys.readouterr().err
    )
    assert "--max-tokens-limit" not in parser().format_help()  # no longer offered


def test_docs_config_md_tables_are_the_fields_as_written_from_the_code() -> None:
    doc = CONFIG_MD.read_text()
    assert with_tables(doc) == doc, (
        "docs/config.md and the config fields disagree: run "
        "`.venv/bin/python -m service.server.options docs/config.md`"
    )
    rows = {}
    for line in doc.splitlines():
        if match := re.match(
            r"\| `(--[a-z0-9-]+)`.*? \| `(PAGECHAT_\w+)` \| `(\w+\.\w+)` \| ", line
        ):
            flag, env, name = match.groups()
            default = line[match.end() :].split(" | ", 1)[0]
            rows[name] = (flag, env, default)
    assert rows == {
        f"{GROUPS[o.group].__name__}.{o.name}": (o.flag, o.env, o.shown_default)
        for o in all_options()
    }


def test_a_setting_needs_its_help_text() -> None:
    with pytest.raises(ValueError, match="help text"):
        setting(1)


def test_no_cuda_graphs_turns_the_decode_graphs_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config_from_args(parse()).engine.cuda_graphs
    assert not config_from_args(parse("--no-cuda-graphs")).engine.cuda_graphs
    monkeypatch.setenv("PAGECHAT_CUDA_GRAPHS", "false")
    assert not config_from_args(parse()).engine.cuda_graphs


def test_the_kv_tier_is_off_unless_a_directory_or_redis_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert config_from_args(parse()).engine.kv_tier is None
    monkeypatch.setenv("PAGECHAT_KV_TIER_REDIS_URL", "redis://kv:6379/0")
    tier = config_from_args(
        parse(
            *("--kv-tier-directory", "/var/kv", "--kv-tier-directory-mb", "64"),
            *("--kv-tier-codec", "int8"),
        )
    ).engine.kv_tier
    assert tier is not None
    assert (tier.directory, tier.directory_mb, tier.codec) == (Path("/var/kv"), 64, "int8")
    assert tier.redis_url == "redis://kv:6379/0"
    with pytest.raises(ValueError, match="codec"):
        config_from_args(parse("--kv-tier-directory", "/var/kv", "--kv-tier-codec", "gzip"))


def test_the_openai_options_parse_and_cors_origins_are_checked_at_start_up() -> None:
    config = config_from_args(
        parse("--served-model-name", "a, b,", "--cors-allowed-origins", "HTTPS://App.example:443/")
    )
    assert config.served_model_name == ("a", "b")
    assert config.cors_allowed_origins == ("https://app.example",)
    assert config_from_args(parse()).cors_allowed_origins == ()  # off
    with pytest.raises(ValueError, match="not an origin"):
        ServerConfig(cors_allowed_origins=("app.example/path",))
