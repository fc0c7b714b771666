"""KV events: an engine's publisher (engine/kv_events.py) and the proxy's consumer
(proxy/kv_subscriber.py) over real ZeroMQ sockets on loopback.

One engine with a small cache (evictions happen) publishes; the proxy's subscriber rebuilds
its set of cached block hashes, checked against /engine_stats. A publisher played by the test
skips a sequence number (the consumer resyncs through the replay socket) and sends malformed
messages (counted and dropped)."""

from __future__ import annotations

import asyncio
import random

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from pd_harness import TEST_ENV
from prometheus_client import CollectorRegistry

from engine.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventBatch,
    prefix_cache_digest,
)
from engine.net import free_port
from pdserve.launcher import launch_server
from proxy.config import EventSource
from proxy.kv_subscriber import EventSubscriber
from proxy.prefix_index import PrefixIndex, chain_hashes
from proxy.routing import RoutingMetrics

pytestmark = pytest.mark.timeout(120)

URL = "http://engine.test:1"
NUM_BLOCKS = 24  # 384 token slots: the workload below stores far more blocks than fit


@pytest.fixture(scope="module")
def engine(tiny_model: str):
    pub, replay = free_port(), free_port()
    config = ('{"enable_kv_cache_events": true, "publisher": "zmq", '
              f'"endpoint": "tcp://*:{pub}", "replay_endpoint": "tcp://*:{replay}", '
              '"topic": "kv"}')
    server = launch_server(tiny_model, "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len",
                           "256", "--kv-events-config", config, "--served-model-name", "m",
                           "--log-level", "warning",
                           env=TEST_ENV)
    try:
        yield server, EventSource(URL, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    finally:
        server.stop()


def _metric(metrics: RoutingMetrics, name: str, **labels: str) -> float:
    value = metrics.kv_events if name == "events" else metrics.kv_event_resyncs
    return value.labels(url=URL, **labels)._value.get()


def test_wire_format_is_vllms_tagged_arrays():
    batch = EventBatch(1.5, [BlockStored([7, 8], None, [1, 2, 3, 4], 2), BlockRemoved([5]),
                             AllBlocksCleared()], 0)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch)) == [
        1.5, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None, "GPU"],
              ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]], 0]


def test_events_rebuild_the_engines_cached_blocks_after_evictions(engine):
    server, source = engine
    index, metrics = PrefixIndex(), RoutingMetrics(CollectorRegistry())
    rng = random.Random(3)
    prompts = [[rng.randrange(4, 2000) for _ in range(rng.randint(60, 120))] for _ in range(10)]

    async def run() -> tuple[set[int], dict]:
        sub = EventSubscriber(source, index, metrics, topic="kv")
        sub.start()
        try:
            async with httpx.AsyncClient(timeout=60) as client:
                for p in prompts:  # one at a time: each evicts what the last left cached
                    r = await client.post(f"{server.url}/v1/completions", json={
                        "model": "m", "prompt": p, "max_tokens": 3,
                        "temperature": 0})
                    assert r.status_code == 200, r.text
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 20
                while True:  # the last batches may still be on their way
                    stats = (await client.get(f"{server.url}/engine_stats")).json()
                    got = index.cached_hashes(URL, 0)
                    if prefix_cache_digest(got)["prefix_cache_digest"] == stats[
                            "prefix_cache_digest"] or loop.time() > deadline:
                        return got, stats
                    await asyncio.sleep(0.05)
        finally:
            await sub.stop()

    got, stats = asyncio.run(run())
    assert len(got) == stats["prefix_cache_blocks"] > 0
    assert prefix_cache_digest(got)["prefix_cache_digest"] == stats["prefix_cache_digest"]
    stored = sum(len(p) // 16 for p in prompts)
    assert stored > NUM_BLOCKS >= len(got)  # blocks were evicted, and the view dropped them
    # the last prompt's full blocks are still cached, and the index matches them
    assert index.matched_tokens(URL, prompts[-1], {}) == (len(prompts[-1]) // 16) * 16
    assert _metric(metrics, "events", outcome="malformed") == 0


def test_a_sequence_gap_is_filled_from_the_replay_socket_and_malformed_input_is_dropped():
    pub_port, replay_port = free_port(), free_port()
    source = EventSource(URL, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}")
    index, metrics = PrefixIndex(), RoutingMetrics(CollectorRegistry())
    tokens = list(range(100, 164))  # four blocks of 16
    chain = chain_hashes(tokens, 16)
    enc = msgspec.msgpack.Encoder()
    batches = [enc.encode(KVEventBatch(0.0, [BlockStored([h], chain[i - 1] if i else None,
                                                          tokens[i * 16:(i + 1) * 16], 16)], 0))
               for i, h in enumerate(chain)]

    async def run() -> None:
        ctx = zmq.asyncio.Context.instance()
        pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
        pub.bind(f"tcp://127.0.0.1:{pub_port}")
        router.bind(f"tcp://127.0.0.1:{replay_port}")
        sub = EventSubscriber(source, index, metrics)
        sub.start()
        requests: list[int] = []
        try:
            async def until(pred, what: str) -> None:
                deadline = asyncio.get_running_loop().time() + 10
                while not pred():
                    assert asyncio.get_running_loop().time() < deadline, what
                    await asyncio.sleep(0.01)

            async def send(seq: int, payload: bytes) -> None:
                await pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

            async def serve_replays() -> None:
                while True:
                    client, empty, start = await router.recv_multipart()
                    first = int.from_bytes(start, "big")
                    requests.append(first)
                    for seq in range(first, len(batches)):
                        await router.send_multipart((client, b"", seq.to_bytes(8, "big"),
                                                     batches[seq]))
                    await router.send_multipart((client, b"", END_SEQ, b""))

            replays = asyncio.get_running_loop().create_task(serve_replays())
            # the SUB joins at some point: resend batch 0 until it has been applied
            while sub.expected is None:
                await send(0, batches[0])
                await asyncio.sleep(0.02)
            await send(2, batches[2])  # batch 1 never comes on PUB
            await until(lambda: sub.expected == 3, "the gap filled")
            assert requests == [1]
            assert index.matched_tokens(URL, tokens, {}) == 48  # blocks 0, 1 (replayed), 2
            assert _metric(metrics, "resyncs", outcome="replayed") == 1

            await pub.send_multipart((b"", b"\x00\x03"))  # two frames
            await pub.send_multipart((b"", b"\x00" * 9, batches[3]))  # a 9-byte seq
            await send(3, b"\xc1 not msgpack")
            await send(4, enc.encode([0.0, [["BlockStored", "not a list"]], 0]))
            await until(lambda: _metric(metrics, "events", outcome="malformed") == 4,
                        "four malformed messages counted")
            assert sub.expected == 5 and requests == [1]  # consumed in order, no resync
            assert index.cached_hashes(URL, 0) == set(chain[:3])  # nothing applied
            await send(5, enc.encode(KVEventBatch(0.0, [BlockRemoved([chain[0]])], 0)))
            await until(lambda: sub.expected == 6, "the next good batch applied")
            assert index.matched_tokens(URL, tokens, {}) == 0
            replays.cancel()
        finally:
            await sub.stop()
            pub.close(0)
            router.close(0)

    asyncio.run(run())
