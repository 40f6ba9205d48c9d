"""Tool calls: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, the history's
assistant `tool_calls` and `tool` messages, and the calls found in an answer.

NOTE (format): every model is told the tools and asked for calls in one format, the Hermes
style that Qwen 2.5/3 and SmolLM were trained on: the function signatures inside `<tools>` in
the system message, each call a JSON object `{"name", "arguments"}` inside `<tool_call>` tags,
each result inside `<tool_response>` tags in a user turn. The history is rendered so through
the model's own chat template, whatever it knows of tools. An answer's calls are read in that
format and in the two other families' own: Llama 3.1's bare JSON object (`{"name",
"parameters"}`) and Mistral's `[TOOL_CALLS]` list, where a model writes those.

`tool_choice` "required" or a named function constrains the answer to calls (the grammar of
`call_grammar`: each call's arguments match its function's `parameters` schema), so they
always parse; "auto" lets the model choose and reads what it wrote; "none" leaves the tools
out of the prompt.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from service.api.openai.errors import invalid
from service.api.structured import closed
from service.engine.params import StructuredOutput

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_MISTRAL_CALLS = "[TOOL_CALLS]"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# The JSON inside a call is written as response_format's is (service/engine/grammar_specs.py's
# JSON_OPTIONS, which a test holds this to): compact, with Python's separators, so a model
# cannot spend its tokens on newlines and runs of spaces.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class FunctionDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; None: no arguments
    strict: bool | None = None


class ToolDef(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: str
    function: FunctionDef


class FunctionCall(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(msgspec.Struct, kw_only=True):
    function: FunctionCall
    id: str | None = None
    type: str = "function"


Mode = Literal["none", "auto", "required", "named"]


@dataclass(slots=True, frozen=True)
class Tools:
    """The request's tools and how the answer may use them."""

    functions: tuple[FunctionDef, ...]
    mode: Mode
    named: str | None = None  # the one function a named tool_choice asks for
    parallel: bool = True

    @property
    def active(self) -> bool:
        """The prompt names the tools and the answer is read for calls."""
        return bool(self.functions) and self.mode != "none"

    @property
    def constrained(self) -> bool:
        return self.active and self.mode in ("required", "named")


def tools_of(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> Tools:
    """The request's fields as `Tools`; an OpenAIError naming the field that is wrong."""
    functions = []
    for i, raw in enumerate(tools or []):
        try:
            tool = msgspec.convert(raw, ToolDef)
        except msgspec.ValidationError as exc:
            raise invalid(f"tools[{i}]: {exc}", f"tools[{i}]") from None
        if tool.type != "function":
            raise invalid(f"tools[{i}].type must be 'function'", f"tools[{i}].type")
        if not _NAME.match(tool.function.name):
            raise invalid(
                f"tools[{i}].function.name must be 1 to 64 letters, digits, _ . -",
                f"tools[{i}].function.name",
            )
        functions.append(tool.function)
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise invalid("tools: each function needs a name of its own", "tools")
    mode, named = _choice(tool_choice, names)
    return Tools(tuple(functions), mode, named, parallel is not False)


def _choice(tool_choice: Any, names: list[str]) -> tuple[Mode, str | None]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not names:
            raise invalid(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise invalid(
                f"tool_choice names {name!r}, which is not among the tools", "tool_choice"
            )
        return "named", name
    raise invalid(
        "tool_choice is 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
        "tool_choice",
    )


def system_text(tools: Tools) -> str:
    """What the system message gains: the signatures and the call format (NOTE (format))."""
    signatures = "\n".join(
        json.dumps({"type": "function", "function": _signature(f)}, ensure_ascii=False)
        for f in tools.functions
    )
    how = "call exactly one function" if not tools.parallel else "call one or more functions"
    return (
        "# Tools\n\nYou may call functions to help with the user's request. The functions "
        f"are described inside <tools></tools> tags:\n<tools>\n{signatures}\n</tools>\n\n"
        f"To {how}, write each call as a JSON object with the function's name and its "
        "arguments inside <tool_call></tool_call> tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>\n'
        "A function's result comes back inside <tool_response></tool_response> tags."
    )


def _signature(function: FunctionDef) -> dict[str, Any]:
    out: dict[str, Any] = {"name": function.name}
    if function.description:
        out["description"] = function.description
    out["parameters"] = function.parameters or {"type": "object", "properties": {}}
    return out


def call_text(call: ToolCall) -> str:
    """An assistant's call in the history, as the model is asked to write one."""
    try:
        arguments = json.loads(call.function.arguments or "{}")
    except ValueError:
        arguments = call.function.arguments  # as the client sent it
    body = json.dumps({"name": call.function.name, "arguments": arguments}, ensure_ascii=False)
    return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}"


def response_text(content: str) -> str:
    """A tool message's content, as the model reads a function's result."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_grammar(tools: Tools) -> StructuredOutput:
    """The answer as calls only (tool_choice "required" or named): one call, or several with
    parallel_tool_calls, each `{"name", "arguments"}` with the arguments its function's
    parameters accept, as compact as response_format's JSON."""
    chosen = [f for f in tools.functions if tools.named in (None, f.name)]
    repeat = ' ("\\n" call)*' if tools.parallel and tools.named is None else ""
    bodies = " | ".join(f"body{i}" for i in range(len(chosen)))
    lark = (
        f'start: call{repeat}\ncall: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}"\nbody: {bodies}\n'
    ) + "".join(f"body{i}: %json {json.dumps(_call_schema(f))}\n" for i, f in enumerate(chosen))
    return StructuredOutput(kind="grammar", spec=lark)


def parameters_of(function: FunctionDef) -> dict[str, Any]:
    """The JSON Schema of a function's arguments (none given: an empty object)."""
    return function.parameters or {"type": "object", "properties": {}}


def _call_schema(function: FunctionDef) -> dict[str, Any]:
    """One call of `function`. Its parameters' own references (`#/$defs/...`, `#`: how
    pydantic writes a nested model or an enum) are rebased onto where they now stand, under
    the call's `arguments`.

    NOTE: an object of the parameters that does not say `additionalProperties` is closed, as
    vLLM's default backend (xgrammar's strict mode) and OpenAI's strict mode have it: pydantic
    writes no `additionalProperties` (instructor's Mode.TOOLS sends its models so), and an open
    object lets a small model add properties until `max_tokens` cuts the call."""
    arguments = _rebased(closed(parameters_of(function)), "#/properties/arguments")
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        "x-guidance": COMPACT_JSON,
    }


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#...") moved under `base`. (Recursive: a request
    nests no deeper than service/api/nesting.py's bound.)"""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = base + value[1:]
        else:
            out[key] = _rebased(value, base)
    return out


@dataclass(slots=True)
class FoundCalls:
    content: str | None  # the answer's text outside its calls, stripped (None: there is none)
    calls: list[dict[str, Any]]  # OpenAI's tool_calls entries
    outside: str  # that text as written, unstripped


def read_calls(text: str, tools: Tools) -> FoundCalls:
    """The calls an answer holds, in any of the formats of NOTE (format); text that does not
    parse as a call of a known function stays content."""
    names = {f.name for f in tools.functions}
    found: list[tuple[str, Any]] = []
    content = text
    if CALL_OPEN in text:
        rest = []
        last = 0
        for match in _HERMES_CALL.finditer(text):
            call = _call_of(match.group(1), names)
            if call is None:
                continue
            found.append(call)
            rest.append(text[last : match.start()])
            last = match.end()
        tail = text[last:]
        cut = tail.rfind(CALL_OPEN)
        if cut >= 0 and CALL_CLOSE not in tail[cut:]:  # a call cut short (max_tokens)
            tail = tail[:cut]
        rest.append(tail)
        content = "".join(rest)
    elif text.lstrip().startswith(_MISTRAL_CALLS):
        payload = text.lstrip()[len(_MISTRAL_CALLS) :]
        try:
            listed = json.loads(payload)
        except ValueError:
            listed = None
        if isinstance(listed, list):
            calls = [_call_of(json.dumps(item), names) for item in listed]
            if all(calls):
                found = [c for c in calls if c is not None]
                content = ""
    elif text.strip().startswith("{") and (call := _call_of(text.strip(), names)):
        found, content = [call], ""  # Llama 3.1's bare JSON call
    entries = [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        }
        for name, arguments in found
    ]
    if tools.constrained:  # its grammar allows calls only: whatever else is one cut short
        content = ""
    if not entries:
        return FoundCalls(content or None, [], content)
    return FoundCalls(content.strip() or None, entries, content)


def _call_of(text: str, names: set[str]) -> tuple[str, Any] | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments


class CallStream:
    """An answer's text streamed as content until a call starts: text that may be the start of
    `<tool_call>` or `[TOOL_CALLS]` is held back, and an answer that opens with `{` (perhaps
    Llama 3.1's bare call) is held whole; from a call on, everything is kept for `finish`,
    which reads the calls."""

    __slots__ = ("_calling", "_streamed", "_text", "_tools", "called")

    def __init__(self, tools: Tools) -> None:
        self._tools = tools
        self._text = ""
        self._streamed = 0  # characters of _text already streamed as content
        self._calling = tools.constrained  # a constrained answer is calls from its start
        self.called = False  # set by finish: the answer held calls

    def push(self, new: str) -> str:
        """The content now safe to stream."""
        self._text += new
        if not self._calling and self._text.lstrip().startswith("{") and not self._streamed:
            self._calling = True
        if self._calling:
            return ""
        for marker in (CALL_OPEN, _MISTRAL_CALLS):
            at = self._text.find(marker, max(0, self._streamed - len(marker)))
            if at >= 0:
                self._calling = True
                return self._stream_to(at)
        return self._stream_to(len(self._text) - _partial_marker(self._text))

    def _stream_to(self, end: int) -> str:
        out = self._text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """What is left to stream as content, and the calls."""
        streamed = self._text[: self._streamed]
        if not self._calling:
            return self._text[self._streamed :], []
        found = read_calls(self._text, self._tools)  # a call cut short is not in `outside`
        rest = found.outside[len(streamed) :] if found.outside.startswith(streamed) else ""
        if not found.calls:
            return rest, []
        self.called = True
        return ("" if not rest.strip() else rest.rstrip()), found.calls


def _partial_marker(text: str) -> int:
    """How many trailing characters of `text` could begin a call marker."""
    return max(
        (
            size
            for marker in (CALL_OPEN, _MISTRAL_CALLS)
            for size in range(1, min(len(marker) - 1, len(text)) + 1)
            if text.endswith(marker[:size])
        ),
        default=0,
    )
