"""`pdserve bench serve` against real servers: the JSON it writes is complete and consistent
with what was sent, round-robin really alternates targets, and the proxy-less P/D mode (the
proxy-overhead baseline) really moves KV from P to D. The pure parts (workload mix,
arrivals, statistics, goodput) are checked directly."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from engine.net import free_port
from pdserve.bench.arrivals import send_offsets
from pdserve.bench.client import RequestResult
from pdserve.bench.metrics import parse_goodput, summarize
from pdserve.bench.workload import class_counts, mixed_requests, parse_mix
from pdserve.launcher import launch_server

VLLM_KEYS = [
    "completed", "failed", "duration", "request_throughput", "output_throughput",
    "total_token_throughput", "total_input_tokens", "total_output_tokens",
    *[f"{stat}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
      for stat in ("mean", "median", "std", "p99")],
]


@pytest.fixture(scope="module")
def server(tiny_model: str):
    with launch_server(tiny_model, "--served-model-name", "tiny", "--log-level", "warning",
                       env={"OMP_NUM_THREADS": "1"}) as s:
        yield s


def bench(tmp_path, *args: str, name: str = "r.json") -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / name
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--disable-tqdm",
         "--result-json", str(out), *args],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.exists(), f"no result JSON; rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(out.read_text()), proc


def test_result_json_has_vllm_keys_and_consistent_values(server, tiny_model, tmp_path):
    plot = tmp_path / "cdf.png"
    want_plot = _has_matplotlib()
    r, proc = bench(tmp_path, "--base-url", server.url, "--tokenizer", tiny_model,
                    "--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "8",
                    "--request-rate", "50", "--goodput", "ttft:600000", "tpot:600000",
                    "--save-detailed", *(["--plot", str(plot)] if want_plot else []))
    assert proc.returncode == 0, proc.stderr
    for key in VLLM_KEYS:
        assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), key
    assert r["model"] == "tiny"  # read from GET /v1/models
    assert (r["completed"], r["failed"]) == (6, 0)
    assert r["total_input_tokens"] == 6 * 32
    assert r["total_output_tokens"] == 6 * 8  # ignore_eos: exactly max_tokens each
    assert r["request_throughput"] == pytest.approx(6 / r["duration"])
    assert r["output_throughput"] == pytest.approx(48 / r["duration"])
    assert r["goodput"] == pytest.approx(r["request_throughput"])  # generous SLOs: all good
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < r[f"median_{m}_ms"] <= r[f"p99_{m}_ms"] + 1e-9, m
    assert r["median_ttft_ms"] < r["median_e2el_ms"]
    assert r["duration"] * 1000 >= r["median_e2el_ms"]
    # one inter-token gap per token after the first, per request
    # One gap per streamed chunk: 7 for 8 tokens, fewer when the server merged the deltas
    # of a consumer that lagged behind the engine (two tokens in one chunk).
    assert all(1 <= len(gaps) <= 7 for gaps in r["itls"]), r["itls"]
    assert all(e2el >= ttft for e2el, ttft in zip(r["e2els"], r["ttfts"], strict=True))
    assert "Serving Benchmark Result" in proc.stdout
    if want_plot:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_round_robin_alternates_base_urls(server, tiny_model, tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every request there fails
    r, proc = bench(tmp_path, "--base-url", server.url, "--base-url", dead,
                    "--tokenizer", tiny_model, "--num-prompts", "4", "--random-input-len", "8",
                    "--random-output-len", "2", "--save-detailed")
    assert proc.returncode == 0  # some requests completed
    assert (r["completed"], r["failed"]) == (2, 2)
    assert [bool(e) for e in r["errors"]] == [False, True, False, True]
    assert "Connect" in r["errors"][1]


def test_mixed_workload_reports_each_class(server, tiny_model, tmp_path):
    r, proc = bench(tmp_path, "--base-url", server.url, "--tokenizer", tiny_model,
                    "--random-mix", "0.75:8:3,0.25:40:5", "--num-prompts", "8",
                    "--max-concurrency", "2", "--goodput", "ttft:0.001")
    assert proc.returncode == 0, proc.stderr
    assert r["completed"] == 8
    assert set(r["by_kind"]) == {"8x3", "40x5"}
    assert r["by_kind"]["8x3"]["completed"] == 6
    assert r["by_kind"]["40x5"]["completed"] == 2
    assert r["total_input_tokens"] == 6 * 8 + 2 * 40
    assert r["total_output_tokens"] == 6 * 3 + 2 * 5
    assert r["goodput"] == 0.0  # a 1 µs TTFT SLO is never met


def test_jsonl_dataset_text_prompts(server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "hello there", "output_len": 3}\n\n'
                    '{"prompt": [5, 6, 7, 8]}\n')
    r, proc = bench(tmp_path, "--base-url", server.url, "--dataset-path", str(data),
                    "--num-prompts", "2", "--random-output-len", "2", "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert r["completed"] == 2 and r["total_output_tokens"] == 3 + 2
    assert r["total_input_tokens"] > 4  # the text prompt's length comes from usage


def test_bad_arguments_are_an_error_not_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--goodput", "latency:5"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "bad --goodput item 'latency:5'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_pd_direct_mode_moves_kv_and_interleaves_with_the_proxy(tiny_model, tmp_path):
    from pd_harness import deployment, metric

    with deployment(tiny_model, "push", num_blocks=256) as dep:
        before = metric(dep.d, "pdserve:kv_remote_prefill_tokens_total")
        r, proc = bench(tmp_path, "--base-url", dep.proxy.url, "--pd-prefill-url", dep.p.url,
                        "--pd-decode-url", dep.d.url, "--save-detailed",
                        "--tokenizer", tiny_model, "--model", "m", "--num-prompts", "4",
                        "--random-input-len", "48", "--random-output-len", "4",
                        "--max-concurrency", "1", "--num-warmups", "0")
        assert proc.returncode == 0, proc.stderr + proc.stdout
        moved = metric(dep.d, "pdserve:kv_remote_prefill_tokens_total") - before
    assert (r["completed"], r["failed"]) == (4, 0)
    assert r["total_output_tokens"] == 16
    # request by request: proxy, direct, proxy, direct; each summarised on its own
    assert r["targets"] == [dep.proxy.url, "pd-direct"] * 2
    assert {t: s["completed"] for t, s in r["by_target"].items()} == {
        dep.proxy.url: 2, "pd-direct": 2}
    # D received every prompt token but the last one of each request from P, both ways
    assert moved == 4 * 47


def test_mix_counts_are_exact_and_order_is_seeded():
    classes = parse_mix("0.9:64:64,0.1:1024:64")
    assert class_counts(classes, 50) == [45, 5]
    assert sum(class_counts(parse_mix("1:1:1,1:2:1,1:3:1"), 10)) == 10
    a = mixed_requests(20, classes, list(range(10, 100)), seed=3)
    b = mixed_requests(20, classes, list(range(10, 100)), seed=3)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert sorted(r.kind for r in a) == ["1024x64"] * 2 + ["64x64"] * 18
    assert all(len(r.prompt) == r.prompt_len for r in a)
    with pytest.raises(ValueError, match="WEIGHT:INPUT_LEN:OUTPUT_LEN"):
        parse_mix("0.5:64")


def test_arrivals_match_the_rate():
    assert send_offsets(5, math.inf) == [0.0] * 5
    offsets = send_offsets(4000, 10.0, burstiness=1.0, seed=1)
    assert offsets == sorted(offsets) and offsets[0] == 0.0
    assert offsets[-1] / 3999 == pytest.approx(0.1, rel=0.05)
    with pytest.raises(ValueError):
        send_offsets(3, 0.0)


def test_summary_statistics_and_goodput():
    def res(ttft: float, n: int, gap: float, ok: bool = True) -> RequestResult:
        return RequestResult("k", 10, success=ok, output_tokens=n, ttft=ttft,
                             latency=ttft + gap * (n - 1), itl=[gap] * (n - 1),
                             error="" if ok else "boom")

    results = [res(0.1, 5, 0.01), res(0.3, 5, 0.03), res(0.2, 1, 0.0), res(0, 0, 0, ok=False)]
    s = summarize(results, 2.0, slos=parse_goodput(["ttft:250", "tpot:20"]))
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["mean_tpot_ms"] == pytest.approx(20.0)  # the 1-token request has no TPOT
    assert s["median_itl_ms"] == pytest.approx(20.0)
    assert s["total_output_tokens"] == 11 and s["total_input_tokens"] == 30
    assert s["request_goodput"] == pytest.approx(2 / 2.0)  # 0.1 s/10 ms and 0.2 s/1 token
    empty = summarize([res(0, 0, 0, ok=False)], 1.0)
    assert empty["completed"] == 0 and empty["median_ttft_ms"] == 0.0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def test_report_computes_goals_and_marks_missing_inputs(tmp_path):
    from pdserve.bench import report

    def run(ttft: float, gap: float, rate: float) -> dict:
        rs = [RequestResult("1024x64", 1024, success=True, output_tokens=3, ttft=ttft,
                            latency=ttft + 2 * gap, itl=[gap, gap])]
        out = summarize(rs, 10.0)
        out.update(request_rate=rate, ttfts=[ttft], itls=[[gap, gap]], errors=[""],
                   kinds=["1024x64"])
        return out

    def interleaved(ttfts: list[float]) -> dict:
        """Proxy and direct alternating, as bench serve sends them with both targets."""
        targets = ["http://proxy", "pd-direct"] * (len(ttfts) // 2)
        return {"ttfts": ttfts, "targets": targets, "errors": [""] * len(ttfts)}

    raw = tmp_path / "raw"
    raw.mkdir()
    files = {"push__A_r0.5": run(0.7, 0.05, 0.5), "pull__A_r0.5": run(1.0, 0.05, 0.5),
             "push__mix": run(0.2, 0.04, 1.0), "colocated__mix": run(0.2, 0.10, 1.0),
             "overhead_1": interleaved([0.100, 0.1015, 0.200, 0.2010, 0.150, 0.1525])}
    for name, data in files.items():
        (raw / f"{name}.json").write_text(json.dumps(data))
    (raw / "loadavg.txt").write_text("start 1.00 0.50 0.20\n")
    rc = report.main(["--raw", str(raw), "--out", str(tmp_path / "r.md")])
    assert rc == 0
    text = (tmp_path / "r.md").read_text()
    numbers = json.loads(text.split("<!-- numbers: ")[1].split(" -->")[0])
    assert numbers["push_over_pull_ttft"] == {"0.5": pytest.approx(0.7)}
    assert numbers["push_over_colocated_p99_itl"] == pytest.approx(0.4)
    assert numbers["pull_over_colocated_p99_itl"] is None  # no pull mix run
    # pairs (proxy − direct): −1.5, −1.0, −2.5 ms; the difference of the medians would be
    # 150 − 152.5 = −2.5 ms, the paired median is −1.5
    assert numbers["proxy_overhead_ms"] == pytest.approx(-1.5)
    assert numbers["transfer_ratio"] is None
    assert "start: 1.00 0.50 0.20" in text
    assert text.count("not measured") >= 2
