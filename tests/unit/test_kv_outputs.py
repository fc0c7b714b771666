"""KVOutputAggregator: N ranks' connector reports → the one the scheduler half expects."""

from __future__ import annotations

from types import SimpleNamespace

from engine.connector_api import KVCacheSpec, KVConnectorOutput
from engine.executor.kv_outputs import KVOutputAggregator
from engine.executor.multiproc import MultiprocExecutor
from engine.kv_transfer_config import KVTransferConfig
from kvconnector.push.scheduler import PushScheduler


def _out(sending=(), recving=(), failed=None) -> KVConnectorOutput:
    # what a worker's reply carries, decoded typed
    return KVConnectorOutput(finished_sending=set(sending), finished_recving=set(recving),
                             failed_recving=failed or {})


def test_done_only_once_every_rank_said_so_even_in_different_steps():
    agg = KVOutputAggregator(2)
    first = agg.combine([_out(recving=["a"], sending=["p"]), _out()])
    assert first.finished_recving == set() and first.finished_sending == set()
    second = agg.combine([_out(), _out(recving=["a"], sending=["p"])])
    assert second.finished_recving == {"a"} and second.finished_sending == {"p"}
    assert not any(agg.table_sizes().values())


def test_a_failure_on_any_rank_fails_at_once_and_later_words_are_dropped():
    agg = KVOutputAggregator(2)
    out = agg.combine([_out(recving=["a"]), _out(failed={"a": "P gone"})])
    assert out.failed_recving == {"a": "tensor-parallel rank 1: P gone"}
    assert out.finished_recving == set()
    later = agg.combine([_out(failed={"a": "cancelled"}), _out(recving=["a"])])
    assert later.failed_recving == {} and later.finished_recving == set()
    agg.combine([_out(sending=["a"]), _out(sending=["a"])])  # released on every rank
    assert not any(agg.table_sizes().values())


def test_a_rank_reply_decodes_to_the_typed_output_the_aggregator_takes():
    import msgspec

    wire = msgspec.msgpack.encode(_out(recving=["a"], failed={"b": "gone"}))
    assert msgspec.msgpack.decode(wire, type=KVConnectorOutput) == _out(
        recving=["a"], failed={"b": "gone"})


def test_a_request_failed_on_every_rank_counts_once():
    """`kv_recv_failed_total` and `kv_recompute_fallback_total` count requests (docs/design.md
    §8): both D ranks failing one request (P died) is one failed request, not two."""
    kv = KVTransferConfig(kv_connector="NixlPushConnector", engine_id="D0", kv_port=1)
    spec = KVCacheSpec(num_blocks=8, block_size=4, num_layers=1, num_kv_heads=2, head_dim=4,
                       dtype="float32", bytes_per_block=64, model_name="m")
    sched = PushScheduler(SimpleNamespace(kv_transfer_config=kv), spec)
    agg = KVOutputAggregator(2)
    sched.update_connector_output(agg.combine([_out(failed={"a": "P gone"}), _out()]))
    sched.update_connector_output(agg.combine([_out(), _out(failed={"a": "P gone"})]))
    stats = sched.get_stats()  # the per-request counters are the scheduler half's
    assert stats["kv_recv_failed_total"] == 1 and stats["kv_recompute_fallback_total"] == 1


class _Ranks:
    """The executor's collective RPC as `connector_stats` sees it: each rank's counters now."""

    kv_outputs = KVOutputAggregator(2)

    def __init__(self, *stats: dict[str, float]) -> None:
        self.stats = list(stats)

    def collective_rpc(self, method: str) -> list[dict[str, float]]:
        assert method == "kv_stats"
        return self.stats


def test_a_scrape_reads_the_ranks_counters_even_when_no_step_reported_them():
    """An idle TP engine takes no steps, yet its ranks count what peers send (a P that got
    D's registrations before its own request arrived): a scrape must show it."""
    ranks = _Ranks({"kv_push_registrations_received_total": 2},
                   {"kv_push_registrations_received_total": 1, "x": 1})
    assert MultiprocExecutor.connector_stats(ranks) == {  # type: ignore[arg-type]
        "kv_push_registrations_received_total": 3, "x": 1}
