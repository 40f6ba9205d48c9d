"""loadtest/run.py and loadtest/wsclient.py: URLs, percentiles, and no surprise servers."""

from __future__ import annotations

import pytest

from benchmarks.peer_servers import free_port
from loadtest.run import _percentile, http_base, main
from loadtest.wsclient import TurnResult, chat_url


def test_chat_url_adds_the_path_and_the_session_argument() -> None:
    assert chat_url("http://h:1") == "ws://h:1/v1/chat"
    assert chat_url("ws://h:1/v1/chat/") == "ws://h:1/v1/chat"
    assert chat_url("https://h", "ab_C-9") == "wss://h/v1/chat?session=ab_C-9"
    assert http_base("ws://h:1/v1/chat") == "http://h:1"


def test_percentile_reads_locusts_histogram() -> None:
    histogram = {"10": 50, "20": 45, "300": 5}
    assert _percentile(histogram, 0.5) == 10
    assert _percentile(histogram, 0.95) == 20
    assert _percentile(histogram, 0.99) == 300
    assert _percentile({}, 0.5) == 0


def test_tokens_sharing_a_frame_are_spaced_since_the_previous_one() -> None:
    result = TurnResult(sent_at=0.0)
    result.add_tokens(1, 1.0)
    result.add_tokens(2, 2.0)
    assert result.ttft_s == 1.0
    assert result.inter_token_s == [0.5, 0.5]


def test_it_starts_no_server_and_says_so_when_none_answers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--url", f"ws://127.0.0.1:{free_port()}"]) == 2
    assert "no pagechat server answers" in capsys.readouterr().err
