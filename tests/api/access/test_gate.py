"""Who may come in (service/api/access/gate.py, and its HTTP guard, access/guard.py): the keys
file, the gate and the Origin rule as units; then API keys, tenants' separate sessions, the
failed-attempt limiter and the Origin rule against a real `pagechat serve` with a keys file,
over real WebSockets and HTTP (the limiter alone: test_limiter.py).

The server trusts 127.0.0.1 as a proxy, so a test client names its address with
X-Forwarded-For; every test uses addresses of its own, since the limiter outlives tests.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from starlette.datastructures import Headers
from websockets.exceptions import InvalidStatus
from websockets.typing import Origin

from clients.chat_client import ChatClient, ChatServerError
from protocol.frames import Error, SessionOpened
from service.api.access.gate import DEFAULT_TENANT, ApiKeys, Gate, KeysFileError
from service.api.refusal import Refusal, RefusalReason
from service.server.config import ServerConfig
from service.server.options import add_arguments, config_from_args
from tests.api.access.test_limiter import Clock
from tests.api.server import ServerProcess, running_server

ALICE = "alice-key-0123456789"  # tenant-a, admin
BOB = "bob-key-0123456789abc"  # tenant-b
CAROL = "carol-key-0123456789"  # tenant-c, given in the file as its SHA-256
ALLOWED = "http://allowed.example"
KEYS_FILE = f"""\
# pagechat API keys: KEY TENANT [admin]
{ALICE} tenant-a admin

{BOB}   tenant-b
sha256:{hashlib.sha256(CAROL.encode()).hexdigest()} tenant-c
"""


# ---------------------------------------------------------------------- the keys file


def test_a_keys_file_maps_keys_to_tenants_and_admins() -> None:
    keys = ApiKeys.parse(KEYS_FILE, "keys.txt")
    assert len(keys) == 3
    alice, bob, carol = keys.lookup(ALICE), keys.lookup(BOB), keys.lookup(CAROL)
    assert alice is not None and (alice.tenant, alice.admin) == ("tenant-a", True)
    assert bob is not None and (bob.tenant, bob.admin) == ("tenant-b", False)
    assert carol is not None and carol.tenant == "tenant-c"
    assert keys.lookup(ALICE + "x") is None
    assert keys.lookup(f"sha256:{hashlib.sha256(CAROL.encode()).hexdigest()}") is None


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("short-key tenant", "the key has 9 characters; at least 16"),
        (f"{ALICE}", "expected `KEY TENANT [admin]`, got 1 fields"),
        (f"{ALICE} tenant admin extra", "got 4 fields"),
        (f"{ALICE} tenant root", "the third field may only be `admin`"),
        (f"{ALICE} a:b", "tenant 'a:b' is not"),
        ("sha256:abc tenant", "64 hex digits"),
        (f"{BOB} tenant-x", "the same key as line 2"),
    ],
)
def test_a_malformed_keys_file_is_refused_naming_its_line(line: str, problem: str) -> None:
    text = f"# keys\n{BOB} tenant-b\n{line}\n"
    with pytest.raises(KeysFileError, match=r"^keys\.txt:3: ") as caught:
        ApiKeys.parse(text, "keys.txt")
    assert problem in str(caught.value)
    assert ALICE not in str(caught.value)  # a key is a secret: never in a message


def test_a_keys_file_without_keys_is_refused() -> None:
    with pytest.raises(KeysFileError, match="no API keys"):
        ApiKeys.parse("# nothing yet\n\n", "keys.txt")


@pytest.mark.server
def test_serve_refuses_a_malformed_keys_file_at_start_up(tmp_path: Path) -> None:
    path = tmp_path / "keys.txt"
    path.write_text(f"{ALICE} tenant-a\nshort tenant-b\n")
    command = [sys.executable, "-m", "service.cli", "serve", "--port", "0"]
    done = subprocess.run(
        [*command, "--api-keys-file", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert f"{path}:2: the key has 5 characters" in done.stderr


# ---------------------------------------------------------------------- the gate


def test_the_gate_counts_wrong_keys_but_not_missing_ones() -> None:
    gate = Gate(ApiKeys.parse(KEYS_FILE, "keys"), clock=Clock())
    for _ in range(20):
        with pytest.raises(Refusal, match="needs an API key") as caught:
            gate.authenticate(None, "10.0.0.1")
        assert caught.value.reason is RefusalReason.UNAUTHORIZED
    assert gate.authenticate(BOB, "10.0.0.1").tenant == "tenant-b"
    for _ in range(6):
        with pytest.raises(Refusal, match="not valid"):
            gate.authenticate("wrong-key-0123456789", "10.0.0.1")
    with pytest.raises(Refusal, match="too many failed attempts") as caught:
        gate.authenticate(BOB, "10.0.0.1")  # refused unheard, even with a good key
    assert caught.value.reason is RefusalReason.TOO_MANY_ATTEMPTS
    assert caught.value.retry_after_s == 1.0


def test_without_keys_everyone_is_the_default_tenant_with_every_right() -> None:
    principal = Gate(None).authenticate(None, "10.0.0.1")
    assert (principal.tenant, principal.admin) == (DEFAULT_TENANT, True)


# ---------------------------------------------------------------------- origins


@pytest.mark.parametrize(
    ("origin", "host", "allowed"),
    [
        (None, "chat.example", True),  # not a browser
        ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
        ("https://10.1.2.3", "10.1.2.3:443", True),
        ("http://[::1]:8000", "[::1]:8000", True),
        ("http://localhost:8000", "LOCALHOST:8000", True),
        ("http://127.0.0.1:8001", "127.0.0.1:8000", False),
        ("http://evil.example", "127.0.0.1", False),
        ("null", "127.0.0.1", False),  # sandboxed frames, files
        ("http://127.0.0.1", None, False),
        # DNS rebinding: a page whose name now points at this server sends its own name as
        # Host and Origin alike; a name is trusted only in the allow-list
        ("http://evil.example:8000", "evil.example:8000", False),
        ("http://chat.example", "chat.example", False),
    ],
)
def test_the_same_origin_is_allowed_by_default_where_no_dns_names_it(
    origin: str | None, host: str | None, allowed: bool
) -> None:
    headers = {name: value for name, value in (("origin", origin), ("host", host)) if value}
    assert Gate(None).origin_allowed(Headers(headers)) is allowed


def test_allowed_origins_add_to_the_own_one_and_a_star_allows_any() -> None:
    gate = Gate(
        None, allowed_origins=ServerConfig(allowed_origins=(ALLOWED + "/",)).allowed_origins
    )
    own = {"host": "127.0.0.1:8000"}
    assert gate.origin_allowed(Headers({"origin": ALLOWED, **own}))
    assert gate.origin_allowed(Headers({"origin": "http://127.0.0.1:8000", **own}))
    assert not gate.origin_allowed(Headers({"origin": "https://allowed.example", **own}))
    # A server reached by name: its origin listed, whatever Host a proxy passes.
    named = Gate(None, allowed_origins=("https://chat.example",))
    assert named.origin_allowed(Headers({"origin": "https://chat.example", "host": "chat.example"}))
    anyone = Gate(None, allowed_origins=("*",))
    assert anyone.origin_allowed(Headers({"origin": "http://evil.example", **own}))


# ---------------------------------------------------------------------- options


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_access_options_from_the_environment_and_the_command_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PAGECHAT_API_KEYS_FILE", "/etc/pagechat/keys")
    monkeypatch.setenv("PAGECHAT_TRUSTED_PROXIES", "10.0.0.1, 192.168.0.0/16")
    config = config_from_args(parse("--allowed-origins", "https://Chat.example:443,http://b:81"))
    assert config.api_keys_file == Path("/etc/pagechat/keys")
    assert config.trusted_proxies == ("10.0.0.1", "192.168.0.0/16")
    assert config.allowed_origins == ("https://chat.example", "http://b:81")
    monkeypatch.delenv("PAGECHAT_API_KEYS_FILE")
    monkeypatch.delenv("PAGECHAT_TRUSTED_PROXIES")
    plain = config_from_args(parse())
    assert (plain.api_keys_file, plain.allowed_origins, plain.trusted_proxies) == (None, (), ())


def test_malformed_origins_and_proxies_are_refused() -> None:
    with pytest.raises(ValueError, match="not an origin"):
        config_from_args(parse("--allowed-origins", "http://a.example/path"))
    with pytest.raises(ValueError, match="neither an IP address nor a network"):
        config_from_args(parse("--trusted-proxies", "proxy.local"))


# ---------------------------------------------------------------------- a real server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, prefix: str) -> Iterator[ServerProcess]:
    directory = tmp_path_factory.mktemp("server")
    keys = directory / "keys.txt"
    keys.write_text(KEYS_FILE)
    with running_server(
        directory,
        *("--dtype", "float32", "--num-device-blocks", "64", "--num-cpu-blocks", "64"),
        *("--max-model-len", "256", "--max-tokens", "16", "--default-max-tokens", "8"),
        *("--api-keys-file", str(keys), "--allowed-origins", ALLOWED),
        *("--trusted-proxies", "127.0.0.1"),
        prefix=prefix,
    ) as server:
        yield server


def fresh_address() -> str:
    return f"10.{secrets.randbelow(256)}.{secrets.randbelow(256)}.{secrets.randbelow(256)}"


def call(
    server: ServerProcess,
    path: str,
    *,
    key: str | None = None,
    address: str | None = None,
    body: dict[str, Any] | None = None,
) -> tuple[int, dict[str, str], Any]:
    """Status, headers (lower-case names) and the JSON body of one request."""
    headers = {"x-forwarded-for": address or fresh_address()}
    if key is not None:
        headers["authorization"] = f"Bearer {key}"
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request("GET" if body is None else "POST", path, data, headers)
        response = conn.getresponse()
        raw = response.read()
        got = {name.lower(): value for name, value in response.getheaders()}
        return response.status, got, json.loads(raw) if raw.startswith((b"{", b"[")) else raw
    finally:
        conn.close()


async def connect(
    server: ServerProcess, *, key: str | None = None, address: str | None = None, **kwargs: Any
) -> ChatClient:
    headers = {"X-Forwarded-For": address or fresh_address()}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return await ChatClient.connect(server.ws, additional_headers=headers, **kwargs)


async def error(chat: ChatClient, code: str) -> Error:
    frame = await chat.receive()
    assert isinstance(frame, Error), frame
    assert frame.code == code and not frame.fatal, frame
    return frame


@pytest.fixture
async def bobs_session(server: ServerProcess) -> AsyncIterator[SessionOpened]:
    async with await connect(server, key=BOB) as chat:
        yield await chat.open()


# HTTP


@pytest.mark.real_model
@pytest.mark.server
def test_openai_endpoints_need_a_key_in_openais_error_shape(server: ServerProcess) -> None:
    for key in (None, "wrong-key-0123456789"):
        status, headers, body = call(server, "/v1/models", key=key)
        assert status == 401 and headers["www-authenticate"] == "Bearer"
        assert body["error"]["code"] == "invalid_api_key", body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    status, _, body = call(server, "/v1/models", key=BOB)
    assert status == 200 and body["data"], body
    question = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert call(server, "/v1/chat/completions", body=question)[0] == 401
    status, _, body = call(server, "/v1/chat/completions", key=CAROL, body=question)
    assert status == 200 and body["choices"], body


@pytest.mark.real_model
@pytest.mark.server
def test_stats_and_the_page_map_need_an_admin_key(server: ServerProcess) -> None:
    for path in ("/v1/stats", "/v1/kv"):
        assert call(server, path)[0] == 401
        status, _, body = call(server, path, key=BOB)
        assert status == 403 and body["error"]["code"] == "permission_denied", body
        assert call(server, path, key=ALICE)[0] == 200


@pytest.mark.real_model
@pytest.mark.server
def test_health_and_metrics_stay_open(server: ServerProcess) -> None:
    assert call(server, "/health")[0] == 200
    assert call(server, "/metrics")[0] == 200


@pytest.mark.real_model
@pytest.mark.server
def test_wrong_keys_over_http_are_refused_after_the_first_few(server: ServerProcess) -> None:
    address = fresh_address()
    statuses = [
        call(server, "/v1/models", key=f"guess-{i:016d}", address=address)[0] for i in range(10)
    ]
    # 5 free failures, then doubling waits (1 s, 2 s, ...) that the guesses do not sit out.
    assert statuses[:6] == [401] * 6 and statuses[-1] == 429 and 429 in statuses[6:], statuses
    status, headers, body = call(server, "/v1/models", key=BOB, address=address)
    assert status == 429 and int(headers["retry-after"]) >= 1, headers
    assert body["error"]["code"] == "too_many_attempts", body
    assert call(server, "/v1/models", key=BOB)[0] == 200  # from another address: at once


# WebSocket


@pytest.mark.real_model
@pytest.mark.server
async def test_a_socket_without_a_key_gets_unauthorized_and_stays_open(
    server: ServerProcess,
) -> None:
    async with await connect(server) as chat:
        await chat.send_raw(json.dumps({"type": "open"}))
        await error(chat, "unauthorized")
        await chat.send_raw(json.dumps({"type": "resume", "session_id": "x" * 22, "secret": "s"}))
        await error(chat, "unauthorized")
        await chat.send_raw(json.dumps({"type": "open", "api_key": "wrong-key-0123456789"}))
        await error(chat, "unauthorized")
        opened = await chat.open(api_key=BOB)  # the same connection, now with a key
        assert not opened.resumed and opened.secret


@pytest.mark.real_model
@pytest.mark.server
async def test_a_key_in_the_frame_wins_over_the_header(server: ServerProcess) -> None:
    async with await connect(server, key="wrong-key-0123456789") as chat:
        opened = await chat.open(api_key=ALICE)
    assert opened.secret is not None
    async with await connect(server, key=ALICE) as chat:
        await chat.resume(opened.session_id, opened.secret)


@pytest.mark.real_model
@pytest.mark.server
async def test_a_tenants_sessions_are_unknown_to_other_tenants(
    server: ServerProcess, prefix: str, redis_client: redis.Redis
) -> None:
    async with await connect(server, key=ALICE) as chat:
        opened = await chat.open(system="Be brief.")
    assert opened.secret is not None
    assert redis_client.exists(f"{prefix}t:tenant-a:session:{opened.session_id}")
    assert not redis_client.exists(f"{prefix}session:{opened.session_id}")
    async with await connect(server, key=BOB) as chat:
        with pytest.raises(ChatServerError, match="unknown_session"):
            await chat.resume(opened.session_id, opened.secret)
        resumed = await chat.resume(opened.session_id, opened.secret, api_key=ALICE)
    assert resumed.resumed and resumed.system == "Be brief."


@pytest.mark.real_model
@pytest.mark.server
async def test_a_tenant_gets_answers_in_its_own_sessions(server: ServerProcess) -> None:
    async with await connect(server, key=BOB) as chat:
        await chat.open()
        answer = await chat.ask("Hi", max_tokens=2, temperature=0.0)
    assert answer.usage.completion_tokens >= 1


@pytest.mark.real_model
@pytest.mark.server
async def test_two_hundred_wrong_secrets_are_refused_after_the_first_few(
    server: ServerProcess, bobs_session: SessionOpened
) -> None:
    victim = bobs_session
    codes: list[str] = []
    async with await connect(server, key=BOB) as chat:
        for _ in range(200):
            await chat.send_raw(
                json.dumps({"type": "resume", "session_id": victim.session_id, "secret": "guess"})
            )
            frame = await chat.receive()
            assert isinstance(frame, Error) and not frame.fatal, frame
            codes.append(str(frame.code))
            if frame.code == "too_many_attempts":
                assert frame.retry_after_s is not None and frame.retry_after_s > 0
    heard = codes.count("wrong_secret")
    assert 6 <= heard <= 10, codes  # 5 free, then doubling waits the guesses do not sit out
    assert codes.count("too_many_attempts") == 200 - heard
    # Another client with another session's secret is not slowed at all.
    async with await connect(server, key=BOB) as chat:
        opened = await chat.open()
    async with await connect(server, key=BOB) as chat:
        assert opened.secret is not None
        await chat.resume(opened.session_id, opened.secret)


@pytest.mark.real_model
@pytest.mark.server
async def test_guesses_from_many_addresses_are_slowed_per_session(
    server: ServerProcess, bobs_session: SessionOpened
) -> None:
    victim = bobs_session
    assert victim.secret is not None
    for i in range(6):
        async with await connect(server, key=BOB) as chat:  # a new address each time
            with pytest.raises(ChatServerError, match="wrong_secret"):
                await chat.resume(victim.session_id, f"guess {i}")
    # Refused unheard, even with the right secret, until the wait is over (about 1 s).
    async with await connect(server, key=BOB) as chat:
        with pytest.raises(ChatServerError, match="too_many_attempts"):
            await chat.resume(victim.session_id, victim.secret)


@pytest.mark.real_model
@pytest.mark.server
async def test_probing_session_ids_is_slowed_per_address(server: ServerProcess) -> None:
    address = fresh_address()
    codes: list[str] = []
    async with await connect(server, key=CAROL, address=address) as chat:
        for _ in range(10):
            session_id = secrets.token_urlsafe(16)
            await chat.send_raw(
                json.dumps({"type": "resume", "session_id": session_id, "secret": "s"})
            )
            frame = await chat.receive()
            assert isinstance(frame, Error), frame
            codes.append(str(frame.code))
    assert codes[:6] == ["unknown_session"] * 6, codes
    assert codes[-1] == "too_many_attempts" and codes.count("unknown_session") <= 8, codes


@pytest.mark.real_model
@pytest.mark.server
async def test_forwarded_for_counts_only_from_a_trusted_proxy(server: ServerProcess) -> None:
    # 127.0.0.2 is not a trusted proxy: its X-Forwarded-For is ignored, so rotating it
    # does not escape the limiter.
    untrusted = {"local_addr": ("127.0.0.2", 0)}
    for i in range(6):
        async with await connect(server, key=CAROL, address=fresh_address(), **untrusted) as chat:
            with pytest.raises(ChatServerError, match="unknown_session"):
                await chat.resume(secrets.token_urlsafe(16), f"guess {i}")
    async with await connect(server, key=CAROL, address=fresh_address(), **untrusted) as chat:
        with pytest.raises(ChatServerError, match="too_many_attempts"):
            await chat.open()
    async with await connect(server, key=CAROL) as chat:  # through the trusted proxy
        await chat.open()


# Origin


@pytest.mark.real_model
@pytest.mark.parametrize("origin", ["http://evil.example", "null", "https://allowed.example"])
@pytest.mark.server
async def test_a_foreign_page_cannot_open_a_socket(server: ServerProcess, origin: str) -> None:
    with pytest.raises(InvalidStatus) as refused:
        await connect(server, key=BOB, origin=Origin(origin))
    assert refused.value.response.status_code == 403


@pytest.mark.real_model
@pytest.mark.server
async def test_a_dns_rebinding_handshake_is_refused(server: ServerProcess) -> None:
    """A page at evil.example whose name now resolves to this server: the browser sends that
    name as Host and Origin alike."""
    rebound = f"evil.example:{server.port}"
    headers = {"X-Forwarded-For": fresh_address(), "Authorization": f"Bearer {BOB}"}
    with pytest.raises(InvalidStatus) as refused:
        await ChatClient.connect(
            f"ws://{rebound}/v1/chat", host="127.0.0.1", port=server.port,
            origin=Origin(f"http://{rebound}"), additional_headers=headers,
        )  # fmt: skip
    assert refused.value.response.status_code == 403


@pytest.mark.real_model
@pytest.mark.parametrize("origin", ["own", ALLOWED, None])
@pytest.mark.server
async def test_the_own_an_allowed_or_no_origin_may_open_a_socket(
    server: ServerProcess, origin: str | None
) -> None:
    if origin == "own":
        origin = f"http://127.0.0.1:{server.port}"
    given = {} if origin is None else {"origin": Origin(origin)}
    async with await connect(server, key=BOB, **given) as chat:
        await chat.open()


# The chat page with keys (?key=, kept, resumed) is pinned in tests/end_to_end/test_web.py.
