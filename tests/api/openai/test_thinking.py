"""A thinking model served: a random-weight Qwen3 (transformers) whose vocabulary holds
`<think>` and `</think>` and whose template, as Qwen3's, writes an empty thinking block into
the prompt with `chat_template_kwargs: {"enable_thinking": false}`. Its answers' thinking comes
apart as `reasoning_content`, whole and streamed.

Its weights are edited so that greedy decoding writes one answer: with the layers' output
projections zeroed each position's hidden state is its own token's embedding (normed), and the
LM head's rows make each token of THOUGHT the next one's only likely successor."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Tokenizer

from tests.api.server import ServerProcess, running_server
from tests.tiny_model import gguf_tokenizer, make_tiny_family

pytestmark = [pytest.mark.server, pytest.mark.timeout(300), pytest.mark.usefixtures("balanced")]

# Qwen3's template, as far as thinking goes: ChatML turns; with enable_thinking false, an empty
# block after the assistant's turn opens, so that the model answers without thinking.
QWEN3_TEMPLATE = (
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
SHAPE = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
}  # fmt: skip
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


def thinking_qwen3(directory: Path) -> tuple[Path, int, int]:
    """The model directory, and the ids of <think> and </think>."""
    vocab = gguf_tokenizer().vocab_size
    make_tiny_family(directory, "qwen3", SHAPE | {"vocab_size": vocab + 2})
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t in ("<think>", "</think>")])  # fmt: skip
    tokenizer.save(str(directory / "tokenizer.json"))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) | {"chat_template": QWEN3_TEMPLATE}
    config_path.write_text(json.dumps(config))
    opened, closed = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    assert (opened, closed) == (vocab, vocab + 1)
    encode = gguf_tokenizer().encode
    # After the generation prompt's last token ("\n"): <think> sun </think> light <eos>.
    chain = [encode("\n")[0], opened, encode("sun")[0], closed, encode("light")[0],
             gguf_tokenizer().eos_token_ids[0]]  # fmt: skip
    _answer_by_chain(directory, chain)
    return directory, opened, closed


def _answer_by_chain(directory: Path, chain: list[int]) -> None:
    path = directory / "model.safetensors"
    weights = load_file(path)
    for name, tensor in weights.items():
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            tensor.zero_()  # the residual stream stays the token's embedding
    embed, norm = weights["model.embed_tokens.weight"], weights["model.norm.weight"]
    head = weights["lm_head.weight"]
    head.mul_(0.01)
    for token, successor in itertools.pairwise(chain):
        x = embed[token].float()
        hidden = x * torch.rsqrt(x.pow(2).mean() + 1e-5) * norm.float()
        head[successor] = (10 * hidden / hidden.norm()).to(head.dtype)
    save_file(weights, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, int]:
    return thinking_qwen3(tmp_path_factory.mktemp("qwen3") / "model")


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, model: tuple[Path, int, int]
) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("thinking"),
        *("--model", str(model[0]), "--dtype", "float32", "--max-model-len", "512"),
    ) as server:
        yield server


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.http + path, json=body, timeout=60)


def test_enable_thinking_false_writes_an_empty_block_and_the_answer_is_content(
    server: ServerProcess, model: tuple[Path, int, int]
) -> None:
    _, opened, closed = model
    off = {"enable_thinking": False}
    plain = post(server, "/tokenize", {"messages": ASK}).json()["tokens"]
    without = post(server, "/tokenize", {"messages": ASK, "chat_template_kwargs": off})
    tokens = without.json()["tokens"]
    assert opened not in plain and closed not in plain
    assert tokens[: len(plain)] == plain and {opened, closed} <= set(tokens[len(plain) :])
    answer = post(server, "/v1/chat/completions", {
        "messages": ASK, "chat_template_kwargs": off, "temperature": 0, "max_tokens": 8,
        "logit_bias": {str(opened): -100, str(closed): -100},
    }).json()  # fmt: skip
    message = answer["choices"][0]["message"]
    assert "reasoning_content" not in message and "<think>" not in message["content"]
    assert answer["usage"]["prompt_tokens"] == len(tokens)


def test_thinking_comes_apart_from_the_content_whole_and_streamed(
    server: ServerProcess,
) -> None:
    body = {"messages": ASK, "temperature": 0, "max_tokens": 40}
    whole = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]
    assert (whole["reasoning_content"], whole["content"]) == ("sun", "light"), whole
    reasoning, content, order = "", "", []
    with httpx.stream(
        "POST", server.http + "/v1/chat/completions", json=body | {"stream": True}, timeout=60
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("reasoning_content"):
                reasoning += delta["reasoning_content"]
                order.append("reasoning")
            if delta.get("content"):
                content += delta["content"]
                order.append("content")
    assert (reasoning.strip(), content) == (whole["reasoning_content"], whole["content"])
    assert order == sorted(order, key=["reasoning", "content"].index)  # thinking first


def test_the_servers_own_template_variables_cannot_be_set(server: ServerProcess) -> None:
    response = post(server, "/v1/chat/completions", {
        "messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False},
    })  # fmt: skip
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template_kwargs"


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(server: ServerProcess) -> None:
    with openai.OpenAI(base_url=server.http + "/v1", api_key="none", max_retries=0) as client:
        model = client.models.list().data[0].id
        whole = client.responses.create(model=model, input=ASK[0]["content"], temperature=0)
        with client.responses.stream(model=model, input=ASK[0]["content"], temperature=0) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
    for response in (whole, streamed):
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and reasoning.content is not None
        assert [part.text for part in reasoning.content] == ["sun"]
        assert message.type == "message" and response.output_text == "light"
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
