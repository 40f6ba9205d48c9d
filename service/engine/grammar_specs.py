"""What was asked (a `StructuredOutput`) as llguidance's grammar text, refused (GrammarError)
where it cannot be constrained before anything is compiled.

NOTE (bounds): llguidance follows a grammar within limits of its own (items in an Earley row,
lexer states, forced tokens), some of which a grammar meets only tokens into the answer, and
it compiles some shapes in time that grows faster than their size. What is checked here keeps
a compile short and an answer followable to its end: the nesting of a JSON Schema, the optional
properties one object lists, a regular expression that ends in a lone backslash (the one
invalid regex llguidance takes, as the empty one). A `choice` is compiled as one regular
expression, a single lexeme, so its strings cost the parser nothing per string. The compiler
(grammar.py) then follows each grammar a few tokens before any answer does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark  # GBNF as Lark; Lark as it is

from service.engine.params import MAX_SCHEMA_DEPTH, StructuredOutput
from service.engine.values import GrammarError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

# Compact JSON with the spaces Python's json.dumps writes (", " and ": "), which is what
# models have read most: never a run of whitespace, which a small model can repeat until the
# answer's length runs out.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# llguidance's parser holds four Earley items per optional property of an open object, and
# at most 2,000 in a row; and compiles an object's optional properties in time quadratic in
# their number (10,000 take 7 s).
MAX_OPTIONAL_PROPERTIES = 400
MAX_CHOICES = 100_000  # as one regular expression, 100,000 strings compile in about 1 s


def grammar_text(structured: StructuredOutput) -> str:
    """llguidance's grammar for `structured`; GrammarError for a spec that is not one, or
    that NOTE (bounds) refuses."""
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            schema = json.loads(spec)
            if schema is True:
                schema = {}  # JSON Schema's true: any value
            if not isinstance(schema, dict):
                raise GrammarError("a JSON Schema is an object (or true)")
            check_schema(schema)
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS))
        if kind == "json_object":
            return str(
                llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
            )
        if kind == "regex":
            check_regex(spec)
            return str(llguidance.LLMatcher.grammar_from_regex(spec))
        if kind == "choice":
            return str(llguidance.LLMatcher.grammar_from_regex(choice_regex(json.loads(spec))))
        return str(llguidance.LLMatcher.grammar_from_lark(_lark(spec)))
    except (ValueError, TypeError, RecursionError) as exc:  # json's errors and llguidance's
        if isinstance(exc, GrammarError):
            raise
        raise GrammarError(one_line(str(exc))) from None


def _lark(spec: str) -> str:
    """A Lark grammar as it is, a GBNF one as Lark. The GBNF converter is Python that raises
    whatever it meets (its own errors, a rule it cannot find, RecursionError): every one of
    them a grammar that is not valid."""
    if "\x00" in spec:
        raise GrammarError("a grammar holds no NUL character")
    try:
        return str(any_to_lark(spec))
    except Exception as exc:
        raise GrammarError(one_line(str(exc) or type(exc).__name__)) from None


def check_regex(regex: str, where: str = "the regex") -> None:
    """GrammarError for a regex ending in a lone backslash, which llguidance would take as
    the empty regex; every other invalid regex its compiler refuses."""
    trailing = len(regex) - len(regex.rstrip("\\"))
    if trailing % 2:
        raise GrammarError(f"{where} ends in a lone backslash (an escape with nothing to escape)")


def choice_regex(choices: Any) -> str:
    """One regular expression matching exactly the strings of `choices`: every character
    that is not a letter or a digit written as its code point, so no string means more than
    itself."""
    if not isinstance(choices, list) or not choices:
        raise GrammarError("choice is a non-empty list of non-empty strings")
    if not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice is a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(f"choice lists {len(choices)} strings; at most {MAX_CHOICES}")
    return "(" + "|".join(_literal(c) for c in dict.fromkeys(choices)) + ")"


def _literal(text: str) -> str:
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):X}}}" for c in text)


def check_schema(schema: dict[str, Any]) -> None:
    """GrammarError for a schema past NOTE (bounds): nested deeper than MAX_SCHEMA_DEPTH, an
    object listing more than MAX_OPTIONAL_PROPERTIES optional properties, or a `pattern` that
    ends in a lone backslash."""
    for node, depth in _nodes(schema):
        if depth > MAX_SCHEMA_DEPTH:
            raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if not isinstance(node, dict):
            continue
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            check_regex(pattern, f"the pattern {_excerpt(pattern)}")
        properties = node.get("properties")
        if isinstance(properties, dict) and len(properties) > MAX_OPTIONAL_PROPERTIES:
            required = node.get("required")
            listed = set(required) if isinstance(required, list) else set()
            optional = sum(1 for name in properties if name not in listed)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise GrammarError(
                    f"an object lists {optional} optional properties; at most "
                    f"{MAX_OPTIONAL_PROPERTIES} can be constrained (make more of them required)"
                )


def _nodes(value: Any) -> Iterator[tuple[Any, int]]:
    """Every value inside `value` and its depth (the root's 0), without recursion."""
    stack = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        yield node, depth
        if isinstance(node, dict):
            stack.extend((child, depth + 1) for child in node.values())
        elif isinstance(node, list):
            stack.extend((child, depth + 1) for child in node)


def _excerpt(text: str, size: int = 40) -> str:
    return json.dumps(text if len(text) <= size else text[:size] + "...")


def one_line(message: str, size: int = 300) -> str:
    """A message on one line, no longer than `size` characters: fit for an error body or a
    log line, however long the grammar it came from."""
    message = message.replace("<non-verbose/>", "")  # llguidance's mark of a short message
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return (text[:size] + "...") if len(text) > size else text or "invalid grammar"
