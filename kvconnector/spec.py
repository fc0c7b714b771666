"""What the engine knows of the NIXL connectors (`engine.connector_api.ConnectorSpec`): the
rules both modes share. `push/spec.py` and `pull/spec.py` add each mode's own; they are
registered by name through the `pdserve.connectors` entry points (pyproject.toml).

Imported by the engine's config validation in every process: keep it light (the builders
import the connector modules, and with them NIXL, only when called).
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.connector_api import (
    ConnectorConfig,
    ConnectorSpec,
    KVCacheSpec,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVParamsValidator,
)
from kvconnector.endpoint import side_channel_port
from kvconnector.params import DECODE_FLAG, PREFILL_FLAG

# Transfer counters the halves report (cumulative), exported as pdserve:<name>
# (docs/design.md §3, Metrics). Both modes export the whole table (0 until counted).
COUNTERS: dict[str, str] = {
    "kv_push_registrations_sent_total": "Push registrations D sent to P.",
    "kv_push_registrations_received_total": "Push registrations P received from D.",
    "kv_push_writes_total": "KV WRITEs P completed into D's memory.",
    "kv_push_write_failures_total": "KV WRITEs that failed.",
    "kv_transfer_bytes_total": "Bytes of KV moved between engines.",
    "kv_lease_expired_total": "P block leases that expired before a WRITE.",
    "kv_registration_expired_total": "D registrations whose watchdog fired.",
    "kv_recv_failed_total": "Requests whose remote KV could not be received.",
    "kv_recompute_fallback_total": "Requests that fell back to computing the prompt locally.",
    "kv_remote_prefill_tokens_total": "Prompt tokens D received instead of computing.",
    "kv_pokes_sent_total": "P: notices to D's side channel that a WRITE into D was posted.",
    "kv_pokes_received_total": "D: such notices received (D then polls its agent fast; "
                               "before, a waiting D polls every 20 ms).",
    "kv_first_token_seeded_total": "D requests that started from P's sampled first token (no "
                                   "forward over the last prompt position).",
    "kv_first_token_recomputed_total": "D requests whose KV landed without a first token D "
                                       "could continue from: the last prompt position was "
                                       "computed on D.",
    "kv_push_fail_sent_total": "PUSH_FAIL notifications P sent (it will not write).",
    "kv_push_digest_mismatch_total": "Push registrations P refused: their prompt digest differs "
                                     "from the prompt P prefilled.",
    "kv_malformed_notifs_total": "Malformed KV notifications counted and dropped.",
    "kv_malformed_side_channel_total": "Malformed side-channel requests counted and dropped.",
    "kv_side_channel_refused_total": "Side-channel requests refused (no or wrong proof of the "
                                     "KV secret, stale nonce, address outside the allowlist).",
    "kv_handshake_refused_total": "Handshakes with peers refused either way (secret, allowlist).",
    "kv_refused_notifs_total": "KV notifications refused: not from the transfer's agent.",
    "kv_refused_peers_total": "Peer agent blobs refused: name bound to another address that "
                              "still serves it.",
    "kv_push_unknown_transfer_total": "Push registrations P refused: no request on P carried "
                                      "their transfer within push_unknown_transfer_timeout.",
    "kv_pull_reads_total": "KV READs D completed from P (pull mode).",
    "kv_pull_leases_total": "Block leases P granted for pull reads.",
    "kv_pull_leases_returned_total": "Pull leases D returned to P.",
    "kv_pull_refused_params_total": "Pull transfer params D refused (stale or mismatched).",
}
# kv_transfer_seconds: the push halves report no _count; each WRITE is one observation.
SUMMARIES: dict[str, tuple[str, str]] = {
    "kv_transfer_seconds": ("Time spent moving KV between engines.", "kv_push_writes_total"),
    "kv_wait_seconds": ("D: a leg's wait for its KV, from its arrival at the scheduler to the "
                        "KV landing.", "kv_wait_seconds_count"),
}


class NixlSpec(ConnectorSpec):
    """The rules both NIXL modes share."""

    counters = COUNTERS
    summaries = SUMMARIES
    package = ""  # the mode's package: its `params` (admission check) and `connector` (halves)

    def params_validator(self, config: ConnectorConfig) -> KVParamsValidator | None:
        module = importlib.import_module(f"{self.package}.params")  # light: no NIXL
        return module.request_params_validator(config)

    def make_scheduler(self, config: ConnectorConfig, cache: KVCacheSpec
                       ) -> KVConnectorScheduler:
        module = importlib.import_module(f"{self.package}.connector")
        return module.make_scheduler(config, cache)

    def make_worker(self, config: ConnectorConfig, cache: KVCacheSpec, tp_rank: int
                    ) -> KVConnectorWorker:
        module = importlib.import_module(f"{self.package}.connector")
        return module.make_worker(config, cache, tp_rank)

    def side_channel_port(self, base: int, dp_rank: int, tp_rank: int, tp_size: int) -> int:
        return side_channel_port(base, dp_rank, tp_rank, tp_size)

    def is_prefill_leg(self, kv_transfer_params: Any) -> bool:
        return (isinstance(kv_transfer_params, dict)
                and kv_transfer_params.get(PREFILL_FLAG) is True)

    def prefilled_elsewhere(self, kv_transfer_params: Any) -> bool:
        return isinstance(kv_transfer_params, dict) and bool(
            kv_transfer_params.get(DECODE_FLAG))

    def prompt_params(self, kv_transfer_params: dict[str, Any], index: int, count: int
                      ) -> dict[str, Any] | None:
        """Each prompt of a list is its own transfer: P and D derive the same transfer_id for
        prompt i, so a registration can never be paired with another prompt's blocks. A D leg
        that names P's blocks (pull) is P's answer for the first prompt; the others compute
        their own prompt (with a KV secret, D refuses params signed for another prompt with a
        400)."""
        kv = kv_transfer_params
        if kv.get(DECODE_FLAG) and "remote_block_ids" in kv:
            return kv if index == 0 else None
        if not isinstance(kv.get("transfer_id"), str):
            return kv
        return {**kv, "transfer_id": f"{kv['transfer_id']}#{index}"}

    def sample_params(self, kv_transfer_params: dict[str, Any], index: int
                      ) -> dict[str, Any] | None:
        """One prefill leg serves one sequence: only child 0 receives P's KV; the others
        prefill locally rather than wait on a transfer that never comes."""
        if index > 0 and kv_transfer_params.get(DECODE_FLAG):
            return None
        if kv_transfer_params.get(DECODE_FLAG):  # P sampled for one sequence, not for n
            return {**kv_transfer_params, "first_token": False}
        return kv_transfer_params

    def validate(self, config: ConnectorConfig) -> None:
        kv = config.kv_transfer_config
        if kv is None or config.tensor_parallel_size == 1:
            return
        if not kv.kv_port:
            raise ValueError("P/D with tensor_parallel_size > 1 needs an explicit kv_port "
                             "(data-parallel rank d's rank r serves its side channel at "
                             "kv_port + d * tensor_parallel_size + r)")
        if not kv.engine_id:
            raise ValueError("P/D with tensor_parallel_size > 1 needs an explicit engine_id "
                             "(every rank's NIXL agent is named <engine_id>-tp<rank>)")
