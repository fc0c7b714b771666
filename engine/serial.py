"""msgpack on every socket: msgspec encoder/decoder with tensor and ndarray tiers.

Wire shape of one message: a list of frames. Frame 0 is the msgpack body; frames 1.. are
auxiliary buffers that hold the raw bytes of large tensors / arrays, sent zero-copy.

A tensor or array travels as a msgpack ext value (code `EXT_TENSOR` / `EXT_NDARRAY`)
whose payload is itself msgpack: `[dtype, shape, data]`, where `data` is
- the raw bytes, inline, when the array holds fewer than `size_threshold` bytes (256);
- an int, the index of the auxiliary frame that carries the bytes, otherwise.

Invariants:
- No pickle, ever. Object-dtype arrays and non-CPU tensors are refused with a TypeError.
- Decoding is strict: anything malformed (bad msgpack, wrong type, unknown ext code, bad
  dtype, bytes that do not match the shape, aux index out of range) raises a
  `msgspec.DecodeError` / `msgspec.ValidationError`. Callers count and drop, never crash.
- An encoder / decoder instance is not thread-safe (it keeps per-message state): one per
  thread.
- Decoded large tensors share memory with the received frame (zero-copy) unless
  `copy_aux=True`; they must be treated as read-only.
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

if TYPE_CHECKING:
    import torch

EXT_TENSOR = 1
EXT_NDARRAY = 2
INLINE_THRESHOLD = 256

Buffer = bytes | bytearray | memoryview


# torch is imported only by a process that meets a tensor: the API server never does (its
# messages carry none), so it starts without paying for torch's import (~2 s of CPU).
@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: dt for name, dt in vars(torch).items()
            if isinstance(dt, torch.dtype) and not name.startswith("_")}


def _is_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")  # no tensor exists before torch is imported
    return torch is not None and isinstance(obj, torch.Tensor)


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of a CPU tensor's data (no copy when already contiguous).

    The view keeps the tensor storage alive (numpy array base -> tensor).
    """
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


class MsgpackEncoder:
    """Encodes any msgspec-encodable object; tensors/arrays go inline or to aux frames."""

    def __init__(self, size_threshold: int = INLINE_THRESHOLD) -> None:
        self.size_threshold = size_threshold
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)
        self._payload_encoder = msgspec.msgpack.Encoder()
        self._aux: list[Buffer] | None = None

    def encode(self, obj: Any) -> list[Buffer]:
        """Frames of one message: [msgpack body, aux buffer 1, ...]."""
        self._aux = bufs = [b""]
        try:
            bufs[0] = self._encoder.encode(obj)
            return bufs
        finally:
            self._aux = None

    def encode_into(self, obj: Any, buf: bytearray) -> list[Buffer]:
        """Like `encode`, writing the body into `buf` (reused by the caller)."""
        self._aux = bufs = [buf]
        try:
            self._encoder.encode_into(obj, buf)
            return bufs
        finally:
            self._aux = None

    def _enc_hook(self, obj: Any) -> Any:
        if _is_tensor(obj):
            if obj.device.type != "cpu":
                raise TypeError(f"only CPU tensors can be encoded, got one on {obj.device}")
            dtype = str(obj.dtype).removeprefix("torch.")
            return self._ext(EXT_TENSOR, dtype, tuple(obj.shape), obj.nbytes, obj)
        if isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                raise TypeError("object-dtype numpy arrays cannot be encoded")
            return self._ext(EXT_NDARRAY, obj.dtype.str, obj.shape, obj.nbytes, obj)
        raise NotImplementedError(f"cannot encode objects of type {type(obj).__name__}")

    def _ext(self, code: int, dtype: str, shape: tuple, nbytes: int, arr: Any) -> Any:
        if _is_tensor(arr):
            data = _tensor_bytes(arr)
        else:
            data = memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
        if nbytes < self.size_threshold or self._aux is None:
            ref: Any = bytes(data)
        else:
            ref = len(self._aux)
            self._aux.append(data)
        return msgspec.msgpack.Ext(code, self._payload_encoder.encode((dtype, shape, ref)))


_PayloadType = tuple[str, list[int], bytes | int]


class MsgpackDecoder:
    """Decodes the frames of one message into `type` (Any when not given).

    `decode` accepts a single buffer, a zmq Frame, or a sequence of buffers / Frames (the
    body first). Raises msgspec errors on anything malformed.
    """

    def __init__(self, type: Any = Any, *, copy_aux: bool = False) -> None:
        self.copy_aux = copy_aux
        self._decoder = msgspec.msgpack.Decoder(
            type, ext_hook=self._ext_hook, dec_hook=self._dec_hook
        )
        self._payload_decoder = msgspec.msgpack.Decoder(_PayloadType)
        self._aux: Sequence[Buffer] = ()

    def decode(self, frames: Any) -> Any:
        if isinstance(frames, (bytes, bytearray, memoryview)) or hasattr(frames, "buffer"):
            frames = (frames,)
        if not frames:
            raise msgspec.DecodeError("empty message: no frames")
        bufs = [f.buffer if hasattr(f, "buffer") else f for f in frames]
        self._aux = bufs
        try:
            return self._decoder.decode(bufs[0])
        finally:
            self._aux = ()

    def _dec_hook(self, type_: type, obj: Any) -> Any:
        if isinstance(obj, type_):
            return obj
        raise msgspec.ValidationError(f"expected {type_.__name__}, got {type(obj).__name__}")

    def _ext_hook(self, code: int, data: memoryview) -> Any:
        if code not in (EXT_TENSOR, EXT_NDARRAY):
            raise msgspec.DecodeError(f"unknown msgpack ext code {code}")
        dtype_name, shape, ref = self._payload_decoder.decode(data)
        if any(d < 0 for d in shape):
            raise msgspec.DecodeError(f"negative dimension in shape {shape}")
        if isinstance(ref, int):
            if not 1 <= ref < len(self._aux):
                raise msgspec.DecodeError(f"aux frame index {ref} out of range")
            raw: Buffer = self._aux[ref]
            inline = False
        else:
            raw, inline = ref, True
        try:
            if code == EXT_TENSOR:
                return self._to_tensor(dtype_name, shape, raw, copy=inline or self.copy_aux)
            return self._to_ndarray(dtype_name, shape, raw, copy=inline or self.copy_aux)
        except (TypeError, ValueError, RuntimeError) as e:
            raise msgspec.DecodeError(f"bad array payload: {e}") from e

    @staticmethod
    def _to_tensor(dtype_name: str, shape: list[int], raw: Buffer, copy: bool) -> torch.Tensor:
        import torch

        dtype = _torch_dtypes().get(dtype_name)
        if dtype is None:
            raise ValueError(f"unknown torch dtype {dtype_name!r}")
        numel = int(np.prod(shape)) if shape else 1
        expected = numel * dtype.itemsize
        if len(memoryview(raw).cast("B")) != expected:
            raise ValueError(f"{len(raw)} bytes do not fill shape {shape} of {dtype_name}")
        if expected == 0:
            return torch.empty(shape, dtype=dtype)
        if copy:
            t = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        else:
            with warnings.catch_warnings():
                # Frames from zmq are read-only views; the tensor shares their memory.
                warnings.simplefilter("ignore", UserWarning)
                t = torch.frombuffer(raw, dtype=torch.uint8)
        return t.view(dtype).view(shape)

    @staticmethod
    def _to_ndarray(dtype_name: str, shape: list[int], raw: Buffer, copy: bool) -> np.ndarray:
        dtype = np.dtype(dtype_name)
        if dtype.hasobject:
            raise TypeError("object-dtype arrays are refused")
        arr = np.frombuffer(raw, dtype=dtype)
        if arr.size != (int(np.prod(shape)) if shape else 1):
            raise ValueError(f"{len(raw)} bytes do not fill shape {shape} of {dtype_name}")
        arr = arr.reshape(shape)
        return arr.copy() if copy else arr
