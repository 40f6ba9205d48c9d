"""`pagechat chat` and `pagechat generate` (service/cli.py) on a tiny model: prompts are built
as the service builds them, every turn's on the previous turns' ids as the model saw them."""

from __future__ import annotations

import builtins
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol.frames import UserParams
from service import cli
from service.engine.engine import LLMEngine
from service.engine.params import SamplingParams
from service.engine.tokenizer import Tokenizer
from service.engine.values import RequestOutput
from service.sessions.prompt import ChatFormat
from tests.tiny_model import gguf_tokenizer, make_tiny_llama


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), seed=0)


class Recorded:
    """Each request's prompt and the tokens it was answered with, read off the real engine."""

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []
        self.answers: list[list[int]] = []
        self.engines: list[LLMEngine] = []


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[Recorded]:
    seen = Recorded()
    add, step = LLMEngine.add_request, LLMEngine.step

    def add_request(
        self: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams | None = None
    ) -> None:
        seen.prompts.append(list(prompt))
        seen.answers.append([])
        seen.engines.append(self)
        add(self, request_id, prompt, params)

    def recording_step(self: LLMEngine) -> list[RequestOutput]:
        outputs = step(self)
        for out in outputs:
            seen.answers[-1].extend(out.new_token_ids)
        return outputs

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    yield seen
    for engine in seen.engines:
        engine.check_balanced()


def typed(monkeypatch: pytest.MonkeyPatch, *lines: str) -> None:
    """What the user types at the prompt, then Ctrl-D."""
    pending = list(lines)

    def read(prompt: str = "") -> str:
        if not pending:
            raise EOFError
        return pending.pop(0)

    monkeypatch.setattr(builtins, "input", read)


ENGINE_ARGS = ("--dtype", "float32", "--device", "cpu", "--max-tokens", "6")


def chat_format() -> tuple[ChatFormat, Tokenizer]:
    tokenizer = gguf_tokenizer()
    return ChatFormat(tokenizer), tokenizer


def test_chat_prompts_extend_the_previous_turns_ids_as_the_model_saw_them(
    model_dir: Path, recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    typed(monkeypatch, "Hi", "And again?", "Third")
    args = ["chat", "--model", str(model_dir), "--system", "Be brief.", *ENGINE_ARGS]
    assert cli.main(args) == 0
    fmt, _ = chat_format()
    first, second, third = recorded.prompts
    assert first == fmt.first_prompt("Be brief.", "Hi")
    answer = recorded.answers[0]
    assert second == first + answer + fmt.close_turn(answer) + fmt.user_turn("And again?")
    answer = recorded.answers[1]
    assert third == second + answer + fmt.close_turn(answer) + fmt.user_turn("Third")


def test_generate_renders_one_turn_with_the_template(
    model_dir: Path, recorded: Recorded, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", "--model", str(model_dir), *ENGINE_ARGS, "Hello?"]) == 0
    fmt, tokenizer = chat_format()
    assert recorded.prompts == [fmt.first_prompt(None, "Hello?")]
    printed = capsys.readouterr().out
    assert printed == tokenizer.decode(recorded.answers[0], True) + "\n"


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_an_unsupported_model_is_refused_in_one_line(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a user brings that pagechat cannot serve: one line naming it, exit status 2, no
    traceback (serve refuses before any server starts)."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]}'
    )
    argv = [command, "--model", str(tmp_path)] + (["hi"] if command == "generate" else [])
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"pagechat {command}: unsupported model_type 'gpt_neox'")
    assert "qwen2" in err and "docs/models.md" in err


def test_a_missing_model_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", "--model", str(tmp_path / "none.gguf"), "hi"]) == 2
    assert capsys.readouterr().err == f"pagechat generate: no GGUF file at {tmp_path}/none.gguf\n"


def test_a_penalty_out_of_range_is_refused_in_one_line_before_loading(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "--repetition-penalty", "3", "--model", "/no/such.gguf", "hi"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == "pagechat generate: repetition_penalty must be in (0, 2] (1 is none)\n"


def test_the_sampling_flags_and_defaults_are_the_terminal_clients(
    model_dir: Path, recorded: Recorded, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Made from a `user` frame's params (protocol/flags.py): no --temperature samples at the
    protocol's 0.7, as the terminal client and a `user` frame without params do."""
    asked: list[SamplingParams] = []
    add = LLMEngine.add_request

    def add_request(
        self: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams | None = None
    ) -> None:
        assert params is not None
        asked.append(params)
        add(self, request_id, prompt, params)

    monkeypatch.setattr(LLMEngine, "add_request", add_request)
    argv = ["generate", "--model", str(model_dir), "--dtype", "float32", "--device", "cpu"]
    assert cli.main([*argv, "--max-tokens", "3", "--stop", "x", "--stop", "y", "Hi"]) == 0
    defaults = UserParams()
    assert (asked[0].temperature, asked[0].top_p) == (defaults.temperature, defaults.top_p)
    assert (asked[0].max_tokens, asked[0].stop) == (3, ("x", "y"))


def test_a_max_tokens_the_context_cannot_hold_is_refused_as_the_server_refuses_it(
    model_dir: Path, recorded: Recorded, capsys: pytest.CaptureFixture[str]
) -> None:
    """NOTE (room) in service/api/sampling.py: refused, never shortened; left out, the
    default is cut to the room the prompt leaves."""
    argv = ["generate", "--model", str(model_dir), "--dtype", "float32", "--device", "cpu"]
    assert cli.main([*argv, "--max-tokens", "100000", "Hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("[not answered: max_tokens is 100000; the context has room for ")
    assert recorded.prompts == []
