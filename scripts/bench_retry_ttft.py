"""TTFT cost of a retry on another pair (issue 30): a P or a D that refuses (answers 503 to the
leg, stays healthy), then the retry succeeds - against a normal request, in the same run.

One real 1P1D push deployment (tiny model) and three proxies over it, all routing
round-robin: `normal` ([P0], [D0]), `d_refuses` ([P0], [refuser, D0]) and `p_refuses`
([refuser-P, P0], [D0]). The refusers are small HTTP servers here: /health answers 200 (so
they stay in rotation), a generation leg answers 503; the P refuser serves P0's
/kv_transfer/info (the proxy must see a P). Requests go one at a time, interleaved across the
three proxies; a request counts as retried when its proxy's retry counter moved. TTFT is the
client's time to the first streamed text event.

    .venv/bin/python scripts/bench_retry_ttft.py --requests 40 --out bench/results/retry_ttft.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, ROOT)

from pd_harness import deployment, metric, start_proxy  # noqa: E402

RETRIES = "pdserve:proxy_retries_total"


def refuser(kv_info_from: str | None) -> tuple[ThreadingHTTPServer, str]:
    info = httpx.get(kv_info_from + "/kv_transfer/info", timeout=10).content if kv_info_from \
        else b"{}"

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802
            if self.path.startswith("/kv_transfer/info"):
                self._send(200, info)
            else:
                self._send(200, b'{"status":"ok"}')

        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("content-length") or 0))
            self._send(503, b'{"error":{"message":"refusing (benchmark)","code":503}}')

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def ttft(url: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text"' in line:
                return time.perf_counter() - start
    raise RuntimeError("no token")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="per proxy")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--model", default="", help="model dir (default: a tiny llama made here)")
    ap.add_argument("--out", default="bench/results/retry_ttft.json")
    args = ap.parse_args()
    model = args.model
    if not model:
        from engine.models.tiny import make_tiny_model

        model = os.path.join(tempfile.mkdtemp(prefix="retry-bench-"), "tiny-llama")
        make_tiny_model(model, arch="llama", size="tiny", seed=0)
    rr = ("--routing", "round-robin")
    with deployment(model, "push", with_proxy=False) as dep:
        d_ref, d_ref_url = refuser(None)
        p_ref, p_ref_url = refuser(dep.p.url)
        proxies = {
            "normal": start_proxy([dep.p.url], [dep.d.url], "push", *rr),
            "d_refuses": start_proxy([dep.p.url], [d_ref_url, dep.d.url], "push", *rr),
            "p_refuses": start_proxy([p_ref_url, dep.p.url], [dep.d.url], "push", *rr),
        }
        try:
            samples: dict[str, list[float]] = {"normal": [], "d_refuses": [], "p_refuses": []}
            for i in range(args.requests * 2 + 3):  # the refusers take every other request
                for name, proxy in proxies.items():
                    prompt = [4 + (i * 7919 + j * 31 + len(name)) % 1990
                              for j in range(args.prompt_len)]
                    before = metric(proxy, RETRIES)
                    t = ttft(proxy.url, prompt, args.max_tokens)
                    retried = metric(proxy, RETRIES) > before
                    if i < 3:
                        continue  # warm-up
                    if name == "normal" and not retried:
                        if len(samples[name]) < args.requests:
                            samples[name].append(t)
                    elif name != "normal" and retried:
                        samples[name].append(t)
        finally:
            for proxy in proxies.values():
                proxy.stop()
            d_ref.shutdown()
            p_ref.shutdown()
    report = summarize(samples)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report["summary"], indent=2))


def summarize(samples: dict[str, list[float]]) -> dict[str, object]:
    def stats(xs: list[float]) -> dict[str, float]:
        xs = sorted(xs)
        return {"n": len(xs), "p50_ms": 1e3 * statistics.median(xs),
                "p90_ms": 1e3 * xs[int(0.9 * (len(xs) - 1))], "mean_ms": 1e3 * statistics.mean(xs)}

    base = stats(samples["normal"])
    summary: dict[str, object] = {"normal": base}
    for name in ("d_refuses", "p_refuses"):
        s = stats(samples[name])
        s["p50_ratio"] = s["p50_ms"] / base["p50_ms"]
        s["p50_cost_ms"] = s["p50_ms"] - base["p50_ms"]
        summary[name] = s
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = next((ln.split(":", 1)[1].strip() for ln in cpu.splitlines()
                  if ln.startswith("Model name")), platform.processor())
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return {"summary": summary, "cpu": model, "load": load, "samples_s": samples}


if __name__ == "__main__":
    main()
