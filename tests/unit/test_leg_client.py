"""The P legs' HTTP client (proxy/leg_client.py) against real loopback servers: a scripted raw
HTTP/1.1 server (asyncio.start_server) that does what a backend can do - answer in chunks,
keep the connection or close it, break off, stall."""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
import tempfile
from collections.abc import Awaitable, Callable

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from pki_kit import make_pki  # noqa: E402

from proxy.leg_client import ConnectFailed, Disconnected, LegClient  # noqa: E402

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bytes], Awaitable[bool]]


class Server:
    """Answers each request on a connection with `handler` (True: keep the connection)."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed = asyncio.Event()  # a connection's reader saw its end

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.tls)
        scheme = "https" if self.tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                if not await self.handler(reader, writer, request):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.closed.set()
            writer.close()


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts)


SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n")


async def sse_answer(reader, writer, request) -> bool:
    writer.write(SSE_HEAD + chunked(b"data: 1\n\n"))
    await writer.drain()
    writer.write(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
    await writer.drain()
    return True


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_streams_a_200_to_on_body_and_keeps_the_connection():
    async def main():
        async with Server(sse_answer) as server:
            client = LegClient(limit=8, keepalive=30, headers={"accept-encoding": "identity"})
            got: list[tuple[bytes, str]] = []
            for _ in range(3):
                answer = await client.post(
                    server.url, "/v1/completions", b'{"a":1}', {"x-request-id": "r1"},
                    total=10, connect=5, on_body=lambda b, h: got.append((b, h["content-type"])))
                assert (answer.status, answer.body) == (200, b"")
                assert answer.headers["content-type"] == "text/event-stream"
            await client.close()
            assert server.connections == 1, "one keep-alive connection for three legs"
            assert b"".join(b for b, _ in got) == b"data: 1\n\ndata: [DONE]\n\n" * 3
            assert {t for _, t in got} == {"text/event-stream"}
            request = server.requests[0]
            assert request.startswith(b"POST /v1/completions HTTP/1.1\r\n")
            host = server.url.removeprefix("http://").encode()
            for line in (b"host: " + host, b"content-length: 7", b"x-request-id: r1",
                         b"accept-encoding: identity"):
                assert line + b"\r\n" in request, (line, request)
            assert request.endswith(b'\r\n\r\n{"a":1}')

    run(main())


def test_on_body_gets_the_first_chunk_before_the_answer_ends():
    async def main():
        first = asyncio.Event()
        release = asyncio.Event()

        async def slow(reader, writer, request) -> bool:
            writer.write(SSE_HEAD + chunked(b"data: head\n\n"))
            await writer.drain()
            await release.wait()  # the rest only once the client has the head
            writer.write(chunked(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            return True

        def on_body(data: bytes, headers: dict[str, str]) -> None:
            if data == b"data: head\n\n":
                first.set()
                release.set()

        async with Server(slow) as server:
            client = LegClient(limit=8, keepalive=30)
            answer = await client.post(server.url, "/p", b"{}", {}, total=10, connect=5,
                                       on_body=on_body)
            assert answer.status == 200 and first.is_set()
            await client.close()

    run(main())


def test_an_error_status_is_read_whole_and_not_streamed():
    async def main():
        async def refuse(reader, writer, request) -> bool:
            body = b'{"error":{"message":"bad max_tokens","param":"max_tokens"}}'
            writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body))
            return True

        async with Server(refuse) as server:
            client = LegClient(limit=8, keepalive=30)
            streamed: list[bytes] = []
            answer = await client.post(server.url, "/p", b"{}", {}, total=10, connect=5,
                                       on_body=lambda b, h: streamed.append(b))
            assert answer.status == 400 and b"bad max_tokens" in answer.body
            assert streamed == []
            await client.close()

    run(main())


def test_a_connection_the_server_closes_is_not_reused():
    async def main():
        async def close_after(reader, writer, request) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok")
            return False

        async with Server(close_after) as server:
            client = LegClient(limit=8, keepalive=30)
            for _ in range(2):
                answer = await client.post(server.url, "/p", b"{}", {}, total=10, connect=5)
                assert (answer.status, answer.body) == (200, b"ok")
            assert server.connections == 2
            await client.close()

    run(main())


def test_an_answer_delimited_by_the_close_is_whole():
    async def main():
        async def http10(reader, writer, request) -> bool:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{\"x\":1}")
            return False

        async with Server(http10) as server:
            client = LegClient(limit=8, keepalive=30)
            answer = await client.post(server.url, "/p", b"{}", {}, total=10, connect=5)
            assert (answer.status, answer.body) == (200, b'{"x":1}')
            await client.close()

    run(main())


def test_an_idle_connection_past_keepalive_is_not_reused():
    async def main():
        async with Server(sse_answer) as server:
            client = LegClient(limit=8, keepalive=0.0)  # every idle connection is stale
            for _ in range(2):
                await client.post(server.url, "/p", b"{}", {}, total=10, connect=5,
                                  on_body=lambda b, h: None)
            assert server.connections == 2
            await client.close()

    run(main())


def test_a_refused_connection_is_connect_failed():
    async def main():
        async with Server(sse_answer) as server:
            url = server.url
        await asyncio.sleep(0)
        client = LegClient(limit=8, keepalive=30)
        with pytest.raises(ConnectFailed, match="cannot connect"):
            await client.post(url, "/p", b"{}", {}, total=10, connect=5)
        await client.close()

    run(main())


def test_an_answer_broken_off_is_disconnected():
    async def main():
        async def break_off(reader, writer, request) -> bool:
            writer.write(SSE_HEAD + chunked(b"data: 1\n\n"))
            await writer.drain()
            return False  # closes without the last chunk

        async with Server(break_off) as server:
            client = LegClient(limit=8, keepalive=30)
            got: list[bytes] = []
            with pytest.raises(Disconnected, match="closed the connection"):
                await client.post(server.url, "/p", b"{}", {}, total=10, connect=5,
                                  on_body=lambda b, h: got.append(b))
            assert got == [b"data: 1\n\n"]
            await client.close()

    run(main())


def test_garbage_is_disconnected():
    async def main():
        async def garbage(reader, writer, request) -> bool:
            writer.write(b"SMTP ready\r\n\r\n")
            await writer.drain()
            await reader.read()  # until the client drops it
            return False

        async with Server(garbage) as server:
            client = LegClient(limit=8, keepalive=30)
            with pytest.raises(Disconnected, match="malformed HTTP answer"):
                await client.post(server.url, "/p", b"{}", {}, total=10, connect=5)
            await asyncio.wait_for(server.closed.wait(), 10)
            await client.close()

    run(main())


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_leg_given_up_closes_its_connection(how):
    """The total timeout, or the caller cancelled: the backend sees the connection close
    (which aborts its request), and the next leg gets a fresh connection."""

    async def main():
        received = asyncio.Event()  # the client has the first chunk: it waits for more

        async def stalls(reader, writer, request) -> bool:
            if len(server.requests) == 1:
                writer.write(SSE_HEAD + chunked(b"data: 1\n\n"))
                await writer.drain()
                await reader.read()  # the client's close
                return False
            return await sse_answer(reader, writer, request)

        async with Server(stalls) as server:
            client = LegClient(limit=8, keepalive=30)
            leg = asyncio.ensure_future(client.post(
                server.url, "/p", b"{}", {}, total=0.5 if how == "timeout" else 30,
                connect=5, on_body=lambda b, h: received.set()))
            await received.wait()
            if how == "cancel":
                leg.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await leg
            else:
                with pytest.raises(TimeoutError):
                    await leg
            await asyncio.wait_for(server.closed.wait(), 10)
            answer = await client.post(server.url, "/p", b"{}", {}, total=10, connect=5,
                                       on_body=lambda b, h: None)
            assert answer.status == 200 and server.connections == 2
            await client.close()

    run(main())


def test_the_limit_holds_a_leg_until_a_slot_frees():
    async def main():
        release = asyncio.Event()
        order: list[str] = []

        async def held(reader, writer, request) -> bool:
            order.append(request.rsplit(b"\r\n\r\n", 1)[1].decode())
            if len(server.requests) == 1:
                await release.wait()
            return await sse_answer(reader, writer, request)

        async with Server(held) as server:
            client = LegClient(limit=1, keepalive=30)

            def leg(name: bytes):
                return asyncio.ensure_future(client.post(server.url, "/p", name, {}, total=10,
                                                         connect=5, on_body=lambda b, h: None))

            first, second = leg(b"1"), leg(b"2")
            while not server.requests:
                await asyncio.sleep(0.01)
            assert not second.done() and order == ["1"], "the second waits for the slot"
            release.set()
            await asyncio.gather(first, second)
            assert order == ["1", "2"] and server.connections == 1
            await client.close()

    run(main())


@pytest.mark.parametrize("header", [("x-evil", "a\r\nhost: b"), ("bad\nname", "v"),
                                    ("x-nul", "a\0b")])
def test_a_header_with_control_characters_is_refused(header):
    async def main():
        async with Server(sse_answer) as server:
            client = LegClient(limit=8, keepalive=30)
            with pytest.raises(ValueError, match="control characters"):
                await client.post(server.url, "/p", b"{}", dict([header]), total=10, connect=5)
            assert server.requests == []
            await client.close()

    run(main())


@pytest.fixture(scope="module")
def pki():
    return make_pki(tempfile.mkdtemp(prefix="pdserve-leg-pki-"))


@pytest.mark.parametrize("trusted", [True, False])
def test_https_verifies_the_backend(pki, trusted, monkeypatch):
    """An https backend is reached over TLS, its certificate checked against the host's CAs
    (SSL_CERT_FILE here): one from a CA the host does not trust is refused, as aiohttp did."""
    if trusted:
        monkeypatch.setenv("SSL_CERT_FILE", pki["ca"])
    else:
        monkeypatch.setenv("SSL_CERT_FILE", os.devnull)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(pki["cert"], pki["key"])

    async def main():
        async with Server(sse_answer, tls) as server:
            client = LegClient(limit=8, keepalive=30)
            if trusted:
                got: list[bytes] = []
                answer = await client.post(server.url, "/p", b"{}", {}, total=10, connect=5,
                                           on_body=lambda b, h: got.append(b))
                assert answer.status == 200
                assert b"".join(got) == b"data: 1\n\ndata: [DONE]\n\n"
                assert server.requests[0].startswith(b"POST /p HTTP/1.1\r\n")
            else:
                with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                    await client.post(server.url, "/p", b"{}", {}, total=10, connect=5)
                assert server.requests == []
            await client.close()

    run(main())
