"""`pdserve bench roofline` end to end on the tiny model (small sizes): the machine's limits
and the engine's prefill / decode against them, with the JSON keys the issue names, the FLOP
and byte counts of the documented formulas, and fractions in a sane range."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((ln for ln in f if ln.startswith("flags")), "").split())


@pytest.fixture(scope="module")
def result(tiny_model, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("roofline") / "roofline.json"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "roofline", "--model",
                    tiny_model, "--threads", "1", "--prefill-tokens", "96",
                    "--decode-context", "40", "--decode-steps", "6", "--repeats", "2",
                    "--buffer-mib", "96", "--fma-iters", "2000000", "--batch-sizes", "2,3",
                    "--batch-context", "40", "--batch-steps", "3", "--result-json", str(out)],
                   check=True, timeout=300, capture_output=True)
    return json.loads(out.read_text())


def _gemm_ceiling(limits: dict) -> float:
    """How far above the peak a gemm may run: a little (timing noise on a tiny model), or,
    where the kernels are forced onto a narrower path (PDSERVE_ISA, as CI's AVX2 pass does)
    while oneDNN or MKL keep this CPU's widest vectors, by the ratio of the widths too."""
    from pdserve.bench.roofline import _standin_hint

    return 1.5 * (16 / limits["fma_lanes"] if _standin_hint(limits) else 1)


def test_roofline_reports_the_fractions_and_the_machine(result):
    ceiling = _gemm_ceiling(result["limits"])
    assert 0 < result["prefill_fma_fraction"] <= ceiling
    # The tiny model's weights fit in the caches, so its decode may beat DRAM bandwidth.
    assert 0 < result["decode_bandwidth_fraction"] < 20
    for t, r in result["float32"].items():  # against the higher of the two streaming reads
        assert r["read_gbps"] >= result["limits"]["threads"][t]["read_gbps"]
        assert r["decode_bandwidth_fraction"] == pytest.approx(
            r["decode_gbps"] / r["read_gbps"], abs=0.002)
    assert result["prefill_fma_fraction_threads"] == 1
    # The practical bound: torch's sgemm on the model's own matmul shapes.
    assert 0 < result["prefill_fma_bound"] <= ceiling
    assert result["float32"]["1"]["sgemm_gflops"] > 0
    assert result["decode_bandwidth_fraction_threads"] == 1
    lim = result["limits"]["threads"]["1"]
    assert lim["fma_gflops"] > 0 and lim["read_gbps"] > 0
    # A real clock (no x86 core runs at 6.5 GHz): a chain of `add $1` read 11.9 GHz on a
    # Golden Cove Xeon, which folds dependent immediate adds at rename.
    assert 0.3 < lim["clock_ghz"] < 6.5
    assert result["cpu"]["model_name"]
    flags = _cpu_flags()
    assert set(result["cpu"]["flags"]) <= flags
    assert (lim["bf16_dot_gflops"] or 0) > 0 if "avx512_bf16" in flags else \
        lim["bf16_dot_gflops"] is None
    # bf16 is measured on every CPU (AVX2 widens it to fp32), not only with AVX512-BF16.
    assert result["bf16_prefill_speedup"] > 0
    assert result["bfloat16"]["1"]["prefill_gflops"] > 0
    assert result["bfloat16"]["1"]["decode_gbps"] > 0
    for dtype in ("float32", "bfloat16"):  # where a batch-1 decode step goes
        b = result[dtype]["1"]["decode_breakdown"]
        assert b["matmul_ms"] > 0 and b["attention_ms"] > 0 and b["matmul_gbps"] > 0
        assert b["matmul_ms"] + b["attention_ms"] + b["other_ms"] == pytest.approx(
            b["step_ms"], abs=0.01)


def test_flop_and_byte_counts_follow_the_model_shapes(result, tiny_model):
    cfg = json.loads(open(f"{tiny_model}/config.json").read())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter)
    head = cfg["vocab_size"] * h
    assert result["costs"]["linear_params"] == params
    t = result["prefill_tokens"]
    flop = 2 * t * params + 2 * head + 2 * layers * q * t * (t + 1)
    r = result["float32"]["1"]
    assert r["prefill_gflops"] == pytest.approx(flop / r["prefill_s"] / 1e9, rel=0.01)
    context = result["decode_context"] + 4 + 6 / 2
    nbytes = 4 * (params + head + 2 * layers * kv * context)
    assert r["decode_gbps"] == pytest.approx(nbytes / (r["decode_step_ms"] / 1e3) / 1e9,
                                             rel=0.01)
    assert r["prefill_fma_fraction"] == pytest.approx(
        r["prefill_gflops"] / result["limits"]["threads"]["1"]["fma_gflops"], abs=0.002)


def test_batch_decode_reads_weights_and_every_sequences_kv(result, tiny_model):
    """Decode at batch B and context C: every batch size and dtype measured, the bytes of a
    step = the weights once + each sequence's KV at its own context, and where the time went."""
    cfg = json.loads(open(f"{tiny_model}/config.json").read())
    kv_per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 64
    weights = result["costs"]["linear_params"] + result["costs"]["head_params"]
    lim = result["limits"]["threads"]["1"]
    for dtype, e in (("float32", 4), ("bfloat16", 2)):
        table = result["batch_decode"][dtype]
        assert sorted(table) == ["2", "3"]
        for size, per_t in table.items():
            r = per_t["1"]
            # each sequence's context: the 40-token prompt plus the tokens it has so far
            assert 40 < r["mean_context"] < 40 + 60
            kv = e * kv_per_token * r["mean_context"] * int(size)
            assert r["bytes_per_step"] == pytest.approx(e * weights + kv, rel=1e-3)
            assert r["decode_gbps"] == pytest.approx(
                r["bytes_per_step"] / (r["step_ms"] / 1e3) / 1e9, rel=0.01)
            # against the higher of the limit's read and one measured beside the steps
            assert r["read_gbps"] >= lim["read_gbps"]
            assert r["decode_bandwidth_fraction"] == pytest.approx(
                r["decode_gbps"] / r["read_gbps"], abs=0.002)
            assert 0 < r["bound_fraction"] <= 1
            b = r["breakdown"]
            assert b["matmul_ms"] > 0 and b["attention_ms"] > 0
            assert b["matmul_ms"] + b["attention_ms"] < b["step_ms"]
