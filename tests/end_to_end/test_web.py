"""The browser pages and the page-map endpoint, against a real `pagechat serve`.

/v1/kv is read while an answer streams and after it; the chat page (/) and the KV view (/kv)
are driven by a real headless Chromium (Playwright with Debian's chromium), talking to the
same server over a real WebSocket.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from clients.chat_client import ChatClient
from protocol.frames import Delta
from service.api.observability.kv_view import session_tag
from tests.api.server import (
    REDIS_URL,
    REPO,
    ServerProcess,
    delete_prefix,
    running_server,
    start_server,
    unique_prefix,
    wait_balanced,
)
from tests.tiny_model import make_tiny_llama

pytestmark = [
    pytest.mark.server,
    pytest.mark.real_model,
    pytest.mark.timeout(300),
    pytest.mark.usefixtures("balanced"),
]

DEVICE_BLOCKS, CPU_BLOCKS = 64, 32
API_KEY = "page-key-0123456789abcdef"
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
    failed: list[str]  # responses of 400 and over, as "STATUS URL"


OpenPage = Callable[..., Awaitable[Page]]
PHONE = {"width": 390, "height": 844}


@pytest.fixture
async def open_page(server: ServerProcess) -> AsyncIterator[OpenPage]:
    """Open a server path in headless Chromium (a fresh profile each time: a first visit),
    collecting the page's JavaScript errors and failed responses."""
    if CHROMIUM is None:
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        # --no-sandbox: CI and this machine run as root, where Chromium's sandbox refuses.
        browser = await pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])

        async def open_(
            path: str,
            viewport: dict[str, int] | None = None,
            base: str = server.http,
            color_scheme: str = "light",
            route_chat: Callable[[Any], Any] | None = None,
        ) -> Page:
            context = await browser.new_context(
                viewport=viewport or {"width": 1280, "height": 800}, color_scheme=color_scheme
            )
            page = Page(await context.new_page(), [], [])
            page.page.on("pageerror", lambda exc: page.errors.append(str(exc)))
            page.page.on(
                "response",
                lambda r: page.failed.append(f"{r.status} {r.url}") if r.status >= 400 else None,
            )
            if route_chat is not None:  # sees the page's /v1/chat frames on their way
                await page.page.route_web_socket(re.compile(r"/v1/chat"), route_chat)
            await page.page.goto(base + path)
            return page

        try:
            yield open_
        finally:
            await browser.close()


async def new_chat(open_page: OpenPage, system: str = "", **kwargs: Any) -> Page:
    """The chat page on a first visit, with the optional system prompt set for its first chat."""
    opened = await open_page("/", **kwargs)
    if system:
        await opened.page.click("#settings summary")
        await opened.page.fill("#system", system)
    return opened


async def ask(page: Any, text: str, answers: int = 1) -> str:
    """Send a message from the input box; the usage line of its answer (the `answers`-th)."""
    await page.fill("#input", text)
    await page.keyboard.press("Enter")
    usage = page.locator(".usage").nth(answers - 1)
    await usage.wait_for(timeout=120_000)
    await page.wait_for_selector("#input:not([disabled])")
    text_: str = await usage.inner_text()
    return text_


async def test_first_visit_answers_the_first_typed_question(open_page: OpenPage) -> None:
    opened = await open_page("/")
    page = opened.page
    # The message box has the focus and works at once: no system prompt to fill in first.
    assert await page.evaluate("document.activeElement.id") == "input"
    assert await page.get_attribute("#settings", "open") is None  # the setting is collapsed
    await page.keyboard.type("What is the capital of France?")
    await page.keyboard.press("Enter")
    usage = await page.wait_for_selector(".usage", timeout=120_000)
    assert "cached" in await usage.inner_text()
    assert await page.locator(".msg").all_inner_texts() == [
        "What is the capital of France?",
        await page.inner_text(".msg.assistant"),
    ]
    assert (await page.inner_text(".msg.assistant")).strip()
    assert await page.evaluate("localStorage.getItem('pagechat.session')")
    assert await page.evaluate("document.activeElement.id") == "input"  # ready for the next
    assert opened.errors == [] and opened.failed == []


async def test_chat_page_streams_an_answer_and_a_reload_resumes_it_with_its_usage_lines(
    open_page: OpenPage,
) -> None:
    opened = await new_chat(open_page, "You are a helpful assistant. Answer briefly.")
    page = opened.page
    first_usage = await ask(page, "What is the capital of France?")
    assert "cached" in first_usage
    answer = await page.inner_text(".msg.assistant")
    assert answer.strip()  # sampled at the server's default temperature: any text will do
    assert await page.locator(".msg.assistant.streaming").count() == 0
    assert "Answer briefly." in await page.inner_text(".system-note")
    stored = await page.evaluate("localStorage.getItem('pagechat.session')")
    session = json.loads(stored)
    tag = session_tag(session["session_id"])
    assert tag in await page.inner_text("#meta")

    await page.reload()
    await page.wait_for_function("document.querySelector('#meta').textContent.includes('resumed')")
    messages = await page.locator(".msg").all_inner_texts()
    assert messages == ["What is the capital of France?", answer]
    # The server's resume gives messages, not usage: the page kept the line for each turn.
    assert await page.locator(".usage").all_inner_texts() == [first_usage]
    assert await page.evaluate("document.activeElement.id") == "input"
    second_usage = await ask(page, "And of Germany?", answers=2)
    # The first turn's conversation came back from the prefix cache, not recomputed.
    cached = int(second_usage.split(": ")[1].split(" cached")[0])
    assert cached > 0
    await page.reload()
    await page.wait_for_function("document.querySelectorAll('.usage').length == 2")
    assert await page.locator(".usage").all_inner_texts() == [first_usage, second_usage]

    # New chat forgets the session and its usage lines; the next message opens a new one.
    await page.click("#new-chat")
    assert await page.locator(".msg, .usage").count() == 0
    assert await page.evaluate("Object.keys(localStorage).filter(k => k.includes('usage'))") == []
    await ask(page, "Hello!")
    assert json.loads(await page.evaluate("localStorage.getItem('pagechat.session')")) != session
    assert opened.errors == [] and opened.failed == []


async def test_phone_viewport_fits_without_horizontal_overflow(open_page: OpenPage) -> None:
    opened = await new_chat(open_page, viewport=PHONE)
    page = opened.page
    await ask(page, "Say hi to " + "Supercalifragilistic" * 8)  # an unbreakable word
    await page.wait_for_function("document.querySelector('#meta').textContent.includes('session')")
    overflow = "document.documentElement.scrollWidth <= window.innerWidth"
    assert await page.evaluate(overflow)
    for control in ("#new-chat", "#kv-link", "#send"):
        box = await page.locator(control).bounding_box()
        assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
    await page.click("#settings summary")  # the open setting fits too
    assert await page.evaluate(overflow)
    kv = (await open_page("/kv", viewport=PHONE)).page
    await kv.wait_for_selector("body[data-ready='1']")
    assert await kv.evaluate(overflow)
    assert opened.errors == []


def protocol_error_codes() -> list[str]:
    """The error codes of docs/protocol.md's table of errors."""
    text = (REPO / "docs" / "protocol.md").read_text()
    table = text[text.index("| code | when | fatal |") :].split("\n\n")[0]
    return re.findall(r"^\| `([a-z_]+)` \|", table, flags=re.MULTILINE)


async def test_every_error_code_reads_as_a_sentence_for_people(open_page: OpenPage) -> None:
    codes = protocol_error_codes()
    assert len(codes) >= 18 and "context_length" in codes and "shutting_down" in codes
    page = (await open_page("/")).page
    for code in codes:
        frame = {"code": code, "message": "raw server detail", "fatal": False, "retry_after_s": 2.5}
        text: str = await page.evaluate("(frame) => explain(frame)", frame)
        assert text[0].isupper() and text.endswith("."), (code, text)
        assert code not in text and "raw server detail" not in text, (code, text)
        assert text != await page.evaluate("(f) => explain(f)", {"code": "no_such_code"}), code
    assert "3 seconds" in await page.evaluate(
        "(f) => explain(f)", {"code": "too_many_attempts", "retry_after_s": 2.5}
    )


async def test_favicon_is_served_and_no_request_fails(
    server: ServerProcess, open_page: OpenPage
) -> None:
    status, body = server.get("/favicon.ico")
    assert status == 200 and body.startswith(b"<svg")
    for path in ("/", "/kv"):
        opened = await open_page(path)
        loaded = await opened.page.evaluate(
            """() => new Promise((resolve) => {
                 const icon = new Image();
                 icon.onload = () => resolve(icon.naturalWidth > 0);
                 icon.onerror = () => resolve(false);
                 icon.src = document.querySelector("link[rel=icon]").href;
               })"""
        )
        assert loaded
        await opened.page.wait_for_load_state("networkidle")
        assert opened.failed == [], opened.failed


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with API keys, on a tiny model (any answer will do)."""
    directory = tmp_path_factory.mktemp("keyed")
    keys = directory / "keys.txt"
    keys.write_text(f"{API_KEY} tenant-a\n")
    tiny = make_tiny_llama(directory / "model")
    with running_server(
        directory, "--model", str(tiny), "--dtype", "float32", "--api-keys-file", str(keys)
    ) as server:
        yield server


async def test_with_api_keys_the_page_takes_its_key_from_the_address_once(
    keyed_server: ServerProcess, open_page: OpenPage
) -> None:
    # Without a key the first message is not sent, and the page says how to give one.
    refused = (await open_page("/", base=keyed_server.http)).page
    await refused.fill("#input", "Hello?")
    await refused.keyboard.press("Enter")
    await refused.wait_for_selector(".msg.user.refused")
    assert "/?key=" in await refused.inner_text("#status")
    assert await refused.input_value("#input") == "Hello?"

    opened = await open_page(f"/?key={API_KEY}", base=keyed_server.http)
    page = opened.page
    assert page.url == keyed_server.http + "/"  # the key is out of the address bar
    await ask(page, "Hello?")
    await page.reload()  # the kept key resumes the session
    await page.wait_for_function("document.querySelector('#meta').textContent.includes('resumed')")
    assert await page.locator(".usage").count() == 1
    assert opened.errors == [] and opened.failed == []


async def test_links_lead_from_the_chat_to_the_kv_view_and_back(open_page: OpenPage) -> None:
    opened = await open_page("/")
    page = opened.page
    await page.click("#kv-link")
    await page.wait_for_selector("body[data-ready='1']")
    assert page.url.endswith("/kv")
    await page.click("#chat-link")
    await page.wait_for_selector("#composer")
    assert page.url.endswith("/") and await page.title() == "pagechat"
    assert opened.errors == [] and opened.failed == []


async def test_a_message_over_the_context_is_marked_not_sent_and_the_chat_goes_on(
    open_page: OpenPage,
) -> None:
    opened = await new_chat(open_page)
    page = opened.page
    too_long = "word " * 700  # ~700 tokens: over this server's 512-token context
    await page.fill("#input", too_long)
    await page.keyboard.press("Enter")
    refused = await page.wait_for_selector(".msg.user.refused", timeout=60_000)
    assert "context" in (await refused.get_attribute("title") or "")
    assert "New chat" in await page.inner_text("#status")  # for people: no raw code
    assert "context_length" not in await page.inner_text("#status")
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
    open_page: OpenPage,
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
    open_page: OpenPage,
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
    server: ServerProcess, open_page: OpenPage
) -> None:
    opened = await open_page("/kv")
    page = opened.page
    async with await ChatClient.connect(server.ws) as chat:
        session = await chat.open()
        await chat.send_user("Tell me about the sea.", max_tokens=96, ignore_eos=True)
        assert isinstance(await chat.receive(), Delta)
        # The view polls twice a second: its first snapshot may predate the admission
        # (status "waiting"), so wait for the one that shows the answer running.
        row = page.locator("#sequences tr", has_text=f"{session_tag(session.session_id)}/0")
        await row.filter(has_text="running").wait_for(timeout=10_000)
        cells = await row.locator("td").all_inner_texts()
        assert cells[1] == "running"
        assert await row.locator(".strip i").count() >= int(cells[2]) // 16
        await chat.cancel()
        await chat.collect()
    assert opened.errors == []


# ---------------------------------------------------------------------- markdown, themes

ANSWER_MD = """Here is the function:

```python
def reverse(s: str) -> str:
    return s[::-1]
```

- it takes a **string**
- it returns it `reversed`
- see [the docs](https://docs.python.org/3/)

| input | output |
|---|---|
| abc | cba |
"""
XSS = (
    '<img src=x onerror="window.__xss = 1"> <script>window.__xss = 2</script> '
    '[click](javascript:window.__xss=3) <a href="javascript:window.__xss=4">a</a> '
    '<svg onload="window.__xss = 5"></svg>'
)


async def stream_answer(page: Any, text: str, pieces: int = 7) -> None:
    """The frames of a streamed answer, fed to the page's own frame handler in `pieces`
    deltas (as the server's WebSocket would), then its `done`."""
    step = -(-len(text) // pieces)
    for i in range(0, len(text), step):
        await page.evaluate("(t) => onFrame({type: 'delta', text: t})", text[i : i + step])
        await page.wait_for_timeout(20)  # a frame or two: the renders while it streams
    done = {
        "type": "done", "turn": 1, "finish_reason": "stop",
        "usage": {"completion_tokens": 9, "prompt_tokens": 9, "cached_tokens": 0,
                  "swapped_in_tokens": 0, "recomputed_tokens": 9},
        "timing": {"ttft_s": 0.1},
    }  # fmt: skip
    await page.evaluate("(f) => onFrame(f)", done)


async def test_a_thinking_models_thinking_is_folded_above_its_answer(
    open_page: OpenPage,
) -> None:
    # As a thinking model (Qwen3) streams it: the block first, then the answer.
    opened = await open_page("/")
    page = opened.page
    await page.evaluate("(t) => onFrame({type: 'delta', text: t})", "<think>\nI weigh <b>it")
    answer = page.locator(".msg.assistant").last
    thinking = answer.locator("details.thinking")
    await thinking.wait_for()
    assert await thinking.locator("summary").inner_text() == "Thinking…"
    await thinking.locator("summary").click()  # opened while it streams: stays open
    await stream_answer(page, "</think>\n\nThe answer is **42**.")
    assert await thinking.evaluate("(el) => el.open")
    assert await thinking.locator("summary").inner_text() == "Thought"
    assert await thinking.locator(".thought").inner_text() == "I weigh <b>it"  # text, not markup
    assert await answer.locator("strong").inner_text() == "42"
    assert "weigh" not in await answer.locator("p").inner_text()
    await stream_answer(page, "<think>short</think>Plain.")  # a new answer: folded
    last = page.locator(".msg.assistant").last
    assert not await last.locator("details.thinking").evaluate("(el) => el.open")
    assert await last.locator("p").inner_text() == "Plain."


async def test_a_markdown_answer_renders_code_lists_tables_and_safe_links(
    open_page: OpenPage, tmp_path: Any
) -> None:
    opened = await open_page("/")
    page = opened.page
    await stream_answer(page, ANSWER_MD)
    answer = page.locator(".msg.assistant").last
    assert await answer.locator(".code-head .lang").inner_text() == "python"
    code = answer.locator("pre code")
    assert await code.inner_text() == "def reverse(s: str) -> str:\n    return s[::-1]\n"
    font = await code.evaluate("(el) => getComputedStyle(el).fontFamily")
    assert "monospace" in font
    assert await answer.locator("li").count() == 3
    assert await answer.locator("strong").inner_text() == "string"
    assert await answer.locator("li code").inner_text() == "reversed"
    assert await answer.locator("th").all_inner_texts() == ["input", "output"]
    assert await answer.locator("td").all_inner_texts() == ["abc", "cba"]
    link = answer.locator("a")
    assert await link.get_attribute("href") == "https://docs.python.org/3/"
    assert await link.get_attribute("target") == "_blank"
    assert "noopener" in (await link.get_attribute("rel") or "")
    assert "```" not in await answer.inner_text() and "**" not in await answer.inner_text()
    # The button says "Copied" for 1.5 s: every text it shows is recorded, so that a slow
    # machine reading it after it turned back still sees that it said so.
    copy = answer.locator("button.copy")
    await copy.evaluate(
        """(button) => {
            window.copyTexts = [];
            new MutationObserver(() => window.copyTexts.push(button.textContent))
                .observe(button, {childList: true, characterData: true, subtree: true});
        }"""
    )
    await copy.click()
    await page.wait_for_function("window.copyTexts.includes('Copied')")
    await page.screenshot(path=str(tmp_path / "markdown-answer.png"))
    assert not opened.errors, opened.errors


async def test_html_in_an_answer_or_a_message_is_shown_as_text_never_run(
    open_page: OpenPage, tmp_path: Any
) -> None:
    opened = await open_page("/")
    page = opened.page
    await stream_answer(page, XSS, pieces=5)
    answer = page.locator(".msg.assistant").last
    assert await answer.locator("img, script, svg, iframe").count() == 0
    assert await answer.locator("a").count() == 0  # no javascript: link survives
    assert "<img src=x onerror=" in await answer.inner_text()  # shown, as typed
    # The same payload typed by the person, answered by the real model.
    await ask(page, XSS)
    mine = page.locator(".msg.user").last
    assert await mine.inner_text() == XSS
    assert await page.locator(".msg img, .msg script, .msg svg").count() == 0
    assert await page.evaluate("window.__xss") is None
    await page.screenshot(path=str(tmp_path / "xss-inert.png"))
    assert not opened.errors, opened.errors


async def test_a_real_answer_is_rendered_as_markdown_when_it_ends(open_page: OpenPage) -> None:
    opened = await open_page("/")
    await ask(opened.page, "Write a Python function that reverses a string.")
    answer = opened.page.locator(".msg.assistant").last
    assert await answer.evaluate("(el) => el.classList.contains('md')")
    # Rendered from what streamed: the text shown is the answer's, markup aside.
    raw = await answer.evaluate("(el) => el.raw")
    assert raw and await answer.evaluate("(el) => el.querySelector('p, pre, ul, ol') !== null")


def _background(page: Any) -> Any:
    return page.evaluate("getComputedStyle(document.body).backgroundColor")


async def test_dark_mode_follows_the_system_and_a_toggle_is_remembered_on_both_pages(
    open_page: OpenPage, tmp_path: Any
) -> None:
    dark, light = "rgb(15, 17, 21)", "rgb(248, 250, 252)"
    opened = await open_page("/", color_scheme="dark")
    page = opened.page
    assert await page.evaluate("document.documentElement.dataset.theme") == "dark"
    assert await _background(page) == dark
    await stream_answer(page, ANSWER_MD)
    await page.screenshot(path=str(tmp_path / "chat-dark.png"))
    await page.click("#theme")  # the person prefers light here, whatever the system says
    assert await _background(page) == light
    await page.reload()
    assert await _background(page) == light
    await page.goto(page.url.rstrip("/") + "/kv")
    assert await _background(page) == light  # one choice for the browser, every page
    await page.click("#theme")
    assert await _background(page) == dark
    await page.screenshot(path=str(tmp_path / "kv-dark.png"))
    system = await open_page("/kv", color_scheme="dark")  # a fresh browser profile
    assert await _background(system.page) == dark
    assert not opened.errors and not system.errors, (opened.errors, system.errors)


# Each text on the chat page: its colour and the background under it (every ancestor's
# background composited, from the page down), as the browser computed them. Controls that are
# disabled are left out: WCAG 1.4.3 asks no contrast of an inactive control. Faded text would
# need its opacity folded in, so none is allowed.
TEXT_COLOURS_JS = """() => {
  const rgba = (s) => {
    const v = s.match(/[\\d.]+/g).map(Number);
    return [v[0], v[1], v[2], v.length > 3 ? v[3] : 1];
  };
  const over = (top, under) => [0, 1, 2].map((i) => top[i] * top[3] + under[i] * (1 - top[3]));
  const pairs = [];
  for (const el of document.querySelectorAll("body *")) {
    if (!el.getClientRects().length || el.closest(":disabled")) continue;
    const style = getComputedStyle(el);
    if (style.visibility !== "visible") continue;
    const chain = [];
    for (let n = el; n; n = n.parentElement) chain.unshift(n);
    let background = [255, 255, 255];
    for (const n of chain) background = over(rgba(getComputedStyle(n).backgroundColor), background);
    const faded = chain.some((n) => getComputedStyle(n).opacity !== "1");
    const label = (n) => n.tagName.toLowerCase() + (n.id ? "#" + n.id : "") +
      [...n.classList].map((c) => "." + c).join("");
    const name = chain.slice(-3).map(label).join(" > ");
    const add = (what, colour) => pairs.push({
      what: name + what, text: over(rgba(colour), background), background, faded,
    });
    const field = el.tagName === "TEXTAREA";
    if ([...el.childNodes].some((n) => n.nodeType === 3 && n.textContent.trim()) || field) {
      add("", style.color);
    }
    if (field && el.placeholder) add("::placeholder", getComputedStyle(el, "::placeholder").color);
    const after = getComputedStyle(el, "::after");
    if (!["none", "normal"].includes(after.content)) add("::after", after.color);
  }
  return pairs;
}"""


SHOWN = (
    *("h1", "span#meta.meta", "a#kv-link", "button#theme", "summary", "textarea#system"),
    *("textarea#input::placeholder", "div.msg.user", "div.msg.user.folded", "button.unfold"),
    *("div.msg.user.refused", "div.msg.user.refused::after", "div.msg.user.lost"),
    *("div.lost-note", "div.system-note", "div.usage", "span.lang", "button.copy", "pre > code"),
    *("li > code", "li > a", "th", "td", "blockquote > p", "div#status", "div#status.error"),
    *("div.msg.assistant.md.lost > p", "div.msg.assistant.md.streaming::after"),
    *("button#send.primary", "textarea#input"),
)


def _contrast(a: list[float], b: list[float]) -> float:
    """WCAG 2's contrast ratio of two sRGB colours (0..255 channels)."""

    def luminance(rgb: list[float]) -> float:
        linear = [c / 255 / 12.92 if c <= 10.31475 else ((c / 255 + 0.055) / 1.055) ** 2.4
                  for c in rgb]  # fmt: skip
        return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]

    light, dark = sorted([luminance(a), luminance(b)], reverse=True)
    return (light + 0.05) / (dark + 0.05)


@pytest.mark.parametrize("scheme", ["light", "dark"])
async def test_every_text_on_the_chat_page_meets_wcag_aa_contrast(
    open_page: OpenPage, scheme: str
) -> None:
    """4.5:1 at least, measured on the colours the browser computed for every text shown:
    the header, the setting, a person's message, a markdown answer (code, links, a table, a
    quote) and its usage line, a refused message, a lost question and answer with their note,
    a folded message, the status line, the placeholders; and the KV view's."""
    opened = await open_page("/", color_scheme=scheme)
    page = opened.page
    assert await page.evaluate("document.documentElement.dataset.theme") == scheme
    await page.click("#settings summary")
    await page.fill("#system", "Be brief.")
    await page.evaluate("addMessage('user', 'What is a palindrome?')")
    await stream_answer(page, ANSWER_MD + "\n> a quote, and *emphasis*\n")
    await page.evaluate("addMessage('user', 'Refused').classList.add('refused')")
    await page.evaluate("fold(addMessage('user', 'Long ' + 'x'.repeat(400)), 405)")
    await page.evaluate(
        "state.lost = {question: 'Lost question', answer: 'Lost answer'}; showLost([])"
    )
    await page.evaluate(
        "const note = document.createElement('div'); note.className = 'system-note';"
        "note.textContent = 'System prompt: Be brief.'; append(note)"
    )
    await page.evaluate("addMessage('assistant', 'Streaming').classList.add('streaming')")
    await page.evaluate("status('A status line', false)")
    measured = await _contrasts(page)
    await page.evaluate("status('An error', true)")
    measured |= {k: v for k, v in (await _contrasts(page)).items() if "status" in k}
    for shown in SHOWN:  # each kind of text was there to be measured
        assert any(k == shown or k.endswith(f" > {shown}") for k in measured), (shown, measured)
    # The KV view's texts too (its legend, counters and table, as this idle server has them).
    kv = await open_page("/kv", color_scheme=scheme)
    await kv.page.wait_for_function("document.getElementById('device-total').textContent")
    measured |= {f"/kv {k}": v for k, v in (await _contrasts(kv.page)).items()}
    low = {what: round(ratio, 2) for what, ratio in measured.items() if ratio < 4.5}
    assert not low, f"{scheme}: under 4.5:1: {low}"
    assert not opened.errors and not kv.errors, (opened.errors, kv.errors)


async def _contrasts(page: Any) -> dict[str, float]:
    """The lowest contrast of each kind of text on the page (TEXT_COLOURS_JS)."""
    measured: dict[str, float] = {}
    for pair in await page.evaluate(TEXT_COLOURS_JS):
        assert not pair["faded"], pair  # opacity below 1 on text
        ratio = _contrast(pair["text"], pair["background"])
        measured[pair["what"]] = min(ratio, measured.get(pair["what"], ratio))
    return measured


async def test_an_over_long_message_is_folded_kept_in_the_box_and_the_limit_said(
    open_page: OpenPage, tmp_path: Any
) -> None:
    opened = await open_page("/", viewport=PHONE)
    page = opened.page
    text = ("too long " * 1889).strip()  # 17,000 characters; the limit is 16,000
    await page.fill("#input", text)
    await page.keyboard.press("Enter")
    await page.wait_for_selector(".msg.user.refused")
    await page.wait_for_selector("#input:not([disabled])")
    status = await page.locator("#status").inner_text()
    assert "16,000 characters" in status and "17,000" in status
    assert await page.input_value("#input") == text  # nothing typed is lost
    bubble = page.locator(".msg.user.refused")
    assert (await bubble.bounding_box())["height"] < 200  # folded, not a wall of text
    unfold = page.locator("button.unfold")
    assert await unfold.inner_text() == "Show all 17,000 characters"
    await page.screenshot(path=str(tmp_path / "over-long-folded.png"))
    await unfold.click()
    assert (await bubble.bounding_box())["height"] > 1000
    assert not opened.errors, opened.errors


def long_answers(route: Any) -> None:
    """The page's frames to the real server, a `user` frame asking to count asking for a
    400-token answer past the end of turn: sure to be streaming when the server is killed."""
    server = route.connect_to_server()

    def to_server(message: str | bytes) -> None:
        frame = json.loads(message)
        if frame.get("type") == "user" and frame["content"].startswith("Count"):
            frame["params"] = {**frame.get("params", {}), "ignore_eos": True, "max_tokens": 400}
        server.send(json.dumps(frame))

    route.on_message(to_server)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def test_an_answer_lost_to_a_server_crash_is_shown_as_lost_with_the_question_kept(
    open_page: OpenPage, tmp_path: Any
) -> None:
    """The server is killed (SIGKILL) mid-answer and started again on the same port and
    Redis: the page says at once that it is disconnected and puts the question back in the
    box; the next message resumes the session, whose stored turns lack the lost one, so the
    question and its partial answer are shown marked, with a sentence saying why."""
    port, prefix = _free_port(), unique_prefix()
    args = ("--port", str(port), "--redis-url", REDIS_URL, "--redis-prefix", prefix)
    args += ("--dtype", "float32", "--max-model-len", "512")
    first = start_server(tmp_path / "first.log", *args)
    second = None
    try:
        opened = await open_page("/", base=first.http, route_chat=long_answers)
        page = opened.page
        await ask(page, "Say hello.")  # a stored turn before the lost one
        question = "Count from one to two hundred, one number a line."
        await page.fill("#input", question)
        await page.keyboard.press("Enter")
        await page.wait_for_selector(".msg.assistant.streaming")
        first.proc.kill()  # a crash: nothing more is stored
        first.proc.wait(30)
        await page.wait_for_function(
            "document.getElementById('status').textContent.includes('Disconnected')"
        )
        assert await page.input_value("#input") == question
        assert "back in the box" in await page.locator("#status").inner_text()
        second = start_server(tmp_path / "second.log", *args)
        assert second.port == port
        # The killed server's turn lease runs out (10 s at most, docs/protocol.md); until
        # then the session answers `busy`.
        session = json.loads(await page.evaluate("localStorage.getItem('pagechat.session')"))
        lease = f"{prefix}session:{session['session_id']}:lease"
        store = redis.Redis.from_url(REDIS_URL)
        deadline = time.monotonic() + 30
        while store.exists(lease):
            assert time.monotonic() < deadline, "the lease outlived its 10 s"
            await asyncio.sleep(0.2)
        store.close()
        await ask(page, "Are you there?", answers=2)
        assert await page.locator(".msg.user.lost").inner_text() == question
        assert await page.locator(".msg.assistant.lost").count() == 1
        note = await page.locator(".lost-note").inner_text()
        assert "restarted before this answer was stored" in note
        # The resumed conversation: the stored turn, the lost one marked, then the new one.
        users = await page.locator(".msg.user").all_inner_texts()
        assert users == ["Say hello.", question, "Are you there?"]
        await page.screenshot(path=str(tmp_path / "lost-turn.png"))
        assert not opened.errors, opened.errors
        await page.close()
        await wait_balanced(second)
    finally:
        if first.proc.poll() is None:
            first.proc.kill()
        if second is not None:
            assert second.stop() == 0, second.log()
        delete_prefix(prefix)
