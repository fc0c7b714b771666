"""Push mode, scheduler half (engine-core thread only; clock injectable for tests).

D side: a request with `do_remote_prefill` asks for every prompt token it does not hold
(asynchronously), gets blocks, and its registration is staged for the worker with a
watchdog deadline. Every such request's blocks are freed only through the worker
(delay-free), because only the worker knows whether a WRITE from P can still land.

P side: a finished request with `do_remote_decode` keeps its blocks (delay-free); they
go to the worker, which writes them into D under a lease and reports when they may be
freed (`finished_sending`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec
from kvconnector.params import KVParams, PrefillLeg, PushDecodeLeg, decode
from kvconnector.push.meta import FinishedBlocks, PushMeta, Queued, Registration
from kvconnector.scheduler_half import TransferRequest, TransferScheduler
from kvconnector.security import prompt_digest
from kvconnector.seed import sampled, to_wire

logger = logging.getLogger(__name__)


class PushScheduler(TransferScheduler):
    meta_type = PushMeta

    def __init__(self, config: EngineConfig, spec: KVCacheSpec,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(config, spec, clock)
        self.registration_timeout = float(self.kv.extra("push_registration_timeout", 480.0))
        self._asked: set[str] = set()  # D: requests already offered a remote load
        self._deadlines: dict[str, float] = {}  # D: registration watchdog
        self._remote_tokens: dict[str, int] = {}  # D: prompt tokens P computes for us
        self.stats["kv_registration_expired_total"] = 0

    # --- D side -------------------------------------------------------------------
    def _decode(self, params: Any) -> KVParams | None:
        return decode(params, "push")

    def _arrived(self, request: TransferRequest, params: KVParams | None) -> None:
        if isinstance(params, PrefillLeg):  # P: registrations for its transfer are expected
            self._meta.arrived.append((request.request_id, params.tid or None))
        if isinstance(params, PushDecodeLeg):
            self._meta.queued.append(Queued(request.request_id, params.tid,
                                            params.remote_engine_id, params.remote_host,
                                            params.remote_port, params.tp_size))
            self._held.add(request.request_id)

    def get_num_new_matched_tokens(self, request: TransferRequest, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        # Marked as asked only once blocks are allocated (update_state_after_alloc): when
        # allocation fails the scheduler asks again next step and must get the same answer.
        if not isinstance(request.kv_params, PushDecodeLeg) or request.request_id in self._asked:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: TransferRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        p = request.kv_params
        if num_external_tokens <= 0 or not isinstance(p, PushDecodeLeg):
            return
        self._asked.add(request.request_id)
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        last = self.num_blocks(request.num_prompt_tokens)
        reg = Registration(
            request_id=request.request_id, transfer_id=p.tid,
            local_block_ids=list(block_ids[first:last]), first_block_index=first,
            num_prompt_tokens=request.num_prompt_tokens,
            remote_engine_id=p.remote_engine_id, remote_host=p.remote_host,
            remote_port=p.remote_port, remote_tp_size=p.tp_size,
            prompt_digest=prompt_digest(request.prompt_token_ids),
            first_token=p.wants_first_token,
        )
        self._meta.registrations.append(reg)
        self._deadlines[request.request_id] = self.clock() + self.registration_timeout
        self._held.add(request.request_id)
        self._remote_tokens[request.request_id] = request.num_prompt_tokens - 1 - first * (
            self.block_size)

    # --- both sides ---------------------------------------------------------------
    def _before_meta(self) -> None:
        now = self.clock()
        for rid, deadline in list(self._deadlines.items()):
            if now >= deadline:
                logger.warning("push registration %s timed out after %.1fs; giving up",
                               rid, self.registration_timeout)
                del self._deadlines[rid]
                self._meta.watchdog_expired.append(rid)
                self.stats["kv_registration_expired_total"] += 1

    def request_finished(self, request: TransferRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._kv_wait.pop(rid, None)  # a leg whose KV never landed
        params = request.kv_params
        self._asked.discard(rid)
        self._deadlines.pop(rid, None)
        self._remote_tokens.pop(rid, None)
        self._seeds.pop(rid, None)
        if rid in self._held:  # D: the worker frees once no WRITE can land
            self._meta.released.append(rid)
            return True, None
        if not isinstance(params, PrefillLeg):
            return False, None
        transfer_id = params.tid or None
        if request.status.finished_normally:
            n = self.num_blocks(request.num_prompt_tokens)
            self._meta.finished_blocks.append(
                FinishedBlocks(rid, transfer_id, list(block_ids[:n]), request.num_prompt_tokens,
                               prompt_digest(request.prompt_token_ids),
                               to_wire(sampled(request.output_token_ids, request.last_logprobs)))
            )
            self._held.add(rid)
            return True, {"transfer_id": transfer_id, "staged_blocks": n}
        self._meta.aborted.append((rid, transfer_id))
        return False, None

    def request_load_failed(self, request: TransferRequest, block_ids: list[int]) -> bool:
        """D: a part may still be WAITING (another TP rank's WRITE) or QUARANTINED (one D
        stopped waiting for): release the transfer now, so each rank cancels and reports
        the id in `finished_sending` once nothing can land; the blocks wait for that."""
        rid = request.request_id
        if rid not in self._held:
            return False
        self._held.discard(rid)
        self._meta.released.append(rid)
        return True

    def _recv_done(self, request_id: str) -> int:
        self._deadlines.pop(request_id, None)
        return self._remote_tokens.pop(request_id, 0)

    def _expects_seed(self, request_id: str) -> bool:
        return request_id in self._asked

    def _recv_failed(self, request_id: str) -> bool:
        self._deadlines.pop(request_id, None)
        self._remote_tokens.pop(request_id, None)
        return True  # every failed receipt falls back (or fails) in the engine's scheduler

    def table_sizes(self) -> dict[str, int]:
        return {"sched_held": len(self._held), "sched_deadlines": len(self._deadlines),
                "sched_asked": len(self._asked), "sched_remote_tokens": len(self._remote_tokens)}

