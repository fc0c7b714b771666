"""Pull mode with plain data: the scheduler half driving real Schedulers (P and D), the
P-side lease table and the D-side reader over a fake transport. No processes, no sleeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.connector_api import KVCacheSpec, KVConnectorOutput
from engine.kv_transfer_config import KVTransferConfig
from engine.protocol import FinishReason, SamplingParams
from engine.runner_output import ModelRunnerOutput
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import Scheduler
from kvconnector import wire
from kvconnector.peers import PeerState
from kvconnector.pull.lender import Lender
from kvconnector.pull.meta import Claim, Lease, Read, prompt_digest
from kvconnector.pull.params import validate_request_params
from kvconnector.pull.reader import Reader
from kvconnector.pull.scheduler import PullScheduler

BS = 4
NUM_BLOCKS = 64
LEASE = 10.0


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _engine(engine_id: str, port: int, clock: Clock, policy: str = "recompute"):
    kv = KVTransferConfig(kv_connector="NixlConnector", engine_id=engine_id, kv_port=port,
                          kv_connector_extra_config={"kv_lease_duration": LEASE,
                                                     "kv_load_failure_policy": policy})
    spec = KVCacheSpec(num_blocks=NUM_BLOCKS, block_size=BS, num_layers=1, num_kv_heads=1,
                       head_dim=4, dtype="float32", bytes_per_block=64, model_name="m")
    conn = PullScheduler(SimpleNamespace(kv_transfer_config=kv), spec, clock=clock,
                         wall_clock=clock)
    sched = Scheduler(block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=8,
                      max_num_batched_tokens=64, max_model_len=256, connector=conn, clock=clock)
    return sched, conn


def _step(sched: Scheduler, kvo: KVConnectorOutput | None = None):
    """One engine step with a runner that samples token 5 once the prompt is computed."""
    so = sched.schedule()
    ids = list(so.num_scheduled_tokens)
    sampled = [[5] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
               else [] for r in ids]
    out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=sampled, logprobs=[None] * len(ids),
                            kv_connector_output=kvo)
    return so, sched.update_from_output(so, out)


def _req(rid: str, prompt: list[int], kv: dict | None, max_tokens: int = 3) -> Request:
    return Request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), None,
                   kv_transfer_params=kv)


def _prefill_on_p(prompt: list[int], rid: str = "p-req-0badcafe"):
    """Run a P leg to completion; return (P scheduler, P connector, answer, lease meta)."""
    clock = Clock()
    p, pc = _engine("P0", 7001, clock)
    p.add_request(_req(rid, prompt, {"do_remote_decode": True, "transfer_id": "t1"},
                       max_tokens=1))
    _, outs = _step(p)
    (final,) = outs
    assert final.finish_reason == FinishReason.LENGTH
    meta = p.schedule().kv_connector_metadata  # the lease travels with the next step
    return p, pc, final.kv_transfer_params, meta


# ---- P side ------------------------------------------------------------------------------


def test_p_answers_with_its_prompt_blocks_and_holds_them_until_finished_sending():
    prompt = list(range(100, 110))  # 10 tokens: 3 blocks
    p, pc, answer, meta = _prefill_on_p(prompt)
    assert answer["remote_block_ids"] == meta.leases[0].block_ids
    assert len(answer["remote_block_ids"]) == 3
    assert answer | {"remote_block_ids": None} == {
        "do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "127.0.0.1",
        "remote_port": 7001, "tp_size": 1, "remote_request_id": "p-req-0badcafe",
        "remote_block_ids": None, "num_prompt_tokens": 10,
        "prompt_digest": prompt_digest(prompt), "lease_expires_at": 1000.0 + LEASE,
        "transfer_id": "t1", "first_token_ids": [5]}  # the token P sampled (issue 28)
    validate_request_params(answer)
    assert meta.leases == [Lease("p-req-0badcafe", answer["remote_block_ids"])]
    assert p.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 3
    assert p.has_work()
    _step(p, KVConnectorOutput(finished_sending={"p-req-0badcafe"}))
    assert p.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not any(pc.table_sizes().values()) and not p.has_work()


def test_p_request_aborted_before_its_prefill_ends_leases_nothing():
    clock = Clock()
    p, pc = _engine("P0", 7001, clock)
    p.add_request(_req("p1", list(range(30)), {"do_remote_decode": True}, max_tokens=1))
    p.finish_requests("p1", RequestStatus.FINISHED_ABORTED)
    assert p.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not p.schedule().kv_connector_metadata.brings_work()
    assert not any(pc.table_sizes().values())


# ---- D side ------------------------------------------------------------------------------


def test_d_reads_every_prompt_block_then_computes_only_the_last_token():
    prompt = list(range(200, 210))
    _, _, answer, _ = _prefill_on_p(prompt)
    d, dc = _engine("D0", 7002, Clock())
    d.add_request(_req("d1", prompt, answer))
    so, outs = _step(d)
    assert so.num_scheduled_tokens == {} and outs == []
    meta = so.kv_connector_metadata
    claim = Claim("d1", "p-req-0badcafe", "P0", "127.0.0.1", 7001)
    assert meta.claims == [claim]
    (read,) = meta.reads
    assert read.claim == claim and read.first_block_index == 0
    assert read.remote_block_ids == answer["remote_block_ids"]
    assert read.local_block_ids == d.kv_cache_manager.get_block_ids("d1")[:3]
    assert d.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    _step(d)  # still parked: nothing arrived
    assert d.requests["d1"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    so, _ = _step(d, KVConnectorOutput(finished_recving={"d1"}))
    so, _ = _step(d)
    assert so.num_scheduled_tokens == {"d1": 1}
    assert dc.get_stats()["kv_remote_prefill_tokens_total"] == len(prompt) - 1
    while d.has_unfinished_requests():
        _step(d)
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS  # freed at once: READ was over
    _step(d)  # hands the finished id to the runner
    assert not any(dc.table_sizes().values()) and not d.has_work()


def test_partial_prefix_hit_on_d_reads_only_the_missing_blocks():
    base = list(range(300, 309))  # 9 tokens: D caches 2 full blocks
    longer = base[:8] + list(range(400, 406))  # 14 tokens, 4 blocks, first 2 shared
    _, _, answer, _ = _prefill_on_p(longer)
    d, dc = _engine("D0", 7002, Clock())
    d.add_request(_req("local", base, None))
    while d.has_unfinished_requests():
        _step(d)
    d.add_request(_req("d2", longer, answer))
    so, _ = _step(d)
    (read,) = so.kv_connector_metadata.reads
    assert read.first_block_index == 2
    assert read.remote_block_ids == answer["remote_block_ids"][2:4]
    assert read.local_block_ids == d.kv_cache_manager.get_block_ids("d2")[2:4]
    _step(d, KVConnectorOutput(finished_recving={"d2"}))
    so, _ = _step(d)
    assert so.num_scheduled_tokens == {"d2": 1}
    assert dc.get_stats()["kv_remote_prefill_tokens_total"] == len(longer) - 1 - 8


def _mutations(answer: dict, prompt: list[int]):
    other = [t + 1 for t in prompt]
    return {
        "other_prompt": {**answer, "prompt_digest": prompt_digest(other)},
        "token_count": {**answer, "num_prompt_tokens": len(prompt) + 1},
        "block_count": {**answer, "remote_block_ids": answer["remote_block_ids"][:-1]},
        "expired_lease": {**answer, "lease_expires_at": 1000.0 - 1.0},
        "tp_size": {**answer, "tp_size": 2},
        "no_request_id": {k: v for k, v in answer.items() if k != "remote_request_id"},
    }


@pytest.mark.parametrize("case", ["other_prompt", "token_count", "block_count",
                                  "expired_lease", "tp_size", "no_request_id"])
def test_params_that_do_not_fit_the_prompt_mean_a_local_prefill(case):
    prompt = list(range(500, 510))
    _, _, answer, _ = _prefill_on_p(prompt)
    d, dc = _engine("D0", 7002, Clock())
    d.add_request(_req("d3", prompt, _mutations(answer, prompt)[case]))
    so, _ = _step(d)
    assert so.num_scheduled_tokens == {"d3": len(prompt)}
    assert not so.kv_connector_metadata.brings_work()
    assert dc.get_stats()["kv_pull_refused_params_total"] == 1


def test_one_p_request_is_read_once_a_replay_prefills_locally():
    prompt = list(range(600, 610))
    _, _, answer, _ = _prefill_on_p(prompt)
    clock = Clock()
    d, dc = _engine("D0", 7002, clock)
    d.add_request(_req("first", prompt, answer))
    d.add_request(_req("second", prompt, answer))  # same P request while the first reads
    so, _ = _step(d)
    assert so.num_scheduled_tokens == {"second": len(prompt)}
    assert [r.claim.request_id for r in so.kv_connector_metadata.reads] == ["first"]
    _step(d, KVConnectorOutput(finished_recving={"first"}))
    while d.has_unfinished_requests():
        _step(d)
    clock.t += 1.0
    d.add_request(_req("replay", prompt, answer))  # after the READ: P's blocks are gone
    so, _ = _step(d)
    assert so.num_scheduled_tokens == {"replay": len(prompt) - 8}  # local prefix hit only
    assert not so.kv_connector_metadata.brings_work()
    assert dc.get_stats()["kv_pull_refused_params_total"] == 2


def test_failed_read_recomputes_the_prompt_locally():
    prompt = list(range(700, 710))
    _, _, answer, _ = _prefill_on_p(prompt)
    d, dc = _engine("D0", 7002, Clock())
    d.add_request(_req("d4", prompt, answer))
    _step(d)
    registered = d.kv_cache_manager.get_block_ids("d4")
    _step(d, KVConnectorOutput(failed_recving={"d4": "READ from prefill engine P0 failed"}))
    so, _ = _step(d)
    # another TP rank's READ may still land in the blocks the READ targeted: the request
    # recomputes in fresh ones, and those wait until every rank's READ is over
    assert so.kv_connector_metadata.released == ["d4"]
    assert so.num_scheduled_tokens == {"d4": len(prompt)}
    assert not set(so.scheduled_new_reqs[0].block_ids) & set(registered)
    assert dc.get_stats()["kv_recompute_fallback_total"] == 1
    assert dc.get_stats()["kv_recv_failed_total"] == 1
    assert dc.get_stats()["kv_remote_prefill_tokens_total"] == 0
    while d.has_unfinished_requests():
        _step(d)
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS - len(registered)
    _step(d, KVConnectorOutput(finished_sending={"d4"}))  # every rank's READ is over
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not any(dc.table_sizes().values()) and not d.has_work()


def test_failed_read_under_fail_policy_ends_the_request_with_the_reason():
    prompt = list(range(800, 810))
    _, _, answer, _ = _prefill_on_p(prompt)
    d, dc = _engine("D0", 7002, Clock(), policy="fail")
    d.add_request(_req("d5", prompt, answer))
    _step(d)
    _, outs = _step(d, KVConnectorOutput(
        failed_recving={"d5": "handshake with prefill engine P0 at 127.0.0.1:7001 failed"}))
    (final,) = outs
    assert final.finish_reason == FinishReason.ERROR
    assert "P0 at 127.0.0.1:7001" in final.error
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 3  # another rank may still READ
    so, _ = _step(d)
    assert so.kv_connector_metadata.released == ["d5"]
    _step(d, KVConnectorOutput(finished_sending={"d5"}))
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not any(dc.table_sizes().values())


def test_request_aborted_during_its_read_keeps_its_blocks_until_the_read_is_over():
    prompt = list(range(900, 910))
    _, _, answer, _ = _prefill_on_p(prompt)
    d, dc = _engine("D0", 7002, Clock())
    d.add_request(_req("d6", prompt, answer))
    _step(d)
    d.finish_requests("d6", RequestStatus.FINISHED_ABORTED)
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 3
    so, _ = _step(d, KVConnectorOutput(finished_recving={"d6"}))  # raced the abort: ignored
    assert so.kv_connector_metadata.released == ["d6"]
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS - 3
    _step(d, KVConnectorOutput(finished_sending={"d6"}))
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert dc.get_stats()["kv_remote_prefill_tokens_total"] == 0
    assert not any(dc.table_sizes().values()) and not d.has_work()


def test_request_aborted_while_queued_returns_the_lease_without_reading():
    prompt = list(range(1000, 1010))
    _, _, answer, _ = _prefill_on_p(prompt)
    d, dc = _engine("D0", 7002, Clock())
    d.add_request(_req("d7", prompt, answer))
    d.finish_requests("d7", RequestStatus.FINISHED_ABORTED)
    meta = d.schedule().kv_connector_metadata
    assert [c.request_id for c in meta.claims] == ["d7"]
    assert meta.reads == [] and meta.abandoned == ["d7"]
    assert d.kv_cache_manager.num_free_blocks == NUM_BLOCKS
    assert not any(dc.table_sizes().values())


@pytest.mark.parametrize(("params", "field"), [
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "h",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": 3, "remote_request_id": "r"},
     "remote_block_ids"),
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "h",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": 3, "remote_block_ids": [0]},
     "remote_request_id"),
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "h",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": 3, "remote_block_ids": [0],
      "remote_request_id": "a,b"}, "remote_request_id"),
    ({"do_remote_prefill": True, "remote_engine_id": "P0", "remote_host": "h",
      "remote_port": 1, "tp_size": 1, "num_prompt_tokens": 3, "remote_block_ids": [0],
      "remote_request_id": "r", "lease_expires_at": "soon"}, "lease_expires_at"),
])
def test_bad_d_leg_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        validate_request_params(params)


# ---- P lease table -----------------------------------------------------------------------


def _stats() -> dict[str, float]:
    return {k: 0 for k in ("kv_pull_leases_total", "kv_pull_leases_returned_total",
                           "kv_lease_expired_total", "kv_pull_reads_total",
                           "kv_transfer_bytes_total", "kv_transfer_seconds_sum",
                           "kv_transfer_seconds_count")}


def test_lease_is_freed_once_on_completion_and_heartbeats_extend_it():
    clock, stats = Clock(), _stats()
    lender = Lender(clock, lease=LEASE, stats=stats)
    lender.on_lease(Lease("a", [1, 2]))
    lender.on_lease(Lease("b", [3]))
    clock.t += LEASE - 1
    lender.on_heartbeat(["b", "unknown"])
    clock.t += 2
    lender.poll()
    assert lender.done == {"a"} and stats["kv_lease_expired_total"] == 1
    assert lender.on_completion("b") and not lender.on_completion("b")
    assert not lender.on_completion("a")  # late completion after expiry changes nothing
    assert lender.done == {"a", "b"} and not lender.needs_poll()
    assert stats["kv_pull_leases_returned_total"] == 1


# ---- D reader over a fake transport ------------------------------------------------------


class FakeTransport:
    def __init__(self) -> None:
        self.reads: list[tuple] = []
        self.notifs: list[tuple[str, bytes]] = []
        self.state = "PROC"

    def read(self, agent, local, remote, notif=b""):
        self.reads.append((agent, list(local), list(remote)))
        return object()

    def check(self, handle) -> str:
        return self.state

    def release(self, handle) -> bool:
        return self.state != "PROC"

    def send_notif(self, agent, msg) -> None:
        self.notifs.append((agent, msg))


class FakePeers:
    def __init__(self, state: PeerState) -> None:
        self.state = state

    def get(self, addr):
        return self.state

    def mark_failed(self, addr, reason: str) -> None:
        self.state = PeerState("failed", reason=reason)


def _reader(peer: PeerState, clock: Clock | None = None):
    t, stats = FakeTransport(), _stats()
    r = Reader(t, FakePeers(peer), clock or Clock(), hb_interval=1.0, bytes_per_block=64,
               stats=stats)
    return r, t, stats


CLAIM = Claim("d1", "p-req-1", "P0", "127.0.0.1", 7001)
READ = Read(CLAIM, [7, 8], [3, 4], 0)


def test_reader_reports_the_read_and_returns_the_lease_to_p():
    r, t, stats = _reader(PeerState("ready", agent_name="P0-tp0", engine_id="P0"))
    r.on_claim(CLAIM)
    r.poll()
    assert t.notifs == [("P0-tp0", b"HB:p-req-1")]
    r.on_read(READ)
    r.poll()
    assert t.reads == [("P0-tp0", [7, 8], [3, 4])] and r.needs_poll()
    t.state = "DONE"
    r.poll()
    assert r.finished_recving == {"d1"} and not r.needs_poll()
    assert t.notifs[-1] == ("P0-tp0", wire.encode_completion("p-req-1", 1))
    assert stats["kv_transfer_bytes_total"] == 128 and stats["kv_pull_reads_total"] == 1
    assert not any(r.table_sizes().values())


def test_reader_holds_released_blocks_until_the_read_is_over():
    r, t, _ = _reader(PeerState("ready", agent_name="P0-tp0", engine_id="P0"))
    r.on_read(READ)
    r.poll()
    r.on_released("d1")
    r.poll()
    assert r.done == set()
    t.state = "ERR"
    r.poll()
    assert r.done == {"d1"} and not r.failed_recving and not r.finished_recving
    assert not any(r.table_sizes().values())
    r.on_read(Read(Claim("d2", "p-req-2", "P0", "127.0.0.1", 7001), [9], [5], 0))
    r.poll()  # P is suspect after a failed READ: no READ on its stale metadata
    assert "P0 at 127.0.0.1:7001" in r.failed_recving["d2"] and len(t.reads) == 1


def test_handshake_failure_fails_the_load_naming_the_peer():
    r, t, stats = _reader(PeerState("failed", reason="timeout"))
    r.on_read(READ)
    r.poll()
    assert "P0 at 127.0.0.1:7001" in r.failed_recving["d1"]
    assert t.reads == []


def test_side_channel_of_another_engine_is_not_read_from():
    r, t, _ = _reader(PeerState("ready", agent_name="X-tp0", engine_id="X"))
    r.on_read(READ)
    r.poll()
    assert "serves engine X" in r.failed_recving["d1"] and t.reads == []
