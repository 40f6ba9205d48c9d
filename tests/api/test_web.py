"""The browser pages and the page-map endpoint, against a real `pagechat serve`.

/v1/kv is read while an answer streams and after it; the chat page (/) and the KV view (/kv)
are driven by a real headless Chromium (Playwright with Debian's chromium), talking to the
same server over a real WebSocket.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from clients.chat_client import ChatClient
from service.api.frames import Delta
from service.api.pagemap import session_tag
from tests.api.server import ServerProcess, running_server, wait_balanced

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

DEVICE_BLOCKS, CPU_BLOCKS = 64, 32
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("server"),
        *("--dtype", "float32"),
        *("--num-device-blocks", str(DEVICE_BLOCKS), "--num-cpu-blocks", str(CPU_BLOCKS)),
        *("--max-model-len", "512"),
    ) as server:
        yield server


@pytest.fixture(autouse=True)
async def balanced(server: ServerProcess) -> AsyncIterator[None]:
    yield
    await wait_balanced(server)


def page_map(server: ServerProcess, query: str = "") -> dict[str, Any]:
    status, body = server.get("/v1/kv" + query)
    assert status == 200, body
    result: dict[str, Any] = json.loads(body)
    return result


# ---------------------------------------------------------------------- /v1/kv


async def test_page_map_shows_a_streaming_answer_and_then_its_cached_blocks(
    server: ServerProcess,
) -> None:
    async with await ChatClient.connect(server.ws) as chat:
        opened = await chat.open()
        await chat.send_user("Tell me a long story about a river.", max_tokens=48, ignore_eos=True)
        assert isinstance(await chat.receive(), Delta)
        during = page_map(server)
        tag = session_tag(opened.session_id)
        (turn,) = [s for s in during["sequences"] if s["label"] == f"{tag}/0"]
        assert turn["status"] == "running"
        # Between steps the newest sampled token has no K/V, nor a slot, yet.
        assert turn["computed"] == turn["tokens"] - 1
        assert len(turn["blocks"]) == -(-turn["computed"] // during["block_size"])
        for block in turn["blocks"]:
            assert block[0] == "d"  # nothing is swapped here
            assert during["device"][int(block[1:])] in "us"
        assert len(during["device"]) == DEVICE_BLOCKS and len(during["cpu"]) == CPU_BLOCKS
        assert set(during["device"] + during["cpu"]) <= set(".usc")
        assert opened.session_id not in json.dumps(during)  # only the tag is shown
        await chat.collect()
    await wait_balanced(server)
    after = page_map(server)
    assert after["sequences"] == [] and after["num_sequences"] == 0
    assert "c" in after["device"] and not set(after["device"]) & set("us")


async def test_page_map_lists_at_most_max_sequences(server: ServerProcess) -> None:
    async with await ChatClient.connect(server.ws) as chat:
        await chat.open()
        await chat.send_user("Count to twenty.", max_tokens=24, ignore_eos=True)
        assert isinstance(await chat.receive(), Delta)
        capped = page_map(server, "?max_sequences=0")
        assert capped["sequences"] == [] and capped["num_sequences"] >= 1
        await chat.collect()


@pytest.mark.parametrize("value", ["-1", "lots", "10001"])
def test_page_map_rejects_a_bad_max_sequences(server: ServerProcess, value: str) -> None:
    status, body = server.get(f"/v1/kv?max_sequences={value}")
    assert status == 400
    assert b"max_sequences" in body


def test_pages_are_served_as_html(server: ServerProcess) -> None:
    for path, marker in (("/", b"/v1/chat"), ("/kv", b"/v1/kv")):
        status, body = server.get(path)
        assert status == 200
        assert body.startswith(b"<!doctype html>") and marker in body


# ---------------------------------------------------------------------- in a real browser


@dataclass
class Page:
    page: Any  # playwright.async_api.Page
    errors: list[str]  # uncaught JavaScript errors


@pytest.fixture
async def open_page(server: ServerProcess) -> AsyncIterator[Callable[[str], Awaitable[Page]]]:
    """Open a server path in headless Chromium, collecting the page's JavaScript errors."""
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        # --no-sandbox: CI and this machine run as root, where Chromium's sandbox refuses.
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])

        async def open_(path: str) -> Page:
            page = Page(await browser.new_page(), [])
            page.page.on("pageerror", lambda exc: page.errors.append(str(exc)))
            await page.page.goto(server.http + path)
            return page

        try:
            yield open_
        finally:
            await browser.close()


async def new_chat(open_page: Callable[[str], Awaitable[Page]], system: str = "") -> Page:
    """The chat page with a new session open, ready for a message."""
    opened = await open_page("/")
    if system:
        await opened.page.fill("#system", system)
    await opened.page.click("#start")
    await opened.page.wait_for_selector("#input:not([disabled])")
    return opened


async def test_chat_page_streams_an_answer_and_a_reload_resumes_the_conversation(
    open_page: Callable[[str], Awaitable[Page]],
) -> None:
    opened = await new_chat(open_page, "You are a helpful assistant. Answer briefly.")
    page = opened.page
    assert await page.is_hidden("#system-row")  # a session is open: no system prompt to set
    await page.fill("#input", "What is the capital of France?")
    await page.keyboard.press("Enter")
    usage = await page.wait_for_selector(".usage", timeout=120_000)
    assert "cached" in await usage.inner_text()
    answer = await page.inner_text(".msg.assistant")
    assert answer.strip()  # sampled at the server's default temperature: any text will do
    assert await page.locator(".msg.assistant.streaming").count() == 0
    stored = await page.evaluate("localStorage.getItem('pagechat.session')")
    session = json.loads(stored)
    tag = session_tag(session["session_id"])
    assert tag in await page.inner_text("#meta")

    await page.reload()
    await page.wait_for_function("document.querySelector('#meta').textContent.includes('resumed')")
    assert await page.is_hidden("#system-row")
    messages = await page.locator(".msg").all_inner_texts()
    assert messages == ["What is the capital of France?", answer]
    await page.fill("#input", "And of Germany?")
    await page.keyboard.press("Enter")
    await page.wait_for_selector(".usage", timeout=120_000)
    second_usage = await page.inner_text(".usage")
    # The first turn's conversation came back from the prefix cache, not recomputed.
    cached = int(second_usage.split(": ")[1].split(" cached")[0])
    assert cached > 0
    assert opened.errors == []


async def test_a_message_over_the_context_is_marked_not_sent_and_the_chat_goes_on(
    open_page: Callable[[str], Awaitable[Page]],
) -> None:
    opened = await new_chat(open_page)
    page = opened.page
    too_long = "word " * 700  # ~700 tokens: over this server's 512-token context
    await page.fill("#input", too_long)
    await page.keyboard.press("Enter")
    refused = await page.wait_for_selector(".msg.user.refused", timeout=60_000)
    assert "context" in (await refused.get_attribute("title") or "")
    assert "New chat" in await page.inner_text("#status")
    assert await page.input_value("#input") == too_long.strip()  # back to edit
    assert await page.locator(".msg.assistant").count() == 0

    await page.fill("#input", "Say hello.")
    await page.keyboard.press("Enter")
    await page.wait_for_selector(".usage", timeout=120_000)
    assert await page.locator(".msg.user:not(.refused)").all_inner_texts() == ["Say hello."]
    # The refused message was never stored: a resume brings back only the answered turn.
    await page.reload()
    await page.wait_for_function("document.querySelector('#meta').textContent.includes('resumed')")
    messages = await page.locator(".msg").all_inner_texts()
    assert len(messages) == 2 and messages[0] == "Say hello."
    assert opened.errors == []


async def test_kv_view_draws_both_pools_and_counts_every_block(
    open_page: Callable[[str], Awaitable[Page]],
) -> None:
    opened = await open_page("/kv")
    page = opened.page
    await page.wait_for_selector("body[data-ready='1']")
    assert await page.get_attribute("#device", "data-slots") == str(DEVICE_BLOCKS)
    assert await page.get_attribute("#cpu", "data-slots") == str(CPU_BLOCKS)
    counts = [int(await page.inner_text(f"#n-{k}")) for k in ("free", "use", "shared", "cached")]
    assert sum(counts) == DEVICE_BLOCKS + CPU_BLOCKS
    assert await page.inner_text("#block-size") == "16"
    assert opened.errors == []


async def test_stop_ends_an_answer_as_cancelled_and_the_chat_goes_on(
    open_page: Callable[[str], Awaitable[Page]],
) -> None:
    opened = await new_chat(open_page)
    page = opened.page
    await page.fill("#input", "Write a very long story about a lighthouse keeper.")
    await page.keyboard.press("Enter")
    await page.wait_for_selector(".msg.assistant.streaming")  # the first delta has come
    await page.click("#stop")
    usage = await page.wait_for_selector(".usage", timeout=60_000)
    assert "cancelled" in await usage.inner_text()
    await page.wait_for_selector("#input:not([disabled])")  # ready for the next message
    assert await page.is_hidden("#stop")
    assert opened.errors == []


async def test_kv_view_lists_a_streaming_answer_with_its_blocks(
    server: ServerProcess, open_page: Callable[[str], Awaitable[Page]]
) -> None:
    opened = await open_page("/kv")
    page = opened.page
    async with await ChatClient.connect(server.ws) as chat:
        session = await chat.open()
        await chat.send_user("Tell me about the sea.", max_tokens=96, ignore_eos=True)
        assert isinstance(await chat.receive(), Delta)
        row = page.locator("#sequences tr", has_text=f"{session_tag(session.session_id)}/0")
        await row.wait_for(timeout=10_000)
        cells = await row.locator("td").all_inner_texts()
        assert cells[1] == "running"
        assert await row.locator(".strip i").count() >= int(cells[2]) // 16
        await chat.cancel()
        await chat.collect()
    assert opened.errors == []
