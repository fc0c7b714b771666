"""Checks for scripts/netns_two_node.sh, run inside the decode namespace (stdlib only).

Sends the same requests to the proxy (P in the other namespace, D here) and to a colocated
reference server, and fails unless:
- every answer through the proxy equals the reference's (greedy decoding: same text, same
  finish reason, same token counts), streamed and chat requests included;
- P advertises the address D reaches it on (``/kv_transfer/info``);
- with ``--discovery``: the proxy (started with no --prefill/--decode) found exactly P and D
  in etcd, at the addresses they advertised, and its watch on etcd is live;
- the KV really crossed: D's ``pdserve:kv_remote_prefill_tokens_total`` grew by exactly
  ``prompt_tokens - 1`` per completion request (distinct prompts, so no prefix hits), P
  counted one WRITE per request, and D's veth received at least the bytes P wrote.

Exit status 0 when every check passes, 1 otherwise (each failure printed on its own line).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REMOTE_TOKENS = "pdserve:kv_remote_prefill_tokens_total"
WRITES = "pdserve:kv_push_writes_total"
BYTES = "pdserve:kv_transfer_bytes_total"
FAILURES = "pdserve:kv_push_write_failures_total"
DISCOVERY_MEMBERS = 'pdserve:proxy_discovery_members{{role="{}"}}'
ETCD_UP = "pdserve:proxy_discovery_etcd_up"
TIMEOUT_S = 60.0

# Distinct from their first words on, longer than one 16-token block each.
PROMPTS = [
    "Alpine lakes reflect the jagged peaks while a lone heron waits in the shallow reeds "
    "near the old wooden pier",
    "Before the storm arrived the fishermen hauled their nets and tied every boat twice "
    "to the iron rings of the harbour wall",
    "Copper kettles hung above the hearth of the mountain inn where travellers traded "
    "stories of passes closed by snow",
    "During the night shift the engineers replaced a failing pump and logged each pressure "
    "reading in the worn notebook",
    "Every spring the orchard bursts into white blossom and the bees return to the hives "
    "along the southern fence",
    "Far beyond the dunes a caravan followed the stars toward a well that only the eldest "
    "guide still remembered",
]


# Straight to the namespaces' addresses, whatever *_proxy variables the caller has set.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> str:
    with _OPENER.open(url, timeout=TIMEOUT_S) as r:
        return r.read().decode()


def _post(url: str, body: dict[str, Any]) -> bytes:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with _OPENER.open(req, timeout=TIMEOUT_S) as r:
        return r.read()


def metric(base: str, name: str) -> float:
    """Sum of every sample of one Prometheus counter/gauge (all label sets)."""
    total = 0.0
    for line in _get(f"{base}/metrics").splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rx_bytes(veth: str) -> int:
    with open(f"/sys/class/net/{veth}/statistics/rx_bytes") as f:
        return int(f.read())


def complete(base: str, prompt: str, model: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    out = json.loads(_post(f"{base}/v1/completions", body))
    c = out["choices"][0]
    return {"text": c["text"], "finish_reason": c["finish_reason"], "usage": out["usage"]}


def complete_streamed(base: str, prompt: str, model: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True}
    text, finish = [], None
    for line in _post(f"{base}/v1/completions", body).decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[6:])["choices"]:
            text.append(c.get("text") or "")
            finish = c.get("finish_reason") or finish
    return {"text": "".join(text), "finish_reason": finish}


def chat(base: str, prompt: str, model: str, max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0.0}
    out = json.loads(_post(f"{base}/v1/chat/completions", body))
    c = out["choices"][0]
    return {"text": c["message"]["content"], "finish_reason": c["finish_reason"],
            "usage": out["usage"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--proxy", required=True, help="proxy base URL")
    ap.add_argument("--prefill", required=True, help="P base URL")
    ap.add_argument("--decode", required=True, help="D base URL")
    ap.add_argument("--reference", required=True, help="colocated reference server URL")
    ap.add_argument("--p-kv-host", required=True, help="address P must advertise")
    ap.add_argument("--veth", required=True, help="D's end of the veth pair")
    ap.add_argument("--model", default="tiny", help="served model name")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of P and D")
    ap.add_argument("--discovery", action="store_true",
                    help="the proxy's pools come from etcd: check what it found there")
    args = ap.parse_args()
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        print(f"netns_check: {'ok  ' if ok else 'FAIL'} {what}", flush=True)
        if not ok:
            failures.append(what)

    info = json.loads(_get(f"{args.prefill}/kv_transfer/info"))
    check(info.get("kv_host") == args.p_kv_host and info.get("kv_connector") ==
          "NixlPushConnector", f"P /kv_transfer/info advertises {args.p_kv_host}: {info}")
    check(info.get("tp_size") == args.tp and len(info.get("kv_ports", ())) == args.tp,
          f"P runs {args.tp} tensor-parallel rank(s), one side channel each: {info}")

    if args.discovery:
        pools = json.loads(_get(f"{args.proxy}/health"))
        found = {role: sorted(b["url"] for b in pools.get(role, ())) for role in
                 ("prefill", "decode")}
        check(found == {"prefill": [args.prefill], "decode": [args.decode]},
              f"the proxy found P and D in etcd, at their veth addresses: {found}")
        members = {role: metric(args.proxy, DISCOVERY_MEMBERS.format(role)) for role in
                   ("prefill", "decode")}
        check(members == {"prefill": 1, "decode": 1} and metric(args.proxy, ETCD_UP) == 1,
              f"the proxy's pools come from its live etcd watch: members {members}")

    before = {"remote": metric(args.decode, REMOTE_TOKENS), "writes": metric(args.prefill, WRITES),
              "bytes": metric(args.prefill, BYTES), "rx": rx_bytes(args.veth)}
    n, mt = len(PROMPTS), args.max_tokens
    with ThreadPoolExecutor(max_workers=n) as pool:  # concurrent, as real clients are
        got = list(pool.map(lambda p: complete(args.proxy, p, args.model, mt), PROMPTS))
    remote = metric(args.decode, REMOTE_TOKENS) - before["remote"]
    expected_remote = sum(g["usage"]["prompt_tokens"] - 1 for g in got)
    want = [complete(args.reference, p, args.model, mt) for p in PROMPTS]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        check(g == w, f"completion {i} equals the colocated reference: {g!r} vs {w!r}")
    check(remote == expected_remote,
          f"D received {remote:.0f} prompt tokens over the veth, expected {expected_remote}")

    g = complete_streamed(args.proxy, PROMPTS[0][::-1], args.model, mt)
    w = complete(args.reference, PROMPTS[0][::-1], args.model, mt)
    check(g["text"] == w["text"] and g["finish_reason"] == w["finish_reason"],
          f"streamed completion equals the reference: {g!r} vs {w!r}")
    g = chat(args.proxy, PROMPTS[1], args.model, mt)
    w = chat(args.reference, PROMPTS[1], args.model, mt)
    check(g == w, f"chat completion equals the reference: {g!r} vs {w!r}")

    writes = metric(args.prefill, WRITES) - before["writes"]
    nbytes = metric(args.prefill, BYTES) - before["bytes"]
    rx = rx_bytes(args.veth) - before["rx"]
    check(writes >= n + 2, f"P made {writes:.0f} KV WRITEs for {n + 2} requests")
    check(metric(args.prefill, FAILURES) == 0, "P counted no failed WRITE")
    check(nbytes > 0 and rx >= nbytes,
          f"D's veth {args.veth} received {rx} bytes >= {nbytes:.0f} KV bytes P wrote")
    if failures:
        print(f"netns_check: {len(failures)} check(s) failed", file=sys.stderr)
        return 1
    print(f"netns_check: all checks passed ({n + 2} requests, {nbytes:.0f} KV bytes, "
          f"{remote:.0f} prompt tokens received by D)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
