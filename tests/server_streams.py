"""A completion request on its own thread, recording what came and when it ended: the
lifecycle tests (engine death, drain, worker death) start several and check how they end."""

from __future__ import annotations

import json
import threading
import time

import httpx


class Stream(threading.Thread):
    """One streaming request on its own thread; records what came and when it ended."""

    def __init__(self, url: str, max_tokens: int, stream: bool = True,
                 model: str = "tiny", body: dict | None = None,
                 headers: dict[str, str] | None = None) -> None:
        """`body`: the request to stream instead of the default one (`max_tokens` then only
        names the thread)."""
        super().__init__(daemon=True, name=f"stream-{max_tokens}")
        self.url, self.max_tokens, self.stream, self.model = url, max_tokens, stream, model
        self.body, self.headers = body, headers
        self.events: list[str] = []
        self.first = threading.Event()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.status: int | None = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": "tell me", "max_tokens": self.max_tokens,
                "stream": self.stream, "ignore_eos": True}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.body is not None:
            body = {**self.body, "stream": self.stream}
        try:
            if not self.stream:
                self.first.set()
                r = httpx.post(self.url + "/v1/completions", json=body, timeout=120)
                self.status, self.events = r.status_code, [r.text]
                return
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              headers=self.headers, timeout=120) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        self.events.append(line[6:])
                        self.first.set()
        except BaseException as exc:  # noqa: BLE001 - inspected by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()
            self.first.set()

    def usage_tokens(self) -> int | None:
        for e in reversed(self.events):
            if e != "[DONE]" and json.loads(e).get("usage"):
                return json.loads(e)["usage"]["completion_tokens"]
        return None


def assert_died_fast(streams: list[Stream], killed: float, server) -> None:
    """After the engine (or one of its workers) was killed at `killed`: every stream ended
    within 2 s, with `engine_dead` where an error event came; /health and new requests
    answer 503; the API server process itself is still up (it neither hangs nor crashes)."""
    for s in streams:
        s.join(10)
        assert s.ended_at is not None and s.ended_at - killed < 2.0
        errors = [json.loads(e) for e in s.events if e != "[DONE]" and "error" in json.loads(e)]
        assert s.error is not None or errors, s.events[-3:]
        if errors:
            assert errors[-1]["error"]["code"] == "engine_dead"
    r = httpx.get(server.url + "/health", timeout=5)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, timeout=5)
    assert r.status_code == 503
    assert server.process.poll() is None
