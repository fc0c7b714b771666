"""NixlConnector's spec: D reads from P (entry point `pdserve.connectors`)."""

from __future__ import annotations

from engine.connector_api import (
    ConnectorConfig,
    KVCacheSpec,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVParamsValidator,
)
from kvconnector.spec import NixlSpec


class PullSpec(NixlSpec):
    name = "NixlConnector"

    def validate(self, config: ConnectorConfig) -> None:
        if config.tensor_parallel_size > 1:
            raise ValueError(f"{self.name} (pull mode) with tensor_parallel_size > 1 is not "
                             "supported yet; use NixlPushConnector (push mode)")

    def params_validator(self, config: ConnectorConfig) -> KVParamsValidator | None:
        from kvconnector.pull.params import request_params_validator

        return request_params_validator(config)

    def make_scheduler(self, config: ConnectorConfig, cache: KVCacheSpec
                       ) -> KVConnectorScheduler:
        from kvconnector.pull.connector import make_scheduler

        return make_scheduler(config, cache)  # type: ignore[arg-type]

    def make_worker(self, config: ConnectorConfig, cache: KVCacheSpec, tp_rank: int
                    ) -> KVConnectorWorker:
        from kvconnector.pull.connector import make_worker

        return make_worker(config, cache, tp_rank)  # type: ignore[arg-type]


SPEC = PullSpec()
