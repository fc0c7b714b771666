"""What both modes' scheduler halves share (engine-core thread only; clock injectable).

A scheduler half stages work for its worker in a per-step metadata object (`meta_type`,
handed over by `build_connector_meta`) and holds back the blocks of every request whose
blocks a transfer may still touch (`_held`) until the worker reports the id in
`finished_sending`. A request's kv_transfer_params are decoded once, on arrival, into the
typed `request.kv_params` (`kvconnector.params`; params that do not decode mean no transfer:
the request is computed locally); the halves read only that afterwards. D's receipts and
failures arrive in `update_connector_output`: a failure wins over a receipt of the same id;
each failed request still expected counts one `kv_recv_failed_total` and, under
`kv_load_failure_policy` "recompute", one `kv_recompute_fallback_total` (the engine's
scheduler does the recompute). Counted here, not in the worker halves, so a request counts
once however many tensor-parallel ranks failed it (docs/design.md §8).

D's first token (kvconnector/seed.py): when a parked request's KV lands the engine asks
`take_seeded_token`; a token P sent along that D can continue from exactly counts one
`kv_first_token_seeded_total`, anything else one `kv_first_token_recomputed_total` (D then
computes the last prompt position as before).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.connector_api import (
    ConnectorRequest,
    KVCacheSpec,
    KVConnectorOutput,
    KVConnectorScheduler,
    SeededToken,
)
from engine.protocol import SamplingParams
from kvconnector import seed as first_token
from kvconnector import transfer_hist
from kvconnector.params import DECODE_FLAG, KVParams

logger = logging.getLogger(__name__)


class TransferRequest(ConnectorRequest, Protocol):
    """What a transfer scheduler half reads of a request: the engine's view, with the
    params typed (`on_request_added` sets them once)."""

    kv_params: KVParams | None
    sampling_params: SamplingParams

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
        self.vocab_size = spec.vocab_size
        self._seeds: dict[str, SeededToken] = {}  # D: P's first token, until taken
        self.stats: dict[str, float] = {"kv_remote_prefill_tokens_total": 0,
                                        "kv_recv_failed_total": 0,
                                        "kv_recompute_fallback_total": 0,
                                        "kv_first_token_seeded_total": 0,
                                        "kv_first_token_recomputed_total": 0,
                                        **transfer_hist.initial(transfer_hist.WAIT_NAME)}
        self._kv_wait: dict[str, float] = {}  # D leg -> when it arrived (kv_wait_seconds)

    def num_blocks(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    # --- the mode's policy --------------------------------------------------------
    def _decode(self, params: Any) -> KVParams | None:
        """The mode's typed params (`kvconnector.params.decode`); ValueError naming a field."""
        raise NotImplementedError

    def _refused(self, request: TransferRequest, reason: str) -> None:
        """The request's params did not decode: it runs without a transfer."""
        logger.warning("request %s: %s; no KV transfer, computing locally",
                       request.request_id, reason)

    def _arrived(self, request: TransferRequest, params: KVParams | None) -> None:
        """A request whose params decoded (`request.kv_params`, None: no transfer) arrived."""

    def _before_meta(self) -> None:
        """Expire whatever is due before this step's metadata leaves."""

    def _recv_failed(self, request_id: str) -> bool:
        """D: the KV of this request will not arrive; whether it was still expected."""
        raise NotImplementedError

    def _recv_done(self, request_id: str) -> int:
        """D: the KV of this request arrived; prompt tokens it spared D (0: not expected)."""
        raise NotImplementedError

    def _expects_seed(self, request_id: str) -> bool:
        """D: a first token that arrives for this request now is kept until taken."""
        return False

    def take_seeded_token(self, request: TransferRequest) -> SeededToken | None:
        seed = self._seeds.pop(request.request_id, None)
        reason = first_token.check(seed, self.vocab_size, request.sampling_params.logprobs)
        if reason is not None:
            self.stats["kv_first_token_recomputed_total"] += 1
            logger.debug("request %s: recomputing the last prompt position (%s)",
                         request.request_id, reason)
            return None
        self.stats["kv_first_token_seeded_total"] += 1
        return seed

    # --- the engine's calls -------------------------------------------------------
    def on_request_added(self, request: TransferRequest) -> None:
        try:
            request.kv_params = self._decode(request.kv_transfer_params)
        except ValueError as e:
            request.kv_params = None
            self._refused(request, str(e))
            return
        if request.kv_params is not None and request.kv_params.flag == DECODE_FLAG:
            self._kv_wait[request.request_id] = self.clock()
        self._arrived(request, request.kv_params)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        self._before_meta()
        meta, self._meta = self._meta, self.meta_type()
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid, token in output.seeded.items():
            if self._expects_seed(rid):
                self._seeds[rid] = token
        for rid in output.failed_recving:  # first: a failure wins over a receipt
            self._seeds.pop(rid, None)
            self._kv_wait.pop(rid, None)
            if not self._recv_failed(rid):
                continue
            self.stats["kv_recv_failed_total"] += 1
            if self.load_failure_policy == "recompute":
                self.stats["kv_recompute_fallback_total"] += 1
        now = self.clock()
        for rid in output.finished_recving:
            self.stats["kv_remote_prefill_tokens_total"] += self._recv_done(rid)
            if (since := self._kv_wait.pop(rid, None)) is not None:
                transfer_hist.observe(self.stats, now - since, transfer_hist.WAIT_NAME)
        for rid in output.finished_sending:
            self._held.discard(rid)

    def has_pending_work(self) -> bool:
        return bool(self._held or self._meta.brings_work())

    def get_stats(self) -> dict[str, float]:
        return dict(self.stats)
