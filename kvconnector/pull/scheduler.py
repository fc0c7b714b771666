"""Pull mode, scheduler half (engine-core thread only; clock injectable for tests).

P side: a finished request with `do_remote_decode` keeps its prompt blocks (delay-free);
the worker leases them to D and reports them free-able (`finished_sending`) on D's
completion notification or at lease expiry. The request's final output carries the
kv_transfer_params D needs (`params.prefill_answer`).

D side: a request with `do_remote_prefill` is checked against its own prompt when it
arrives (token count, block count, prompt digest, one reader per P request); if the
params do not fit, it prefills locally and never touches P's blocks. With a KV secret the
frontend has already refused (HTTP 400) params P did not sign for this prompt; the check is
repeated here so nothing that reaches the core by another path reads unsigned blocks.
Otherwise D claims P's blocks (the worker heartbeats P while the request queues), asks for
every prompt token it does not hold locally (async), and stages one READ of the missing
blocks (`first_block_index` = local hit / block size). A request that finishes while its READ is
staged or in flight keeps its blocks until the worker reports the READ over.

Invariants: each claim ends in exactly one of finished_recving, failed_recving (the
scheduler applies `kv_load_failure_policy`), `released` (blocks held, freed on
`finished_sending`) or `abandoned` (no READ was ever posted; P's lease is returned).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.connector_api import KVCacheSpec
from engine.connector_seam import KVBinding
from kvconnector.endpoint import Endpoint
from kvconnector.params import KVParams, PrefillLeg, PullDecodeLeg
from kvconnector.pull import signing
from kvconnector.pull.meta import Claim, Lease, PullMeta, Read, prompt_digest
from kvconnector.pull.params import (
    carriable_request_id,
    prefill_answer,
    validate_request_params,
)
from kvconnector.scheduler_half import TransferRequest, TransferScheduler
from kvconnector.security import KVSecurity
from kvconnector.seed import from_params, sampled, to_params

logger = logging.getLogger(__name__)

_LEASE_MARGIN_S = signing.LEASE_MARGIN_S  # clock skew, and the first heartbeat reaching P


class PullScheduler(TransferScheduler):
    meta_type = PullMeta

    def __init__(self, config: EngineConfig, spec: KVCacheSpec,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        super().__init__(config, spec, clock)
        kv = self.kv
        self.wall_clock = wall_clock  # lease_expires_at crosses hosts: wall time
        self.endpoint = Endpoint.from_config(kv)  # until bind_workers: what the worker bound
        self.security = KVSecurity.from_config(kv, warn=False)
        self.lease = float(kv.extra("kv_lease_duration", 30.0))
        self._accepted: dict[str, Claim] = {}  # D: claim made, READ not over
        self._reading: dict[str, int] = {}  # D: READ staged/in flight -> tokens it brings
        # D: the READ failed (on some rank: another rank's may still run) and is not released
        self._read_failed: set[str] = set()
        # (P engine, P request) -> until when a second claim is refused (inf: active).
        self._claimed: dict[tuple[str, str], float] = {}
        self.stats["kv_pull_refused_params_total"] = 0

    def bind_workers(self, bindings: list[KVBinding]) -> None:
        """P advertises in its kv_transfer_params what its worker half bound (an ephemeral
        port, a generated engine id), not what was configured."""
        if bindings:
            b = bindings[0]
            self.endpoint = Endpoint(b.engine_id, b.host, b.port)

    # --- D side -------------------------------------------------------------------
    def _decode(self, params: Any) -> KVParams | None:
        return validate_request_params(params)

    def _refused(self, request: TransferRequest, reason: str) -> None:
        self.stats["kv_pull_refused_params_total"] += 1
        logger.warning("request %s: not reading KV from P (%s); prefilling locally",
                       request.request_id, reason)

    def _arrived(self, request: TransferRequest, params: KVParams | None) -> None:
        if not isinstance(params, PullDecodeLeg):
            return
        reason = self._refusal(request, params)
        if reason is not None:
            request.kv_params = None  # never read P's blocks: a local prefill
            self._refused(request, reason)
            return
        claim = Claim(request.request_id, params.remote_request_id, params.remote_engine_id,
                      params.remote_host, params.remote_port)
        self._claimed[(claim.remote_engine_id, claim.remote_request_id)] = math.inf
        self._accepted[request.request_id] = claim
        self._meta.claims.append(claim)
        seed = from_params(params.first_token_ids or None, params.first_token_logprobs or None)
        if seed is not None and params.wants_first_token:
            self._seeds[request.request_id] = seed

    def _refusal(self, request: TransferRequest, p: PullDecodeLeg) -> str | None:
        """Why these (decoded) params must not load this request's KV, or None when they
        fit. The signature is checked on the wire form, as received (`pull.signing`)."""
        try:
            signing.check(self.security, request.kv_transfer_params or {},
                          request.prompt_token_ids, self.wall_clock())
        except ValueError as e:
            return str(e)
        n = request.num_prompt_tokens
        if p.tp_size != 1:
            return f"P's tp_size {p.tp_size} is not supported (pull reads from tp_size 1)"
        if p.num_prompt_tokens != n:
            return f"P prefilled {p.num_prompt_tokens} tokens, this prompt has {n}"
        if len(p.remote_block_ids) != self.num_blocks(n):
            return (f"P lists {len(p.remote_block_ids)} blocks for {n} tokens at block "
                    f"size {self.block_size}")
        if p.prompt_digest is not None and p.prompt_digest != prompt_digest(
                request.prompt_token_ids):
            return "this prompt differs from the one P prefilled (prompt_digest)"
        if p.lease_expires_at is not None and (
                self.wall_clock() > p.lease_expires_at - _LEASE_MARGIN_S):
            return "P's lease on these blocks has run out (lease_expires_at)"
        key = (p.remote_engine_id, p.remote_request_id)
        if self._claimed.get(key, -math.inf) > self.clock():
            return (f"P request {key[1]} of engine {key[0]} is already claimed (its blocks "
                    "are read once)")
        return None

    def get_num_new_matched_tokens(self, request: TransferRequest, num_computed_tokens: int
                                   ) -> tuple[int, bool]:
        rid = request.request_id
        if rid not in self._accepted or rid in self._reading:
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request: TransferRequest, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        claim = self._accepted.get(rid)
        if claim is None or rid in self._reading:
            return
        if num_external_tokens <= 0:
            self._abandon(rid)
            return
        assert isinstance(request.kv_params, PullDecodeLeg)  # accepted: decoded on arrival
        remote = request.kv_params.remote_block_ids
        first = (request.num_prompt_tokens - num_external_tokens) // self.block_size
        last = self.num_blocks(request.num_prompt_tokens)
        self._meta.reads.append(Read(claim, list(block_ids[first:last]),
                                     list(remote[first:last]), first))
        self._reading[rid] = num_external_tokens - 1  # the last token is recomputed

    # --- both sides ---------------------------------------------------------------
    def _before_meta(self) -> None:
        if self._claimed:
            now = self.clock()
            for key, until in list(self._claimed.items()):
                if until <= now:
                    del self._claimed[key]

    def request_finished(self, request: TransferRequest, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._kv_wait.pop(rid, None)  # a leg whose KV never landed
        self._seeds.pop(rid, None)
        if self._release_read(rid):
            return True, None
        if rid in self._accepted:  # D: finished before any READ was posted
            self._abandon(rid)
            return False, None
        params = request.kv_params
        if isinstance(params, PrefillLeg):
            return self._lease(request, block_ids, params)
        return False, None

    def _lease(self, request: TransferRequest, block_ids: list[int], params: PrefillLeg
               ) -> tuple[bool, dict[str, Any] | None]:
        """P: keep the prompt blocks for D and answer with where to read them."""
        rid = request.request_id
        n = self.num_blocks(request.num_prompt_tokens)
        if not request.status.finished_normally:
            return False, None
        if len(block_ids) < n or not carriable_request_id(rid) or not self.endpoint.port:
            logger.warning("request %s: cannot lease its KV for a pull (%d of %d blocks, "
                           "side-channel port %d); D will prefill itself", rid,
                           len(block_ids), n, self.endpoint.port)
            return False, None
        blocks = list(block_ids[:n])
        self._meta.leases.append(Lease(rid, blocks))
        self._held.add(rid)
        answer = prefill_answer(self.endpoint, rid, blocks, request.num_prompt_tokens,
                                prompt_digest(request.prompt_token_ids),
                                self.wall_clock() + self.lease, params.tid)
        answer.update(to_params(sampled(request.output_token_ids, request.last_logprobs)))
        return True, signing.signed(self.security, answer)

    def request_load_failed(self, request: TransferRequest, block_ids: list[int]) -> bool:
        return self._release_read(request.request_id)

    def _release_read(self, rid: str) -> bool:
        """D: a READ may still land in the request's blocks (this rank's, or after one
        rank's failed, another rank's): release it; every rank reports the id in
        `finished_sending` once its own READ is over, and the blocks wait for that. False
        when the request has no READ. (Pull runs at TP 1 today: a failed READ is the only
        one and over, so its blocks come back a step later; a TP pull needs no change.)"""
        if self._reading.pop(rid, None) is None and rid not in self._read_failed:
            return False
        self._read_failed.discard(rid)
        self._end_claim(rid)
        self._held.add(rid)
        self._meta.released.append(rid)
        return True

    def _abandon(self, rid: str) -> None:
        self._end_claim(rid)
        self._meta.abandoned.append(rid)

    def _end_claim(self, rid: str) -> None:
        """The request no longer reads P's blocks; refuse the same P request for a while
        (its blocks are free on P, maybe someone else's by now)."""
        claim = self._accepted.pop(rid, None)
        if claim is not None:
            key = (claim.remote_engine_id, claim.remote_request_id)
            self._claimed[key] = self.clock() + 2 * self.lease

    def _recv_failed(self, request_id: str) -> bool:
        if self._reading.pop(request_id, None) is None:
            return False
        self._end_claim(request_id)
        self._read_failed.add(request_id)  # released by the recompute or the request's end
        return True

    def _recv_done(self, request_id: str) -> int:
        tokens = self._reading.pop(request_id, None)
        if tokens is None:
            return 0
        self._end_claim(request_id)
        return tokens

    def table_sizes(self) -> dict[str, int]:
        return {"pull_sched_held": len(self._held), "pull_sched_accepted": len(self._accepted),
                "pull_sched_reading": len(self._reading),
                "pull_sched_read_failed": len(self._read_failed)}

