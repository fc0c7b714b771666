"""Notification codecs (DESIGN §3): round trips, strictness, and a bounded fuzz proving that
decode_notif raises MalformedNotif and nothing else."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconnector import wire
from kvconnector.wire import (
    Completion,
    Heartbeat,
    MalformedNotif,
    PushCancel,
    PushCancelAck,
    PushFail,
    PushReg,
    base_request_id,
    decode_notif,
)

REG = PushReg(
    request_id="cmpl-abc-0-1a2b3c4d", transfer_id="tx-1", decode_engine_id="D0",
    decode_host="10.0.0.2", decode_port=5601, decode_tp_size=1,
    local_block_ids=[[4, 5, 9, 10]], first_block_index=2, remote_engine_id="P0",
    remote_host="10.0.0.1", remote_port=5600, remote_tp_size=1,
    prompt_digest="0123456789abcdef0123456789abcdef",
)
# DESIGN §3's fields plus prompt_digest (issue 15: P writes only into the same prompt)
DESIGN_FIELDS = {
    "request_id", "transfer_id", "decode_engine_id", "decode_host", "decode_port",
    "decode_tp_size", "local_block_ids", "first_block_index", "remote_engine_id", "remote_host",
    "remote_port", "remote_tp_size", "prompt_digest",
    "decode_tp_rank",  # docs/design.md §3: which D rank registers (heterogeneous TP, §8)
    "first_token",  # D asks P for its sampled first token (issue 28)
}


def _reg_map(**changes: object) -> dict:
    data = msgspec.to_builtins(REG)
    data.update(changes)
    return data


def _push_reg_raw(data: dict) -> bytes:
    return b"PUSH_REG:" + msgspec.msgpack.encode(data)


def test_push_reg_round_trips_with_exactly_the_design_fields() -> None:
    raw = wire.encode_push_reg(REG)
    assert raw.startswith(b"PUSH_REG:")
    assert set(msgspec.msgpack.decode(raw[len(b"PUSH_REG:"):])) == DESIGN_FIELDS
    assert decode_notif(raw) == REG


def test_push_reg_without_a_decode_rank_reads_as_rank_0() -> None:
    data = _reg_map()
    del data["decode_tp_rank"]
    raw = b"PUSH_REG:" + msgspec.msgpack.encode(data)
    assert decode_notif(raw).decode_tp_rank == 0


def test_every_message_round_trips() -> None:
    assert decode_notif(wire.encode_completion("req-7", 2)) == Completion("req-7", 2)
    assert decode_notif(wire.encode_heartbeat(["a", "b-2"])) == Heartbeat(("a", "b-2"))
    assert decode_notif(wire.encode_heartbeat([])) == Heartbeat(())
    assert decode_notif(wire.encode_push_fail("r", "t", "no blocks")) == PushFail("r", "t",
                                                                                  "no blocks")
    assert decode_notif(wire.encode_push_cancel("r", "t")) == PushCancel("r", "t")
    assert decode_notif(wire.encode_push_cancel_ack("r", "")) == PushCancelAck("r", "")


def test_exact_wire_bytes_of_the_text_formats() -> None:
    assert wire.encode_completion("cmpl-1-0-deadbeef", 1) == b"cmpl-1-0-deadbeef:1"
    assert wire.encode_heartbeat(["t1", "t2"]) == b"HB:t1,t2"
    assert wire.encode_push_cancel_ack("r", "t").startswith(b"PUSH_CANCEL_ACK:")


def test_completion_request_id_may_contain_colons() -> None:
    raw = wire.encode_completion("chat:cmpl:42-0a0b0c0d", 4)
    assert raw == b"chat:cmpl:42-0a0b0c0d:4"
    assert decode_notif(raw) == Completion("chat:cmpl:42-0a0b0c0d", 4)


def test_a_registration_without_a_digest_decodes_with_an_empty_one() -> None:
    """A D that sends no digest gets PUSH_FAIL from P (empty matches nothing), not silence."""
    data = _reg_map()
    del data["prompt_digest"]
    assert decode_notif(_push_reg_raw(data)).prompt_digest == ""
    with pytest.raises(MalformedNotif):
        decode_notif(_push_reg_raw(_reg_map(prompt_digest="f" * 65)))


@pytest.mark.parametrize("rid,tagged", [("HB", True), ("HB:x", True), ("PUSH_REG:", True),
                                        ("PUSH_CANCEL_ACK:1", True), ("HBx:1", False),
                                        ("x:HB", False), ("cmpl-1", False)])
def test_reads_as_tagged_names_ids_a_completion_could_not_carry(rid: str, tagged: bool) -> None:
    assert wire.reads_as_tagged(rid) is tagged


@pytest.mark.parametrize("bad_id", ["HB", "HB:x", "PUSH_REG:1", "PUSH_CANCEL_ACK", "", "x" * 2000])
def test_completion_encoder_refuses_ids_a_decoder_would_misread(bad_id: str) -> None:
    with pytest.raises(ValueError):
        wire.encode_completion(bad_id, 1)


def test_encoders_refuse_invalid_values() -> None:
    with pytest.raises(ValueError):
        wire.encode_heartbeat(["a,b"])
    with pytest.raises(ValueError):
        wire.encode_heartbeat([""])
    with pytest.raises(ValueError):
        wire.encode_completion("r", 0)
    with pytest.raises(ValueError):
        wire.encode_push_reg(PushReg(**_reg_map(local_block_ids=[[-1]])))
    with pytest.raises(ValueError):
        wire.encode_push_cancel("", "t")


@pytest.mark.parametrize("raw,why", [
    (b"", "empty"),
    (b"no-colon-at-all", "no separator"),
    (b"req:0", "tp_size 0"),
    (b"req:-1", "negative tp_size"),
    (b"req:01", "non-canonical tp_size"),
    (b"req: 1", "space"),
    (b"req:1.0", "float tp_size"),
    (b":1", "empty request id"),
    (b"\xff\xfe:1", "not UTF-8"),
    (b"HB:a,,b", "empty heartbeat id"),
    (b"HB:\xff", "heartbeat not UTF-8"),
    (b"PUSH_REG:", "empty body"),
    (b"PUSH_REG:\xc1", "invalid msgpack"),
    (wire.encode_push_reg(REG) + b"\x00", "trailing garbage"),
    (b"PUSH_FAIL:" + msgspec.msgpack.encode({"request_id": "r", "transfer_id": "t"}),
     "missing reason"),
    (b"PUSH_CANCEL:" + msgspec.msgpack.encode(["r", "t"]), "array instead of map"),
    (b"PUSH_CANCEL_ACK:" + msgspec.msgpack.encode({"request_id": 5, "transfer_id": "t"}),
     "int request id"),
])
def test_malformed_messages_raise_malformed_notif(raw: bytes, why: str) -> None:
    with pytest.raises(MalformedNotif):
        decode_notif(raw)


@pytest.mark.parametrize("changes", [
    {"extra": 1},
    {"local_block_ids": [[1, -2]]},
    {"local_block_ids": [[1, True]]},
    {"local_block_ids": [[1.5]]},
    {"local_block_ids": []},
    {"local_block_ids": [list(range(wire.MAX_BLOCKS_PER_GROUP + 1))]},
    {"local_block_ids": [[1]] * (wire.MAX_KV_GROUPS + 1)},
    {"first_block_index": -1},
    {"decode_port": 0},
    {"decode_port": 70000},
    {"decode_tp_size": 0},
    {"request_id": ""},
    {"request_id": None},
    {"decode_host": 12},
])
def test_push_reg_with_wrong_fields_is_malformed(changes: dict) -> None:
    with pytest.raises(MalformedNotif):
        decode_notif(_push_reg_raw(_reg_map(**changes)))


def test_push_reg_missing_any_field_but_the_digest_and_rank_is_malformed() -> None:
    for name in DESIGN_FIELDS - {"prompt_digest", "decode_tp_rank", "first_token"}:
        data = _reg_map()
        del data[name]
        with pytest.raises(MalformedNotif):
            decode_notif(_push_reg_raw(data))


def test_oversized_and_non_bytes_input_is_malformed() -> None:
    with pytest.raises(MalformedNotif):
        decode_notif(b"r" * (wire.MAX_NOTIF_BYTES + 1) + b":1")
    with pytest.raises(MalformedNotif):
        decode_notif("req:1")  # type: ignore[arg-type]
    with pytest.raises(MalformedNotif):
        decode_notif(None)  # type: ignore[arg-type]


def test_notif_kind_tells_cancel_from_cancel_ack() -> None:
    assert wire.notif_kind(wire.encode_push_cancel("r", "t")) == "PUSH_CANCEL"
    assert wire.notif_kind(wire.encode_push_cancel_ack("r", "t")) == "PUSH_CANCEL_ACK"
    assert wire.notif_kind(wire.encode_heartbeat(["a"])) == "HB"
    assert wire.notif_kind(wire.encode_completion("HBX", 1)) == "COMPLETION"


@pytest.mark.parametrize("req_id,base", [
    ("cmpl-abc-0-1a2b3c4d", "cmpl-abc-0"),
    ("cmpl-abc-1-1a2b3c4d", "cmpl-abc-1"),  # the completion index survives
    ("cmpl-abc-0", "cmpl-abc-0"),  # no suffix: unchanged
    ("x-1A2B3C4D", "x-1A2B3C4D"),  # upper-case hex is not our suffix
    ("x-1a2b3c4", "x-1a2b3c4"),  # 7 hex digits
    ("x-1a2b3c4d5", "x-1a2b3c4d5"),  # 9 hex digits
    ("-1a2b3c4d", "-1a2b3c4d"),  # nothing before the suffix
    ("a:b-00000000", "a:b"),
    ("req-12345678-9abcdef0", "req-12345678"),  # strips only one suffix
])
def test_base_request_id_strips_only_the_engine_suffix(req_id: str, base: str) -> None:
    assert base_request_id(req_id) == base


def _only_malformed(raw: bytes) -> None:
    try:
        decode_notif(raw)
    except MalformedNotif:
        pass


_VALID = [
    wire.encode_push_reg(REG), wire.encode_completion("req-1:x", 2),
    wire.encode_heartbeat(["t1", "t2"]), wire.encode_push_fail("r", "t", "why"),
    wire.encode_push_cancel("r", "t"), wire.encode_push_cancel_ack("r", "t"),
]
_FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                 suppress_health_check=[HealthCheck.too_slow])


@_FUZZ
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_only_ever_raise_malformed(raw: bytes) -> None:
    _only_malformed(raw)


@_FUZZ
@given(st.sampled_from([b"PUSH_REG:", b"PUSH_FAIL:", b"PUSH_CANCEL:", b"PUSH_CANCEL_ACK:",
                        b"HB:", b"req:"]), st.binary(max_size=256))
def test_fuzz_tagged_garbage_only_ever_raises_malformed(tag: bytes, body: bytes) -> None:
    _only_malformed(tag + body)


@_FUZZ
@given(st.sampled_from(_VALID), st.data())
def test_fuzz_mutated_valid_messages_only_ever_raise_malformed(raw: bytes, data) -> None:
    buf = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        pos = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if op == "flip" and buf:
            buf[pos] = data.draw(st.integers(0, 255))
        elif op == "cut":
            del buf[pos:pos + data.draw(st.integers(1, 8))]
        else:
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
    _only_malformed(bytes(buf))


@_FUZZ
@given(st.dictionaries(st.sampled_from(sorted(DESIGN_FIELDS) + ["junk"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                                 st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3),
                                 st.lists(st.lists(st.integers(-3, 3), max_size=3), max_size=3))))
def test_fuzz_push_reg_field_types_only_ever_raise_malformed(data: dict) -> None:
    _only_malformed(_push_reg_raw(data))
