"""Keeping a stored conversation's KV findable from one turn to the next.

Three things, all about the blocks a conversation leaves in the engine's prefix cache:
- `scope`: who may find them (the conversation's tenant; across sessions, by default, only the
  blocks wholly inside the template's prefix and the system prompt);
- `page_map`: the record stored with each turn (the token ids exactly as the model saw them,
  and the model and namespace they were computed under), from which the next turn, on any
  replica, starts;
- `prefill_tail`: the K/V of the turn's last tokens, computed while the user reads the answer.

NOTE (tail prefill): an answer's last token and the end-of-turn tokens after it were never fed
to the model, so the block they fall in would miss the prefix cache on the next turn. A
prefill-only request (max_tokens 0) computes them in the background; the next turn of the
session waits for it (`wait_for_tail`) and then finds every full block of the conversation
cached. It is a second engine request per turn, named `<session>/tail/<tokens>` (the /kv
view shows it so).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from array import array

from service.engine.params import SamplingParams
from service.engine.serving import ServingEngine
from service.engine.values import CacheScope, EngineDeadError, RequestError
from service.sessions.models import PageMap
from service.sessions.prompt import ChatFormat

log = logging.getLogger(__name__)


class ConversationCache:
    def __init__(
        self,
        engine: ServingEngine,
        chat_format: ChatFormat,
        *,
        share_across_sessions: bool = False,
    ) -> None:
        self.engine = engine
        self.chat_format = chat_format
        # --prefix-cache-scope global: every session of a tenant shares every block.
        self.share_across_sessions = share_across_sessions
        self._tails: dict[str, asyncio.Task[None]] = {}  # per session, its tail prefill
        self._closed = False

    def scope(self, salt: str, session_id: str, system: str | None) -> CacheScope:
        """Who may share this conversation's KV blocks (CacheScope's NOTE): requests of the
        same `salt` (tenant) only, and across sessions only the blocks wholly inside the
        template's prefix and the system prompt, with sessions of the very same system prompt
        (its digest keys them), unless every block is shared."""
        if self.share_across_sessions:
            return CacheScope(salt=salt)
        shared = self.chat_format.system_prefix(system)
        digest = hashlib.blake2b(array("q", shared).tobytes(), digest_size=12).hexdigest()
        return CacheScope(
            salt=salt, private=session_id, shared_tokens=len(shared), shared_key=digest
        )

    def page_map(self, token_ids: list[int]) -> PageMap:
        """The page map of a conversation whose ids are `token_ids` (PageMap's NOTE: where
        its blocks are is the engine's to find at the next turn, not the record's)."""
        return PageMap(
            token_ids=token_ids,
            block_size=self.engine.limits.block_size,
            namespace=self.engine.namespace,
            model_id=self.engine.model_id,
            updated=time.time(),
        )

    def prefill_tail(self, session_id: str, token_ids: list[int], scope: CacheScope) -> None:
        """Compute the K/V of the stored conversation `token_ids` in the background (NOTE)."""
        if self._closed:
            return
        self._tails[session_id] = asyncio.create_task(
            self._prefill(session_id, token_ids, scope), name=f"tail {session_id}"
        )

    async def wait_for_tail(self, session_id: str) -> None:
        """Let the session's tail prefill finish before its next turn looks up the cache."""
        task = self._tails.get(session_id)
        if task is not None:
            await asyncio.wait([task])  # a cancelled turn must not cancel the prefill

    def close(self) -> None:
        """Start no more tail prefills (the server is draining)."""
        self._closed = True

    async def stop(self) -> None:
        """Cancel the tail prefills still running, and wait for them to end."""
        self._closed = True
        tails = list(self._tails.values())
        for task in tails:
            task.cancel()
        await asyncio.gather(*tails, return_exceptions=True)

    async def _prefill(self, session_id: str, token_ids: list[int], scope: CacheScope) -> None:
        try:
            # Named after its session, unique per conversation length.
            request_id = f"{session_id}/tail/{len(token_ids)}"
            params = SamplingParams(max_tokens=0)
            # persist: the stored conversation's blocks also go to the third KV tier, where
            # a restarted server or another replica finds them (no-op without a tier).
            stream = self.engine.generate(token_ids, params, request_id, scope, persist=True)
            async for _ in stream:
                pass
        except (RequestError, EngineDeadError) as exc:
            # Too long for the context, or shutting down: the next turn recomputes the tail.
            log.debug("no tail prefill for %s: %s", session_id, exc)
        finally:
            if self._tails.get(session_id) is asyncio.current_task():
                del self._tails[session_id]
