"""KV-cache events: what an engine's prefix cache gains and loses, published over ZeroMQ.

Wire-compatible with vLLM's `--kv-events-config` publisher (vllm/distributed/kv_events.py), so
routers that consume vLLM's events (llm-d's KV-cache manager, Dynamo's KV router) read ours:

  PUB socket, multipart [topic, seq (8 bytes, big-endian), payload]; payload is a msgpack
  `KVEventBatch` = [ts, [event, ...], data_parallel_rank] where each event is a tagged array
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
  ["BlockRemoved", block_hashes, medium] or ["AllBlocksCleared"].
  ROUTER replay socket: a client sends [b"", start_seq (8 bytes)] (REQ or DEALER) and gets one
  [b"", seq, payload] per buffered batch with seq >= start_seq, then [b"", -1 (8 bytes), b""].

Block hashes are the engine's own chained prefix hashes (engine/sched/block_pool.py): a
consumer that knows the block size recomputes them from token ids. Each data-parallel rank
publishes on its own ports (endpoint port + rank, as vLLM does).

Threading: `KVEventRecorder` lives on the engine-core thread (the block pool calls it, the
core flushes it once per step); `ZmqEventPublisher` owns its sockets on its own thread
("kv-events-publisher") and takes batches through a bounded queue.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any

import msgspec
import zmq

logger = logging.getLogger(__name__)

MEDIUM = "GPU"  # vLLM's name for the engine's own KV tier; consumers filter on it
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the cache events (tag = the class name, vLLM's encoding)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None = MEDIUM


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys (`--kv-events-config '{"enable_kv_cache_events": true,
    "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config.publisher must be 'null' or 'zmq', "
                             f"got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config.{name} must be a tcp://, ipc:// or "
                                 f"inproc:// address, got {value!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, value: str | dict[str, Any]) -> KVEventsConfig:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"kv_events_config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**value)


def prefix_cache_digest(hashes: Iterable[int]) -> dict[str, Any]:
    """The set of cached block hashes in two numbers (/engine_stats): a consumer that
    replays the events checks its reconstruction against them."""
    ordered = sorted(hashes)
    digest = hashlib.sha256(msgspec.msgpack.encode(ordered)).hexdigest()[:16]
    return {"prefix_cache_blocks": len(ordered), "prefix_cache_digest": digest}


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """The endpoint of data-parallel rank `rank`: tcp port + rank, ipc/inproc name + _dp<rank>."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    return f"{endpoint}_dp{rank}"


class KVEventRecorder:
    """Collects the block pool's cache changes of one step (engine-core thread only).

    Consecutive stores along one chain coalesce into one BlockStored, consecutive removals
    into one BlockRemoved, as vLLM sends them."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVCacheEvent] = []

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]
               ) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockStored) and last.block_hashes[-1] == parent_hash:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.events.append(BlockStored([block_hash], parent_hash, list(token_ids),
                                       self.block_size))

    def removed(self, block_hash: int) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
            return
        self.events.append(BlockRemoved([block_hash]))

    def cleared(self) -> None:
        self.events = [AllBlocksCleared()]

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


class ZmqEventPublisher:
    """PUB socket + optional ROUTER replay socket with the last `buffer_steps` batches.

    `publish` (engine-core thread) never blocks: a full queue drops the batch and counts it
    (`dropped`); consumers see the sequence gap and resync through the replay socket."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        try:
            _bind_or_connect(self._pub, self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv events: cannot open {self.endpoint} / "
                             f"{self.replay_endpoint}: {exc}") from None
        self.published = 0
        self.dropped = 0
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kv-events-publisher")
        self._thread.start()
        logger.info("kv events: publishing on %s (replay %s), data-parallel rank %d",
                    self.endpoint, self.replay_endpoint, data_parallel_rank)

    def publish(self, events: list[KVCacheEvent]) -> None:
        try:
            self._queue.put_nowait(EventBatch(time.time(), events, self.rank))
        except queue.Full:
            self.dropped += 1

    def shutdown(self, timeout: float = 1.0) -> None:
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if batch is None:
                return
            payload = encoder.encode(batch)
            seq = self._seq.to_bytes(8, "big")
            self._pub.send_multipart((self._topic, seq, payload))
            self._buffer.append((self._seq, payload))
            self._seq += 1
            self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: malformed replay request (%d frames) dropped",
                           len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _bind_or_connect(sock: zmq.Socket, endpoint: str | None) -> None:
    """vLLM's rule: bind a wildcard, ipc or inproc address, connect to any other."""
    if endpoint is None:
        return
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
