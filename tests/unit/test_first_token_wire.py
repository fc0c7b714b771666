"""PUSH_DONE (issue 28): a completion that carries P's first token decodes strictly, and D's
gate refuses a token it cannot continue from exactly."""

from __future__ import annotations

import msgspec
import pytest

from engine.connector_seam import SeededToken
from engine.protocol import Logprobs
from kvconnector import seed, wire


def test_push_done_round_trips_with_token_and_logprobs():
    token = wire.FirstToken([7], wire.TokenLogprobs([7, 3], [-0.5, float("-inf")], 0))
    msg = wire.decode_notif(wire.encode_completion_with_token("req-1", 2, token))
    assert msg == wire.Completion("req-1", 2, token)
    assert seed.from_wire(msg.first_token) == SeededToken([7], Logprobs([7, 3],
                                                                        [-0.5, float("-inf")], 0))


@pytest.mark.parametrize("body", [
    {"request_id": "r", "tp_size": 1, "first_token": {"token_ids": []}},
    {"request_id": "r", "tp_size": 1, "first_token": {"token_ids": [-1]}},
    {"request_id": "r", "tp_size": 0, "first_token": {"token_ids": [1]}},
    {"request_id": "r", "tp_size": 1, "first_token": {"token_ids": [1],
                                                      "logprobs": [[1, 2], [0.0], 0]}},
    {"request_id": "PUSH_REG:x", "tp_size": 1, "first_token": {"token_ids": [1]}},
    {"request_id": "r", "tp_size": 1},
])
def test_malformed_push_done_is_refused(body):
    with pytest.raises(wire.MalformedNotif):
        wire.decode_notif(b"PUSH_DONE:" + msgspec.msgpack.encode(body))


def test_seed_gate():
    ok = SeededToken([5], Logprobs([5, 1], [-0.1, -2.0], 0))
    assert seed.check(ok, 10, 1) is None
    assert seed.check(SeededToken([5]), 10, None) is None
    assert "vocabulary" in seed.check(SeededToken([10]), 10, None)
    assert "logprobs" in seed.check(SeededToken([5]), 10, 1)
    assert "one expected" in seed.check(SeededToken([5, 6]), 10, None)
    assert "no first token" in seed.check(None, 10, None)
    assert seed.to_params(SeededToken([5], Logprobs([5], [float("-inf")], 0))) == {}
