"""Checks shared by the first-token handover tests (issue 28), one cluster per mode's module.

The colocated reference is D itself, asked without kv_transfer_params: the same engine, the
same weights, the same sampler. Through the proxy D starts from P's sampled token
(`pdserve:kv_first_token_seeded_total`) instead of recomputing the last prompt position.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
from pd_harness import Deployment, assert_no_leaks, metric

SEEDED = "pdserve:kv_first_token_seeded_total"
RECOMPUTED = "pdserve:kv_first_token_recomputed_total"
MAX_TOKENS = 8


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 2000) for _ in range(n)]


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The SSE chunks, ids and timestamps dropped (they differ per request)."""
    chunks = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True,
                      "stream_options": {"include_usage": True}}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                chunk.pop("id", None)
                chunk.pop("created", None)
                if chunk.get("usage"):  # D reports the KV it received as cached
                    chunk["usage"].pop("prompt_tokens_details", None)
                chunks.append(chunk)
    return chunks


def _strip(answer: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in answer.items() if k not in ("id", "created", "kv_transfer_params")}
    out["usage"] = {k: v for k, v in answer["usage"].items()
                    if k != "prompt_tokens_details"}  # D reports the KV it received as cached
    out["choices"] = [{k: v for k, v in c.items() if k != "kv_transfer_params"}
                      for c in answer["choices"]]
    return out


def flatten(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's content, whatever its chunking (the frontend merges outputs that queue up
    behind a slow reader, colocated too): text, per-token logprobs, finish reason, usage."""
    text, logprobs, finish, usage = "", [], None, None
    for c in chunks:
        usage = c.get("usage") or usage
        for choice in c["choices"]:
            delta = choice.get("delta", {})
            text += choice.get("text") or delta.get("content") or ""
            lp = choice.get("logprobs") or {}
            if "content" in lp:
                logprobs += lp["content"] or []
            elif lp:
                logprobs += list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"],
                                     strict=True))
            finish = choice.get("finish_reason") or finish
    return {"text": text, "logprobs": logprobs, "finish_reason": finish, "usage": usage}


def check_equal(dep: Deployment, path: str, body: dict[str, Any], streamed: bool) -> None:
    """Through the proxy == D colocated, and D started from P's token (one more seeded)."""
    assert dep.proxy is not None
    # colocated first, on a fresh prompt (a prefix-cache hit changes fp32 sums slightly)
    if streamed:
        colocated = flatten(stream(dep.d.url, path, body))
        seeded = metric(dep.d, SEEDED)
        via = flatten(stream(dep.proxy.url, path, body))
        assert via["logprobs"] and via == colocated, (via, colocated)
    else:
        colocated = post(dep.d.url, path, body)
        seeded = metric(dep.d, SEEDED)
        via = post(dep.proxy.url, path, body)
        assert _strip(via) == _strip(colocated), (via, colocated)
    assert metric(dep.d, SEEDED) == seeded + 1, (path, body)


def completion_body(which: int, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": prompt(which), "max_tokens": MAX_TOKENS, **extra}


def chat_body(which: int, **extra: Any) -> dict[str, Any]:
    words = " ".join(f"w{t}" for t in prompt(which, 12))
    return {"model": "m", "messages": [{"role": "user", "content": words}],
            "max_tokens": MAX_TOKENS, **extra}


SAMPLINGS = [{"temperature": 0.0}, {"temperature": 0.9, "seed": 1234, "top_p": 0.95}]


def check_all_equal(dep: Deployment) -> None:
    """Greedy and seeded, completions (with logprobs) and chat, streamed and not."""
    for i, sampling in enumerate(SAMPLINGS):
        for streamed in (False, True):
            check_equal(dep, "/v1/completions",
                        completion_body(100 + i * 2 + streamed, logprobs=2, **sampling),
                        streamed)
            check_equal(dep, "/v1/chat/completions", chat_body(200 + i * 2 + streamed,
                        logprobs=True, top_logprobs=2, **sampling), streamed)


def check_stop_on_first_token(dep: Deployment) -> None:
    """A first token that ends the request — max_tokens=1, a stop token, a stop string —:
    the client gets that one token as colocated, and no block or table entry is left."""
    assert dep.proxy is not None
    body = completion_body(300, max_tokens=1, temperature=0.0)
    colocated = post(dep.d.url, "/v1/completions", body)
    via = post(dep.proxy.url, "/v1/completions", body)
    assert _strip(via) == _strip(colocated)
    assert via["choices"][0]["finish_reason"] == "length"
    for i, stop in enumerate(("token", "string")):
        probe = completion_body(310 + i, temperature=0.0, return_token_ids=True)
        chunks = [c for c in stream(dep.d.url, "/v1/completions", probe) if c["choices"]]
        ids = [t for c in chunks for t in c["choices"][0].get("token_ids") or []]
        text = "".join(c["choices"][0].get("text") or "" for c in chunks)
        body = completion_body(310 + i, temperature=0.0)
        if stop == "token":
            body["stop_token_ids"] = ids[:1]
        else:
            body["stop"] = [text[:1] or "x"]
        colocated = post(dep.d.url, "/v1/completions", body)
        via = post(dep.proxy.url, "/v1/completions", body)
        assert _strip(via) == _strip(colocated)
        assert via["choices"][0]["finish_reason"] == "stop"
    assert_no_leaks(dep.engines)


def check_n_recomputes(dep: Deployment) -> None:
    """n > 1: P sampled for one sequence, so D recomputes (counted), and output stays equal."""
    assert dep.proxy is not None
    body = completion_body(400, n=2, temperature=0.0)
    before = metric(dep.d, RECOMPUTED)
    colocated = post(dep.d.url, "/v1/completions", body)
    via = post(dep.proxy.url, "/v1/completions", body)
    assert _strip(via) == _strip(colocated)
    assert metric(dep.d, RECOMPUTED) >= before + 1
