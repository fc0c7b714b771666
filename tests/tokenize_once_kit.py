"""Checks of tokenize-once (issue 28: D encodes no prompt), shared by the push and pull
first-token modules (one cluster each, its proxy started with --tokenizer).

The proxy renders and encodes the prompt with the engine's own code and both legs carry the
ids as `prompt_token_ids`; each engine counts where a prompt's ids came from in
`pdserve:prompt_tokenizations_total{source="encoded"|"given"}`. The colocated reference is
D itself, asked without kv_transfer_params (it encodes the text: the counter proves it).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import httpx
from first_token_kit import _strip, flatten, post, prompt, stream
from pd_harness import Deployment, start_proxy

from engine.models.formats import load_tokenizer
from pdserve.launcher import ServerProcess

TOKENIZATIONS = "pdserve:prompt_tokenizations_total"
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def tokenizations(server: ServerProcess) -> dict[str, float]:
    """The server's prompts by source: {"encoded": n, "given": m}."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out = {"encoded": 0.0, "given": 0.0}
    for source in out:
        line = f'{TOKENIZATIONS}{{source="{source}"}} '
        out[source] = sum(float(x[len(line):]) for x in text.splitlines()
                          if x.startswith(line))
    return out


def _words(seed: int) -> str:
    return " ".join(f"w{t}" for t in prompt(seed, 12)) + " é 日本"  # multi-byte characters


def text_bodies(seed: int) -> list[tuple[str, dict[str, Any]]]:
    """A text completion (echoed, with logprobs) and a chat (with logprobs), greedy."""
    common = {"model": "m", "max_tokens": 6, "temperature": 0.0}
    return [
        (COMPLETIONS, {**common, "prompt": _words(seed), "logprobs": 2}),
        (CHAT, {**common, "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": _words(seed + 1)}],
                "logprobs": True, "top_logprobs": 2}),
    ]


def _answer(url: str, path: str, body: dict[str, Any], streamed: bool) -> Any:
    if not streamed:
        return _strip(post(url, path, body))
    chunks = stream(url, path, {**body, "return_token_ids": True})
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    return flatten(chunks), ids


def _moved(before: dict[str, float], server: ServerProcess) -> dict[str, float]:
    now = tokenizations(server)
    return {k: now[k] - before[k] for k in now}


def check_tokenized_once(dep: Deployment, proxy: ServerProcess | None = None) -> None:
    """Through a proxy with --tokenizer (`proxy`, else the deployment's), chat and
    completions, streamed and not: neither P nor D encodes the prompt (their `encoded`
    counts stay), both take it as given, and the answer (text, logprobs, token ids, usage)
    equals the colocated server's."""
    proxy = proxy or dep.proxy
    assert proxy is not None
    for streamed in (False, True):
        for path, body in text_bodies(800 + 10 * streamed):
            if path == COMPLETIONS and not streamed:  # the text is kept for echo (its
                body = {**body, "echo": True, "logprobs": None}  # logprobs: D alone)
            colocated = _answer(dep.d.url, path, body, streamed)
            p0, d0 = tokenizations(dep.p), tokenizations(dep.d)
            via = _answer(proxy.url, path, body, streamed)
            assert via == colocated, (path, streamed, via, colocated)
            moved = _moved(p0, dep.p), _moved(d0, dep.d)
            assert moved == ({"encoded": 0, "given": 1},) * 2, (path, streamed, moved)


def check_bad_ids_refused(dep: Deployment) -> None:
    """A client sending bad `prompt_token_ids` straight to an engine gets a 400 naming the
    field: not integers, negative, outside the vocabulary, empty, too long for
    max_model_len (1024 here), or beside a batch of prompts."""
    base = {"model": "m", "prompt": "hello", "max_tokens": 2}
    bad: list[dict[str, Any]] = [
        {"prompt_token_ids": "x"}, {"prompt_token_ids": [1, "2"]},
        {"prompt_token_ids": [True, 2]}, {"prompt_token_ids": [1.5]},
        {"prompt_token_ids": [-1]}, {"prompt_token_ids": [1 << 30]},
        {"prompt_token_ids": []}, {"prompt_token_ids": [5] * 1024},
        {"prompt": ["a", "b"], "prompt_token_ids": [5, 6]},
        {"prompt": [5, 6], "prompt_token_ids": [5, 6]},
    ]
    for server in (dep.p, dep.d):
        for extra in bad:
            for path, body in ((COMPLETIONS, {**base, **extra}),
                               (CHAT, {**base, "messages": [{"role": "user", "content": "hi"}],
                                       **extra})):
                if path == CHAT and "prompt" in extra:
                    continue
                r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
                assert r.status_code == 400, (path, extra, r.text)
                param = r.json()["error"]["param"] or ""
                assert param.startswith("prompt_token_ids"), (path, extra, r.text)


def check_tokenized_once_by_another_proxy(dep: Deployment, model: str) -> None:
    """check_tokenized_once through a proxy of its own started with --tokenizer `model`."""
    proxy = start_proxy([dep.p.url], [d.url for d in dep.decodes], dep.mode,
                        "--tokenizer", model)
    try:
        check_tokenized_once(dep, proxy)
    finally:
        proxy.stop()


def check_proxy_without_tokenizer_encodes_on_d(dep: Deployment) -> None:
    """The deployment's proxy, started without --tokenizer, sends no ids: the engines
    encode as before (counted), and the answers still equal the colocated server's."""
    assert dep.proxy is not None
    for path, body in text_bodies(900):
        colocated = _answer(dep.d.url, path, body, False)
        p0, d0 = tokenizations(dep.p), tokenizations(dep.d)
        assert _answer(dep.proxy.url, path, body, False) == colocated, path
        moved = _moved(p0, dep.p), _moved(d0, dep.d)
        assert moved == ({"encoded": 1, "given": 0},) * 2, (path, moved)


def foreign_tokenizer(model: str, out_dir: str) -> str:
    """`model`'s tokenizer files with a tokenizer trained on another seed in `out_dir`: the
    same vocabulary size and chat template, other merges (its ids are in the vocabulary,
    and wrong)."""
    from engine.models.tiny_tokenizer import train_tokenizer

    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(model, name), out_dir)
    train_tokenizer(len(load_tokenizer(model)), seed=1).save(
        os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def check_foreign_tokenizer_is_not_trusted(dep: Deployment, tokenizer_dir: str) -> None:
    """A proxy started with another model's --tokenizer sends ids the engines' tokenizer
    would not make; its fingerprint (`prompt_tokenizer`) gives it away: the engines encode
    the text themselves (counted) and the answers equal the colocated server's."""
    foreign = start_proxy([dep.p.url], [d.url for d in dep.decodes], dep.mode,
                          "--tokenizer", tokenizer_dir)
    try:
        for path, body in text_bodies(950):
            colocated = _answer(dep.d.url, path, body, False)
            p0, d0 = tokenizations(dep.p), tokenizations(dep.d)
            assert _answer(foreign.url, path, body, False) == colocated, path
            moved = _moved(p0, dep.p), _moved(d0, dep.d)
            assert moved == ({"encoded": 1, "given": 0},) * 2, (path, moved)
    finally:
        foreign.stop()
