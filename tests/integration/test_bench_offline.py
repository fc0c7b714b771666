"""`pdserve bench offline` and `bench broadcast` end to end on the tiny model: every engine
runs, the JSON has the contract keys (DESIGN §3), --matmul-time accounts matmul time inside
each run, --compare-tp reports TP=1 and TP=2 side by side."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_offline_reports_both_throughputs_and_matmul_time(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "offline", "--model", tiny_model,
                    "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                    "--matmul-time", "--result-json", str(out)], check=True, timeout=300,
                   capture_output=True)
    r = json.loads(out.read_text())
    assert r["tokens_per_s"] > 0 and r["hf_tokens_per_s"] > 0
    assert abs(r["ratio"] - r["tokens_per_s"] / r["hf_tokens_per_s"]) < 0.01
    hf_elapsed = 4 * 8 / r["hf_tokens_per_s"]
    assert 0 < r["hf_matmul_s"] < hf_elapsed * 1.01
    assert 0 < r["matmul_s"] < 4 * 8 / r["tokens_per_s"] * 1.01
    assert r["ratio_bound_at_hf_matmul_time"] > 1


def test_bench_offline_compare_tp_reports_both_sizes_and_their_ratio(tiny_model, tmp_path):
    out = tmp_path / "tp.json"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "offline", "--model", tiny_model,
                    "--num-prompts", "2", "--input-len", "8", "--output-len", "4",
                    "--compare-tp", "2", "--result-json", str(out)], check=True, timeout=300,
                   capture_output=True)
    r = json.loads(out.read_text())
    assert len(r["runs_tokens_per_s"]["tp1"]) == len(r["runs_tokens_per_s"]["tp2"]) == 2
    assert r["tp2_tokens_per_s"] == max(r["runs_tokens_per_s"]["tp2"]) > 0
    assert abs(r["tp_ratio"] - r["tp2_tokens_per_s"] / r["tp1_tokens_per_s"]) < 0.01
    # side-by-side pairs, the load each run started under, and the CPU (a noisy machine)
    runs = r["runs_tokens_per_s"]
    pairs = zip(r["pair_ratios"], runs["tp1"], runs["tp2"], strict=True)
    assert all(abs(ratio - b / a) < 0.01 * ratio for ratio, a, b in pairs), r
    assert len(r["load_average_per_run"]) == 4 and r["cpu"]["model_name"]


def test_bench_broadcast_times_the_shm_ring_against_zeromq(tmp_path):
    out = tmp_path / "broadcast.json"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "broadcast", "--rounds", "30",
                    "--blocks", "1", "--result-json", str(out)], check=True, timeout=120,
                   capture_output=True)
    r = json.loads(out.read_text())
    assert r["readers"] == 2 and r["round_trips"] == 30 and r["message_bytes"] > 1000
    assert r["shm"]["median_us"] > 0 and r["zmq"]["median_us"] > 0
    assert abs(r["ratio_median"] - r["shm"]["median_us"] / r["zmq"]["median_us"]) < 0.01
