"""KVOutputAggregator: N ranks' connector reports → the one the scheduler half expects."""

from __future__ import annotations

from types import SimpleNamespace

from engine.connector_api import KVCacheSpec, KVConnectorOutput
from engine.executor.kv_outputs import KVOutputAggregator, TPConnectorView
from engine.kv_transfer_config import KVTransferConfig
from kvconnector.push.scheduler import PushScheduler


def _out(sending=(), recving=(), failed=None, stats=None) -> dict:
    # the msgpack-decoded form a worker's reply carries
    return {"finished_sending": list(sending), "finished_recving": list(recving),
            "failed_recving": failed or {}, "stats": stats or {}}


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


def test_counters_are_summed_over_ranks_and_typed_outputs_pass():
    agg = KVOutputAggregator(2)
    agg.combine([KVConnectorOutput(stats={"w": 3}), _out(stats={"w": 4, "x": 1})])
    assert agg.stats() == {"w": 7, "x": 1}


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
    stats = {**sched.get_stats(), **agg.stats()}  # as EngineCore.make_stats merges them
    assert stats["kv_recv_failed_total"] == 1 and stats["kv_recompute_fallback_total"] == 1


class _Ranks:
    """The executor's collective RPC as the view sees it: each rank's counters now."""

    def __init__(self, *stats: dict[str, float]) -> None:
        self.stats = list(stats)

    def collective_rpc(self, method: str) -> list[dict[str, float]]:
        assert method == "kv_stats"
        return self.stats


def test_a_scrape_reads_the_ranks_counters_even_when_no_step_reported_them():
    """An idle TP engine takes no steps, yet its ranks count what peers send (a P that got
    D's registrations before its own request arrived): a scrape must show it."""
    agg = KVOutputAggregator(2)
    agg.combine([_out(stats={"kv_push_registrations_received_total": 1}), _out()])
    ranks = _Ranks({"kv_push_registrations_received_total": 2},
                   {"kv_push_registrations_received_total": 1})
    view = TPConnectorView(ranks, agg)
    assert view.get_stats() == {"kv_push_registrations_received_total": 1}  # last step's
    view.refresh_stats()
    assert view.get_stats() == {"kv_push_registrations_received_total": 3}
