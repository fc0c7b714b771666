"""The proxy's HTTP server writes a response's headers with its first body bytes
(proxy/http_server.py): a real uvicorn server on a loopback socket and a raw client socket."""

from __future__ import annotations

import asyncio
import socket
import threading

from server_thread import ServerThread

from proxy.http_server import CoalescingHttpToolsProtocol

REQUEST = b"GET /s HTTP/1.1\r\nhost: x\r\n\r\n"


def _serve(started: threading.Event, go: threading.Event):
    async def app(scope, receive, send):
        assert scope["type"] == "http"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        started.set()
        await asyncio.get_running_loop().run_in_executor(None, go.wait, 30)
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False})

    return ServerThread(app, "coalescing", http=CoalescingHttpToolsProtocol, lifespan="off")


def _read_response(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        chunk = conn.recv(65536)
        assert chunk, f"connection closed early after {data!r}"
        data += chunk
    return data


def test_headers_leave_with_the_first_body_bytes_not_before():
    started, go = threading.Event(), threading.Event()
    server = _serve(started, go).start()
    try:
        with socket.create_connection(server.address, timeout=30) as conn:
            conn.sendall(REQUEST)
            assert started.wait(30), "the app sent its response start"
            conn.setblocking(False)
            try:
                early = conn.recv(65536)
            except BlockingIOError:
                early = b""
            assert early == b"", "the headers left alone, before any body"
            conn.setblocking(True)
            go.set()
            first = conn.recv(65536)
            assert first.startswith(b"HTTP/1.1 200 OK\r\n")
            assert b"content-type: text/event-stream\r\n" in first
            assert b"\r\n\r\n9\r\ndata: 1\n\n\r\n" in first, "the first chunk in the same write"
            rest = first if first.endswith(b"0\r\n\r\n") else first + _read_response(conn)
            assert rest.endswith(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
            # the connection stays usable: a second request on it is answered whole
            started.clear()
            conn.sendall(REQUEST)
            assert started.wait(30)
            second = _read_response(conn)
            assert second.startswith(b"HTTP/1.1 200 OK\r\n") and b"data: 2" in second
    finally:
        go.set()
        server.stop()
