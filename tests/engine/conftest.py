"""Engine fixtures: a tiny random Llama saved as a Hugging Face directory, and engines whose
KV pools are checked for leaks after every test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from service.engine.config import EngineConfig
from service.engine.engine import LLMEngine
from service.engine.loader import LoadedModel, load_model
from tests.tiny_model import make_tiny_llama

EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir: Path) -> LoadedModel:
    return load_model(tiny_model_dir, dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture
def make_engine(tiny_model: LoadedModel) -> Iterator[EngineFactory]:
    """Build engines on the tiny model (or `loaded=`, the same model elsewhere); after the
    test, each must hold no request and no block."""
    engines: list[LLMEngine] = []

    def factory(loaded: LoadedModel = tiny_model, **overrides: Any) -> LLMEngine:
        settings: dict[str, Any] = {
            "dtype": "float32",
            # fp32 K/V, so that engine results compare exactly with fp32 references; the
            # default 16-bit CPU cache has tests of its own (test_native_decode, test_config).
            "kv_cache_dtype": "float32",
            "device": "cpu",
            "num_device_blocks": 256,
            "num_cpu_blocks": 64,
            "max_model_len": 512,
            "max_num_batched_tokens": 128,
        }
        settings.update(overrides)
        engine = LLMEngine(EngineConfig(**settings), loaded=loaded)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        assert not engine.has_unfinished_requests(), "a test left requests running"
        engine.check_balanced()
        engine.close()
