"""`pdserve demo`: one prefill, one decode and the proxy on localhost, streamed answers.

Everything runs as real processes talking HTTP, ZeroMQ and NIXL, exactly as on two
nodes; the demo prints the tokens as they stream through the proxy, then the transfer
counters that prove the KV moved from P to D, and shuts everything down.

By default it serves SmolLM2-135M-Instruct (the `smollm2` alias, a GGUF file the `smollm2`
extra installs) and asks three questions through `/v1/chat/completions` with the model's own
chat template. `--model tiny` keeps the fast path: the seeded random tiny model (made on first
use) continuing three prompts through `/v1/completions` — random text, quick to start.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time

import httpx

from engine.net import free_port
from pdserve.launcher import ServerProcess, launch_server

QUESTIONS = [
    "What is the capital of France?",
    "In one sentence, why does a serving system split prefill and decode?",
    "Write a haiku about the sea.",
]
PROMPTS = [  # for the tiny model: continuations, no chat
    "Disaggregated serving splits prefill and decode because",
    "The decode engine registers its blocks with the prefill engine, and then",
    "Once upon a time, in a cluster far away,",
]
TINY_DIR = ".models/tiny-llama"
COUNTERS = [
    ("D", "pdserve:kv_push_registrations_sent_total"),
    ("P", "pdserve:kv_push_registrations_received_total"),
    ("P", "pdserve:kv_push_writes_total"),
    ("P", "pdserve:kv_transfer_bytes_total"),
    ("D", "pdserve:kv_remote_prefill_tokens_total"),
    ("D", "pdserve:prompt_tokens_total"),
]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="model directory, .gguf file or alias (default smollm2); 'tiny' = "
                             f"{TINY_DIR} (made with make-tiny-model if missing)")
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="per answer (default 96 for chat, 40 for the tiny model)")


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _chunk_text(chunk: dict, chat: bool) -> str:
    if not chunk.get("choices"):
        return ""
    choice = chunk["choices"][0]
    return (choice.get("delta", {}).get("content") or "") if chat else choice.get("text", "")


def _stream(proxy_url: str, name: str, prompt: str, max_tokens: int, chat: bool) -> None:
    body: dict = {"model": name, "max_tokens": max_tokens, "temperature": 0.0, "stream": True}
    if chat:
        route, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:  # random weights never say EOS on purpose; show the full length
        route, body["prompt"], body["ignore_eos"] = "/v1/completions", prompt, True
    print(f"\n>>> {prompt}", flush=True)
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{proxy_url}{route}", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text = _chunk_text(json.loads(line[6:]), chat)
            if text:
                first = first or time.perf_counter()
            print(text, end="", flush=True)
    ttft = (first or time.perf_counter()) - start
    print(f"\n    (time to first token {ttft * 1000:.0f} ms, "
          f"total {(time.perf_counter() - start) * 1000:.0f} ms)", flush=True)


def _model(name: str) -> tuple[str, str, bool]:
    """(path or alias to serve, served name, chat?) for --model."""
    if name == "tiny" or name == TINY_DIR:
        if not os.path.exists(os.path.join(TINY_DIR, "config.json")):
            from engine.models.tiny import make_tiny_model

            print(f"making a tiny model in {TINY_DIR} ...", flush=True)
            make_tiny_model(TINY_DIR, arch="llama", size="tiny", seed=0)
        return TINY_DIR, "tiny", False
    from engine.models.source import resolve_model

    resolve_model(name)  # a missing extra or path fails here, before any process starts
    return name, os.path.basename(name.rstrip("/")) or name, True


def main(args: argparse.Namespace) -> int:
    try:
        model, name, chat = _model(args.model)
    except ValueError as exc:
        print(f"pdserve demo: error: {exc}", file=sys.stderr)
        return 2
    max_tokens = args.max_tokens or (96 if chat else 40)
    connector = "NixlPushConnector" if args.mode == "push" else "NixlConnector"
    common = ["--served-model-name", name, "--num-kv-blocks", "512",
              "--kv-connector", connector, "--log-level", "warning"]
    # P and D share a fresh KV secret: the demo runs the authenticated side channel
    # (docs/security.md), passed in the environment as a deployment should.
    env = {"OMP_NUM_THREADS": "1",
           "PDSERVE_KV_SECRET": os.environ.get("PDSERVE_KV_SECRET") or secrets.token_hex(32)}
    servers: list[ServerProcess] = []
    try:
        print("starting prefill (P) and decode (D) engines ...", flush=True)
        p = launch_server(model, *common, "--engine-id", "demo-P", "--kv-port",
                          str(free_port()), module="prefill", env=env, wait=False)
        servers.append(p)
        d = launch_server(model, *common, "--engine-id", "demo-D", "--kv-port",
                          str(free_port()), module="decode", env=env, wait=False)
        servers.append(d)
        p.wait_healthy(300)
        d.wait_healthy(300)
        port = free_port()
        proxy = ServerProcess(
            [sys.executable, "-m", "proxy", "--prefill", p.url, "--decode", d.url,
             "--mode", args.mode, "--port", str(port), "--log-level", "warning"],
            "127.0.0.1", port, {**os.environ, **env}, None)
        servers.append(proxy)
        proxy.wait_healthy(60)
        print(f"P {p.url}  D {d.url}  proxy {proxy.url}  ({args.mode} mode, model {name})",
              flush=True)
        for prompt in QUESTIONS if chat else PROMPTS:
            _stream(proxy.url, name, prompt, max_tokens, chat)
        print("\ntransfer counters:")
        for role, name in COUNTERS:
            url = p.url if role == "P" else d.url
            print(f"  {role} {name:48s} {_metric(url, name):12.0f}")
    finally:
        print("\nshutting down ...", flush=True)
        for s in reversed(servers):
            s.stop()
    print("done.")
    return 0
