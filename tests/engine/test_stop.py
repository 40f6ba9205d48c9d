"""StopChecker (service/engine/stop.py) on the default model's tokenizer: text that may be the
start of a stop string is held back until it is known not to be, so a client never sees any
part of one; stop tokens end the answer without text of their own."""

from __future__ import annotations

from service.engine.params import SamplingParams
from service.engine.stop import StopChecker
from service.engine.values import FinishReason
from tests.tiny_model import gguf_tokenizer


def feed(checker: StopChecker, token_ids: list[int]) -> tuple[list[str], FinishReason | None]:
    """Push tokens until one stops the answer: the text released after each, and why."""
    pieces = []
    for n, token in enumerate(token_ids, start=1):
        text, reason = checker.push(token, n)
        pieces.append(text)
        if reason is not None:
            return pieces, reason
    return pieces, None


def test_text_that_could_start_a_stop_string_is_held_back_until_it_cannot() -> None:
    tok = gguf_tokenizer()
    checker = StopChecker(tok, SamplingParams(stop=("END.",), max_tokens=100))
    ids = tok.encode("one two EN three")
    pieces, reason = feed(checker, ids)
    assert reason is None
    released = "".join(pieces)
    # The last three characters could still begin "END.": nothing of them is out yet.
    assert released == "one two EN three"[:-3]
    for i in range(1, len(pieces) + 1):  # at no point did a prefix of "END." show
        assert not "".join(pieces[:i]).endswith(("E", "EN", "END"))
    assert checker.flush() == "ree"


def test_a_stop_string_across_tokens_ends_the_answer_and_is_never_shown() -> None:
    tok = gguf_tokenizer()
    checker = StopChecker(tok, SamplingParams(stop=("END.",), max_tokens=100))
    ids = tok.encode("Paris is big. END. More text")
    pieces, reason = feed(checker, ids)
    assert reason is FinishReason.STOP
    assert "".join(pieces) == "Paris is big. "
    assert checker.text == "Paris is big. "
    assert len(pieces) < len(ids)  # it stopped at the stop string, not at the end


def test_a_stop_token_ends_the_answer_with_the_held_text_and_none_of_its_own() -> None:
    tok = gguf_tokenizer()
    eos = tok.eos_token_ids[0]
    checker = StopChecker(tok, SamplingParams(stop=("zzz",), max_tokens=100))
    pieces, reason = feed(checker, [*tok.encode("Hello there"), eos])
    assert reason is FinishReason.STOP
    assert "".join(pieces) == "Hello there"  # the held "re" came out with the stop
    assert pieces[-1].endswith("re")


def test_ignore_eos_lets_the_answer_run_on_to_max_tokens() -> None:
    tok = gguf_tokenizer()
    eos = tok.eos_token_ids[0]
    ids = [*tok.encode("Hi"), eos, *tok.encode(" again")]
    checker = StopChecker(tok, SamplingParams(ignore_eos=True, max_tokens=len(ids)))
    pieces, reason = feed(checker, ids)
    assert reason is FinishReason.LENGTH and len(pieces) == len(ids)
    assert "".join(pieces) == "Hi again"  # the eos token renders as nothing


def test_stop_token_ids_stop_as_eos_does() -> None:
    tok = gguf_tokenizer()
    (stop_id,) = tok.encode("!")
    checker = StopChecker(tok, SamplingParams(stop_token_ids=(stop_id,), max_tokens=100))
    pieces, reason = feed(checker, tok.encode("Wow! Great"))
    assert reason is FinishReason.STOP and "".join(pieces) == "Wow"
