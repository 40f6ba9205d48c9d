"""Command-line flags made from a `user` frame's params (`UserParams`): the terminal client's
(clients/terminal.py) and the `pagechat chat` / `generate` command's (service/cli.py), so that
both take the same options, with the protocol's defaults and help, written once in frames.py.

A field becomes `--field-name`: an int or float takes one value (`none` for a nullable one's
default), a bool is a switch, a list of strings takes one value and may be given again.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Any

import msgspec

from protocol.frames import UserParams

# Fields no terminal shows or writes: log-probabilities, and a JSON schema for the answer.
NOT_FLAGS = frozenset({"logprobs", "response_format"})


def param_fields() -> list[tuple[str, type, msgspec.Meta]]:
    """(name, type, help) of each UserParams field that is a flag, in the struct's order."""
    hints = typing.get_type_hints(UserParams, include_extras=True)
    found = []
    for name in UserParams.__struct_fields__:
        if name in NOT_FLAGS:
            continue
        base, *extras = typing.get_args(hints[name])
        about = next(e for e in extras if isinstance(e, msgspec.Meta))
        found.append((name, base, about))
    return found


def add_param_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per flagged UserParams field, its help ending with its default."""
    defaults = UserParams()
    for name, kind, about in param_fields():
        flag = "--" + name.replace("_", "-")
        default = getattr(defaults, name)
        help_text = f"{about.description} (default: {_shown(default)})"
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=help_text)
        elif typing.get_origin(kind) is list:
            parser.add_argument(flag, action="append", default=None, help=help_text)
        else:
            parser.add_argument(flag, type=_scalar(kind), default=default, help=help_text)


def param_values(args: argparse.Namespace) -> UserParams:
    """The flags' values as a `user` frame's params."""
    values: dict[str, Any] = {}
    for name, kind, _ in param_fields():
        value = getattr(args, name)
        if typing.get_origin(kind) is list:
            value = value or []
        values[name] = value
    return UserParams(**values)


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return "on" if default else "off"
    return "none" if default is None or default == [] else str(default)


def _scalar(kind: type) -> Any:
    """The parser of an int, a float, or either or None (written `none`)."""
    members = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
    (base,) = [m for m in members if m is not type(None)]
    if len(members) == 1:
        return base

    def parse(text: str) -> Any:
        return None if text.lower() == "none" else base(text)

    parse.__name__ = base.__name__  # argparse's "invalid int value: 'x'"
    return parse
