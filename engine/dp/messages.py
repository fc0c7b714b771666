"""Messages of the data-parallel coordinator (msgspec msgpack; tagged, strictly decoded).

engines --PUSH--> coordinator (PULL):   EngineStats, StartWave
coordinator --PUB--> engines (SUB):     StartDPWave, WaveComplete
coordinator --PUB--> frontend (SUB):    FrontStats, every `interval` (and at once when a
                                        wave starts or ends)
"""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct, tag="STATS", array_like=True):
    rank: int
    waiting: int
    running: int
    wave: int = 0
    step: int = 0


class StartWave(msgspec.Struct, tag="START_WAVE", array_like=True):
    """An engine got a request while no wave ran: every engine must start stepping."""

    rank: int
    wave: int


class StartDPWave(msgspec.Struct, tag="START_DP_WAVE", array_like=True):
    wave: int


class WaveComplete(msgspec.Struct, tag="WAVE_COMPLETE", array_like=True):
    """Every engine is idle: wave `wave` is over, the next one is `wave + 1`."""

    wave: int


class FrontStats(msgspec.Struct, tag="FRONT_STATS", array_like=True):
    seq: int
    counts: list[list[int]]  # per rank: [waiting, running]
    wave: int
    running: bool
    stamps: list[int] = []  # per rank: stats messages received so far (fresh = changed)


EngineToCoordinator = EngineStats | StartWave
CoordinatorToEngine = StartDPWave | WaveComplete

ENCODER = msgspec.msgpack.Encoder()
engine_msg_decoder = msgspec.msgpack.Decoder(EngineToCoordinator)
wave_msg_decoder = msgspec.msgpack.Decoder(CoordinatorToEngine)
front_decoder = msgspec.msgpack.Decoder(FrontStats)
DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError)
