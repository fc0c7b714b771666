"""With --kv-secret, only engines that prove the secret get each other's metadata.

One P and two D's as real processes: D0 shares P's secret (both from --kv-secret), D1 holds
another one (from the extra config). The test process plays the stranger: no secret, a wrong
one, a raw vLLM-style GET_META. A pair with the same secret moves KV and answers like the
reference; the pair with different secrets refuses each other with a clear error and D1
recomputes, so the request is still answered.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import msgspec
import pytest
import zmq
from fault_kit import LOG_DIR, cluster, kv_stat, legs, post, prompts, text_of
from pd_harness import assert_no_leaks, engine_stats, metric

from kvconnector.handshake import (
    ErrorReply,
    GetMeta,
    HandshakeError,
    Reply,
    fetch_peer_metadata,
)
from kvconnector.security import KVSecurity

pytestmark = pytest.mark.timeout(240)

SECRET = "p-and-d0-share-this-secret"
OTHER = "d1-holds-another-secret!!"


@pytest.fixture(scope="module")
def dep(tiny_model: str):
    with cluster(tiny_model, name="secret", with_proxy=False,
                 extra={"kv_lease_duration": 2.0, "push_registration_timeout": 6.0},
                 p_args=("--kv-secret", SECRET),
                 d_extras=[{}, {"kv_secret": OTHER}],
                 d_args=[("--kv-secret", SECRET), ()]) as d:
        yield d


def _run_pair(dep, d_server, seed: int, n: int) -> tuple[list[list[int]], list[str]]:
    """Both legs of n requests at once, as the proxy sends them; D's texts."""
    ps = prompts(n, seed=seed)

    async def one(i: int, p: list[int]) -> str:
        p_leg, d_leg = legs(dep, p, f"tid-secret-{seed}-{i}")
        p_r, d_r = await asyncio.gather(post(dep.p.url, p_leg, f"s-{seed}-{i}"),
                                        post(d_server.url, d_leg, f"s-{seed}-{i}"))
        assert p_r.status_code == 200, p_r.text
        return text_of(d_r)

    async def run() -> list[str]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(ps))))

    return ps, asyncio.run(run())


def test_engines_sharing_a_secret_move_kv_and_match_the_reference(dep, reference):
    d0 = dep.decodes[0]
    tokens = kv_stat(d0, "kv_remote_prefill_tokens_total")
    writes = kv_stat(dep.p, "kv_push_writes_total")
    ps, texts = _run_pair(dep, d0, seed=801, n=3)
    assert texts == reference(ps)
    assert kv_stat(dep.p, "kv_push_writes_total") == writes + 3
    assert kv_stat(d0, "kv_remote_prefill_tokens_total") > tokens
    assert kv_stat(d0, "kv_handshake_refused_total") == 0
    assert_no_leaks([dep.p, d0])


def _raw_get_meta(port: int) -> Reply:
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(msgspec.msgpack.encode(GetMeta(tp_rank=0)))
        assert sock.poll(3000, zmq.POLLIN)
        return msgspec.msgpack.decode(sock.recv(), type=Reply)
    finally:
        sock.close()


@pytest.mark.parametrize("engine", ["P0", "D0"])
def test_a_stranger_without_the_secret_gets_no_metadata(dep, engine):
    server = dep.p if engine == "P0" else dep.decodes[0]
    port = dep.kv_ports[engine]
    refused = kv_stat(server, "kv_side_channel_refused_total")
    with pytest.raises(HandshakeError) as none:
        fetch_peer_metadata("127.0.0.1", port, None, 3.0)
    with pytest.raises(HandshakeError) as wrong:
        fetch_peer_metadata("127.0.0.1", port, None, 3.0,
                            security=KVSecurity(b"guessed-wrong-secret-000"))
    reply = _raw_get_meta(port)
    assert none.value.cause == wrong.value.cause == "refused"
    assert isinstance(reply, ErrorReply) and reply.code == "refused"
    assert kv_stat(server, "kv_side_channel_refused_total") == refused + 3
    assert metric(server, "pdserve:kv_side_channel_refused_total") == refused + 3
    # The same side channel still serves an engine that proves the secret.
    meta = fetch_peer_metadata("127.0.0.1", port, None, 3.0,
                               security=KVSecurity(SECRET.encode()))
    assert meta.engine_id == engine


def test_engines_with_different_secrets_refuse_each_other_and_d_recomputes(dep, reference):
    d1 = dep.decodes[1]
    refused = kv_stat(dep.p, "kv_side_channel_refused_total")
    fallbacks = kv_stat(d1, "kv_recompute_fallback_total")
    ps, texts = _run_pair(dep, d1, seed=802, n=1)
    assert texts == reference(ps)  # answered: D1 computed the prompt itself
    assert kv_stat(d1, "kv_handshake_refused_total") >= 1
    assert kv_stat(dep.p, "kv_side_channel_refused_total") > refused
    assert kv_stat(d1, "kv_recompute_fallback_total") == fallbacks + 1
    assert kv_stat(d1, "kv_remote_prefill_tokens_total") == 0
    with open(os.path.join(LOG_DIR, "secret-D1.log"), errors="replace") as f:
        assert "kv secrets differ" in f.read()  # the operator is told why
    assert_no_leaks(dep.engines)


def test_the_secret_appears_in_no_log_and_no_endpoint(dep):
    for engine in ("P0", "D0", "D1"):
        with open(os.path.join(LOG_DIR, f"secret-{engine}.log"), errors="replace") as f:
            log = f.read()
        assert SECRET not in log and OTHER not in log
        assert "NO KV SECRET" not in log
    for server in dep.engines:
        assert SECRET not in str(engine_stats(server))
        assert SECRET not in httpx.get(f"{server.url}/kv_transfer/info", timeout=5).text


def test_pull_engines_sharing_a_secret_read_kv_and_refuse_strangers(tiny_model, reference):
    from pd_harness import deployment

    with deployment(tiny_model, "pull", num_blocks=256, extra={"kv_secret": SECRET}) as pull:
        reads = kv_stat(pull.d, "kv_pull_reads_total")
        ps = prompts(2, seed=803)

        async def run() -> list[str]:
            return [text_of(r) for r in await asyncio.gather(
                *(post(pull.proxy.url, {"model": "m", "prompt": p, "max_tokens": 8,
                                        "temperature": 0.0}, f"pull-secret-{i}")
                  for i, p in enumerate(ps)))]

        assert asyncio.run(run()) == reference(ps)
        assert kv_stat(pull.d, "kv_pull_reads_total") == reads + 2  # D read P's blocks
        with pytest.raises(HandshakeError) as e:
            fetch_peer_metadata("127.0.0.1", pull.kv_ports["P0"], None, 3.0)
        assert e.value.cause == "refused"
        assert kv_stat(pull.p, "kv_side_channel_refused_total") == 1
        assert_no_leaks(pull.engines)
