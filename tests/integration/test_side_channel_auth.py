"""The side channel's challenge–response, allowlist and reply cap over real ZeroMQ sockets.

A real :class:`SideChannelServer` serves a fixed :class:`AgentMetadata`; the tests play the
stranger (no secret, a wrong one, a replayed nonce, a forbidden address) with the real client
or a raw ZeroMQ REQ socket, and a fake server (its own process) plays a side channel that
does not know the secret or that answers with 256 MiB.
"""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvconnector.handshake import (
    MAX_REPLY_BYTES,
    AgentMetadata,
    Challenge,
    ErrorReply,
    GetMeta,
    HandshakeError,
    Hello,
    MetaReply,
    Reply,
    SealedMetaReply,
    SideChannelServer,
    fetch_peer_metadata,
)
from kvconnector.handshake_auth import NonceBook, client_proof, new_nonce, open_meta
from kvconnector.security import KVSecurity

pytestmark = pytest.mark.timeout(60)

SECRET = KVSecurity(b"the-right-secret-0123456789")
WRONG = KVSecurity(b"a-wrong-secret-0123456789ab")
META = AgentMetadata(agent_name="P0-tp0", agent_blob=b"\x01blob" * 80, base_addr=4096,
                     num_blocks=32, bytes_per_block=1024, block_size=4, tp_rank=0, tp_size=1,
                     engine_id="P0", compat_hash="c0ffee")


@pytest.fixture
def server(request: pytest.FixtureRequest) -> Iterator[SideChannelServer]:
    sec = getattr(request, "param", SECRET)
    with SideChannelServer("127.0.0.1", 0, lambda: META, sec) as s:
        yield s


def _raw(port: int, *requests: object) -> list[Reply]:
    """Send requests one after another on one REQ socket; the typed replies."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        out = []
        for req in requests:
            sock.send(msgspec.msgpack.encode(req))
            assert sock.poll(3000, zmq.POLLIN), "the side channel stopped answering"
            out.append(msgspec.msgpack.decode(sock.recv(), type=Reply))
        return out
    finally:
        sock.close()


def test_a_peer_with_the_same_secret_gets_the_metadata(server):
    meta = fetch_peer_metadata("127.0.0.1", server.port, "c0ffee", 3.0, security=SECRET)
    assert meta == META
    assert server.refused_count == 0 and server.served_count == 1


def test_a_client_without_the_secret_gets_no_metadata_and_is_counted(server):
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("127.0.0.1", server.port, None, 3.0)
    assert e.value.cause == "refused" and "kv secret required" in str(e.value)
    # A raw GET_META, as vLLM or any stranger would send it: an error reply, no blob.
    (reply,) = _raw(server.port, GetMeta(tp_rank=0))
    assert isinstance(reply, ErrorReply) and reply.code == "refused"
    assert server.refused_count == 2 and server.served_count == 0


def test_a_client_with_a_wrong_secret_gets_no_metadata_and_is_counted(server):
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("127.0.0.1", server.port, None, 3.0, security=WRONG)
    assert e.value.cause == "refused" and "wrong proof" in str(e.value)
    assert server.refused_count == 1 and server.served_count == 0


def test_a_challenge_nonce_works_once_and_only_for_its_client_nonce(server):
    cnonce = new_nonce()
    (challenge,) = _raw(server.port, Hello(cnonce))
    assert isinstance(challenge, Challenge)
    good = _proven(GetMeta(0, cnonce, challenge.server_nonce, endpoint=_here(server)))
    first, replay = _raw(server.port, good, good)
    assert isinstance(first, SealedMetaReply)
    assert isinstance(replay, ErrorReply) and "nonce" in replay.message
    # A nonce issued to one client nonce is no good with another, even with a valid proof.
    (challenge,) = _raw(server.port, Hello(cnonce))
    (reply,) = _raw(server.port, _proven(GetMeta(0, new_nonce(), challenge.server_nonce,
                                                 endpoint=_here(server))))
    assert isinstance(reply, ErrorReply) and reply.code == "refused"
    assert server.refused_count == 2 and server.served_count == 1


def _here(server: SideChannelServer) -> str:
    return f"127.0.0.1:{server.port}"


def _proven(req: GetMeta, sec: KVSecurity = SECRET) -> GetMeta:
    return msgspec.structs.replace(req, proof=client_proof(sec, req))


def test_the_metadata_never_crosses_in_clear_and_opens_only_for_its_exchange(server):
    """What a relay or an observer of the side channel sees is ciphertext: the agent blob
    (UCX address and memory keys) is not in the reply, and another exchange's key, or the
    right transcript under another secret, does not open it."""
    cnonce = new_nonce()
    (challenge,) = _raw(server.port, Hello(cnonce))
    ask = _proven(GetMeta(0, cnonce, challenge.server_nonce, endpoint=_here(server),
                          client_id="D0-tp0"))
    (reply,) = _raw(server.port, ask)
    assert isinstance(reply, SealedMetaReply)
    assert META.agent_blob not in reply.sealed and b"P0-tp0" not in reply.sealed
    opened = open_meta(SECRET, ask, reply.sealed)
    assert opened is not None and msgspec.msgpack.decode(opened, type=AgentMetadata) == META
    assert open_meta(WRONG, ask, reply.sealed) is None
    for changed in ({"client_id": "rogue-tp0"}, {"endpoint": "127.0.0.1:1"},
                    {"client_nonce": new_nonce()}):
        assert open_meta(SECRET, msgspec.structs.replace(ask, **changed), reply.sealed) is None


@pytest.mark.parametrize("endpoint", ["127.0.0.2:{port}", "127.0.0.1:1", "", "not-an-ip:{port}",
                                      "10.1.2.3:{port}"])
def test_a_proof_for_another_endpoint_is_refused_and_counted(server, endpoint):
    """The proof names the address the client dialled; a side channel answers only a client
    that dialled it (a relay makes the client name the relay)."""
    cnonce = new_nonce()
    (challenge,) = _raw(server.port, Hello(cnonce))
    (reply,) = _raw(server.port, _proven(GetMeta(0, cnonce, challenge.server_nonce,
                                                 endpoint=endpoint.format(port=server.port))))
    assert isinstance(reply, ErrorReply) and reply.code == "refused"
    assert "not this side channel" in reply.message
    assert server.refused_count == 1 and server.served_count == 0


def test_a_side_channel_bound_to_a_wildcard_owns_its_interfaces_only():
    with SideChannelServer("0.0.0.0", 0, lambda: META, SECRET) as s:
        assert fetch_peer_metadata("127.0.0.1", s.port, "c0ffee", 3.0, security=SECRET) == META
        cnonce = new_nonce()
        (challenge,) = _raw(s.port, Hello(cnonce))
        (reply,) = _raw(s.port, _proven(GetMeta(0, cnonce, challenge.server_nonce,
                                                endpoint=f"192.0.2.7:{s.port}")))
        assert isinstance(reply, ErrorReply) and reply.code == "refused"


def test_server_nonces_expire_and_stay_bounded_in_count():
    now = [100.0]
    book = NonceBook(capacity=4, lifetime_s=10.0, clock=lambda: now[0])
    c = new_nonce()
    stale = book.issue(c)
    now[0] += 10.0
    assert not book.take(stale, c)
    nonces = [book.issue(c) for _ in range(10)]
    assert len(book) == 4
    assert not book.take(nonces[0], c)  # the oldest gave way
    assert book.take(nonces[-1], c) and not book.take(nonces[-1], c)


@pytest.mark.parametrize("server", [KVSecurity(SECRET.secret, KVSecurity.from_extra(
    {"kv_peer_allowlist": ["10.0.0.0/8"]}, warn=False).allowlist)], indirect=True)
def test_the_side_channel_refuses_an_address_outside_the_allowlist(server):
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("127.0.0.1", server.port, None, 3.0, security=SECRET)
    assert e.value.cause == "refused" and "kv_peer_allowlist" in str(e.value)
    assert server.refused_count == 1 and server.served_count == 0


def test_the_client_refuses_a_peer_outside_its_allowlist_before_connecting(server):
    only_10 = KVSecurity(SECRET.secret, KVSecurity.from_extra(
        {"kv_peer_allowlist": "10.0.0.0/8, fd00::/8"}, warn=False).allowlist)
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("localhost", server.port, None, 3.0, security=only_10)
    assert e.value.cause == "not allowed"
    assert server.served_count == 0 and server.refused_count == 0  # never reached it


@pytest.mark.parametrize("server", [None], indirect=True)
def test_without_a_secret_both_sides_behave_as_before(server):
    assert fetch_peer_metadata("127.0.0.1", server.port, "c0ffee", 3.0) == META
    (reply,) = _raw(server.port, GetMeta(tp_rank=0))
    assert isinstance(reply, MetaReply) and reply.meta == META
    # A client that holds a secret does not take an unauthenticated peer's blob.
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("127.0.0.1", server.port, None, 3.0, security=SECRET)
    assert e.value.cause == "refused" and "no kv secret" in str(e.value)


# A side channel in its own process: it answers HELLO with a challenge, then GET_META with
# whatever MODE says (a forged, unsigned or huge reply).
FAKE_SERVER = r"""
import sys, msgspec, zmq
from kvconnector.handshake import Challenge, MetaReply, SealedMetaReply
from kvconnector.handshake_msgs import AgentMetadata
mode, meta = sys.argv[1], msgspec.msgpack.decode(bytes.fromhex(sys.argv[2]), type=AgentMetadata)
sock = zmq.Context.instance().socket(zmq.ROUTER)
port = sock.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
while True:
    ident, empty, body = sock.recv_multipart()
    if b"HELLO" in body:
        reply = msgspec.msgpack.encode(Challenge(b"n" * 32))
    elif mode == "huge":
        reply = b"\0" * (256 << 20)
    elif mode == "forged":
        reply = msgspec.msgpack.encode(SealedMetaReply(msgspec.msgpack.encode(meta) + b"x" * 16))
    else:
        reply = msgspec.msgpack.encode(MetaReply(meta))
    sock.send_multipart([ident, empty, reply])
"""


@contextlib.contextmanager
def _listening(*argv: str) -> Iterator[int]:
    """A Python process that prints the port it listens on; killed afterwards."""
    proc = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[int]:
    with _listening("-c", FAKE_SERVER, request.param, msgspec.msgpack.encode(META).hex()) as p:
        yield p


@pytest.mark.parametrize("fake_server", ["forged"], indirect=True)
def test_a_side_channel_that_cannot_prove_the_secret_hands_out_no_blob(fake_server):
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("127.0.0.1", fake_server, None, 3.0, security=SECRET)
    assert e.value.cause == "bad proof"


@pytest.mark.parametrize("fake_server", ["unsigned"], indirect=True)
def test_an_unsigned_reply_is_refused_by_a_client_with_a_secret(fake_server):
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("127.0.0.1", fake_server, None, 3.0, security=SECRET)
    assert e.value.cause == "refused"


@pytest.mark.parametrize("fake_server", ["huge"], indirect=True)
def test_a_huge_handshake_reply_fails_fast_with_bounded_memory(fake_server):
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    started = time.monotonic()
    with pytest.raises(HandshakeError) as e:
        fetch_peer_metadata("127.0.0.1", fake_server, None, 30.0)
    elapsed = time.monotonic() - started
    assert e.value.cause == "bad reply" and str(MAX_REPLY_BYTES) in str(e.value)
    assert elapsed < 10.0, elapsed  # the connection drop ends it, not the 30 s timeout
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 32, f"the client grew by {grown_mib:.0f} MiB"


RELAY = os.path.join(os.path.dirname(__file__), "..", "kv_relay.py")


def relay_to(port: int, record: str) -> contextlib.AbstractContextManager[int]:
    """A relay process in front of the side channel on `port` (tests/kv_relay.py)."""
    return _listening(RELAY, "127.0.0.1", str(port), record)


def test_a_relayed_handshake_is_refused_and_the_relay_keeps_no_metadata(server, tmp_path):
    """Issue 26, finding 1: a client holding the secret dials a relay that passes each frame
    to the real side channel. Before the fix both ends accepted and SIGNED_META crossed the
    relay in clear; now the server refuses (the proof names the relay's address), the relay
    records a CHALLENGE and a refusal only, and a direct handshake beside it succeeds."""
    record = str(tmp_path / "relay.hex")
    with relay_to(server.port, record) as relay_port:
        with pytest.raises(HandshakeError) as e:
            fetch_peer_metadata("127.0.0.1", relay_port, None, 3.0, security=SECRET,
                                client_id="D0-tp0")
    assert e.value.cause == "refused" and "not this side channel" in str(e.value)
    with open(record) as f:
        seen = [msgspec.msgpack.decode(bytes.fromhex(line), type=Reply) for line in f]
    assert [type(r) for r in seen] == [Challenge, ErrorReply]
    assert all(META.agent_blob not in bytes.fromhex(line) for line in open(record))
    assert server.refused_count == 1 and server.served_count == 0
    assert fetch_peer_metadata("127.0.0.1", server.port, "c0ffee", 3.0, security=SECRET) == META


@pytest.mark.parametrize("host", ["no-such-host.invalid", None])
def test_a_side_channel_that_cannot_start_says_so_instead_of_hanging(host):
    """Start-up (issue 26, finding 9): an error anywhere before the serving loop — a ZeroMQ
    bind error or any other — reaches start() as an OSError; before, one raised while the
    socket was being set up killed the thread and start() waited forever."""
    started = time.monotonic()
    with pytest.raises(OSError, match="KV side channel"):
        SideChannelServer(host, 0, lambda: META, SECRET).start()  # type: ignore[arg-type]
    assert time.monotonic() - started < 10
