"""Random JSON Schemas of the kinds apps send, and a valid instance of each.

Nested objects with required and optional properties, arrays with item bounds, enums, string
patterns and formats, numbers with ranges, `anyOf`, `const`, nullable fields (`type` lists) and
`$defs` references. Used by the grammar benchmark (`benchmarks/grammar_backends.py`,
`benchmarks/structured_throughput.py`) and by the structured-output tests, which decode every
schema at temperature 1.0 and validate what comes out.

The schemas are closed as OpenAI's strict mode requires (`additionalProperties: false`),
strings carry a `maxLength` or a pattern, and fractional numbers a `multipleOf`: an open object
(any further property), a free string or an unbounded fraction is content without an end, and
a small model at temperature 1.0 may write it until `max_tokens` cuts the JSON short.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from typing import Any

Schema = dict[str, Any]

_WORDS = ["alpha", "beta", "gamma", "delta", "north", "south", "red", "green", "blue", "small"]
_NAMES = [
    "name",
    "id",
    "title",
    "city",
    "count",
    "score",
    "tags",
    "items",
    "owner",
    "kind",
    "email",
    "price",
    "active",
    "notes",
    "level",
    "color",
    "size",
    "when",
    "code",
    "rank",
]
_PATTERNS: list[tuple[str, Callable[[random.Random], str]]] = [
    (r"^[A-Z]{3}-[0-9]{2,4}$", lambda r: _rand(r, string.ascii_uppercase, 3) + "-" + _rand(r, string.digits, r.randint(2, 4))),  # noqa: E501
    (r"^[a-z]{1,12}(_[a-z]{1,12})?$", lambda r: _rand(r, string.ascii_lowercase, r.randint(1, 6))),
    (r"^#[0-9a-f]{6}$", lambda r: "#" + _rand(r, "0123456789abcdef", 6)),
    (r"^\d{4}-\d{2}-\d{2}$", lambda r: f"{r.randint(1990, 2030)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"),  # noqa: E501
]  # fmt: skip


def _rand(rng: random.Random, alphabet: str, n: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(n))


def random_schema(rng: random.Random, depth: int = 0) -> Schema:
    """An object schema (the top level of every structured-output request) of up to three
    levels."""
    names = rng.sample(_NAMES, rng.randint(1, 5 if depth == 0 else 3))
    properties = {name: value_schema(rng, depth + 1) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    schema: Schema = {"type": "object", "properties": properties}
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema


def value_schema(rng: random.Random, depth: int) -> Schema:
    kinds = ["string", "integer", "number", "boolean", "enum", "pattern", "null-or", "const"]
    if depth < 3:
        kinds += ["object", "array", "anyOf"]
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 24)}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 1000)}
    if kind == "number":
        top = rng.choice([1, 100, 1e6])
        return {"type": "number", "minimum": 0, "maximum": top, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(_WORDS, rng.randint(1, 4))}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(_PATTERNS)[0]}
    if kind == "null-or":  # pydantic's Optional as a type list; bounded as the rest
        base: Schema = rng.choice([
            {"type": "string", "maxLength": 12},
            {"type": "integer", "minimum": 0, "maximum": 9999},
            {"type": "boolean"},
        ])  # fmt: skip
        return {**base, "type": [base["type"], "null"]}
    if kind == "const":
        return {"const": rng.choice(_WORDS)}
    if kind == "object":
        return random_schema(rng, depth)
    if kind == "array":
        low = rng.randint(0, 2)
        return {
            "type": "array",
            "items": value_schema(rng, depth + 1),
            "minItems": low,
            "maxItems": low + rng.randint(0, 3),
        }
    return {"anyOf": [value_schema(rng, depth + 1) for _ in range(rng.randint(2, 3))]}


def random_instance(schema: Schema, rng: random.Random) -> Any:
    """A value `schema` accepts (for the schemas `random_schema` makes)."""
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(schema["enum"])
    if "anyOf" in schema:
        return random_instance(rng.choice(schema["anyOf"]), rng)
    kind = schema["type"]
    if isinstance(kind, list):
        kind = rng.choice(kind)
    if kind == "object":
        keep = set(schema.get("required", []))
        return {
            name: random_instance(sub, rng)
            for name, sub in schema["properties"].items()
            if name in keep or rng.random() < 0.5
        }
    if kind == "array":
        count = rng.randint(schema["minItems"], schema["maxItems"])
        return [random_instance(schema["items"], rng) for _ in range(count)]
    if kind == "string":
        if "pattern" in schema:
            return dict(_PATTERNS)[schema["pattern"]](rng)
        return _rand(rng, string.ascii_letters + " ", rng.randint(0, min(schema["maxLength"], 12)))
    if kind == "integer":
        return rng.randint(schema["minimum"], schema["maximum"])
    if kind == "number":
        # x, x.25 or x.75: llguidance writes (and reads) a multiple of 0.25 with no fraction
        # or with two decimals (2.50, never 2.5), so an instance is written so too.
        whole = rng.randint(0, int(schema["maximum"]) - 1)
        return rng.choice([whole, whole + 0.25, whole + 0.75])
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    raise ValueError(f"no instance for {schema}")


def schemas(count: int, seed: int = 0) -> list[Schema]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]
