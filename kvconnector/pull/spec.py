"""NixlConnector's spec: D reads from P (entry point `pdserve.connectors`)."""

from __future__ import annotations

from engine.connector_api import ConnectorConfig
from kvconnector.spec import NixlSpec


class PullSpec(NixlSpec):
    package = "kvconnector.pull"
    name = "NixlConnector"

    def validate(self, config: ConnectorConfig) -> None:
        if config.tensor_parallel_size > 1:
            raise ValueError(f"{self.name} (pull mode) with tensor_parallel_size > 1 is not "
                             "supported yet; use NixlPushConnector (push mode)")


SPEC = PullSpec()
