"""The proxy's HTTP server writes a response's headers with its first body bytes
(proxy/http_server.py): a real uvicorn server on a loopback socket and a raw client socket."""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn
from pd_harness import wait_until

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

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=CoalescingHttpToolsProtocol,
                                           lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    return server, thread, sock.getsockname()


def _read_response(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"0\r\n\r\n"):
        chunk = conn.recv(65536)
        assert chunk, f"connection closed early after {data!r}"
        data += chunk
    return data


def test_headers_leave_with_the_first_body_bytes_not_before():
    started, go = threading.Event(), threading.Event()
    server, thread, addr = _serve(started, go)
    try:
        wait_until(lambda: server.started, 30, "the server to start")
        with socket.create_connection(addr, timeout=30) as conn:
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
        server.should_exit = True
        thread.join(10)
