"""What a request asks its answer to match, from the fields clients send, as the engine's
`StructuredOutput`: OpenAI's `response_format` (chat, and the WebSocket `user` frame), vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. At most one of them per request; `StructuredError` names the field that is
wrong. Whether the schema or grammar itself can be matched is the engine's to say
(`ServingEngine.check_structured`), once, before the request is queued.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import msgspec

from protocol.frames import ResponseFormat
from service.api.nesting import nesting_message, too_deep
from service.engine.params import StructuredOutput

# A regex or grammar a client writes. Their compile time grows faster than their length
# (a 50,000-character regex of nested stars takes seconds and gigabytes); grammars people
# write are a few thousand characters.
MAX_GRAMMAR_CHARS = 16_384


class StructuredError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class VllmStructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` (one of json, regex, choice, grammar, json_object)."""

    json: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's tuning knobs, accepted at what this server does anyway.
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


def from_response_format(
    fmt: ResponseFormat | None, param: str = "response_format"
) -> StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput(kind="json_object")
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise StructuredError(f"{param} json_schema needs its json_schema field", param)
        schema = fmt.json_schema.schema
        if schema is None:  # OpenAI's: a schema-less json_schema is any JSON object
            return StructuredOutput(kind="json_object")
        if fmt.json_schema.strict and isinstance(schema, dict):
            schema = closed(schema)
        return StructuredOutput(kind="json", spec=_schema_text(schema, param))
    raise StructuredError(
        f"{param} type {fmt.type!r} is not supported (text, json_object, json_schema)", param
    )


def from_vllm_fields(
    outputs: VllmStructuredOutputs | None,
    guided_json: dict[str, Any] | bool | str | None = None,
    guided_regex: str | None = None,
    guided_choice: list[str] | None = None,
    guided_grammar: str | None = None,
) -> tuple[StructuredOutput, str] | None:
    """vLLM's fields as one StructuredOutput and the field it came from (None: none given)."""
    asked: list[tuple[StructuredOutput, str]] = []
    if outputs is not None:
        asked += _from_outputs(outputs)
    if guided_json is not None:
        asked.append(
            (
                StructuredOutput(kind="json", spec=_schema_text(guided_json, "guided_json")),
                "guided_json",
            )
        )
    if guided_regex is not None:
        asked.append((_text("regex", guided_regex, "guided_regex"), "guided_regex"))
    if guided_choice is not None:
        asked.append((_choice(guided_choice, "guided_choice"), "guided_choice"))
    if guided_grammar is not None:
        asked.append((_text("grammar", guided_grammar, "guided_grammar"), "guided_grammar"))
    if len(asked) > 1:
        names = ", ".join(param for _, param in asked)
        raise StructuredError(
            f"one structured output at a time; this request gives {names}", asked[1][1]
        )
    return asked[0] if asked else None


def _from_outputs(outputs: VllmStructuredOutputs) -> list[tuple[StructuredOutput, str]]:
    found = []
    if outputs.json is not None:
        found.append(
            (
                StructuredOutput(
                    kind="json", spec=_schema_text(outputs.json, "structured_outputs.json")
                ),
                "structured_outputs.json",
            )
        )
    if outputs.regex is not None:
        param = "structured_outputs.regex"
        found.append((_text("regex", outputs.regex, param), param))
    if outputs.choice is not None:
        found.append(
            (_choice(outputs.choice, "structured_outputs.choice"), "structured_outputs.choice")
        )
    if outputs.grammar is not None:
        param = "structured_outputs.grammar"
        found.append((_text("grammar", outputs.grammar, param), param))
    if outputs.json_object:
        found.append((StructuredOutput(kind="json_object"), "structured_outputs.json_object"))
    if not found:
        raise StructuredError(
            "structured_outputs needs one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    return found


def closed(schema: Any) -> Any:
    """`schema` with every object that does not say otherwise closed (`additionalProperties:
    false`), as OpenAI's strict mode has them: only the properties listed are written. (An
    open object lets the answer add properties without end.)"""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed(value) for key, value in schema.items()}
    is_object = schema.get("type") == "object" or "properties" in schema
    if is_object and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _text(kind: Literal["regex", "grammar"], text: str, param: str) -> StructuredOutput:
    """A regex or a grammar as the client wrote it, within MAX_GRAMMAR_CHARS."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise StructuredError(
            f"{param} has {len(text)} characters; at most {MAX_GRAMMAR_CHARS}", param
        )
    return StructuredOutput(kind=kind, spec=text)


def _choice(choices: list[str], param: str) -> StructuredOutput:
    if not choices or not all(choices):
        raise StructuredError(f"{param} must be a non-empty list of non-empty strings", param)
    return StructuredOutput(kind="choice", spec=json.dumps(choices))


def _schema_text(schema: dict[str, Any] | bool | str, param: str) -> str:
    """A schema as compact JSON text (keys in their order: the answer writes an object's
    properties in the order the schema lists them)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise StructuredError(f"{param}: the JSON Schema is not valid JSON", param) from None
        except RecursionError:
            raise StructuredError(f"{param}: {nesting_message()}", param) from None
        if too_deep(schema):  # NOTE (nesting): text the body's own check did not see into
            raise StructuredError(f"{param}: {nesting_message()}", param)
    return json.dumps(schema, separators=(",", ":"))
