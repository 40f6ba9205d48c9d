"""Tests for `benchmarks/perplexity.py`: the windows score every token once, the windowed fp32
figure equals a direct computation through another attention path, and a short slice of the
text on the bundled model gives sane numbers for every format."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks.llama_perplexity import chunks_of
from benchmarks.perplexity import (
    TEXT,
    Window,
    evaluate,
    load_format,
    main,
    text_tokens,
    window_logits,
    windows,
)
from kernels.cpu import dispatch
from service.engine.loader import load_model
from tests.tiny_model import (
    ContiguousAttention,
    PagedAttention,
    make_tiny_family,
    make_tiny_llama,
)

# The text as shipped (benchmarks/data/README.md): figures are comparable only over the same one.
TEXT_SHA256 = "1c7f5bf63287214b28fd34b09f5b081de76910fbc73784f2689087f91cefa389"


@pytest.mark.parametrize(("n", "window", "stride"), [(10, 4, 2), (11, 4, 3), (9, 4, 1), (5, 8, 4)])
def test_every_token_but_the_first_is_scored_exactly_once(n: int, window: int, stride: int) -> None:
    spans = windows(n, window, stride)
    scored = [t for w in spans for t in range(w.score_from, w.end)]
    assert scored == list(range(1, n))
    for w in spans:
        assert w.end - w.start <= window
        assert w.start < w.score_from <= w.end
    for w in spans[1:]:  # later windows give every scored token the overlap as context
        assert w.score_from - w.start >= window - stride


def test_a_window_as_long_as_the_text_is_one_window() -> None:
    assert windows(6, 6, 3) == [Window(0, 6, 1)]


@pytest.mark.parametrize(("window", "stride"), [(1, 1), (4, 0), (4, 4), (4, 5)])
def test_impossible_windows_are_refused(window: int, stride: int) -> None:
    with pytest.raises(ValueError):
        windows(10, window, stride)


def test_the_shipped_text_is_the_one_documented() -> None:
    assert hashlib.sha256(TEXT.read_bytes()).hexdigest() == TEXT_SHA256
    readme = (TEXT.parent / "README.md").read_text()
    assert TEXT.name in readme and "public domain" in readme.lower()


def direct_perplexity(model_dir: Path, ids: torch.Tensor) -> float:
    """The definition, another way: the model fed in two pieces through a growing contiguous
    cache (as an engine prefills, then continues), every token but the first scored."""
    loaded = load_format(str(model_dir), "fp32", 1, "auto", None)
    model = loaded.model
    attention = ContiguousAttention(model.args.num_layers)
    half = ids.shape[0] // 2
    with torch.inference_mode():
        first = model(ids[:half], torch.arange(half), attention)
        second = model(ids[half:], torch.arange(half, ids.shape[0]), attention)
        logits = model.compute_logits(torch.cat([first, second]))
    return math.exp(float(F.cross_entropy(logits[:-1].double(), ids[1:])))


def test_windowed_fp32_perplexity_equals_the_direct_computation(tmp_path: Path) -> None:
    model_dir = make_tiny_llama(tmp_path / "tiny")
    fp32 = load_format(str(model_dir), "fp32", 64, "auto", None)
    ids = text_tokens(fp32, TEXT, 60)
    (result,) = evaluate({"fp32": fp32}, ids, window=64, stride=32)
    assert result.tokens == 59
    assert result.perplexity == pytest.approx(direct_perplexity(model_dir, ids), rel=1e-5)
    # With a shorter window the later tokens lose context, so the figure moves (but stays sane).
    (windowed,) = evaluate({"fp32": fp32}, ids, window=16, stride=8)
    assert windowed.tokens == 59
    assert windowed.perplexity != pytest.approx(result.perplexity, rel=1e-6)


def test_the_logits_of_a_window_are_the_models_own(tmp_path: Path) -> None:
    loaded = load_format(str(make_tiny_llama(tmp_path / "tiny")), "fp32", 64, "auto", None)
    ids = text_tokens(loaded, TEXT, 12)
    logits = window_logits(loaded, ids)
    assert logits.shape == (12, loaded.args.vocab_size) and logits.dtype == torch.float32
    # Causal: the first 6 rows do not depend on the tokens after them.
    assert torch.allclose(window_logits(loaded, ids[:6]), logits[:6], atol=1e-5)


def test_a_sliding_window_model_scores_through_its_windows(tmp_path: Path) -> None:
    """Each layer's window as the engine applies it: the window's logits are those of the
    paged cache's attention (tests/tiny_model.PagedAttention) over the same tokens."""
    shape = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=5,
    )  # fmt: skip
    directory = make_tiny_family(tmp_path / "m", "mistral", shape)
    loaded = load_model(directory, torch.float32, torch.device("cpu"))
    ids = text_tokens(loaded, TEXT, 24)
    model = loaded.model
    with torch.inference_mode():
        paged = model.compute_logits(model(ids, torch.arange(24), PagedAttention(loaded.args)))
    assert torch.allclose(window_logits(loaded, ids), paged, atol=1e-4)


def test_llama_perplexitys_chunks_start_with_bos_and_drop_the_tail() -> None:
    ids = list(range(10, 33))  # 23 tokens
    assert chunks_of(ids, 8, 1, None) == [[1, *range(11, 18)], [1, *range(19, 26)]]
    assert chunks_of(ids, 8, None, 1) == [list(range(10, 18))]


@pytest.mark.real_model
def test_a_short_slice_on_the_bundled_model_gives_sane_figures_per_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Three overlapping windows (the first scoring all but its first token, the later ones
    only what lies past the previous window's end) over the text's first 48 tokens: every
    format in every window, each format's figures against the same bounds."""
    out = tmp_path / "perplexity.json"
    argv = ["--max-tokens", "48", "--window", "24", "--stride", "12", "--json", str(out)]
    formats = ["stored", "bf16", "fp32", "q8_0", "stored-dense"]
    assert main([*argv, "--weights", *formats, "--cpu-isa", "generic", "auto"]) == 0
    record = json.loads(out.read_text())
    assert record["tokens"] == 48 and record["text_sha256"] == TEXT_SHA256
    assert len(windows(48, record["window"], record["stride"])) == 3
    results = {r["weights"]: r for r in record["results"]}
    assert list(results) == [  # the reference first; each packed format on each version
        "fp32", "stored generic", "stored auto", "bf16", "q8_0 fp32", "q8_0 generic",
        "q8_0 auto", "stored-dense generic", "stored-dense auto",
    ]  # fmt: skip
    fp32 = results["fp32"]
    assert fp32["vs_reference"] == 0.0 and fp32["max_rel_logit_dev"] == 0.0
    assert fp32["top1_agreement"] == 1.0
    for r in results.values():
        assert r["tokens"] == 47
        # An English text under a 135M chat model: far better than chance over ~49k tokens.
        assert 2.0 < r["perplexity"] < 200.0
        assert abs(r["vs_reference"]) < 0.1  # every format is that model, rounded
        if r["weights"].split()[-1] in dispatch.names() or r["weights"].endswith(" auto"):
            assert abs(r["vs_own_fp32"]) < 1e-4  # what the kernels add to their weights: ~0
        assert 0.0 <= r["max_rel_logit_dev"] < 0.2
        assert r["top1_agreement"] > 0.8
    # The file's own blocks in fp32: the reference's values, in another order of additions.
    for name in ("stored generic", "stored auto", "stored-dense auto"):
        assert abs(results[name]["vs_reference"]) < 1e-5
        assert results[name]["max_rel_logit_dev"] < 1e-4
    assert results["stored generic"]["description"].startswith("Q4_1 blocks")
    assert results["q8_0 auto"]["description"].startswith("Q8_0 blocks")
    output = capsys.readouterr().out
    assert "| q8_0 generic |" in output and "worst" in output and "met" in output
    assert results["q8_0 generic"]["own_fp32"] == "q8_0 fp32"
