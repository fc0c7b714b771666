"""bench_pd.sh's report: paired differences of interleaved requests, and the raw-file layout."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.report import cost_numbers, load_runs, paired_samples, render

PROXY, P = "http://127.0.0.1:18102", "http://127.0.0.1:18100"


def _interleaved(first: str, second: str, ttfts: list[float], errors=None) -> dict:
    targets = [first if i % 2 == 0 else second for i in range(len(ttfts))]
    return {"targets": targets, "ttfts": ttfts, "errors": errors or [""] * len(ttfts)}


def test_overhead_pairs_are_proxy_minus_direct_whichever_goes_first():
    a = _interleaved("pd-direct", PROXY, [0.100, 0.103, 0.200, 0.201])
    b = _interleaved(PROXY, "pd-direct", [0.105, 0.100])
    direct, proxied, pairs = paired_samples([a, b])
    assert pairs == pytest.approx([3.0, 1.0, 5.0])
    assert sorted(direct) == pytest.approx([100.0, 100.0, 200.0])
    assert sorted(proxied) == pytest.approx([103.0, 105.0, 201.0])


def test_a_failed_request_drops_its_pair_only():
    r = _interleaved("pd-direct", PROXY, [0.1, 0.2, 0.3, 0.31], errors=["", "boom", "", ""])
    _, _, pairs = paired_samples([r])
    assert pairs == pytest.approx([10.0])


def test_cost_takes_the_second_target_p_alone_as_baseline(tmp_path):
    for system, ttfts in {"push": [0.92, 0.90, 0.95, 0.93], "pull": [0.95, 0.90, 0.99, 0.94]
                          }.items():
        (tmp_path / f"{system}__cost.json").write_text(json.dumps(_interleaved(PROXY, P, ttfts)))
    runs = load_runs(str(tmp_path))
    costs = cost_numbers(runs)
    assert costs["push"]["added_ms"] == pytest.approx(20.0)
    assert costs["pull"]["added_ms"] == pytest.approx(50.0)
    assert costs["push"]["p_alone_ms"] == pytest.approx(915.0)
    assert "push adds 0.40 × what pull adds." in render(runs, None, None)


def test_side_by_side_modes_ratio_is_push_over_pull(tmp_path):
    pull, push = "http://127.0.0.1:18102", "http://127.0.0.1:18122"
    r = _interleaved(pull, push, [1.00, 1.02, 0.90, 0.95, 1.10, 1.10])
    (tmp_path / "modes_paired.json").write_text(json.dumps(r))
    report = render(load_runs(str(tmp_path)), None, None)
    assert "1020 / 1000 ms = 1.02 (push − pull, 3 pairs: +20.0 ms) | no |" in report
