"""protocol/flags.py: the terminal client's and `pagechat chat`'s sampling flags are made from
a `user` frame's params, with the protocol's defaults and help."""

from __future__ import annotations

import argparse

import pytest

from clients.terminal import parser as terminal_parser
from protocol.flags import NOT_FLAGS, add_param_flags, param_fields, param_values
from protocol.frames import UserParams


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_param_flags(parser)
    return parser.parse_args(argv)


def test_every_field_but_the_unflagged_is_a_flag_with_help() -> None:
    names = [name for name, _, _ in param_fields()]
    assert set(names) == set(UserParams.__struct_fields__) - NOT_FLAGS
    for _, _, about in param_fields():
        assert about.description


def test_no_flags_are_the_protocols_defaults() -> None:
    assert param_values(parsed()) == UserParams()


def test_each_kind_of_field_parses_as_its_type() -> None:
    args = parsed(
        "--max-tokens", "9", "--temperature", "0", "--seed", "none", "--stop", "a", "--stop",
        "b", "--ignore-eos", "--bad-words", "x", "--repetition-penalty", "1.3",
    )  # fmt: skip
    assert param_values(args) == UserParams(
        max_tokens=9, temperature=0.0, stop=["a", "b"], ignore_eos=True, bad_words=["x"],
        repetition_penalty=1.3,
    )  # fmt: skip
    assert param_values(parsed("--seed", "7")).seed == 7
    with pytest.raises(SystemExit):
        parsed("--max-tokens", "many")


def test_the_terminal_client_takes_the_same_flags() -> None:
    options = {a.dest: a for a in terminal_parser()._actions}
    for name, _, about in param_fields():
        assert about.description is not None
        assert options[name].help is not None and about.description in options[name].help
        assert options[name].default in (getattr(UserParams(), name), None)
