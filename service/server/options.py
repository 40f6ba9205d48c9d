"""`pagechat serve` options and docs/config.md's tables, both made from the config fields.

Every field of EngineConfig, ServerConfig, Limits and KVTierConfig (made with
`service.settings.setting`) is one option and one environment variable, named after it:
`kv_cache_mb` is `--kv-cache-mb` and PAGECHAT_KV_CACHE_MB, a KVTierConfig field takes the
prefix `kv-tier-` (`codec`: `--kv-tier-codec`, PAGECHAT_KV_TIER_CODEC); a bool is `--name` /
`--no-name` and PAGECHAT_NAME=true|false. The
command line wins over the environment, the environment over the field's default. Kept free
of the web stack so that building the CLI parser stays cheap.

    python -m service.server.options docs/config.md   # rewrite the tables between the markers
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.api.limits import Limits
from service.engine.config import EngineConfig
from service.engine.kvtier.config import KVTierConfig
from service.server.config import ServerConfig
from service.settings import HELP, SHOWN_DEFAULT

# Each group's dataclass, in the order of docs/config.md; ServerConfig's `engine` and
# `limits` fields and EngineConfig's `kv_tier` are groups of their own.
GROUPS: dict[str, type] = {
    "engine": EngineConfig,
    "kv_tier": KVTierConfig,
    "server": ServerConfig,
    "limits": Limits,
}
NESTED = {"server": frozenset({"engine", "limits"}), "engine": frozenset({"kv_tier"})}
# A group's options are named `--{prefix}{field}`: the tier's fields say only what they
# are within the tier (`codec`, `ttl_s`).
PREFIX = {"kv_tier": "kv_tier_"}

# Spellings from before the options were made from the fields: still read, with a warning.
# Old option -> (field, whether the old option meant the field's opposite).
RENAMED: dict[str, tuple[str, bool]] = {
    "--max-tokens-limit": ("max_tokens", False),
    "--session-ttl": ("session_ttl_s", False),
    "--drain-timeout": ("drain_timeout_s", False),
    "--send-timeout": ("send_timeout_s", False),
    "--no-prefix-caching": ("enable_prefix_caching", True),
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def names(value: str) -> tuple[str, ...]:
    """A comma-separated list: "a, b," -> ("a", "b")."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


def boolean(value: str) -> bool:
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise ValueError(f"not a boolean (true or false): {value!r}")


def env_name(option: str) -> str:
    """--kv-cache-mb -> PAGECHAT_KV_CACHE_MB."""
    return "PAGECHAT_" + option.removeprefix("--").upper().replace("-", "_")


@dataclass(slots=True, frozen=True)
class Option:
    """One config field as an option."""

    group: str
    name: str  # the field's
    dest: str  # the option's: the field's name with its group's prefix
    parse: Callable[[str], Any]  # a command line's or an environment variable's text
    default: Any
    help: str
    shown_default: str
    choices: tuple[str, ...] | None  # an enum's values

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def env(self) -> str:
        return env_name(self.flag)

    @property
    def is_bool(self) -> bool:
        return self.parse is boolean


def options(group: str) -> list[Option]:
    cls = GROUPS[group]
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if f.name in NESTED.get(group, ()):
            continue
        # A field without help text still gets its option; tests/server/test_options.py fails.
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        parse, choices = _parser_for(hints[f.name])
        shown = f.metadata.get(SHOWN_DEFAULT) or _shown(default)
        help_text = f.metadata.get(HELP, "")
        dest = PREFIX.get(group, "") + f.name
        found.append(Option(group, f.name, dest, parse, default, help_text, shown, choices))
    return found


def all_options() -> list[Option]:
    return [option for group in GROUPS for option in options(group)]


def _parser_for(hint: Any) -> tuple[Callable[[str], Any], tuple[str, ...] | None]:
    """How to read a field of type `hint` from text: X | None reads as X; a str | Path as a
    str (EngineConfig.model takes either); a tuple[str, ...] as a comma-separated list."""
    if isinstance(hint, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return _parser_for(str if str in args else args[0])
    if typing.get_origin(hint) is tuple:
        return names, None
    if hint is bool:
        return boolean, None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return str, tuple(str(member.value) for member in hint)  # the dataclass converts
    if hint in (str, int, float, Path):
        return hint, None
    raise TypeError(f"no option type for {hint!r}")


def _shown(default: Any) -> str:
    """A default as docs/config.md and --help write it."""
    if default is None or default == ():
        return "none"
    if isinstance(default, bool):
        return "true" if default else "false"
    if isinstance(default, enum.Enum):
        return f"`{default.value}`"
    if isinstance(default, tuple):
        return "`" + ",".join(default) + "`"
    if isinstance(default, str | Path):
        return f"`{default}`" if str(default) else '`""`'
    return f"{default:,}" if isinstance(default, int) else f"{default:g}"


# ---------------------------------------------------------------------- the command line


class _Renamed(argparse.Action):
    """An old spelling of an option: warns, then sets the field as the new one would."""

    def __init__(self, *args: Any, new: str, opposite: bool, **kwargs: Any) -> None:
        self.new, self.opposite = new, opposite
        super().__init__(*args, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        sys.stderr.write(f"pagechat: {option_string} is deprecated; use {self.new}\n")
        setattr(namespace, self.dest, False if self.opposite else values)


def _from_environment(option: Option) -> Any:
    """The option's value from its environment variable (or an old one's), else None; a
    variable set to nothing counts as unset."""
    value = os.environ.get(option.env)
    if value:
        return option.parse(value)
    for old, (name, opposite) in RENAMED.items():
        value = os.environ.get(env_name(old))
        if name == option.name and value:
            sys.stderr.write(f"pagechat: {env_name(old)} is deprecated; use {option.env}\n")
            parsed = option.parse(value)
            return not parsed if opposite else parsed
    return None


def add_arguments(
    parser: argparse.ArgumentParser,
    groups: Iterable[str] = GROUPS,
    only: Sequence[str] | None = None,
) -> None:
    """One option per field of `groups` (or only the fields named in `only`)."""
    chosen = [o for g in groups for o in options(g) if only is None or o.name in only]
    for option in chosen:
        from_env = _from_environment(option)
        default = option.default if from_env is None else from_env
        help_text = f"{option.help} [{option.env}; {option.shown_default.replace('`', '')}]"
        help_text = help_text.replace("%", "%%")
        if option.is_bool:
            parser.add_argument(
                option.flag,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=help_text,
            )
        else:
            parser.add_argument(
                option.flag,
                type=option.parse,
                default=default,
                choices=option.choices,
                metavar=option.name.upper() if option.choices is None else None,
                help=help_text,
            )
    names_chosen = {o.name: o for o in chosen}
    for old, (name, opposite) in RENAMED.items():
        if name in names_chosen:
            new = names_chosen[name]
            kind = {"nargs": 0} if opposite else {"type": new.parse}
            new_flag = f"--no-{new.flag[2:]}" if opposite else new.flag
            parser.add_argument(
                old,
                dest=name,
                default=argparse.SUPPRESS,
                action=_Renamed,
                new=new_flag,
                opposite=opposite,
                help=argparse.SUPPRESS,
                **kind,
            )


def values(
    args: argparse.Namespace, group: str, only: Sequence[str] | None = None
) -> dict[str, Any]:
    """The fields of `group` (or those named in `only`) in `args`, as keyword arguments of
    its dataclass."""
    return {o.name: getattr(args, o.dest) for o in options(group) if only is None or o.name in only}


def kv_tier_from_args(args: argparse.Namespace) -> KVTierConfig | None:
    """The third tier's config, or None (off) when neither backend is named."""
    tier = values(args, "kv_tier")
    if tier["directory"] is None and tier["redis_url"] is None:
        return None
    return KVTierConfig(**tier)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    engine = EngineConfig(**values(args, "engine"), kv_tier=kv_tier_from_args(args))
    limits = Limits(**values(args, "limits"))
    return ServerConfig(engine=engine, limits=limits, **values(args, "server"))


# ---------------------------------------------------------------------- docs/config.md


def doc_table(group: str) -> str:
    """The markdown table of `group`'s options, as docs/config.md holds it."""
    rows = ["| option | environment | field | default | meaning |", "|---|---|---|---|---|"]
    cls = GROUPS[group].__name__
    for o in options(group):
        flag = f"`{o.flag}` / `--no-{o.flag[2:]}`" if o.is_bool else f"`{o.flag}`"
        meaning = o.help.replace("|", "\\|")
        rows.append(f"| {flag} | `{o.env}` | `{cls}.{o.name}` | {o.shown_default} | {meaning} |")
    return "\n".join(rows) + "\n"


def markers(group: str) -> tuple[str, str]:
    return f"<!-- options:{group} -->", f"<!-- /options:{group} -->"


def with_tables(doc: str) -> str:
    """`doc` with every group's table rewritten between its markers."""
    for group in GROUPS:
        start, end = markers(group)
        head, found, rest = doc.partition(start)
        _, found_end, tail = rest.partition(end)
        if not (found and found_end):
            raise ValueError(f"no {start} ... {end} in the document")
        doc = f"{head}{start}\n{doc_table(group)}{end}{tail}"
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rewrite docs/config.md's option tables")
    parser.add_argument("doc", type=Path)
    path = parser.parse_args(argv).doc
    path.write_text(with_tables(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
