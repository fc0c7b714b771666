"""Checks of the zero-bubble handover (issue 28 items 1 and 3, proxy/handover.py), shared by
the push and pull first-token modules (one cluster each).

The colocated reference is D itself, asked without kv_transfer_params. Through the proxy a
streaming client gets P's first token the moment P has it, then D's stream without the token
D was seeded with; a request P's token ends is P's answer alone (D's leg ends unrelayed).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import httpx
import psutil
from first_token_kit import SAMPLINGS, chat_body, completion_body, flatten, post, stream
from pd_harness import Deployment, assert_no_leaks, wait_until

HANDOVER = "pdserve:proxy_first_token_handover_total"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def handovers(dep: Deployment, path: str) -> float:
    """The proxy's count of requests whose first token took `path` (early, p_alone, decode)."""
    assert dep.proxy is not None
    text = httpx.get(f"{dep.proxy.url}/metrics", timeout=10).text
    line = f'{HANDOVER}{{path="{path}"}} '
    return sum(float(x[len(line):]) for x in text.splitlines() if x.startswith(line))


def raw_stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Every SSE chunk as sent (ids and timestamps kept)."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


def _content(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [c for c in chunks if c["choices"] and "role" not in c["choices"][0].get("delta", {})]


def _plain(chunk: dict[str, Any]) -> dict[str, Any]:
    """Without what differs per request: id, created, and the engine's own prefix-cache hit."""
    out = {k: v for k, v in chunk.items() if k not in ("id", "created")}
    if isinstance(out.get("usage"), dict):
        out["usage"] = {k: v for k, v in out["usage"].items() if k != "prompt_tokens_details"}
    return out


def check_streams_exact(dep: Deployment) -> None:
    """Greedy and seeded, completions and chat, with logprobs and usage: the client's stream
    through the proxy is colocated's - one id and one `created` throughout, chat's role chunk
    once, token 1's chunk exactly colocated's (P's), no token twice or lost - and P's token
    went first (counted `early`)."""
    for i, sampling in enumerate(SAMPLINGS):
        for path, body in ((COMPLETIONS, completion_body(800 + i, logprobs=2, **sampling)),
                           (CHAT, chat_body(810 + i, logprobs=True, top_logprobs=2,
                                            **sampling))):
            colocated = raw_stream(dep.d.url, path, body)
            # P's token goes first unless D's first chunk (seeded with it: no forward) reaches
            # the proxy before P's head, a race a loaded host can lose: then D's stream is the
            # answer, equal all the same (test_push_client_has_token_1_while_d_is_stopped
            # proves P's token goes first without D)
            before = handovers(dep, "early") + handovers(dep, "decode")
            via = raw_stream(dep.proxy.url, path, body)
            assert handovers(dep, "early") + handovers(dep, "decode") == before + 1, path
            assert len({c["id"] for c in via}) == 1 and len({c["created"] for c in via}) == 1
            roles = [c for c in via if c["choices"] and "role" in c["choices"][0].get("delta",
                                                                                      {})]
            assert len(roles) == (path == CHAT)
            if path == CHAT:
                assert _plain(via[0]) == _plain(colocated[0])  # the role chunk first
            _same_first_token(_content(via)[0], _content(colocated)[0])
            flat_via, flat_colocated = flatten(via), flatten(colocated)
            for flat in (flat_via, flat_colocated):
                flat["usage"].pop("prompt_tokens_details", None)  # D's own prefix cache
            assert flat_via == flat_colocated and flat_via["logprobs"]


def _same_first_token(via: dict[str, Any], colocated: dict[str, Any]) -> None:
    """Token 1's chunk (P's) is colocated's first chunk - whole, unless colocated's frontend
    coalesced more tokens into it behind a slow reader (a loaded host): then its start."""
    one, ref = flatten([via]), flatten([colocated])
    assert len(one["logprobs"]) == 1, via
    if len(ref["logprobs"]) == 1:
        assert _plain(via) == _plain(colocated), (via, colocated)
    else:
        assert ref["text"].startswith(one["text"]) and ref["logprobs"][0] == one["logprobs"][0]


def check_stream_stop_on_first_token(dep: Deployment) -> None:
    """A streamed answer that token 1 ends - max_tokens=1, a stop token, a one-character stop
    string -, and a non-streamed max_tokens=1: P's answer alone (counted p_alone), chunk for
    chunk colocated's, D's leg not relayed, nothing left on P or D."""
    probe = completion_body(820, temperature=0.0, return_token_ids=True)
    chunks = _content(raw_stream(dep.d.url, COMPLETIONS, probe))
    first_id = chunks[0]["choices"][0]["token_ids"][0]
    first_text = chunks[0]["choices"][0]["text"]
    cases = [(COMPLETIONS, completion_body(820, temperature=0.0, max_tokens=1)),
             (CHAT, chat_body(821, temperature=0.0, max_completion_tokens=1, logprobs=True)),
             (COMPLETIONS, completion_body(820, temperature=0.0, stop_token_ids=[first_id])),
             (COMPLETIONS, completion_body(820, temperature=0.0, stop=[first_text[:1] or "x"]))]
    for path, body in cases:
        colocated = raw_stream(dep.d.url, path, body)
        alone = handovers(dep, "p_alone") + handovers(dep, "decode")  # the race above
        via = raw_stream(dep.proxy.url, path, body)
        assert handovers(dep, "p_alone") + handovers(dep, "decode") == alone + 1, body
        assert [_plain(c) for c in via] == [_plain(c) for c in colocated], (via, colocated)
    body = completion_body(822, temperature=0.0, max_tokens=1, logprobs=1)
    colocated = post(dep.d.url, COMPLETIONS, body)
    alone = handovers(dep, "p_alone")
    via = post(dep.proxy.url, COMPLETIONS, body)
    assert handovers(dep, "p_alone") == alone + 1
    assert via["kv_transfer_params"] is None
    assert _plain(via) == _plain(colocated)
    assert_no_leaks(dep.engines)


def check_held_first_token_goes_with_decode(dep: Deployment) -> None:
    """A first token colocated would not send at once - part of a multi-byte character (a
    regex of CJK characters: byte tokens on the tiny model's byte-level BPE), or text a stop
    string may start with - is not sent early: D's stream carries it, still equal."""
    cases = [completion_body(830, temperature=0.0, guided_regex="[一-龥]{4}"),
             completion_body(831, temperature=0.0, stop=["zz-never", "qq-never"])]
    for body in cases:
        colocated = flatten(stream(dep.d.url, COMPLETIONS, body))
        decode = handovers(dep, "decode")
        via = flatten(stream(dep.proxy.url, COMPLETIONS, body))
        assert handovers(dep, "decode") == decode + 1, body
        assert via == colocated and via["text"], (via, colocated)


def check_first_token_before_decode(dep: Deployment, path: str = COMPLETIONS) -> None:
    """D's server is stopped (SIGSTOP) before the request: the client still gets token 1 -
    P's - while D cannot have sent a byte; once D runs again the answer completes, equal to
    colocated. (Before: the client waited for D's first chunk.)"""
    body = (completion_body if path == COMPLETIONS else chat_body)(840, temperature=0.0,
                                                                   max_tokens=4)
    colocated = stream(dep.d.url, path, body)
    got: list[dict[str, Any]] = []
    d = psutil.Process(dep.d.pid)
    os.kill(d.pid, signal.SIGSTOP)
    try:
        reader = threading.Thread(target=_reader(dep, path, body, got), daemon=True)
        reader.start()
        wait_until(lambda: _content(got), timeout=60, what="token 1 while D is stopped")
        assert d.status() == psutil.STATUS_STOPPED
    finally:
        os.kill(d.pid, signal.SIGCONT)
    reader.join(120)
    assert got[-1] is _DONE
    assert flatten(got[:-1]) == flatten(colocated)
    wait_until(lambda: _decode_healthy(dep), timeout=30, what="D back in rotation")
    assert_no_leaks(dep.engines)


_DONE: dict[str, Any] = {"done": True}


def _reader(dep: Deployment, path: str, body: dict[str, Any], got: list[dict[str, Any]]):
    def run() -> None:
        with httpx.stream("POST", f"{dep.proxy.url}{path}", json={
                **body, "stream": True, "stream_options": {"include_usage": True}},
                timeout=120) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    got.append(_DONE)
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    chunk.pop("id", None)
                    chunk.pop("created", None)
                    if chunk.get("usage"):  # D's own prefix cache, as first_token_kit
                        chunk["usage"].pop("prompt_tokens_details", None)
                    got.append(chunk)
    return run


def _decode_healthy(dep: Deployment) -> bool:
    text = httpx.get(f"{dep.proxy.url}/metrics", timeout=10).text
    return any(line.startswith("pdserve:proxy_backend_healthy{") and 'role="decode"' in line
               and line.endswith(" 1.0") for line in text.splitlines())
