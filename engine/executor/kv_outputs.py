"""The KV connector seen from EngineCore when its worker halves live in TP worker processes.

Every rank runs its own worker half (docs/design.md §8) and reports, each step, what it
finished. `KVOutputAggregator` turns the N per-rank reports into the one the scheduler half
expects: a request's blocks may be freed (`finished_sending`) and its remote KV has landed
(`finished_recving`) only once **every** rank said so; a failed receipt on any rank fails the
request at once (the scheduler recomputes or fails it), and the other ranks' later word on
it is dropped. (Counters do not ride here: the executor reads every rank's when stats are
asked for, `MultiprocExecutor.connector_stats`.)

Thread: the engine-core thread only.
"""

from __future__ import annotations

from collections import Counter

from engine.connector_seam import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._sending: Counter[str] = Counter()  # ranks that reported finished_sending
        self._recving: Counter[str] = Counter()  # ranks that reported finished_recving
        self._failed: set[str] = set()  # failure reported; the other ranks' word is dropped

    def _all_ranks(self, counts: Counter[str], rid: str) -> bool:
        counts[rid] += 1
        if counts[rid] < self.world_size:
            return False
        del counts[rid]
        return True

    def combine(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        """One step's reports, in rank order."""
        result = KVConnectorOutput()
        for rank, out in enumerate(outputs):
            for rid, reason in out.failed_recving.items():
                if rid not in self._failed:
                    self._failed.add(rid)
                    result.failed_recving[rid] = f"tensor-parallel rank {rank}: {reason}"
            result.seeded.update(out.seeded)  # any rank's copy: P's ranks send the same
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

    def table_sizes(self) -> dict[str, int]:
        return {"sched_tp_sending": len(self._sending), "sched_tp_recving": len(self._recving),
                "sched_tp_failed": len(self._failed)}
