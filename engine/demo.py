"""`pdserve demo`: one prefill, one decode and the proxy on localhost, streamed answers.

Everything runs as real processes talking HTTP, ZeroMQ and NIXL, exactly as on two
nodes; the demo prints the tokens as they stream through the proxy, then the transfer
counters that prove the KV moved from P to D, and shuts everything down.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx

from engine.server.launcher import ServerProcess, free_port, launch_server

PROMPTS = [
    "Disaggregated serving splits prefill and decode because",
    "The decode engine registers its blocks with the prefill engine, and then",
    "Once upon a time, in a cluster far away,",
]
COUNTERS = [
    ("D", "pdserve:kv_push_registrations_sent_total"),
    ("P", "pdserve:kv_push_registrations_received_total"),
    ("P", "pdserve:kv_push_writes_total"),
    ("P", "pdserve:kv_transfer_bytes_total"),
    ("D", "pdserve:kv_remote_prefill_tokens_total"),
    ("D", "pdserve:prompt_tokens_total"),
]


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=".models/tiny-llama",
                        help="model directory (made with make-tiny-model if missing)")
    parser.add_argument("--mode", choices=["push", "pull"], default="push")
    parser.add_argument("--max-tokens", type=int, default=40)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def _stream(proxy_url: str, prompt: str, max_tokens: int) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "ignore_eos": True}
    print(f"\n>>> {prompt}", flush=True)
    start, first = time.perf_counter(), None
    with httpx.stream("POST", f"{proxy_url}/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            first = first or time.perf_counter()
            print(text, end="", flush=True)
    ttft = (first or time.perf_counter()) - start
    print(f"\n    (time to first token {ttft * 1000:.0f} ms, "
          f"total {(time.perf_counter() - start) * 1000:.0f} ms)", flush=True)


def main(args: argparse.Namespace) -> int:
    if not os.path.exists(os.path.join(args.model, "config.json")):
        from engine.models.tiny import make_tiny_model

        print(f"making a tiny model in {args.model} ...", flush=True)
        make_tiny_model(args.model, arch="llama", size="tiny", seed=0)
    connector = "NixlPushConnector" if args.mode == "push" else "NixlConnector"
    common = ["--served-model-name", "tiny", "--num-kv-blocks", "512",
              "--kv-connector", connector, "--log-level", "warning"]
    env = {"OMP_NUM_THREADS": "1"}
    servers: list[ServerProcess] = []
    try:
        print("starting prefill (P) and decode (D) engines ...", flush=True)
        p = launch_server(args.model, *common, "--engine-id", "demo-P", "--kv-port",
                          str(free_port()), module="prefill", env=env, wait=False)
        servers.append(p)
        d = launch_server(args.model, *common, "--engine-id", "demo-D", "--kv-port",
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
        print(f"P {p.url}  D {d.url}  proxy {proxy.url}  ({args.mode} mode)", flush=True)
        for prompt in PROMPTS:
            _stream(proxy.url, prompt, args.max_tokens)
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
