"""NixlPushConnector's spec: P writes into D (entry point `pdserve.connectors`)."""

from __future__ import annotations

from kvconnector.spec import NixlSpec


class PushSpec(NixlSpec):
    package = "kvconnector.push"
    name = "NixlPushConnector"
    # D registers with the P rank named in its leg: an unpinned P leg must run there
    pins_prefill_leg = True


SPEC = PushSpec()
