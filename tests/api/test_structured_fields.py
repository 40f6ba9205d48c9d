"""service/api/structured.py on its own: each field a client may send for a structured
answer (response_format, structured_outputs, guided_*) as the engine's StructuredOutput, or a
StructuredError naming the field. (tests/api/test_structured.py sends hostile ones to a real
server.)"""

from __future__ import annotations

import json

import pytest

from protocol.frames import JsonSchemaFormat, ResponseFormat
from service.api.nesting import MAX_NESTING
from service.api.structured import (
    MAX_GRAMMAR_CHARS,
    StructuredError,
    VllmStructuredOutputs,
    closed,
    from_response_format,
    from_vllm_fields,
)
from service.engine.params import StructuredOutput


def schema_format(schema: object, strict: bool | None = None) -> ResponseFormat:
    return ResponseFormat(
        type="json_schema", json_schema=JsonSchemaFormat(schema=schema, strict=strict)
    )


def test_response_format_text_is_free_and_json_object_is_any_object() -> None:
    assert from_response_format(None) is None
    assert from_response_format(ResponseFormat(type="text")) is None
    json_object = StructuredOutput(kind="json_object")
    assert from_response_format(ResponseFormat(type="json_object")) == json_object
    assert from_response_format(schema_format(None)) == json_object  # OpenAI's: no schema


def test_a_schema_keeps_its_key_order_compact() -> None:
    got = from_response_format(schema_format({"properties": {"b": {}, "a": {}}}))
    assert got == StructuredOutput(kind="json", spec='{"properties":{"b":{},"a":{}}}')


def test_strict_closes_every_object_that_does_not_say_otherwise() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": {"type": "object", "properties": {}}},
        "$defs": {"open": {"type": "object", "additionalProperties": True}},
    }
    got = from_response_format(schema_format(schema, strict=True))
    assert got is not None
    spec = json.loads(got.spec)
    assert spec["additionalProperties"] is False
    assert spec["properties"]["inner"]["additionalProperties"] is False
    assert spec["$defs"]["open"]["additionalProperties"] is True
    assert closed([{"properties": {}}, 3]) == [{"properties": {}, "additionalProperties": False}, 3]


def test_a_wrong_response_format_names_the_field_as_the_transport_calls_it() -> None:
    with pytest.raises(StructuredError) as caught:
        from_response_format(ResponseFormat(type="xml"), "params.response_format")
    assert caught.value.param == "params.response_format" and "'xml'" in str(caught.value)
    with pytest.raises(StructuredError) as caught:
        from_response_format(ResponseFormat(type="json_schema"))
    assert caught.value.param == "response_format"


def test_vllms_fields_each_become_one_output_named_by_its_field() -> None:
    so, string = "structured_outputs", '{"type":"string"}'
    cases = [
        (VllmStructuredOutputs(regex="a+"), {}, "regex", "a+", f"{so}.regex"),
        (VllmStructuredOutputs(choice=["x", "y"]), {}, "choice", '["x", "y"]', f"{so}.choice"),
        (
            VllmStructuredOutputs(grammar="root ::= 'a'"),
            {}, "grammar", "root ::= 'a'", f"{so}.grammar",
        ),
        (VllmStructuredOutputs(json_object=True), {}, "json_object", "", f"{so}.json_object"),
        (VllmStructuredOutputs(json='{"type": "string"}'), {}, "json", string, f"{so}.json"),
        (None, {"guided_json": {"type": "string"}}, "json", string, "guided_json"),
        (None, {"guided_regex": "b"}, "regex", "b", "guided_regex"),
        (None, {"guided_choice": ["z"]}, "choice", '["z"]', "guided_choice"),
        (None, {"guided_grammar": "g"}, "grammar", "g", "guided_grammar"),
    ]  # fmt: skip
    for outputs, guided, kind, spec, param in cases:
        got = from_vllm_fields(outputs, **guided)  # type: ignore[arg-type]
        assert got == (StructuredOutput(kind=kind, spec=spec), param)  # type: ignore[arg-type]
    assert from_vllm_fields(None) is None


def test_two_at_once_or_none_in_structured_outputs_is_refused_by_name() -> None:
    with pytest.raises(StructuredError) as caught:
        from_vllm_fields(VllmStructuredOutputs(regex="a"), guided_regex="b")
    assert caught.value.param == "guided_regex"
    with pytest.raises(StructuredError) as caught:
        from_vllm_fields(VllmStructuredOutputs())
    assert caught.value.param == "structured_outputs"


@pytest.mark.parametrize(
    ("guided", "param"),
    [
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex"),
        ({"guided_grammar": "g" * (MAX_GRAMMAR_CHARS + 1)}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": "[" * (MAX_NESTING + 1) + "]" * (MAX_NESTING + 1)}, "guided_json"),
    ],
)
def test_what_is_not_an_output_at_all_is_refused_naming_its_field(
    guided: dict[str, object], param: str
) -> None:
    with pytest.raises(StructuredError) as caught:
        from_vllm_fields(None, **guided)  # type: ignore[arg-type]
    assert caught.value.param == param
