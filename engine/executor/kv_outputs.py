"""The KV connector seen from EngineCore when its worker halves live in TP worker processes.

Every rank runs its own worker half (docs/design.md §8) and reports, each step, what it
finished. `KVOutputAggregator` turns the N per-rank reports into the one the scheduler half
expects: a request's blocks may be freed (`finished_sending`) and its remote KV has landed
(`finished_recving`) only once **every** rank said so; a failed receipt on any rank fails the
request at once (the scheduler recomputes or fails it), and the other ranks' later word on
it is dropped. Counters are the per-rank cumulative counters summed (the per-request ones,
e.g. `kv_recv_failed_total`, are the scheduler half's: docs/design.md §3): as of each
rank's last step report, or fresh from every rank when a scrape asks
(`TPConnectorView.refresh_stats`; an idle engine takes no steps, yet its ranks' writer
threads count what peers send).

Thread: the engine-core thread only.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec

from engine.connector_api import KVConnectorOutput, KVConnectorWorker


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: Counter[str] = Counter()  # ranks that reported finished_sending
        self._recving: Counter[str] = Counter()  # ranks that reported finished_recving
        self._failed: set[str] = set()  # failure reported; the other ranks' word is dropped
        self._stats: list[dict[str, float]] = [{} for _ in range(world_size)]

    def _all_ranks(self, counts: Counter[str], rid: str) -> bool:
        counts[rid] += 1
        if counts[rid] < self.world_size:
            return False
        del counts[rid]
        return True

    def combine(self, outputs: list[Any]) -> KVConnectorOutput:
        """One step's reports, in rank order (KVConnectorOutput or its msgpack-decoded form)."""
        result = KVConnectorOutput()
        for rank, raw in enumerate(outputs):
            out = raw if isinstance(raw, KVConnectorOutput) else msgspec.convert(
                raw or {}, KVConnectorOutput)
            self.set_stats(rank, out.stats)
            for rid, reason in out.failed_recving.items():
                if rid not in self._failed:
                    self._failed.add(rid)
                    result.failed_recving[rid] = f"tensor-parallel rank {rank}: {reason}"
            for rid in out.finished_recving:
                if rid not in self._failed and self._all_ranks(self._recving, rid):
                    result.finished_recving.add(rid)
            for rid in out.finished_sending:
                if self._all_ranks(self._sending, rid):
                    result.finished_sending.add(rid)
                    self._recving.pop(rid, None)  # the request is over on every rank
                    self._failed.discard(rid)
        result.finished_recving -= result.failed_recving.keys()
        return result

    def set_stats(self, rank: int, stats: dict[str, float]) -> None:
        self._stats[rank] = stats

    def stats(self) -> dict[str, float]:
        total: dict[str, float] = {}
        for per_rank in self._stats:
            for name, value in per_rank.items():
                total[name] = total.get(name, 0) + value
        return total

    def table_sizes(self) -> dict[str, int]:
        return {"sched_tp_sending": len(self._sending), "sched_tp_recving": len(self._recving),
                "sched_tp_failed": len(self._failed)}


class TPConnectorView(KVConnectorWorker):
    """What EngineCore reads of its ranks' worker halves: summed counters and tables."""

    def __init__(self, executor: Any, aggregator: KVOutputAggregator) -> None:
        self.executor = executor
        self.aggregator = aggregator

    def get_stats(self) -> dict[str, float]:
        return self.aggregator.stats()

    def refresh_stats(self) -> None:
        """Read every rank's counters now (a scrape; each step's report refreshes them too)."""
        for rank, stats in enumerate(self.executor.collective_rpc("kv_stats")):
            self.aggregator.set_stats(rank, stats)

    def table_sizes(self) -> dict[str, int]:
        total = Counter(self.aggregator.table_sizes())
        for sizes in self.executor.collective_rpc("kv_table_sizes"):
            total.update(sizes)
        return dict(total)
