"""The seam of a migrated stream across real boundaries (proxy/migrate.py), the case CI caught:
a D whose reader lagged merges its deltas, so one chunk carries text *and* the ids of a
character it still holds back (text "…fi", ids [fi, first byte of the next character]); the D
then dies. The proxy must ask the new D (`/detokenize`) which ids were held and regenerate
them, or the client loses that character.

A scripted D (uvicorn, real HTTP) streams the greedy answer's first chunks, merged as the
engine's collector merges them, then breaks the connection; the real proxy (`python -m proxy`)
continues on a real engine server. The client's text equals the colocated answer."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from migration_kit import merged_events
from pd_harness import TEST_ENV, metric, start_proxy
from server_thread import ServerThread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from engine import LLM, SamplingParams
from engine.models.tokenizer import Tokenizer
from pdserve.launcher import launch_server

MAX_TOKENS = 48
_REPLACEMENT = "\ufffd"


def _held_cut(tok: Tokenizer, prompt: list[int], out: list[int]) -> int | None:
    """A number of events after which the last event had text and its last id still held."""
    events = merged_events(tok, prompt, out)
    for cut in range(1, len(events)):
        last = events[cut - 1]["choices"][0]
        ids = [t for e in events[:cut] for t in e["choices"][0]["token_ids"]]
        if last["text"] and tok.decode(ids).endswith(_REPLACEMENT):
            return cut
    return None


def _case(model: str) -> tuple[list[int], list[int], str, int]:
    """A prompt whose greedy answer has the held-byte seam: prompt, ids, text, cut."""
    tok = Tokenizer.from_dir(model)
    prompts = [[(7 * i + 13 * j) % 1990 + 4 for j in range(24)] for i in range(40)]
    llm = LLM(model, num_kv_blocks=256, max_model_len=512, multiprocess=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, o in zip(prompts, outs, strict=True):
        ids = list(o.outputs[0].token_ids)
        cut = _held_cut(tok, prompt, ids)
        if cut is not None:
            return prompt, ids, o.outputs[0].text, cut
    pytest.fail("no greedy answer of the tiny model put text and a held byte in one chunk")


class DyingDecode:
    """A D that streams `events` and then breaks the connection (no [DONE], no last chunk)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events, self.legs = events, 0
        app = Starlette(routes=[Route("/health", self.health),
                                Route("/v1/completions", self.complete, methods=["POST"])])
        self.server = ServerThread(app, "dying-decode", log_level="critical", lifespan="off")
        self.url = self.server.url

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def complete(self, request: Request) -> Response:
        self.legs += 1

        async def body():
            for event in self.events:
                yield f"data: {json.dumps(event)}\n\n"
            raise ConnectionResetError("the decode engine died")  # uvicorn drops the socket

        return StreamingResponse(body(), media_type="text/event-stream")


def test_a_held_character_at_the_seam_reaches_the_client_whole(tiny_model):
    prompt, ids, want, cut = _case(tiny_model)
    tok = Tokenizer.from_dir(tiny_model)
    events = merged_events(tok, prompt, ids)[:cut]
    shown = "".join(e["choices"][0]["text"] for e in events)
    sent = [t for e in events for t in e["choices"][0]["token_ids"]]
    assert not want.startswith(shown + tok.decode(ids[len(sent):])), \
        "continuing after every relayed id would lose text (the case under test)"
    dying = DyingDecode(events)
    dying.server.start()
    engine = launch_server(tiny_model, "--served-model-name", "m", "--num-kv-blocks", "256",
                           "--max-model-len", "512",
                           env=TEST_ENV)
    proxy = None
    try:
        # D alone (no P leg: every prompt is "short"), the scripted D first of the two
        proxy = start_proxy([engine.url], [dying.url, engine.url], "push",
                            "--tokenizer", tiny_model, "--disagg-min-tokens", "100000")
        body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True, "stream": True}
        text, done = [], False
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[len("data: "):])
                    assert "error" not in event, event["error"]["message"]
                    text.append(event["choices"][0]["text"])
        assert dying.legs == 1, "the request went to the scripted D first"
        assert done and "".join(text) == want
        assert metric(proxy, "pdserve:proxy_migrations_total") == 1
    finally:
        if proxy is not None:
            proxy.stop()
        engine.stop()
        dying.server.stop()
