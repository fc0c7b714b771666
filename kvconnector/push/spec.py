"""NixlPushConnector's spec: P writes into D (entry point `pdserve.connectors`)."""

from __future__ import annotations

from engine.connector_api import (
    ConnectorConfig,
    KVCacheSpec,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVParamsValidator,
)
from kvconnector.spec import NixlSpec


class PushSpec(NixlSpec):
    name = "NixlPushConnector"
    # D registers with the P rank named in its leg: an unpinned P leg must run there
    pins_prefill_leg = True

    def params_validator(self, config: ConnectorConfig) -> KVParamsValidator | None:
        from kvconnector.push.params import request_params_validator

        return request_params_validator(config)  # type: ignore[arg-type]

    def make_scheduler(self, config: ConnectorConfig, cache: KVCacheSpec
                       ) -> KVConnectorScheduler:
        from kvconnector.push.connector import make_scheduler

        return make_scheduler(config, cache)  # type: ignore[arg-type]

    def make_worker(self, config: ConnectorConfig, cache: KVCacheSpec, tp_rank: int
                    ) -> KVConnectorWorker:
        from kvconnector.push.connector import make_worker

        return make_worker(config, cache, tp_rank)  # type: ignore[arg-type]


SPEC = PushSpec()
