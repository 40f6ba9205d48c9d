"""A thinking model's answer split into reasoning and content (service/api/openai/reasoning.py),
whole and streamed piece by piece: the same split however the text is cut."""

from __future__ import annotations

import pytest

from service.api.openai.reasoning import ReasoningStream, split

CASES = [
    # (answer, the prompt opened the block, reasoning, content)
    ("<think>\nweigh it\n</think>\n\nParis.", False, "weigh it", "Paris."),
    ("Paris.", False, None, "Paris."),
    ("weigh it</think>Paris.", True, "weigh it", "Paris."),
    ("<think>still thinking", False, "still thinking", ""),
    ("a < b, so <think> is text here", False, None, "a < b, so <think> is text here"),
    ("", False, None, ""),
]


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
def test_a_whole_answer_splits_at_its_thinking_block(
    text: str, opened: bool, reasoning: str | None, content: str
) -> None:
    got = split(text, opened)
    assert (got.reasoning, got.content) == (reasoning, content)


@pytest.mark.parametrize(("text", "opened", "reasoning", "content"), CASES)
@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_a_streamed_answer_splits_the_same_cut_anywhere(
    text: str, opened: bool, reasoning: str | None, content: str, size: int
) -> None:
    stream = ReasoningStream(opened)
    streamed_reasoning = streamed_content = ""
    for start in range(0, len(text), size):
        r, c = stream.push(text[start : start + size])
        streamed_reasoning, streamed_content = streamed_reasoning + r, streamed_content + c
    r, c = stream.finish()
    streamed_reasoning, streamed_content = streamed_reasoning + r, streamed_content + c
    assert streamed_reasoning.strip() == (reasoning or "")
    assert streamed_content == content


def test_a_marker_cut_across_pieces_is_held_until_it_is_known() -> None:
    stream = ReasoningStream(opened=False)
    assert stream.push("<th") == ("", "")
    assert stream.push("ink>why") == ("why", "")
    assert stream.push("</thi") == ("", "")
    assert stream.push("nk>so") == ("", "so")
