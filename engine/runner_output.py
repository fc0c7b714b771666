"""What the model runner hands back each step (`ModelRunnerOutput`), read by the scheduler.

The runner's input (`SchedulerOutput`) is the scheduler's, in engine/sched/output.py, and the
runner imports it; this module sits below both so that the scheduler reads the runner's output
without importing the runner (runner -> sched only, never back). It also crosses the executor's
RPC to tensor-parallel workers as msgpack (engine/executor/messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.connector_seam import KVConnectorOutput
from engine.protocol import Logprobs


@dataclass
class ModelRunnerOutput:
    """One entry per scheduled request, in `req_ids` order.

    `sampled_token_ids[i]` is empty when request i only computed part of its prompt.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[Logprobs | None] = field(default_factory=list)
    # request id -> prompt positions 1..P-1, sent with the request's first sampled token
    prompt_logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None
