"""engine.serial: tensor tiers, zero-copy frames, typed decoding, strictness."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pytest
import torch
import zmq

from engine.core.messages import UtilityCall
from engine.protocol import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SamplingParams,
    UtilityOutput,
)
from engine.serial import INLINE_THRESHOLD, MsgpackDecoder, MsgpackEncoder


class Holder(msgspec.Struct):
    name: str
    tensor: torch.Tensor
    array: np.ndarray | None = None
    extra: Any = None


def roundtrip(obj: Any, type_: Any = Any) -> tuple[list, Any]:
    frames = MsgpackEncoder().encode(obj)
    return frames, MsgpackDecoder(type_).decode(frames)


def test_small_tensor_is_inline_in_one_frame():
    t = torch.arange(10, dtype=torch.int32)  # 40 bytes
    frames, out = roundtrip({"t": t})
    assert len(frames) == 1
    assert out["t"].dtype == torch.int32 and torch.equal(out["t"], t)


def test_large_tensor_goes_to_an_aux_frame_without_copy():
    t = torch.randn(64, 33)
    frames = MsgpackEncoder().encode({"t": t})
    assert len(frames) == 2
    aux = memoryview(frames[1])
    assert aux.nbytes == t.nbytes
    # The aux frame is a view of the tensor's own memory (zero-copy send).
    t[0, 0] = 123.0
    assert np.frombuffer(aux, dtype=np.float32)[0] == 123.0
    out = MsgpackDecoder().decode(frames)
    assert torch.equal(out["t"], t)


def test_threshold_boundary():
    below = torch.zeros(INLINE_THRESHOLD - 1, dtype=torch.uint8)
    at = torch.zeros(INLINE_THRESHOLD, dtype=torch.uint8)
    assert len(MsgpackEncoder().encode(below)) == 1
    assert len(MsgpackEncoder().encode(at)) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.bool, torch.uint8])
@pytest.mark.parametrize("shape", [(), (0, 3), (5,), (7, 9, 11)])
def test_tensor_dtypes_and_shapes_roundtrip(dtype, shape):
    t = (torch.rand(shape) * 10).to(dtype)
    _, out = roundtrip([t])
    assert out[0].dtype == dtype and tuple(out[0].shape) == shape
    assert torch.equal(out[0], t)


def test_non_contiguous_tensor_roundtrip():
    t = torch.randn(40, 30).t()[::2]
    assert not t.is_contiguous()
    _, out = roundtrip(t)
    assert torch.equal(out, t)


def test_numpy_arrays_roundtrip_both_tiers():
    small = np.arange(6, dtype=np.int16).reshape(2, 3)
    big = np.random.default_rng(0).standard_normal((50, 20)).astype(">f8")
    frames, out = roundtrip({"s": small, "b": big})
    assert len(frames) == 2
    assert out["s"].dtype == small.dtype and np.array_equal(out["s"], small)
    assert out["b"].dtype == big.dtype and np.array_equal(out["b"], big)


def test_object_arrays_are_refused():
    with pytest.raises(TypeError):
        MsgpackEncoder().encode(np.array([object()], dtype=object))


def test_typed_struct_with_tensor_fields():
    h = Holder("x", torch.randn(100), np.ones(3), extra={"k": torch.ones(2)})
    _, out = roundtrip(h, Holder)
    assert isinstance(out, Holder) and torch.equal(out.tensor, h.tensor)
    assert np.array_equal(out.array, h.array) and torch.equal(out.extra["k"], torch.ones(2))


def test_typed_field_rejects_a_tensor_where_an_array_is_expected():
    frames = MsgpackEncoder().encode({"name": "x", "tensor": np.ones(2), "array": None})
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(Holder).decode(frames)


def test_engine_core_messages_roundtrip():
    req = EngineCoreRequest("r-1", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4),
                            eos_token_id=2, arrival_time=1.5, kv_transfer_params={"a": 1})
    _, got = roundtrip(req, EngineCoreRequest)
    assert got == req
    outs = EngineCoreOutputs(
        outputs=[EngineCoreOutput("r-1", [5, 6], finish_reason=FinishReason.LENGTH)],
        utility_output=UtilityOutput(call_id=3, result={"x": [1, 2]}), timestamp=2.0)
    _, got = roundtrip(outs, EngineCoreOutputs)
    assert got == outs
    _, got = roundtrip(UtilityCall(7, "get_stats", []), UtilityCall)
    assert got == UtilityCall(7, "get_stats", [])


def test_encode_into_reuses_the_buffer():
    enc = MsgpackEncoder()
    buf = bytearray()
    frames = enc.encode_into({"a": list(range(100))}, buf)
    assert frames[0] is buf and len(buf) > 0
    first_len = len(buf)
    frames = enc.encode_into({"a": [1]}, buf)
    assert frames[0] is buf and len(buf) < first_len
    assert MsgpackDecoder().decode(frames) == {"a": [1]}


@pytest.mark.parametrize("frames", [
    [b"\xc1"],  # never-used msgpack byte
    [b"\x92\x01"],  # truncated array
    [msgspec.msgpack.encode(msgspec.msgpack.Ext(99, b"x"))],  # unknown ext code
    [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, b"\x93\xa4nope\x91\x01\xc4\x00"))],  # dtype
    [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, msgspec.msgpack.encode(
        ("float32", [4], b"abc"))))],  # bytes do not fill the shape
    [msgspec.msgpack.encode(msgspec.msgpack.Ext(1, msgspec.msgpack.encode(
        ("float32", [4], 5))))],  # aux frame index out of range
    [msgspec.msgpack.encode(msgspec.msgpack.Ext(2, msgspec.msgpack.encode(
        ("|O", [1], b"12345678"))))],  # object dtype
    [],  # no frames at all
])
def test_malformed_bytes_raise_msgspec_errors(frames):
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        MsgpackDecoder().decode(frames)


def test_wrong_shape_for_typed_decoder_raises_validation_error():
    frames = MsgpackEncoder().encode({"request_id": 1})
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(EngineCoreRequest).decode(frames)


def test_frames_survive_a_real_zmq_socket_zero_copy():
    ctx = zmq.Context()
    try:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        pull.bind("inproc://serial-test")
        push.connect("inproc://serial-test")
        t = torch.randn(256, 256)
        frames = MsgpackEncoder().encode({"t": t, "small": torch.ones(3)})
        assert len(frames) == 2
        tracker = push.send_multipart(frames, copy=False, track=True)
        received = pull.recv_multipart(copy=False)
        out = MsgpackDecoder().decode(received)
        assert torch.equal(out["t"], t) and torch.equal(out["small"], torch.ones(3))
        copied = MsgpackDecoder(copy_aux=True).decode(received)
        assert torch.equal(copied["t"], t)
        del out, received
        tracker.wait(5)  # zmq released the tensor memory once the receiver let go
    finally:
        ctx.destroy(linger=0)
