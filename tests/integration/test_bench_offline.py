"""`pdserve bench offline` end to end on the tiny model: both engines run, the JSON has the
contract keys (DESIGN §3), and --matmul-time accounts matmul time inside each run."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_offline_reports_both_throughputs_and_matmul_time(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    subprocess.run([sys.executable, "-m", "engine.cli", "bench", "offline", "--model", tiny_model,
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
