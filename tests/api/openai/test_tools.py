"""Tool calls without a server: the request's tools and choice, the prompt they make, the
grammar that holds a required call to its function's schema, and the calls read back from an
answer, whole or streamed, in each family's format."""

from __future__ import annotations

import json
from typing import Any

import pytest

from service.api.limits import Limits
from service.api.openai.chat_request import decode_request, render_prompt
from service.api.openai.errors import OpenAIError
from service.api.openai.tools import (
    COMPACT_JSON,
    CallStream,
    Tools,
    call_grammar,
    read_calls,
    tools_of,
)
from service.engine.grammar import GrammarCompiler
from service.sessions.prompt import ChatFormat
from tests.api.openai.two_hops import openai_params
from tests.tiny_model import gguf_tokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = tools_of([WEATHER, TIME], "auto", None)


def decode(**body: Any) -> Any:
    messages = body.pop("messages", [{"role": "user", "content": "Weather in Paris?"}])
    return decode_request(json.dumps({"messages": messages, **body}).encode(), ("m",))


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        ([{"type": "retrieval"}], None, "tools[0]"),
        ([{"type": "code", "function": {"name": "f"}}], None, "tools[0].type"),
        ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
        ([TIME, TIME], None, "tools"),
        ([TIME], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
        ([TIME], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_malformed_tools_and_choices_are_refused_by_name(
    tools: Any, choice: Any, param: str
) -> None:
    with pytest.raises(OpenAIError) as caught:
        decode(tools=tools, tool_choice=choice)
    assert caught.value.param == param, caught.value.message


def test_a_required_call_takes_no_other_structured_output() -> None:
    with pytest.raises(OpenAIError) as caught:
        decode(tools=[TIME], tool_choice="required", response_format={"type": "json_object"})
    assert caught.value.param == "tool_choice"


def test_the_prompt_carries_the_tools_and_the_history_its_calls_and_results() -> None:
    chat = ChatFormat(gguf_tokenizer())
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
    }
    req = decode(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
        ],
        tools=[WEATHER],
    )
    text = chat.tokenizer.decode(render_prompt(req, chat, Limits()))
    assert text.index("Be brief.") < text.index("<tools>") < text.index('"get_weather"')
    call_text = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    assert f"<tool_call>\n{call_text}\n</tool_call>" in text
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice none: the tools stay out of the prompt.
    none = decode(tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in chat.tokenizer.decode(render_prompt(none, chat, Limits()))


def test_required_and_named_choices_constrain_the_answer_to_calls() -> None:
    required = openai_params(
        decode(tools=[WEATHER, TIME], tool_choice="required"), Limits(), 10, 512
    )
    assert required.structured is not None and required.structured.kind == "grammar"
    assert openai_params(decode(tools=[WEATHER]), Limits(), 10, 512).structured is None  # auto


@pytest.mark.parametrize("parallel", [True, False])
def test_the_call_grammar_takes_calls_of_the_tools_with_valid_arguments_only(
    parallel: bool,
) -> None:
    tokenizer = gguf_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    grammar = call_grammar(tools_of([WEATHER, TIME], "required", parallel))

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(grammar)
        return all(matcher.accept(t) for t in tokenizer.encode(text))

    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon", "unit": "f"}}\n</tool_call>'  # noqa: E501
    clock = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert accepts(weather) and accepts(clock)
    assert accepts(weather + "\n" + clock) is parallel
    assert not accepts(weather.replace('"f"', '"kelvin"'))
    assert not accepts(weather.replace("get_weather", "get_wether"))
    assert not accepts("Sure! " + weather)
    named = call_grammar(
        tools_of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, None)
    )
    matcher = compiler.matcher(named)
    assert not all(matcher.accept(t) for t in tokenizer.encode(weather))


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>',  # noqa: E501
            "Let me check.",
            [("get_weather", {"city": "Oslo", "unit": "c"})],
        ),
        (
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>',  # noqa: E501
            None,
            [("get_time", {}), ("get_time", {})],
        ),
        (  # Llama 3.1's bare JSON call
            '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}',
            None,
            [("get_weather", {"city": "Rome", "unit": "c"})],
        ),
        (  # Mistral's
            '[TOOL_CALLS][{"name": "get_time", "arguments": {"tz": "UTC"}}]',
            None,
            [("get_time", {"tz": "UTC"})],
        ),
        (
            '{"name": "unknown_tool", "arguments": {}}',
            '{"name": "unknown_tool", "arguments": {}}',
            [],
        ),
        ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
        (  # a call cut short by max_tokens after a whole one: dropped, not content
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n<tool_call>\n{"na',
            None,
            [("get_time", {})],
        ),
        (  # a first call cut short: dropped, whatever came before it stays
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci',
            "Let me look.\n",
            [],
        ),
    ],
    ids=["text", "hermes", "two", "llama", "mistral", "unknown", "broken", "cut", "cut-first"],
)
def test_calls_are_read_in_each_familys_format(
    text: str, content: str | None, calls: list[tuple[str, Any]]
) -> None:
    found = read_calls(text, TOOLS)
    assert found.content == content
    assert [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found.calls
    ] == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in found.calls)


def stream(tools: Tools, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    calls = CallStream(tools)
    streamed = "".join(calls.push(p) for p in pieces)
    rest, found = calls.finish()
    return streamed + rest, found


def test_streamed_text_holds_back_what_may_open_a_call_and_nothing_else() -> None:
    calls = CallStream(TOOLS)
    assert calls.push("The answer is <") == "The answer is "
    assert calls.push("b>bold") == "<b>bold"  # not a call after all
    assert calls.push(" and <tool_") == " and "
    assert calls.push('call>{"name": "get_time", "arguments": {}}</tool_call>') == ""
    rest, found = calls.finish()
    assert rest == "" and [c["function"]["name"] for c in found] == ["get_time"] and calls.called


@pytest.mark.parametrize(
    "text",
    [
        "Plain answer, streamed as it comes.",
        'Checking.<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        '{"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}}',
        '{"not": "a call"}',
        "Half a marker at the end <tool_ca",
    ],
)
def test_streaming_in_any_pieces_gives_what_reading_the_whole_gives(text: str) -> None:
    whole = read_calls(text, TOOLS)
    for size in (1, 3, 7, len(text)):
        content, calls = stream(TOOLS, [text[i : i + size] for i in range(0, len(text), size)])
        assert (content.strip() or None) == (whole.content.strip() if whole.content else None)
        assert [c["function"] for c in calls] == [c["function"] for c in whole.calls]


@pytest.mark.parametrize("cut", [1, 3, 5, 12, 30, 60])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_cut_anywhere_is_never_content(cut: int, choice: Any) -> None:
    """The answer of a forced call is calls only: cut at any character (max_tokens), it has
    no content, whole or streamed."""
    forced = tools_of([WEATHER, TIME], choice, None)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    text = (call + "\n</tool_call>")[:cut]
    found = read_calls(text, forced)
    assert found.content is None and found.calls == []
    content, calls = stream(forced, [text[i : i + 4] for i in range(0, len(text), 4)])
    assert content == "" and calls == []


PLACE = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
NESTED = {  # as pydantic writes a nested model and an enum: $defs and $refs to them
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}, "Place": PLACE},
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}, "days": {"type": "integer"}},
            "required": ["place", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "forecast"}}]
)
def test_the_call_grammar_follows_refs_to_the_parameters_own_defs_compactly(choice: Any) -> None:
    tokenizer = gguf_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    grammar = call_grammar(tools_of([NESTED, TIME], choice, False))
    compiler.check(grammar)  # before: the $refs were looked up in the call grammar's root

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(grammar)
        return all(matcher.accept(t) for t in tokenizer.encode(text))

    call = '{"name": "forecast", "arguments": {"place": {"city": "Oslo", "unit": "c"}, "days": 2}}'
    assert accepts(f"<tool_call>\n{call}\n</tool_call>")
    wrong_unit = call.replace('"c"', '"k"')
    assert not accepts(f"<tool_call>\n{wrong_unit}\n</tool_call>")
    spaced = call.replace(": {", ":  {").replace(", ", ",\n  ")  # what response_format refuses
    assert not accepts(f"<tool_call>\n{spaced}\n</tool_call>")


def test_objects_that_do_not_say_are_closed_and_those_that_do_keep_their_word() -> None:
    tokenizer = gguf_tokenizer()
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    town = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    pydantics = {  # no additionalProperties anywhere, as pydantic (and instructor) write them
        "$defs": {"Town": town},
        "type": "object",
        "properties": {"town": {"$ref": "#/$defs/Town"}, "tags": {"type": "object",
                                                                "additionalProperties": True}},
        "required": ["town", "tags"],
    }  # fmt: skip
    tool = {"type": "function", "function": {"name": "f", "parameters": pydantics}}
    grammar = call_grammar(tools_of([tool], "required", False))

    def accepts(arguments: str) -> bool:
        matcher = compiler.matcher(grammar)
        text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        return all(matcher.accept(t) for t in tokenizer.encode(text))

    assert accepts('{"town": {"name": "Oslo"}, "tags": {"any": 1}}')
    assert not accepts('{"town": {"name": "Oslo"}, "tags": {}, "days": 2}')
    assert not accepts('{"town": {"name": "Oslo", "days": 2}, "tags": {}}')


def test_calls_are_written_with_response_formats_json_options() -> None:
    from service.engine.grammar_specs import JSON_OPTIONS

    assert COMPACT_JSON == JSON_OPTIONS
