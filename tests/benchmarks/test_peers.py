"""Tests for `benchmarks/peers.py`: the prompts, the figures and tables from known streams, the
skip without llama-server, and small runs against real servers: `pagechat serve` on the tiny
model, and (where scripts/build-llama-server.sh has built it) the whole command against
llama-server on the bundled GGUF."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import msgspec
import pytest

from benchmarks.peer_servers import DEFAULT_BINARY, Peak
from benchmarks.peers import (
    LLAMA,
    QUESTIONS,
    Measurement,
    Target,
    chat_messages,
    check_counts,
    main,
    markdown,
    measure,
    model_summary,
    pagechat_label,
    request_body,
    run_rounds,
    summarize,
)
from benchmarks.serve import Server
from benchmarks.sse_client import StreamError, StreamResult
from service.api.openai.chat_request import ChatCompletionRequest
from service.engine.loader import default_model_path
from tests.tiny_model import gguf_tokenizer, make_tiny_llama


def stream(sent: float, first: float, done: float, tokens: int, prompt: int = 100) -> StreamResult:
    usage = {"prompt_tokens": prompt, "completion_tokens": tokens}
    return StreamResult(sent_at=sent, first_content_at=first, done_at=done, usage=usage)


def measurement(server: str, rnd: int, streams: int, tps: float, ttfts: list[float]) -> Measurement:
    return Measurement(server, rnd, streams, 1.0, int(tps), tps, ttfts, [100] * streams, 0.5)


# ---------------------------------------------------------------------- prompts


def test_prompts_are_about_a_hundred_tokens_and_distinct_per_stream_and_round() -> None:
    tokenizer = gguf_tokenizer()
    prompts = [chat_messages(f"r{r}-n32", i) for r in (1, 2) for i in range(32)]
    lengths = [len(tokenizer.apply_chat_template(m)) for m in prompts]
    assert min(lengths) >= 80 and max(lengths) <= 130, lengths
    rendered = [tokenizer.render_chat(m) for m in prompts]
    assert len(set(rendered)) == len(rendered)
    # The tag opens the system message: no two requests share a 16-token KV block.
    ids = [tokenizer.apply_chat_template(m) for m in prompts]
    assert len({tuple(i[:16]) for i in ids}) == len(ids)


def test_every_stream_of_a_run_gets_its_own_question() -> None:
    questions = {chat_messages("t", i)[1]["content"] for i in range(len(QUESTIONS))}
    assert len(questions) == len(QUESTIONS) >= 32


def test_the_request_is_one_pagechat_accepts_field_for_field() -> None:
    body = request_body(chat_messages("t", 0), 128) | {"stream": True}
    # Unknown fields are refused by pagechat (forbid_unknown_fields): decoding proves none is.
    request = msgspec.json.decode(msgspec.json.encode(body), type=ChatCompletionRequest)
    assert request.ignore_eos is True
    assert request.temperature == 0.0
    assert request.max_tokens == 128
    assert request.stream_options is not None and request.stream_options.include_usage


def test_pagechat_configurations_are_labelled_by_their_options() -> None:
    assert pagechat_label("") == "pagechat"
    assert pagechat_label("--weights int4") == "pagechat --weights int4"


# ---------------------------------------------------------------------- figures


def test_tokens_per_second_are_all_streams_tokens_over_the_batchs_wall_time() -> None:
    results = [stream(10.0, 10.5, 14.0, 128), stream(10.1, 11.0, 12.0, 128)]
    m = measure("s", 1, results, loadavg=1.5)
    assert m.wall_s == pytest.approx(4.0)
    assert m.completion_tokens == 256
    assert m.tokens_per_s == pytest.approx(64.0)
    assert m.ttfts_s == pytest.approx([0.5, 0.9])
    assert m.loadavg_1m == 1.5


def test_an_answer_of_another_length_fails_the_run() -> None:
    check_counts("s", [stream(0, 1, 2, 128)], 128)
    with pytest.raises(StreamError, match=r"\[128, 127\]"):
        check_counts("s", [stream(0, 1, 2, 128), stream(0, 1, 2, 127)], 128)


def test_summaries_pool_the_rounds_and_divide_by_llama_servers_figures() -> None:
    ms = [
        measurement("pagechat", 1, 2, 100.0, [0.1, 0.3]),
        measurement(LLAMA, 1, 2, 50.0, [0.4, 0.6]),
        measurement(LLAMA, 2, 2, 70.0, [0.8, 1.0]),
        measurement("pagechat", 2, 2, 140.0, [0.2, 0.4]),
        measurement("pagechat", 1, 1, 30.0, [0.05]),
        measurement(LLAMA, 1, 1, 60.0, [0.1]),
    ]
    by = {(s.streams, s.server): s for s in summarize(ms)}
    pc = by[(2, "pagechat")]
    assert pc.tokens_per_s_rounds == [100.0, 140.0]
    assert pc.tokens_per_s == pytest.approx(120.0)
    assert pc.ttft_p50_s == pytest.approx(0.25)  # median of 0.1, 0.2, 0.3, 0.4
    assert pc.ttft_mean_s == pytest.approx(0.25)
    assert pc.loadavg_mean == pytest.approx(0.5)
    assert pc.tokens_per_s_ratio == pytest.approx(120.0 / 60.0)
    assert pc.ttft_p50_ratio == pytest.approx(0.25 / 0.7)
    assert by[(2, LLAMA)].tokens_per_s_ratio == pytest.approx(1.0)
    assert by[(1, "pagechat")].tokens_per_s_ratio == pytest.approx(0.5)
    assert [s.streams for s in summarize(ms)] == [1, 1, 2, 2]


def test_without_llama_server_there_is_no_ratio() -> None:
    (s,) = summarize([measurement("pagechat", 1, 4, 10.0, [1.0])])
    assert s.tokens_per_s_ratio is None and s.ttft_p50_ratio is None


def test_the_tables_put_each_concurrency_and_each_servers_memory_side_by_side() -> None:
    ms = [measurement("pagechat", 1, 8, 182.0, [0.5]), measurement(LLAMA, 1, 8, 186.0, [1.0])]
    peaks = {"pagechat": Peak(2100.0, 2300.0, 12.0, {"redis-server"}), LLAMA: Peak(1100.0)}
    table = markdown(summarize(ms), peaks)
    assert "8 concurrent streams:" in table
    assert "| pagechat | 182.0 | 182.0 | 0.500 s | 0.500 s | 100 | 0.5 | 0.98x | 0.50x |" in table
    assert (
        "| llama-server | 186.0 | 186.0 | 1.000 s | 1.000 s | 100 | 0.5 | 1.00x | 1.00x |" in table
    )
    assert "| pagechat | 2100 MB | 2300 MB | 12 MB (redis-server) |" in table
    assert "| llama-server | 1100 MB | 0 MB | none |" in table
    named = markdown(summarize(ms), peaks, "m.gguf, 98 MB, 0.13B parameters, Q4_1: Q4_1 x210")
    assert "8 concurrent streams (m.gguf, 98 MB, 0.13B parameters, Q4_1: Q4_1 x210):" in named


def test_the_model_is_named_with_its_size_parameters_and_quant() -> None:
    summary = model_summary(default_model_path())
    assert summary.startswith("SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB, 0.13B parameters, Q4_1:")
    assert "Q4_1 x210" in summary and "Q8_0 x1" in summary


def test_without_a_llama_server_binary_it_says_so_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "peers.json"
    assert main(["--llama-server", str(tmp_path / "missing"), "--json", str(out)]) == 0
    assert "SKIPPED: no llama-server at" in capsys.readouterr().err
    assert not out.exists()


# ---------------------------------------------------------------------- real servers


@pytest.mark.server
def test_the_client_half_against_a_real_pagechat_server(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    args = ["--data-dir", str(tmp_path / "data"), "--model", str(model), "--dtype", "float32"]
    server = Server(tmp_path / "server.log", args)
    try:
        host, port = server.http.removeprefix("http://").split(":")
        target = Target("pagechat", host, int(port))
        ms = asyncio.run(run_rounds([target], [1, 3], 1, 5, lambda line: None))
    finally:
        assert server.stop() == 0
    assert [(m.streams, m.round) for m in ms] == [(1, 1), (3, 1)]
    for m in ms:
        assert m.completion_tokens == 5 * m.streams  # ignore_eos: the random model's eos too
        assert m.tokens_per_s > 0 and all(t > 0 for t in m.ttfts_s)
        assert min(m.prompt_tokens) >= 80


@pytest.mark.real_model
@pytest.mark.server
def test_the_whole_command_against_llama_server_on_the_bundled_model(tmp_path: Path) -> None:
    if not DEFAULT_BINARY.is_file() or shutil.which(str(DEFAULT_BINARY)) is None:
        pytest.skip(f"llama-server is not built ({DEFAULT_BINARY}): make llama-server")
    out = tmp_path / "peers.json"
    argv = ["--streams", "1", "2", "--rounds", "2", "--max-tokens", "6", "--slots", "2"]
    assert main([*argv, "--json", str(out), "--markdown", str(tmp_path / "peers.md")]) == 0
    record = json.loads(out.read_text())
    servers = [(m["server"], m["round"], m["streams"]) for m in record["measurements"]]
    # Round 1 in the given order, round 2 reversed: pagechat first, then llama-server first.
    assert servers == [
        ("pagechat", 1, 1),
        (LLAMA, 1, 1),
        ("pagechat", 1, 2),
        (LLAMA, 1, 2),
        (LLAMA, 2, 1),
        ("pagechat", 2, 1),
        (LLAMA, 2, 2),
        ("pagechat", 2, 2),
    ]
    for m in record["measurements"]:
        assert m["completion_tokens"] == 6 * m["streams"]  # both honour ignore_eos
    prompts = {m["server"]: m["prompt_tokens"] for m in record["measurements"]}
    assert abs(prompts["pagechat"][0] - prompts[LLAMA][0]) <= 2  # the same chat template
    ratios = [s["tokens_per_s_ratio"] for s in record["summaries"] if s["server"] == "pagechat"]
    assert len(ratios) == 2 and all(r > 0 for r in ratios)
    rss = record["peak_rss_mb"]
    assert rss["pagechat"]["rss_mb"] > 100 and rss[LLAMA]["rss_mb"] > 50
    for peak in rss.values():  # the kernel's peak is at least any sample of it
        assert peak["hwm_mb"] >= peak["rss_mb"] - 1
    assert rss["pagechat"]["children"] == ["redis-server"]
    # each table names the model (the bundled GGUF: its size and quant)
    assert (
        "1 concurrent stream (SmolLM2-135M-Instruct.Q4_1.gguf, "
        in (tmp_path / "peers.md").read_text()
    )
