"""Structured output in the engine, on the bundled SmolLM2-135M-Instruct: answers match their
JSON Schema, regex, choice or grammar at temperature 1.0, through forks (n > 1), preemption and
the other masks; a grammar that cannot be matched is refused when the request is added."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import pytest

from benchmarks.json_schemas import schemas
from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams, StructuredOutput
from service.engine.values import FinishReason, RequestError
from tests.engine.greedy import Generated, assert_same_greedy, run

pytestmark = pytest.mark.real_model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"enum": ["fr", "en", "de"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(kv_cache_mb=64, swap_space_mb=16, max_model_len=1024))
    yield engine
    assert not engine.has_unfinished_requests()
    engine.check_balanced()
    engine.close()


def ask(engine: LLMEngine, question: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def json_schema(schema: dict[str, object]) -> StructuredOutput:
    return StructuredOutput(kind="json", spec=json.dumps(schema))


def run_all(engine: LLMEngine) -> dict[tuple[str, int], tuple[str, FinishReason | None]]:
    """Every request to its end: (request id, sample) -> (text, finish reason)."""
    texts: dict[tuple[str, int], str] = {}
    reasons: dict[tuple[str, int], FinishReason | None] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            key = (out.request_id, out.index)
            texts[key] = texts.get(key, "") + out.new_text
            if out.finished:
                reasons[key] = out.finish_reason
    return {key: (text, reasons.get(key)) for key, text in texts.items()}


def test_two_hundred_generated_schemas_all_parse_and_validate_at_temperature_one(
    engine: LLMEngine,
) -> None:
    """The must-show: 200 schemas (nested objects, arrays, enums, patterns, anyOf, required
    and optional fields; benchmarks/json_schemas.py), each answered once at temperature 1.0,
    all in one batch stream: every answer parses and validates."""
    generated = schemas(200, seed=2026)
    prompt = ask(engine, "Fill in the JSON object with plausible values.")
    for i, schema in enumerate(generated):
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=400, structured=json_schema(schema)
        )
        engine.add_request(f"s{i}", prompt, params)
    answers = run_all(engine)
    failures = []
    for i, schema in enumerate(generated):
        text, reason = answers[(f"s{i}", 0)]
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append((i, reason, text, str(exc)[:200]))
    assert not failures, failures[:5]


def test_each_fork_follows_the_schema_on_its_own(engine: LLMEngine) -> None:
    """n = 4 samples fork after the prompt with their parent's matcher copied; each goes its
    own way (seeded) and each ends valid."""
    params = SamplingParams(
        temperature=1.0, seed=7, n=4, max_tokens=120, structured=json_schema(PERSON)
    )
    engine.add_request("forks", ask(engine, "Describe a person as JSON."), params)
    answers = run_all(engine)
    texts = [answers[("forks", i)][0] for i in range(4)]
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1, texts


def test_a_json_answer_ends_where_its_object_closes(engine: LLMEngine) -> None:
    """No end-of-turn token is needed: the grammar allows nothing after the closing brace, so
    the answer finishes with `stop` on it (even with ignore_eos)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=200, ignore_eos=True, structured=json_schema(PERSON)
    )
    engine.add_request("closes", ask(engine, "Describe a person as JSON."), params)
    text, reason = run_all(engine)[("closes", 0)]
    assert reason is FinishReason.STOP
    assert text.endswith("}") and json.loads(text)["age"] >= 0


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        (
            StructuredOutput(kind="choice", spec='["Paris", "Lyon", "Marseille"]'),
            lambda t: t in {"Paris", "Lyon", "Marseille"},
        ),
        (
            StructuredOutput(kind="regex", spec=r"[A-Z][a-z]{2,12}, [0-9]{4}"),
            lambda t: re.fullmatch(r"[A-Z][a-z]{2,12}, [0-9]{4}", t),
        ),
        (
            StructuredOutput(kind="grammar", spec='start: "yes" | "no" | "maybe"'),
            lambda t: t in {"yes", "no", "maybe"},
        ),
        (
            StructuredOutput(kind="grammar", spec='root ::= "oui" | "non"'),
            lambda t: t in {"oui", "non"},
        ),
    ],
    ids=["choice", "regex", "lark", "gbnf"],
)
def test_regex_choice_and_grammars_hold_at_temperature_one(
    engine: LLMEngine, structured: StructuredOutput, check: object
) -> None:
    params = SamplingParams(temperature=1.0, seed=3, n=3, max_tokens=200, structured=structured)
    engine.add_request("kinds", ask(engine, "Which city, and when?"), params)
    answers = run_all(engine)
    for i in range(3):
        text, reason = answers[("kinds", i)]
        assert reason is FinishReason.STOP and check(text), text  # type: ignore[operator]


def test_json_object_answers_are_json_objects(engine: LLMEngine) -> None:
    """Any JSON object: greedy, as its strings and properties are unbounded (at temperature
    1.0 a small model may write a key until max_tokens)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=200, structured=StructuredOutput(kind="json_object")
    )
    engine.add_request("object", ask(engine, "Describe Paris as JSON."), params)
    text, reason = run_all(engine)[("object", 0)]
    assert reason is FinishReason.STOP and isinstance(json.loads(text), dict), text


def test_the_grammar_wins_over_min_tokens(engine: LLMEngine) -> None:
    """min_tokens holds the end back, but the grammar allows only the end after "yes": the
    answer ends there rather than with a token the grammar forbids."""
    structured = StructuredOutput(kind="choice", spec='["yes"]')
    params = SamplingParams(temperature=0.0, max_tokens=20, min_tokens=10, structured=structured)
    engine.add_request("wins", ask(engine, "Say yes."), params)
    assert run_all(engine)[("wins", 0)] == ("yes", FinishReason.STOP)


def test_constrained_answers_survive_preemption() -> None:
    """A pool too small for every answer at once preempts some mid-answer (recompute); each
    matcher keeps its place: the greedy answers equal those of a pool that never preempts
    (a near-tie excepted: a recomputed prompt's matmuls round otherwise than the decode
    steps'), and every answer validates."""
    prompts = {f"p{i}": f"Describe person number {i} as JSON." for i in range(6)}

    def answers(num_device_blocks: int) -> tuple[dict[str, Generated], int]:
        # dtype fp32, not auto: the start-up dtype trial picks bf16 activations on some CPUs,
        # whose roundings part a recomputed answer from its decoded one at far wider margins
        config = EngineConfig(
            num_device_blocks=num_device_blocks, num_cpu_blocks=0, max_model_len=512,
            dtype="float32", kv_cache_dtype="float32", weights="fp32",
            max_num_batched_tokens=256,
        )  # fmt: skip
        engine = LLMEngine(config)
        params = SamplingParams(
            temperature=0.0, max_tokens=80, structured=json_schema(PERSON), logprobs=2
        )
        asked = {rid: ask(engine, question) for rid, question in prompts.items()}
        generated = run(engine, asked, params)
        preempted = engine.stats().preemptions_recompute
        engine.check_balanced()
        engine.close()
        return generated, preempted

    roomy, _ = answers(256)
    tight, preempted = answers(14)
    assert preempted > 0
    assert_same_greedy(roomy, tight)
    for answer in tight.values():
        assert answer.finish_reason == "stop", answer.text
        jsonschema.validate(json.loads(answer.text), PERSON)


def test_bad_words_are_never_written(engine: LLMEngine) -> None:
    prompt = ask(engine, "What is the capital of France?")
    free = run_all_one(engine, prompt, SamplingParams(temperature=0.0, max_tokens=30))
    assert "Paris" in free
    words = tuple(
        tuple(engine.tokenizer.encode(w)) for w in ("Paris", " Paris")
    )  # as the API tokenizes "Paris"
    banned = run_all_one(
        engine, prompt, SamplingParams(temperature=0.0, max_tokens=30, bad_words=words)
    )
    assert "Paris" not in banned and banned


def run_all_one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> str:
    engine.add_request("one", prompt, params)
    return run_all(engine)[("one", 0)][0]


@pytest.mark.parametrize(
    ("structured", "says"),
    [
        (
            StructuredOutput(kind="json", spec='{"type": "array", "uniqueItems": true}'),
            "uniqueItems",
        ),
        (StructuredOutput(kind="json", spec="[1, 2]"), "JSON Schema is an object"),
        (StructuredOutput(kind="json", spec="{not json"), "Expecting"),
        (StructuredOutput(kind="regex", spec="[a-"), "regex"),
        (StructuredOutput(kind="grammar", spec="start: nothing_here"), "nothing_here"),
        (StructuredOutput(kind="choice", spec="[]"), "non-empty"),
        (StructuredOutput(kind="regex", spec="[^\\s\\S]"), "no text matches it"),
        (StructuredOutput(kind="regex", spec="ab\\"), "lone backslash"),
        (StructuredOutput(kind="grammar", spec='start: "a" start'), "cannot follow it"),
        (StructuredOutput(kind="grammar", spec="root ::= undefined"), "undefined"),
    ],
    ids=["unimplemented", "not-an-object", "not-json", "regex", "grammar", "choice",
         "matches-nothing", "lone-backslash", "no-end", "gbnf-undefined"],
)  # fmt: skip
def test_what_cannot_be_matched_is_refused_when_added(
    engine: LLMEngine, structured: StructuredOutput, says: str
) -> None:
    with pytest.raises(RequestError, match=re.escape(says)):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured=structured))
    assert not engine.has_unfinished_requests()


def test_an_answer_whose_grammar_breaks_off_ends_with_error_never_stop(engine: LLMEngine) -> None:
    """x{1000000} outgrows llguidance's lexer a few tokens in; the probe follows `a` (the
    smaller id) and passes it, so the answer meets the limit: it ends ERROR, with why."""
    [a] = engine.tokenizer.encode("a")
    regex = StructuredOutput(kind="regex", spec="a|x{1000000}")
    params = SamplingParams(
        temperature=0.0, max_tokens=30, structured=regex, logit_bias=((a, -100.0),)
    )
    engine.add_request("broken", ask(engine, "Write x many times."), params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    last = outputs[-1]
    assert last.finished and last.finish_reason is FinishReason.ERROR, last
    assert last.error and "too many" in last.error
    assert [o.finish_reason for o in outputs[:-1]] == [None] * (len(outputs) - 1)
