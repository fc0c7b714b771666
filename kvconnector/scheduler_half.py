"""What both modes' scheduler halves share (engine-core thread only; clock injectable).

A scheduler half stages work for its worker in a per-step metadata object (`meta_type`,
handed over by `build_connector_meta`) and holds back the blocks of every request whose
blocks a transfer may still touch (`_held`) until the worker reports the id in
`finished_sending`. D's receipts and failures arrive in `update_connector_output`: a failure
wins over a receipt of the same id, and under `kv_load_failure_policy` "recompute" each
counts one `kv_recompute_fallback_total` (the engine's scheduler does the recompute).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.config import EngineConfig
from engine.kv_connector import KVCacheSpec, KVConnectorOutput, KVConnectorScheduler

LOAD_FAILURE_POLICIES = ("recompute", "fail")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TransferScheduler(KVConnectorScheduler):
    meta_type: Callable[[], Any]  # the mode's per-step metadata (has `brings_work()`)

    def __init__(self, config: EngineConfig, spec: KVCacheSpec,
                 clock: Callable[[], float]) -> None:
        kv = config.kv_transfer_config
        assert kv is not None
        self.kv = kv
        self.block_size = spec.block_size
        self.clock = clock
        self.load_failure_policy = kv.extra("kv_load_failure_policy", "recompute")
        if self.load_failure_policy not in LOAD_FAILURE_POLICIES:
            raise ValueError("kv_load_failure_policy must be 'recompute' or 'fail'")
        self._meta = self.meta_type()
        self._held: set[str] = set()  # requests whose blocks wait for the worker's word
        self.stats: dict[str, float] = {"kv_remote_prefill_tokens_total": 0,
                                        "kv_recompute_fallback_total": 0}

    def num_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- the mode's policy --------------------------------------------------------
    def _before_meta(self) -> None:
        """Expire whatever is due before this step's metadata leaves."""

    def _recv_failed(self, request_id: str) -> bool:
        """D: the KV of this request will not arrive; whether it was still expected."""
        raise NotImplementedError

    def _recv_done(self, request_id: str) -> int:
        """D: the KV of this request arrived; prompt tokens it spared D (0: not expected)."""
        raise NotImplementedError

    # --- the engine's calls -------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._before_meta()
        meta, self._meta = self._meta, self.meta_type()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.failed_recving:  # first: a failure wins over a receipt
            if self._recv_failed(rid) and self.load_failure_policy == "recompute":
                self.stats["kv_recompute_fallback_total"] += 1
        for rid in output.finished_recving:
            self.stats["kv_remote_prefill_tokens_total"] += self._recv_done(rid)
        for rid in output.finished_sending:
            self._held.discard(rid)

    def has_pending_work(self) -> bool:
        return bool(self._held or self._meta.brings_work())

    def get_stats(self) -> dict[str, float]:
        return dict(self.stats)
