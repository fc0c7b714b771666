"""Scheduler behaviour with plain data: batching, preemption, stops, aborts, connector hooks.

`FakeRunner` keeps its own copy of every request exactly as the real model runner does
(new requests whole, cached ones as deltas) and models the KV cache: each slot it writes
holds a fingerprint of the full prefix ending at that position, and every slot a step
reads is checked against the request's own tokens. A wrong prefix hit, a block reused
while still in use or a token scheduled twice fails the test at the step it happens.
"""

from __future__ import annotations

import zlib

import pytest

from engine.connector_api import KVConnectorOutput
from engine.protocol import FinishReason, SamplingParams
from engine.runner_output import ModelRunnerOutput
from engine.sched.output import SchedulerOutput
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler

BS = 4


def _fp(tokens: list[int], pos: int) -> int:
    return hash(tuple(tokens[:pos + 1]))


class FakeRunner:
    def __init__(self, block_size: int = BS) -> None:
        self.bs = block_size
        self.slots: dict[tuple[int, int], int] = {}
        self.reqs: dict[str, dict] = {}
        self.script: dict[str, list[int]] = {}  # rid -> tokens to sample, in order
        self.preload: dict[str, int] = {}  # rid -> tokens a sync connector loads in-step
        self.kvo: KVConnectorOutput | None = None  # returned (once) with the next step

    def write_kv(self, block_ids: list[int], tokens: list[int], upto: int) -> None:
        """What a remote prefill would have written into these blocks."""
        for p in range(upto):
            self.slots[(block_ids[p // self.bs], p % self.bs)] = _fp(tokens, p)

    def _next_token(self, rid: str, tokens: list[int]) -> int:
        if self.script.get(rid):
            return self.script[rid].pop(0)
        return 1000 + (sum(tokens) * 7 + len(tokens)) % 997  # a function of the prefix

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids | so.preempted_req_ids:
            self.reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.reqs, f"{new.req_id} sent whole twice"
            self.reqs[new.req_id] = {"tokens": list(new.token_ids), "blocks": list(new.block_ids),
                                     "computed": new.num_computed_tokens}
            if new.req_id in self.preload:
                self.write_kv(new.block_ids, new.token_ids, self.preload.pop(new.req_id))
        for c in so.scheduled_cached_reqs:
            st = self.reqs[c.req_id]
            assert st["computed"] == c.num_computed_tokens
            st["blocks"].extend(c.new_block_ids)
        ids = [n.req_id for n in so.scheduled_new_reqs]
        ids += [c.req_id for c in so.scheduled_cached_reqs]
        assert sorted(ids) == sorted(so.num_scheduled_tokens)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[], logprobs=[])
        for rid in ids:
            out.sampled_token_ids.append(self._run_one(rid, so.num_scheduled_tokens[rid]))
            out.logprobs.append(None)
        out.kv_connector_output, self.kvo = self.kvo, None
        return out

    def _run_one(self, rid: str, n: int) -> list[int]:
        st = self.reqs[rid]
        tokens, blocks, start = st["tokens"], st["blocks"], st["computed"]
        assert n > 0 and start + n <= len(tokens)
        assert len(blocks) * self.bs >= start + n, f"{rid}: block table too short"
        for p in range(start):
            slot = (blocks[p // self.bs], p % self.bs)
            assert self.slots.get(slot) == _fp(tokens, p), f"{rid}: wrong KV at position {p}"
        for p in range(start, start + n):
            self.slots[(blocks[p // self.bs], p % self.bs)] = _fp(tokens, p)
        st["computed"] = start + n
        if st["computed"] < len(tokens):
            return []
        tok = self._next_token(rid, tokens)
        tokens.append(tok)
        return [tok]


class FakeConnector:
    """Records every hook call; answers from per-request plans set by the test."""

    def __init__(self, policy: str = "recompute") -> None:
        self.load_failure_policy = policy
        self.remote: dict[str, str] = {}  # rid -> "async" | "sync" | "unknown"
        self.delay_free: set[str] = set()
        self.pending = False
        self.seeds: dict = {}  # rid -> SeededToken handed over when its KV lands
        self.calls: list[tuple] = []

    def on_request_added(self, request: Request) -> None:
        self.calls.append(("added", request.request_id))

    def get_num_new_matched_tokens(self, request: Request, num_computed: int):
        self.calls.append(("match", request.request_id, num_computed))
        plan = self.remote.pop(request.request_id, None)
        if plan == "unknown":
            return None, False
        if plan in ("async", "sync"):
            return request.num_prompt_tokens - num_computed, plan == "async"
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], n: int) -> None:
        self.calls.append(("alloc", request.request_id, list(block_ids), n))

    def build_connector_meta(self, so: SchedulerOutput):
        self.calls.append(("meta", dict(so.num_scheduled_tokens)))
        return {"num_scheduled": dict(so.num_scheduled_tokens)}

    def request_finished(self, request: Request, block_ids: list[int]):
        self.calls.append(("finished", request.request_id, list(block_ids)))
        return request.request_id in self.delay_free, {"params_for": request.request_id}

    def request_load_failed(self, request: Request, block_ids: list[int]) -> bool:
        """As the push connector: a held request's transfer is released now (it then holds
        nothing more at its finish)."""
        self.calls.append(("load_failed", request.request_id, list(block_ids)))
        held = request.request_id in self.delay_free
        self.delay_free.discard(request.request_id)
        return held

    def update_connector_output(self, kvo) -> None:
        self.calls.append(("output", kvo))

    def take_seeded_token(self, request: Request):
        self.calls.append(("seed", request.request_id))
        return self.seeds.pop(request.request_id, None)

    def has_pending_work(self) -> bool:
        return self.pending

    def called(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def _req(rid: str, prompt: list[int] | int, eos: int | None = None, **params) -> Request:
    if isinstance(prompt, int):
        # a stable per-id offset: str hash() changes per process, and 1 run in ~500 made two
        # ids' prompts share a first block (a prefix-cache hit the test did not plan for)
        prompt = [(zlib.crc32(rid.encode()) + i) % 500 for i in range(prompt)]
    params.setdefault("max_tokens", 4)
    return Request(rid, prompt, SamplingParams(**params), eos_token_id=eos)


class Harness:
    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.runner = FakeRunner(sched.block_size)
        self.outputs: dict[str, list] = {}

    def step(self) -> tuple[SchedulerOutput, list]:
        so = self.sched.schedule()
        outs = self.sched.update_from_output(so, self.runner.execute(so))
        for o in outs:
            self.outputs.setdefault(o.request_id, []).append(o)
        return so, outs

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("scheduler did not drain")

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs.get(rid, []) for t in o.new_token_ids]

    def final(self, rid: str):
        outs = self.outputs[rid]
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        return outs[-1]


@pytest.fixture
def make():
    """Builds harnesses; after the test every block is free and every table empty."""
    made: list[Harness] = []

    def factory(**kw) -> Harness:
        args = dict(block_size=BS, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                    max_model_len=256)
        args.update(kw)
        made.append(Harness(Scheduler(**args)))
        return made[-1]

    yield factory
    for h in made:
        kv = h.sched.kv_cache_manager
        assert kv.num_free_blocks == kv.num_blocks
        assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
        assert not h.sched.requests and not h.sched.waiting and not h.sched.running
        assert not h.sched.remote_kv.delayed_free and not h.sched.finished_recving_kv_req_ids
        h.run(max_steps=2)  # report the last finished ids to the runner
        assert not h.sched.has_work() and not h.runner.reqs


# ---- batching ----------------------------------------------------------------------------


def test_prefill_then_decode_until_max_tokens(make):
    h = make()
    h.sched.add_request(_req("a", 10, max_tokens=3))
    so, outs = h.step()
    assert [n.req_id for n in so.scheduled_new_reqs] == ["a"]
    assert so.num_scheduled_tokens == {"a": 10}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0
    assert len(so.scheduled_new_reqs[0].block_ids) == 3
    assert len(outs) == 1 and len(outs[0].new_token_ids) == 1 and not outs[0].finished
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs[0].num_computed_tokens == 10
    h.step()
    assert h.final("a").finish_reason == FinishReason.LENGTH and len(h.tokens("a")) == 3
    so, outs = h.step()  # the runner learns that "a" finished
    assert so.finished_req_ids == {"a"} and so.is_empty and outs == []


def test_chunked_prefill_respects_the_token_budget(make):
    h = make(max_num_batched_tokens=8)
    h.sched.add_request(_req("a", 20, max_tokens=2))
    sizes = []
    for _ in range(3):
        so, outs = h.step()
        sizes.append(so.num_scheduled_tokens["a"])
        assert (outs == []) == (sum(sizes) < 20)  # no token until the prompt is done
    assert sizes == [8, 8, 4]
    h.run()
    assert len(h.tokens("a")) == 2


def test_running_requests_go_first_and_waiting_ones_fill_the_rest(make):
    h = make(max_num_batched_tokens=8)
    h.sched.add_request(_req("a", 5, max_tokens=5))
    h.step()
    h.sched.add_request(_req("b", 20, max_tokens=1))
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a"]
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"a": 1, "b": 7}
    assert [c.req_id for c in so.scheduled_cached_reqs] == ["a", "b"]
    h.run()


def test_max_num_seqs_caps_the_running_set(make):
    h = make(max_num_seqs=2)
    for rid in "abc":
        h.sched.add_request(_req(rid, 3, max_tokens=2))
    so, _ = h.step()
    assert set(so.num_scheduled_tokens) == {"a", "b"} and len(h.sched.waiting) == 1
    h.step()  # a and b finish here
    so, _ = h.step()
    assert set(so.num_scheduled_tokens) == {"c"}
    h.run()


def test_waiting_requests_are_admitted_first_come_first_served(make):
    h = make(num_blocks=8, max_num_batched_tokens=64)
    h.sched.add_request(_req("a", 20, max_tokens=2))  # 5 blocks
    h.step()
    h.sched.add_request(_req("big", 16, max_tokens=1))  # needs 4 blocks + 0 hits: 2 left
    h.sched.add_request(_req("small", 2, max_tokens=1))  # would fit, but must not jump
    so, _ = h.step()
    assert set(so.num_scheduled_tokens) == {"a"}
    assert [r.request_id for r in h.sched.waiting] == ["big", "small"]
    h.run()
    assert h.final("big").finished and h.final("small").finished


def test_prefix_cache_hit_skips_the_shared_prefix(make):
    h = make()
    prompt = list(range(1, 11))
    h.sched.add_request(_req("a", prompt, max_tokens=1))
    h.run()
    h.sched.add_request(_req("b", prompt[:9] + [77], max_tokens=1))
    so, outs = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8 and so.num_scheduled_tokens == {"b": 2}
    assert outs[0].num_cached_tokens == 8
    stats = h.sched.make_stats()
    assert stats.prefix_cache_queries == 20 and stats.prefix_cache_hits == 8


def test_identical_prompt_never_hits_its_last_token(make):
    h = make()
    prompt = list(range(1, 9))  # two full blocks
    h.sched.add_request(_req("a", prompt, max_tokens=1))
    h.run()
    h.sched.add_request(_req("b", prompt, max_tokens=1))
    so, outs = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 4 and so.num_scheduled_tokens == {"b": 4}
    assert h.tokens("b") == h.tokens("a")  # same prefix, same (fake) model: same token


def test_blocks_from_a_step_are_cached_only_after_it_ran(make):
    h = make()
    prompt = list(range(1, 14))
    h.sched.add_request(_req("a", prompt, max_tokens=1))
    h.sched.add_request(_req("b", prompt, max_tokens=1))  # same step: nothing to hit yet
    so, _ = h.step()
    assert [n.num_computed_tokens for n in so.scheduled_new_reqs] == [0, 0]
    h.sched.add_request(_req("c", prompt, max_tokens=1))
    so, _ = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    h.run()


def test_reset_prefix_cache_only_when_idle(make):
    h = make()
    h.sched.add_request(_req("a", list(range(9)), max_tokens=2))
    h.step()
    assert h.sched.reset_prefix_cache() is False
    h.run()
    assert h.sched.reset_prefix_cache() is True
    h.sched.add_request(_req("b", list(range(9)), max_tokens=1))
    so, _ = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 0


# ---- preemption --------------------------------------------------------------------------


def test_preemption_takes_the_latest_request_and_resumes_it_with_all_tokens(make):
    # 6 blocks of 4: a and b hold 3 full blocks each after their 12-token prompts.
    ref = make(num_blocks=64)
    h = make(num_blocks=6)
    for harness in (ref, h):
        harness.sched.add_request(_req("a", 12, max_tokens=8))
        harness.sched.add_request(_req("b", 12, max_tokens=8))
    ref.run()
    h.step()  # prefill both: 3 blocks each, pool empty, first tokens sampled
    so, _ = h.step()  # a decodes into slot 12 -> needs a 4th block: b is preempted
    assert so.preempted_req_ids == {"b"} and set(so.num_scheduled_tokens) == {"a"}
    b = h.sched.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert h.sched.waiting[0] is b and h.sched.kv_cache_manager.get_block_ids("b") == []
    tokens_so_far = list(b.all_token_ids)
    assert len(tokens_so_far) == 13  # the prompt and the token sampled before preemption
    resumed = None
    for _ in range(100):
        so, _ = h.step()
        resumed = next((n for n in so.scheduled_new_reqs if n.req_id == "b"), None)
        if resumed:
            break
    assert resumed is not None
    assert resumed.token_ids == tokens_so_far
    assert resumed.num_prompt_tokens == 12
    h.run()
    # Recompute is invisible in the output: same tokens as the run that never preempted.
    assert h.tokens("a") == ref.tokens("a") and h.tokens("b") == ref.tokens("b")
    assert b.num_preemptions >= 1


def test_a_request_preempts_itself_when_it_is_the_last_one(make):
    conn = FakeConnector()
    h = make(num_blocks=4, connector=conn)
    conn.delay_free.add("p")  # "p" keeps 2 blocks after it finishes (a P-side lease)
    h.sched.add_request(_req("p", 8, max_tokens=1))
    h.step()
    assert h.sched.kv_cache_manager.num_free_blocks == 2
    h.sched.add_request(_req("a", 8, max_tokens=4))
    h.step()  # the prompt fills 2 blocks; the first sampled token goes to position 8
    so, _ = h.step()  # needs a 3rd block: none, and nobody else to preempt
    assert so.preempted_req_ids == {"a"} and so.is_empty
    assert h.sched.waiting[0].request_id == "a"
    h.runner.kvo = KVConnectorOutput(finished_sending={"p"})
    h.step()  # the lease ends: blocks come back
    h.run()
    assert len(h.tokens("a")) == 4 and h.final("a").finish_reason == FinishReason.LENGTH


def test_first_scheduled_time_comes_from_the_injected_clock(make):
    now = [100.0]
    h = make(num_blocks=6, clock=lambda: now[0])
    a, b = _req("a", 12, max_tokens=6), _req("b", 12, max_tokens=6)
    h.sched.add_request(a)
    h.sched.add_request(b)
    h.step()
    now[0] = 200.0
    h.run()  # b is preempted and resumed on the way
    assert b.num_preemptions >= 1
    assert a.first_scheduled_time == 100.0 and b.first_scheduled_time == 100.0


# ---- stop conditions ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, script, expect_tokens, reason, stop_reason",
    [
        ({"max_tokens": 10}, [5, 6, 2, 7], [5, 6, 2], FinishReason.STOP, None),  # eos = 2
        ({"max_tokens": 10, "min_tokens": 3}, [2, 2, 2, 2], [2, 2, 2], FinishReason.STOP, None),
        ({"max_tokens": 3, "ignore_eos": True}, [2, 2, 2, 2], [2, 2, 2], FinishReason.LENGTH,
         None),
        ({"max_tokens": 10, "stop_token_ids": [9]}, [5, 9, 1], [5, 9], FinishReason.STOP, 9),
        ({"max_tokens": 10, "stop_token_ids": [9], "min_tokens": 2}, [9, 9, 1], [9, 9],
         FinishReason.STOP, 9),
        ({"max_tokens": 2}, [5, 6, 7], [5, 6], FinishReason.LENGTH, None),
        ({"max_tokens": 2}, [5, 2], [5, 2], FinishReason.STOP, None),  # stop beats length
    ],
)
def test_stop_conditions(make, params, script, expect_tokens, reason, stop_reason):
    h = make()
    h.sched.add_request(_req("a", 5, eos=2, **params))
    h.runner.script["a"] = list(script)
    h.run()
    final = h.final("a")
    assert h.tokens("a") == expect_tokens
    assert final.finish_reason == reason and final.stop_reason == stop_reason


def test_max_model_len_caps_prompt_plus_output(make):
    h = make(max_model_len=12)
    h.sched.add_request(_req("a", 10, max_tokens=100))
    h.run()
    assert len(h.tokens("a")) == 2 and h.final("a").finish_reason == FinishReason.LENGTH


def test_kv_cache_smaller_than_max_model_len_caps_length_instead_of_looping(make):
    h = make(num_blocks=3, max_model_len=1000)  # 12 tokens fit in the whole cache
    h.sched.add_request(_req("a", 10, max_tokens=100))
    h.run()
    assert len(h.tokens("a")) == 2 and h.final("a").finish_reason == FinishReason.LENGTH


def test_prompt_longer_than_max_model_len_is_an_error_reply(make):
    h = make(max_model_len=8)
    h.sched.add_request(_req("long", 9))
    assert h.sched.has_work() and not h.sched.has_unfinished_requests()
    so, outs = h.step()
    assert so.is_empty
    assert outs[0].finish_reason == FinishReason.ERROR and "exceeds" in outs[0].error


def test_empty_prompt_is_an_error_reply(make):
    h = make()
    h.sched.add_request(_req("empty", []))
    _, outs = h.step()
    assert outs[0].finish_reason == FinishReason.ERROR and "empty" in outs[0].error


def test_duplicate_request_id_is_refused(make):
    h = make()
    h.sched.add_request(_req("a", 3, max_tokens=1))
    with pytest.raises(ValueError, match="already known"):
        h.sched.add_request(_req("a", 3))
    h.run()


# ---- aborts ------------------------------------------------------------------------------


def test_abort_in_every_state_frees_blocks_and_emits_nothing(make):
    conn = FakeConnector()
    h = make(num_blocks=12, max_num_batched_tokens=16, connector=conn)
    conn.remote["remote"] = "async"
    h.sched.add_request(_req("decoding", 5, max_tokens=50))
    h.sched.add_request(_req("remote", 6, max_tokens=50))
    h.step()
    h.sched.add_request(_req("prefilling", 40, max_tokens=50))
    h.step()  # prefilling gets a 15-token chunk
    h.sched.add_request(_req("waiting", 4, max_tokens=50))
    states = {rid: r.status for rid, r in h.sched.requests.items()}
    assert states == {
        "decoding": RequestStatus.RUNNING, "remote": RequestStatus.WAITING_FOR_REMOTE_KVS,
        "prefilling": RequestStatus.RUNNING, "waiting": RequestStatus.WAITING,
    }
    assert 0 < h.sched.requests["prefilling"].num_computed_tokens < 40
    for _ in range(30):  # grow until something is preempted
        so, _ = h.step()
        if so.preempted_req_ids:
            break
    preempted = next(iter(so.preempted_req_ids))
    assert h.sched.requests[preempted].status == RequestStatus.PREEMPTED
    before = {rid for rid, r in h.sched.requests.items() if r.status == RequestStatus.RUNNING}
    h.sched.finish_requests(list(h.sched.requests), RequestStatus.FINISHED_ABORTED)
    assert len(conn.called("finished")) == 4
    so, outs = h.step()
    assert outs == [] and so.finished_req_ids == before  # only what the runner holds


def test_abort_while_the_step_runs_drops_its_output(make):
    h = make()
    h.sched.add_request(_req("a", 5, max_tokens=5))
    so = h.sched.schedule()
    ro = h.runner.execute(so)
    h.sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert h.sched.update_from_output(so, ro) == []
    h.run()


def test_finish_requests_needs_a_finished_status(make):
    h = make()
    with pytest.raises(ValueError):
        h.sched.finish_requests(["x"], RequestStatus.RUNNING)


def test_runner_without_a_token_for_a_finished_prompt_fails_the_request(make):
    h = make()
    h.sched.add_request(_req("a", 5))
    so = h.sched.schedule()
    h.runner.execute(so)
    outs = h.sched.update_from_output(so, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[]]))
    assert outs[0].finish_reason == FinishReason.ERROR and "no token" in outs[0].error
    h.run()


# ---- connector hooks ---------------------------------------------------------------------


def test_remote_prefill_parks_then_computes_only_the_last_prompt_token(make):
    conn = FakeConnector()
    h = make(connector=conn)
    prompt = list(range(1, 11))
    conn.remote["d"] = "async"
    h.sched.add_request(_req("d", prompt, max_tokens=3))
    so, _ = h.step()
    d = h.sched.requests["d"]
    assert so.is_empty and d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    blocks = h.sched.kv_cache_manager.get_block_ids("d")
    assert len(blocks) == 3 and d.num_computed_tokens == 0
    assert conn.called("match") == [("match", "d", 0)]
    assert conn.called("alloc") == [("alloc", "d", blocks, 10)]
    assert so.kv_connector_metadata == {"num_scheduled": {}}
    so, _ = h.step()  # still parked
    assert so.is_empty and d.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.runner.write_kv(blocks, prompt, 10)  # P pushes the KV
    h.runner.kvo = KVConnectorOutput(finished_recving={"d"})
    h.step()
    so, outs = h.step()
    assert so.num_scheduled_tokens == {"d": 1} and so.scheduled_new_reqs[0].num_computed_tokens == 9
    assert so.scheduled_new_reqs[0].block_ids == blocks
    # usage's cached_tokens counts this engine's prefix-cache hit only, not KV received
    assert len(outs[0].new_token_ids) == 1 and outs[0].num_cached_tokens == 0
    h.run()
    assert len(h.tokens("d")) == 3
    # The received blocks are in the prefix cache now.
    h.sched.add_request(_req("again", prompt + [5], max_tokens=1))
    so, _ = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 8
    h.run()


def test_landed_requests_run_past_a_preempted_one_waiting_for_blocks(make):
    """Parked D legs hold 4 of 6 blocks; a local request grows, preempts itself and waits at
    the head of the queue for 3 blocks. When the legs' KV lands they run past it (a block at
    most each), finish, and give it the blocks; with the head blocking everything, nothing ran
    and nothing freed a block: a hang."""
    conn = FakeConnector()
    h = make(num_blocks=6, connector=conn)
    prompts = {rid: _req(rid, 5).prompt_token_ids for rid in ("r1", "r2")}
    for rid, prompt in prompts.items():
        conn.remote[rid] = "async"
        h.sched.add_request(_req(rid, prompt, max_tokens=2))
    h.step()  # both parked: 2 blocks each
    h.sched.add_request(_req("loc", 4, max_tokens=12))
    for _ in range(10):
        so, _ = h.step()
        if so.preempted_req_ids:
            break
    assert so.preempted_req_ids == {"loc"} and h.sched.waiting[0].request_id == "loc"
    for rid, prompt in prompts.items():
        h.runner.write_kv(h.sched.kv_cache_manager.get_block_ids(rid), prompt, 5)
    h.runner.kvo = KVConnectorOutput(finished_recving={"r1", "r2"})
    h.run(max_steps=100)
    assert [len(h.tokens(rid)) for rid in ("r1", "r2", "loc")] == [2, 2, 12]


def test_remote_prefill_after_a_local_prefix_hit_asks_only_for_the_rest(make):
    conn = FakeConnector()
    h = make(connector=conn)
    prompt = list(range(1, 15))
    h.sched.add_request(_req("local", prompt[:9], max_tokens=1))
    h.run()
    conn.remote["d"] = "async"
    h.sched.add_request(_req("d", prompt, max_tokens=2))
    h.step()
    assert conn.called("match")[-1] == ("match", "d", 8)
    _, rid, block_ids, n_ext = conn.called("alloc")[-1]
    assert n_ext == 6 and len(block_ids) == 4
    h.runner.write_kv(block_ids, prompt, 14)
    h.runner.kvo = KVConnectorOutput(finished_recving={"d"})
    h.step()
    so, _ = h.step()
    assert so.num_scheduled_tokens == {"d": 1}
    assert so.scheduled_new_reqs[0].num_computed_tokens == 13
    h.run()


def test_synchronous_external_tokens_count_as_computed(make):
    conn = FakeConnector()
    h = make(connector=conn)
    conn.remote["s"] = "sync"
    prompt = list(range(1, 11))
    h.runner.preload["s"] = 10
    h.sched.add_request(_req("s", prompt, max_tokens=2))
    so, outs = h.step()
    # The connector offered all 10; the last token is still computed here.
    assert so.scheduled_new_reqs[0].num_computed_tokens == 9 and so.num_scheduled_tokens == {"s": 1}
    assert len(outs[0].new_token_ids) == 1
    h.run()


@pytest.mark.parametrize("local_hit", [0, 8])
def test_failed_recv_with_recompute_policy_computes_locally(make, local_hit):
    conn = FakeConnector(policy="recompute")
    h = make(connector=conn)
    prompt = list(range(1, 11))
    if local_hit:
        h.sched.add_request(_req("local", prompt[:9], max_tokens=1))
        h.run()
    conn.remote["d"] = "async"
    h.sched.add_request(_req("d", prompt, max_tokens=2))
    h.step()
    blocks = h.sched.kv_cache_manager.get_block_ids("d")
    h.runner.kvo = KVConnectorOutput(failed_recving={"d": "P went away"})
    h.step()
    assert h.sched.requests["d"].status == RequestStatus.WAITING
    so, outs = h.step()
    assert so.scheduled_new_reqs[0].num_computed_tokens == local_hit
    assert so.num_scheduled_tokens == {"d": 10 - local_hit}
    assert so.scheduled_new_reqs[0].block_ids == blocks  # the same blocks, recomputed
    assert len(outs[0].new_token_ids) == 1
    h.run()
    assert h.final("d").finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("local_hit", [0, 8])
def test_failed_recv_whose_blocks_a_write_may_still_hit_recomputes_in_fresh_ones(make,
                                                                                local_hit):
    """The connector says a WRITE may still land in the failed request's blocks (another TP
    rank's part, or one D stopped waiting for): they stay held until the id comes back in
    `finished_sending`, and the request recomputes in fresh blocks (its local prefix hit is
    shared again: no WRITE targets it)."""
    conn = FakeConnector(policy="recompute")
    h = make(connector=conn)
    kv = h.sched.kv_cache_manager
    prompt = list(range(1, 41))
    if local_hit:
        h.sched.add_request(_req("local", prompt[:local_hit + 1], max_tokens=1))
        h.run()
    conn.remote["d"] = "async"
    conn.delay_free.add("d")
    h.sched.add_request(_req("d", prompt, max_tokens=2))
    h.step()
    old = kv.get_block_ids("d")
    h.runner.kvo = KVConnectorOutput(failed_recving={"d": "P rank 1: WRITE failed"})
    h.step()
    assert conn.called("load_failed") == [("load_failed", "d", old)]
    so, outs = h.step()
    new = so.scheduled_new_reqs[0].block_ids
    hit = local_hit // 4  # blocks of 4 tokens
    assert new[:hit] == old[:hit]  # the local prefix hit, shared
    assert not set(new[hit:]) & set(old[hit:]), "recomputed into blocks a WRITE may hit"
    assert so.scheduled_new_reqs[0].num_computed_tokens == local_hit
    while "d" in h.sched.requests:
        h.step()
    assert h.final("d").finish_reason == FinishReason.LENGTH
    assert h.sched.has_work() and kv.num_free_blocks == kv.num_blocks - len(old)  # held
    h.runner.kvo = KVConnectorOutput(finished_sending={"d"})  # nothing can land any more
    h.step()
    assert not h.sched.has_work() and kv.num_free_blocks == kv.num_blocks


def test_failed_recv_with_fail_policy_is_an_error_reply(make):
    conn = FakeConnector(policy="fail")
    h = make(connector=conn)
    conn.remote["d"] = "async"
    h.sched.add_request(_req("d", 10))
    h.step()
    blocks = h.sched.kv_cache_manager.get_block_ids("d")
    h.runner.kvo = KVConnectorOutput(failed_recving={"d": "P went away"},
                                     finished_recving={"d"})
    _, outs = h.step()
    assert len(outs) == 1 and outs[0].finish_reason == FinishReason.ERROR
    assert "P went away" in outs[0].error and "d" in outs[0].error
    assert outs[0].kv_transfer_params == {"params_for": "d"}
    assert conn.called("finished") == [("finished", "d", blocks)]


def test_delayed_free_holds_blocks_until_finished_sending(make):
    conn = FakeConnector()
    h = make(connector=conn)
    conn.delay_free.add("p")
    h.sched.add_request(_req("p", 10, max_tokens=1))
    _, outs = h.step()
    assert outs[0].finished and outs[0].kv_transfer_params == {"params_for": "p"}
    kv = h.sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 3
    assert h.sched.has_work() and not h.sched.has_unfinished_requests()
    h.step()
    assert kv.num_free_blocks == kv.num_blocks - 3
    h.runner.kvo = KVConnectorOutput(finished_sending={"p", "unknown"})
    h.step()
    assert kv.num_free_blocks == kv.num_blocks
    assert [c[0] for c in conn.calls].count("output") == 1


def test_abort_while_waiting_for_remote_kv_goes_through_request_finished(make):
    conn = FakeConnector()
    h = make(connector=conn)
    conn.remote["d"] = "async"
    conn.delay_free.add("d")  # the connector quarantines the blocks a late WRITE may hit
    h.sched.add_request(_req("d", 10))
    h.step()
    blocks = h.sched.kv_cache_manager.get_block_ids("d")
    h.sched.finish_requests(["d"], RequestStatus.FINISHED_ABORTED)
    assert conn.called("finished") == [("finished", "d", blocks)]
    assert h.sched.kv_cache_manager.num_free_blocks == 64 - 3
    h.runner.kvo = KVConnectorOutput(finished_recving={"d"})  # late: ignored
    _, outs = h.step()
    assert outs == [] and not h.sched.finished_recving_kv_req_ids
    h.runner.kvo = KVConnectorOutput(finished_sending={"d"})
    h.step()


def test_connector_that_cannot_answer_yet_does_not_block_later_requests(make):
    conn = FakeConnector()
    h = make(connector=conn)
    conn.remote["slow"] = "unknown"
    h.sched.add_request(_req("slow", 5, max_tokens=1))
    h.sched.add_request(_req("next", 5, max_tokens=1))
    so, _ = h.step()
    assert set(so.num_scheduled_tokens) == {"next"} and h.sched.waiting[0].request_id == "slow"
    so, _ = h.step()  # asked again: now it answers 0
    assert set(so.num_scheduled_tokens) == {"slow"}
    assert [c[1] for c in conn.called("match")] == ["slow", "next", "slow"]
    h.run()


def test_connector_meta_and_pending_work(make):
    conn = FakeConnector()
    h = make(connector=conn)
    h.sched.add_request(_req("a", 5, max_tokens=1))
    so, _ = h.step()
    assert so.kv_connector_metadata == {"num_scheduled": {"a": 5}}
    assert conn.called("meta")[0] == ("meta", {"a": 5})
    h.run()
    conn.pending = True
    assert h.sched.has_work()
    conn.pending = False


def test_stats_report_queues_and_blocks(make):
    h = make(num_blocks=16)
    h.sched.add_request(_req("a", 9, max_tokens=2))
    h.sched.add_request(_req("b", 3, max_tokens=2))
    stats = h.sched.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (2, 0)
    h.step()
    stats = h.sched.make_stats()
    assert (stats.num_waiting_reqs, stats.num_running_reqs) == (0, 2)
    assert stats.num_free_blocks == 16 - 4 and stats.num_total_blocks == 16
    assert stats.kv_cache_usage == pytest.approx(4 / 16)
    h.run()


# ---- randomized ----------------------------------------------------------------------------


def _expected_tokens(prompt: list[int], eos: int | None, max_tokens: int, max_len: int
                     ) -> list[int]:
    """What FakeRunner's model produces for `prompt` alone, with the scheduler's stops."""
    tokens, out = list(prompt), []
    while True:
        tok = 1000 + (sum(tokens) * 7 + len(tokens)) % 997
        tokens.append(tok)
        out.append(tok)
        if tok == eos or len(out) >= max_tokens or len(tokens) >= max_len:
            return out


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_gives_each_request_its_own_tokens_and_leaks_nothing(make, seed):
    import random

    rng = random.Random(seed)
    conn = FakeConnector()
    num_blocks = rng.choice([12, 20, 40])
    h = make(num_blocks=num_blocks, max_num_seqs=rng.choice([2, 4, 8]),
             max_num_batched_tokens=rng.choice([8, 16, 64]), max_model_len=48, connector=conn)
    prefixes = [[rng.randrange(1, 300) for _ in range(rng.randint(4, 20))] for _ in range(3)]
    spec: dict[str, tuple] = {}
    aborted: set[str] = set()
    landing: dict[str, int] = {}  # parked rid -> step its KV lands
    sending: dict[str, int] = {}  # delayed-free rid -> step its send completes
    for step in range(400):
        if step < 120 and rng.random() < 0.35:
            rid = f"r{step}"
            prompt = rng.choice(prefixes) + [rng.randrange(1, 300)
                                             for _ in range(rng.randint(0, 12))]
            eos = rng.choice([None, 1000 + rng.randrange(997)])
            max_tokens = rng.randint(1, 10)
            spec[rid] = (prompt, eos, max_tokens)
            if rng.random() < 0.25:
                conn.remote[rid] = "async"
            if rng.random() < 0.2:
                conn.delay_free.add(rid)
            h.sched.add_request(_req(rid, prompt, eos=eos, max_tokens=max_tokens))
        live = [rid for rid in h.sched.requests if rid not in aborted]
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            aborted.add(victim)
            h.sched.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        for rid, req in h.sched.requests.items():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and rid not in landing:
                landing[rid] = step + rng.randint(0, 3)
        for rid in list(h.sched.remote_kv.delayed_free):
            sending.setdefault(rid, step + rng.randint(0, 3))
        kvo = KVConnectorOutput()
        for rid, due in list(landing.items()):
            req = h.sched.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                del landing[rid]
            elif due <= step:
                del landing[rid]
                if rng.random() < 0.2:
                    kvo.failed_recving[rid] = "injected"
                else:
                    blocks = h.sched.kv_cache_manager.get_block_ids(rid)
                    h.runner.write_kv(blocks, req.prompt_token_ids, req.num_prompt_tokens)
                    kvo.finished_recving.add(rid)
        for rid, due in list(sending.items()):
            if due <= step:
                del sending[rid]
                kvo.finished_sending.add(rid)
        h.runner.kvo = kvo
        h.step()
        if step >= 120 and not h.sched.has_work():
            break
    assert not h.sched.has_work(), "traffic did not drain"
    for rid, (prompt, eos, max_tokens) in spec.items():
        if rid in aborted:
            assert not any(o.finished for o in h.outputs.get(rid, []))  # the caller knows
            continue
        assert h.final(rid).finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert h.tokens(rid) == _expected_tokens(prompt, eos, max_tokens, 48), rid
