"""The scheduler: which requests run each step, how many tokens each, with which blocks.

Continuous batching with chunked prefill under a token budget (`max_num_batched_tokens`)
and a sequence limit (`max_num_seqs`). Running requests go first (a decode token or their
next prefill chunk); waiting ones follow in arrival order until one does not fit.
When a running request cannot get a block, the most recently admitted running request is
preempted (its blocks freed, recomputed later, prefix cache permitting).

Invariants (engine-core thread only; call `schedule()` then `update_from_output()` once per
step, also when the schedule is empty):
- `request.num_computed_tokens` counts tokens whose KV will exist once the step scheduled
  last has run; it is advanced inside `schedule()`, after the output is built.
- The runner samples for a request iff its scheduled tokens reach `num_tokens`.
- Every request the scheduler admits ends in exactly one finished `EngineCoreOutput`,
  except requests finished through `finish_requests` (the caller already knows).
- Each finished request's blocks are freed exactly once: now, or — when the connector
  asks to delay — once its id comes back in `finished_sending`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.connector_seam import SchedulerConnector
from engine.protocol import EngineCoreOutput, FinishReason, Logprobs, SchedulerStats
from engine.runner_output import ModelRunnerOutput
from engine.sched.kv_cache_manager import KVCacheManager
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sched.remote_kv import RemoteKVState, clamp_external_tokens
from engine.sched.request import Request, RequestStatus
from engine.sched.stop import check_stop

logger = logging.getLogger(__name__)

# Outcomes of trying to admit the request at the head of the waiting queue.
_ADMITTED, _SKIPPED, _BLOCKED = "admitted", "skipped", "blocked"


def _queued_time(req: Request) -> float:
    """Seconds from arrival to first schedule, on a finished request's last output only."""
    if not req.is_finished() or req.first_scheduled_time is None or req.arrival_time <= 0:
        return 0.0
    return max(0.0, req.first_scheduled_time - req.arrival_time)


@dataclass
class _StepPlan:
    """What one `schedule()` call has decided so far."""

    budget: int
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled: dict[str, int] = field(default_factory=dict)
    scheduled: list[Request] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)

    def add(self, req: Request, num_tokens: int) -> None:
        self.num_scheduled[req.request_id] = num_tokens
        self.scheduled.append(req)
        self.budget -= num_tokens


class Scheduler:
    """Owns every unfinished request and the KV cache manager."""

    def __init__(
        self, *, block_size: int, num_blocks: int, max_num_seqs: int,
        max_num_batched_tokens: int, max_model_len: int, enable_prefix_caching: bool = True,
        connector: SchedulerConnector | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("block_size", block_size), ("num_blocks", num_blocks),
                            ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # A request longer than the whole cache would preempt itself forever: cap it.
        self.max_len = min(max_model_len, num_blocks * block_size)
        if self.max_len < max_model_len:
            logger.warning("KV cache holds %d tokens < max_model_len %d: requests are capped",
                           self.max_len, max_model_len)
        self.connector = connector
        self.clock = clock
        self.num_preemptions = 0  # cumulative (vllm:num_preemptions)
        self.kv_cache_manager = KVCacheManager(block_size, num_blocks, enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()  # WAITING, PREEMPTED, WAITING_FOR_REMOTE_KVS
        self.running: list[Request] = []  # admission order; the last is preempted first
        self.remote_kv = RemoteKVState(self.kv_cache_manager)
        self._finished_req_ids: set[str] = set()  # for the runner, with the next schedule
        self._pending_outputs: list[EngineCoreOutput] = []  # errors; seeded first tokens

    @property
    def finished_recving_kv_req_ids(self) -> set[str]:
        """Parked requests whose KV has landed; the next `schedule()` admits them."""
        return self.remote_kv.finished_recving

    # ---- requests in and out ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        rid = request.request_id
        if rid in self.requests or rid in self.remote_kv.delayed_free:
            raise ValueError(f"request {rid} is already known to the scheduler")
        if request.num_prompt_tokens == 0:
            return self._finish_with_error(request, f"request {rid} has an empty prompt",
                                           admitted=False)
        if request.num_prompt_tokens > self.max_len:
            return self._finish_with_error(
                request, f"request {rid}: prompt of {request.num_prompt_tokens} tokens exceeds"
                f" the limit of {self.max_len} (max_model_len {self.max_model_len},"
                f" KV cache {self.kv_cache_manager.num_blocks} blocks of {self.block_size})",
                admitted=False,
            )
        self.requests[rid] = request
        if self.connector is not None:
            self.connector.on_request_added(request)
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests in any state (abort etc.). No output is emitted for them."""
        if not status.finished:
            raise ValueError(f"finish_requests needs a finished status, got {status.name}")
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        for rid in ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.status = status
            self._retire(req)
            logger.debug("request %s finished by caller: %s", rid, status.name)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def only_parked(self) -> bool:
        """True when no step can run anything now: every unfinished request waits for remote
        KV that has not landed, and no output or finished id waits to be reported (the busy
        loop then sleeps until the connector wakes it)."""
        return (not self.running and not self.remote_kv.finished_recving
                and not self._pending_outputs and not self._finished_req_ids
                and all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting))

    def decode_awaits_kv(self) -> bool:
        """True when the next step would only decode while requests still wait for remote KV
        and could join the batch (engine/threads.py DecodePace holds such steps on shared
        cores, so they join one step instead of each starting another)."""
        return (bool(self.running) and bool(self.waiting)
                and len(self.running) < self.max_num_seqs
                and all(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in self.waiting))

    def has_work(self) -> bool:
        """True while a step would do or report anything (drives the busy loop)."""
        return (
            self.has_unfinished_requests() or bool(self._finished_req_ids)
            or bool(self._pending_outputs) or bool(self.remote_kv.delayed_free)
            or (self.connector is not None and bool(self.connector.has_pending_work()))
        )

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage, num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks, prefix_cache_queries=kv.prefix_cache_stats.queries,
            prefix_cache_hits=kv.prefix_cache_stats.hits, num_preemptions=self.num_preemptions,
        )

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ---- schedule -----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        plan = _StepPlan(budget=self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:  # blocks are short: admitting more would thrash
            self._schedule_waiting(plan)
        out = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs, scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=sum(plan.num_scheduled.values()),
            finished_req_ids=self._finished_req_ids, preempted_req_ids=plan.preempted,
        )
        self._finished_req_ids = set()
        if self.connector is not None:
            # Before the advance below: the connector sees counts as of this step's start.
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        for req in plan.scheduled:
            req.num_computed_tokens += plan.num_scheduled[req.request_id]
        return out

    def _tokens_to_schedule(self, req: Request, num_computed: int, budget: int) -> int:
        """The next chunk: the rest of the known tokens, within budget and length limit."""
        return min(req.num_tokens - num_computed, budget, self.max_len - num_computed)

    def _schedule_running(self, plan: _StepPlan) -> None:
        i = 0
        while i < len(self.running) and plan.budget > 0:
            req = self.running[i]
            num_new = self._tokens_to_schedule(req, req.num_computed_tokens, plan.budget)
            if num_new <= 0:
                i += 1
                continue
            new_block_ids = self._allocate_or_preempt(req, num_new, plan)
            if new_block_ids is None:
                break  # `req` preempted itself: nothing runs after it
            plan.cached_reqs.append(
                CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens)
            )
            plan.add(req, num_new)
            i += 1

    def _allocate_or_preempt(self, req: Request, num_new: int, plan: _StepPlan
                             ) -> list[int] | None:
        """Blocks for `req`, preempting from the back of `running` until they fit."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(req, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim)
            plan.preempted.add(victim.request_id)
            if victim is req:
                return None

    def _preempt(self, req: Request) -> None:
        self.kv_cache_manager.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.info("request %s preempted (recompute), %d free blocks, preemption #%d",
                    req.request_id, self.kv_cache_manager.num_free_blocks, req.num_preemptions)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """First come, first served; past a request that cannot get its blocks, only requests
        that already hold theirs (KV landed from P) are admitted. They need a block at most,
        and running them frees theirs: a preempted request at the head waiting for blocks
        that parked D legs hold would otherwise wait for ever (with nothing running, nothing
        frees a block: 600 streamed P/D requests on 4096 blocks hung a D this way)."""
        skipped: list[Request] = []  # keep their place at the head of the queue
        blocked = False  # a request ahead could not get its blocks
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req.request_id not in self.finished_recving_kv_req_ids:
                    skipped.append(self.waiting.popleft())
                    continue
                if not self._kv_landed(req):
                    continue  # its seeded first token ended it
            if self.kv_cache_manager.get_block_ids(req.request_id):
                outcome = self._admit_resident(req, plan)
            elif blocked:
                outcome = _SKIPPED  # no fresh admission overtakes a blocked one
            else:
                outcome = self._admit_fresh(req, plan)
            if outcome == _BLOCKED:
                blocked = True
                outcome = _SKIPPED
            if outcome == _SKIPPED:
                skipped.append(self.waiting.popleft())
        self.waiting.extendleft(reversed(skipped))

    def _admit_fresh(self, req: Request, plan: _StepPlan) -> str:
        """Admit a request holding no blocks: prefix lookup, connector, allocation."""
        kv = self.kv_cache_manager
        hit_blocks, num_local = kv.get_computed_blocks(req)
        if req.num_cached_tokens < 0:  # usage's cached_tokens: this engine's prefix-cache hit
            req.num_cached_tokens = num_local  # only, never KV received from another engine
        num_external, load_async = 0, False
        if self.connector is not None:
            num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
            if num_external is None:
                return _SKIPPED  # the connector cannot tell yet; ask again next step
            num_external = clamp_external_tokens(req, num_local, num_external, load_async)
        num_computed = num_local + num_external
        num_new = 0 if load_async else self._tokens_to_schedule(req, num_computed, plan.budget)
        new_block_ids = kv.allocate_slots(req, num_new, num_local, hit_blocks, num_external)
        if new_block_ids is None:
            return _BLOCKED
        kv.prefix_cache_stats.record(req.num_tokens, num_local)
        req.num_external_computed_tokens = num_external
        if self.connector is not None:
            self.connector.update_state_after_alloc(
                req, kv.get_block_ids(req.request_id), num_external
            )
        if load_async:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            req.num_computed_tokens = num_local
            logger.debug("request %s waits for %d remote KV tokens", req.request_id,
                         num_external)
            return _SKIPPED
        self.waiting.popleft()
        req.num_computed_tokens = num_computed
        self._start_running(req, num_new, plan)
        return _ADMITTED

    def _admit_resident(self, req: Request, plan: _StepPlan) -> str:
        """Admit a waiting request that already holds its blocks (after a KV transfer)."""
        num_new = self._tokens_to_schedule(req, req.num_computed_tokens, plan.budget)
        if self.kv_cache_manager.allocate_slots(req, num_new) is None:
            return _BLOCKED
        self.waiting.popleft()
        self._start_running(req, num_new, plan)
        return _ADMITTED

    def _start_running(self, req: Request, num_new: int, plan: _StepPlan) -> None:
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.clock()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.new_reqs.append(NewRequestData(
            req_id=req.request_id, token_ids=list(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens, sampling_params=req.sampling_params,
            block_ids=self.kv_cache_manager.get_block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens, eos_token_id=req.eos_token_id,
        ))
        plan.add(req, num_new)

    # ---- remote KV (connector) ----------------------------------------------------------

    def _kv_landed(self, req: Request) -> bool:
        """A parked request's KV landed: make it schedulable, seeded with the first token the
        connector brought along (then its next step decodes that token; the last prompt
        position is never computed here). False when that token ended the request."""
        seed = None if self.connector is None else self.connector.take_seeded_token(req)
        if seed is not None:
            req.append_output_token_ids(list(seed.token_ids))
            req.last_logprobs = seed.logprobs
        self.remote_kv.mark_ready(req)
        if seed is None:
            return True
        stopped = check_stop(req, self.max_len)
        kv_params = self._retire(req) if stopped else None
        self._pending_outputs.append(EngineCoreOutput(
            request_id=req.request_id, new_token_ids=list(seed.token_ids),
            new_logprobs=[seed.logprobs] if seed.logprobs is not None else None,
            finish_reason=req.get_finished_reason(), stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0), kv_transfer_params=kv_params,
            queued_time=_queued_time(req),
        ))
        return not stopped

    def _on_remote_kv_failed(self, req: Request, reason: str) -> None:
        policy = "recompute" if self.connector is None else self.connector.load_failure_policy
        if policy == "fail":
            self._finish_with_error(req, f"KV transfer for request {req.request_id} failed:"
                                         f" {reason}")
            return
        self.remote_kv.forget(req.request_id)
        req.num_external_computed_tokens = 0
        req.status = RequestStatus.WAITING
        block_ids = self.kv_cache_manager.get_block_ids(req.request_id)
        if self.connector is not None and self.connector.request_load_failed(req, block_ids):
            # A WRITE may still land in the blocks the request registered (another TP rank's
            # part, or one D stopped waiting for): they stay with the transfer until it is
            # over, and the request starts afresh in other blocks (its local prefix hit again)
            self.remote_kv.hold_blocks(req)
            req.num_computed_tokens = 0
        # else it keeps its blocks; everything past the local prefix hit is computed here
        logger.warning("request %s: KV transfer failed (%s); recomputing %d tokens locally",
                       req.request_id, reason, req.num_tokens - req.num_computed_tokens)

    # ---- update -------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Apply one step's results: cache computed blocks, append tokens, finish requests."""
        kvo = runner_output.kv_connector_output
        if kvo is not None and self.connector is not None:
            self.connector.update_connector_output(kvo)
        index = {rid: i for i, rid in enumerate(runner_output.req_ids)}
        outputs: list[EngineCoreOutput] = []
        for rid in scheduler_output.num_scheduled_tokens:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # finished by the caller while the step ran
            self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            i = index.get(rid)
            sampled = runner_output.sampled_token_ids[i] if i is not None else []
            if not sampled:
                if i is None or req.num_computed_tokens >= req.num_tokens:
                    # Without a token it could never be scheduled again: fail, don't hang.
                    self._finish_with_error(req, f"model runner returned no token for request"
                                                 f" {rid}")
                continue
            logprobs = runner_output.logprobs[i] if i < len(runner_output.logprobs) else None
            outputs.append(self._append_tokens(req, sampled, logprobs))
            if rid in runner_output.prompt_logprobs:  # the prefill's, with its first token
                outputs[-1].prompt_logprobs = runner_output.prompt_logprobs[rid]
        if kvo is not None:
            for rid, reason in self.remote_kv.absorb(kvo, self.requests).items():
                self._on_remote_kv_failed(self.requests[rid], reason)
            # KV that landed now: a seeded first token goes out with this step's outputs,
            # in an output of its own, before the step that decodes it
            for rid in list(self.remote_kv.finished_recving):
                self._kv_landed(self.requests[rid])
        outputs.extend(self._pending_outputs)
        self._pending_outputs = []
        return outputs

    def _append_tokens(self, req: Request, sampled: list[int],
                       logprobs: Logprobs | None) -> EngineCoreOutput:
        accepted: list[int] = []
        req.last_logprobs = logprobs
        for token in sampled:
            req.append_output_token_ids([token])
            accepted.append(token)
            if check_stop(req, self.max_len):
                break
        kv_params = self._retire(req) if req.is_finished() else None
        return EngineCoreOutput(
            request_id=req.request_id, new_token_ids=accepted,
            new_logprobs=[logprobs] if logprobs is not None else None,
            finish_reason=req.get_finished_reason(), stop_reason=req.stop_reason,
            num_cached_tokens=max(req.num_cached_tokens, 0), kv_transfer_params=kv_params,
            queued_time=_queued_time(req),
        )

    # ---- finishing ----------------------------------------------------------------------

    def _finish_with_error(self, req: Request, message: str, *, admitted: bool = True) -> None:
        """The scheduler gives up on a request: it ends in an ERROR output with `message`."""
        req.status = RequestStatus.FINISHED_ERROR
        req.error = message
        kv_params = self._retire(req) if admitted else None
        logger.error("%s", message)
        self._pending_outputs.append(EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
            num_cached_tokens=max(req.num_cached_tokens, 0), kv_transfer_params=kv_params,
            queued_time=_queued_time(req),
            error=message,
        ))

    def _retire(self, req: Request) -> dict[str, Any] | None:
        """Drop a finished request from every queue and release (or park) its blocks.

        Returns the connector's kv_transfer_params for the request's final output.
        """
        rid = req.request_id
        if req in self.running:
            self.running.remove(req)
            self._finished_req_ids.add(rid)  # the runner holds its state
        elif req in self.waiting:
            self.waiting.remove(req)
        self.remote_kv.forget(rid)
        del self.requests[rid]
        delay_free, kv_params = False, None
        block_ids = self.kv_cache_manager.get_block_ids(rid)
        if self.connector is not None:
            delay_free, kv_params = self.connector.request_finished(req, block_ids)
        if delay_free and block_ids:
            self.remote_kv.hold_blocks(req)
        else:
            self.kv_cache_manager.free(req)
        return kv_params
