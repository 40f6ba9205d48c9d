"""The whole engine on the bundled SmolLM2-135M-Instruct, as `pagechat generate` runs it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def engine() -> Iterator[LLMEngine]:
    engine = LLMEngine(EngineConfig(kv_cache_mb=64, swap_space_mb=16, max_model_len=1024))
    yield engine
    assert not engine.has_unfinished_requests()
    engine.check_balanced()


def answer(engine: LLMEngine, request_id: str, question: str, max_tokens: int = 40) -> str:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
    engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.new_text
    return text


def test_default_model_knows_the_capital_of_france(engine: LLMEngine) -> None:
    assert "Paris" in answer(engine, "france", "What is the capital of France?")


def test_default_model_second_ask_hits_the_prefix_cache(engine: LLMEngine) -> None:
    before = engine.stats().blocks.prefix_hits
    first = answer(engine, "q1", "Name three primary colors.", max_tokens=12)
    second = answer(engine, "q2", "Name three primary colors.", max_tokens=12)
    assert first == second
    assert engine.stats().blocks.prefix_hits > before
