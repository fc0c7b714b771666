"""Scheduler-side bookkeeping for KV that moves through a connector.

Two tables, both keyed by request id and both owned by the engine-core thread:
- `finished_recving`: parked requests (WAITING_FOR_REMOTE_KVS) whose KV has landed and
  that the next `schedule()` may run. Only ids of live, parked requests enter it.
- `delayed_free`: blocks the connector still needs, by request id: a finished request's (a
  P-side lease, a D-side quarantine), or those a failed receipt left behind (a WRITE may
  still land in them; the request recomputes in fresh blocks). Freed once, when the id
  comes back in `finished_sending`.
"""

from __future__ import annotations

import logging

from engine.connector_seam import KVConnectorOutput
from engine.sched.block_pool import KVBlock
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.request import Request, RequestStatus

logger = logging.getLogger(__name__)


def clamp_external_tokens(req: Request, num_local: int, num_external: int,
                          load_async: bool) -> int:
    """What the scheduler accepts of a connector's offer: never the token to sample from.

    A synchronous load may cover up to the last token (exclusive); an async one may cover
    the whole prompt, since the last prompt token is recomputed after it lands anyway.
    """
    limit = (req.num_prompt_tokens if load_async else req.num_tokens - 1) - num_local
    accepted = max(0, min(num_external, limit))
    if accepted != num_external:
        logger.warning("request %s: connector offered %d external tokens, using %d",
                       req.request_id, num_external, accepted)
    return accepted


class RemoteKVState:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.finished_recving: set[str] = set()
        self.delayed_free: dict[str, list[KVBlock]] = {}

    def mark_ready(self, req: Request) -> None:
        """The KV landed: everything is computed but the last token, which yields logits."""
        self.finished_recving.discard(req.request_id)
        req.num_computed_tokens = min(
            req.num_computed_tokens + req.num_external_computed_tokens, req.num_tokens - 1
        )
        self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
        req.status = RequestStatus.WAITING

    def hold_blocks(self, req: Request) -> None:
        """Take the request's blocks from it until its id is in `finished_sending`."""
        self.delayed_free.setdefault(req.request_id, []).extend(
            self.kv_cache_manager.detach(req))

    def forget(self, request_id: str) -> None:
        self.finished_recving.discard(request_id)

    def absorb(self, kvo: KVConnectorOutput, requests: dict[str, Request]) -> dict[str, str]:
        """Apply one step's connector output. Returns the parked requests whose load failed.

        `finished_sending` frees held blocks; `finished_recving` makes parked requests
        schedulable; an id in `failed_recving` (id -> reason) is left to the caller's failure
        policy even when it is also reported as received.
        """
        for rid in kvo.finished_sending:
            blocks = self.delayed_free.pop(rid, None)
            if blocks is not None:
                self.kv_cache_manager.free_blocks(blocks)
        failed = {rid: reason or "no reason given" for rid, reason in kvo.failed_recving.items()
                  if _parked(requests.get(rid))}
        for rid in kvo.finished_recving:
            if rid not in kvo.failed_recving and _parked(requests.get(rid)):
                self.finished_recving.add(rid)
        return failed


def _parked(req: Request | None) -> bool:
    return req is not None and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
