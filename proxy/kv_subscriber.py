"""The proxy's consumer of KV events: one SUB socket per engine publisher, feeding PrefixIndex.

Each publisher (one per data-parallel rank of a backend, engine/kv_events.py or vLLM's) sends
[topic, seq, payload]. The subscriber applies batches in sequence order. A gap (also the first
batch not being seq 0: a SUB joins late) is filled from the publisher's replay socket (a
DEALER sends [b"", first missing seq] and reads [b"", seq, payload] frames up to the seq -1
end marker); when that cannot fill it (no replay socket, the batches left the buffer, no
answer within `replay_timeout`) the rank's view is dropped and rebuilt from what comes next.
A seq below the expected one means the publisher restarted (its cache is empty too).
Every malformed message (frame count, seq width, payload that is not a KVEventBatch) is
counted in `pdserve:proxy_kv_events_total{outcome="malformed"}` and dropped.

Threading: an asyncio task on the proxy's event loop ("proxy-kv-events"); sockets are its own.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
import zmq
import zmq.asyncio

from engine.kv_events import END_SEQ, KVEventBatch
from proxy.config import EventSource
from proxy.prefix_index import PrefixIndex

logger = logging.getLogger("pdserve.proxy")

_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class EventSubscriber:
    def __init__(self, source: EventSource, index: PrefixIndex, metrics: object,
                 topic: str = "", replay_timeout: float = 1.0) -> None:
        self.source = source
        self.index = index
        self.metrics = metrics  # RoutingMetrics (proxy/routing.py)
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self.rank = 0
        self.expected: int | None = None  # next seq to apply; None before the first batch
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self._ctx = zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None
        index.expect_events(source.url)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="proxy-kv-events")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def _count(self, outcome: str, n: int = 1) -> None:
        self.metrics.kv_events.labels(url=self.source.url, outcome=outcome).inc(n)

    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.source.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                batch_seq = self._parse(frames)
                if batch_seq is not None:
                    await self._accept(*batch_seq)
        finally:
            sub.close(linger=0)

    def _parse(self, frames: list[bytes]) -> tuple[int, KVEventBatch | None] | None:
        """(seq, batch); batch None when only the payload is malformed (its seq still
        counts: replaying it would bring the same bytes). None when the frames are."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._count("malformed")
            return None
        seq = int.from_bytes(frames[1], "big")
        try:
            return seq, self._decoder.decode(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._count("malformed")
            logger.warning("kv events from %s: malformed batch %d dropped: %s",
                           self.source.endpoint, seq, exc)
            return seq, None

    async def _accept(self, seq: int, batch: KVEventBatch | None) -> None:
        if batch is not None:
            self.rank = batch.data_parallel_rank or 0
        if self.expected is not None and seq < self.expected:  # the publisher restarted
            self.metrics.kv_event_resyncs.labels(url=self.source.url, outcome="restart").inc()
            self.index.forget(self.source.url, self.rank)
            self.expected = 0
        expected = self.expected or 0
        if seq > expected:
            await self._resync(expected, seq)
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: KVEventBatch | None) -> None:
        self.expected = seq + 1
        if batch is not None:
            self.index.apply(self.source.url, batch.data_parallel_rank or 0, batch.events)
            self._count("applied")

    async def _resync(self, first: int, upto: int) -> None:
        """Apply batches first..upto-1 from the replay socket, or drop the rank's view."""
        replayed = await self._replay(first, upto) if self.source.replay_endpoint else None
        if replayed is None or (replayed and replayed[0][0] != first) or (
                len(replayed) != upto - first):
            self.metrics.kv_event_resyncs.labels(url=self.source.url, outcome="failed").inc()
            logger.warning("kv events from %s: batches %d..%d missed and not replayable; "
                           "the view of rank %d starts again", self.source.endpoint, first,
                           upto - 1, self.rank)
            self.index.forget(self.source.url, self.rank)
            return
        for seq, batch in replayed:
            self._apply(seq, batch)
        self._count("replayed", len(replayed))
        self.metrics.kv_event_resyncs.labels(url=self.source.url, outcome="replayed").inc()

    async def _replay(self, first: int, upto: int
                      ) -> list[tuple[int, KVEventBatch | None]] | None:
        """The consecutive batches first..upto-1 the publisher still buffers; None on timeout."""
        dealer = self._ctx.socket(zmq.DEALER)  # a fresh one: no stale answer can be read
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        dealer.connect(self.source.replay_endpoint)
        got: list[tuple[int, KVEventBatch | None]] = []

        async def collect() -> None:
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                frames = await dealer.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self._count("malformed")
                    continue
                if frames[1] == END_SEQ:
                    return
                parsed = self._parse(frames)
                if parsed is not None and first + len(got) == parsed[0] < upto:
                    got.append(parsed)

        try:
            await asyncio.wait_for(collect(), self.replay_timeout)
            return got
        except asyncio.TimeoutError:
            return None
        finally:
            dealer.close(linger=0)
