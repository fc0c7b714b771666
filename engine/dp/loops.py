"""Which busy loop an engine-core process runs: plain, publishing stats to the data-parallel
coordinator, or lockstep (engine/dp/lockstep.py). Chosen once, from the handshake's answer.

Its own module so `engine_link` (the coordinator link) and `lockstep` (a loop that uses the
link) do not import each other.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq

from engine.config import EngineConfig
from engine.core.busy_loop import EngineCoreLoop
from engine.core.messages import HandshakeInit
from engine.dp.engine_link import CoordinatorLink
from engine.dp.lockstep import LockstepLoop


def build_loop(core: Any, engine_index: int, config: EngineConfig, ctx: zmq.Context,
               init: HandshakeInit, stop: threading.Event) -> EngineCoreLoop:
    """The busy loop of this engine: plain, publishing stats, or lockstep."""
    if not init.coordinator_engine_in:
        return EngineCoreLoop(core, engine_index)
    link = CoordinatorLink(ctx, engine_index, init)
    if config.data_parallel_lockstep:
        loop: EngineCoreLoop = LockstepLoop(core, engine_index, link)
        link.listen_for_waves(ctx, init.coordinator_wave_pub, loop, stop)
    else:
        loop = EngineCoreLoop(core, engine_index)
    loop.on_step = link.stats
    return loop
