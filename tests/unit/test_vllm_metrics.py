"""vLLM's request phases and counters as the engine computes them (issue 32 item 1): the
core's queue time on a request's last output, the frontend's prefill/decode split, the
scheduler's cumulative preemptions, and kv_transfer_seconds as histogram buckets."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_scheduler import Harness, _req

from engine.frontend.stats import IterationStats, RequestStateStats
from engine.protocol import SchedulerStats
from engine.sched.scheduler import Scheduler
from engine.server.metrics import ServerMetrics
from kvconnector import transfer_hist


def _samples(m: ServerMetrics) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}


def _value(m: ServerMetrics, name: str, **labels: str) -> float:
    return sum(v for (n, ls), v in _samples(m).items()
               if n == name and all(dict(ls).get(k) == x for k, x in labels.items()))


def test_request_phases_split_the_latency_as_vllm_does():
    it = IterationStats(10.0)
    st = RequestStateStats(arrival_time=1.0, first_token_time=2.0, last_token_time=5.0,
                           num_generation_tokens=4)
    it.observe_finished("r", st, "length", 8, queued_time=0.25)
    fin = it.finished_requests[0]
    assert (fin.queued_time, fin.prefill_time, fin.decode_time) == (0.25, 0.75, 3.0)
    assert fin.inference_time == 3.75 and fin.e2e_latency == 9.0
    m = ServerMetrics("m", max_model_len=1024)
    m.record(None, it)
    for fam, total in (("queue", 0.25), ("prefill", 0.75), ("decode", 3.0),
                       ("inference", 3.75)):
        assert _value(m, f"vllm:request_{fam}_time_seconds_sum") == total, fam
    assert _value(m, "vllm:request_time_per_output_token_seconds_sum") == 1.0  # 3 s / 3 gaps
    assert _value(m, "vllm:time_per_prefill_token_request_seconds_sum") == 0.75 / 8
    assert _value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert _value(m, "vllm:request_prompt_tokens_bucket", le="5.0") == 0
    assert _value(m, "vllm:request_prompt_tokens_bucket", le="10.0") == 1
    assert _value(m, "vllm:e2e_request_latency_seconds_bucket", le="7680.0") == 1
    assert _value(m, "pdserve:e2e_request_latency_seconds_bucket", le="7680.0") == 1


def test_a_queue_time_past_the_first_token_is_clipped():
    it = IterationStats(3.0)
    st = RequestStateStats(arrival_time=1.0, first_token_time=1.5, last_token_time=1.5)
    it.observe_finished("r", st, "stop", 2, queued_time=7.0)  # a skewed or bogus value
    fin = it.finished_requests[0]
    assert (fin.queued_time, fin.prefill_time, fin.decode_time) == (0.5, 0.0, 0.0)


def test_the_core_sends_queue_time_on_the_last_output_and_counts_preemptions():
    clock = [100.0]
    h = Harness(Scheduler(block_size=4, num_blocks=6, max_num_seqs=8,
                          max_num_batched_tokens=64, max_model_len=256,
                          clock=lambda: clock[0]))
    for rid in ("a", "b"):
        req = _req(rid, 12, max_tokens=8)
        req.arrival_time = 99.0
        h.sched.add_request(req)
    h.step()  # both prefilled at t=100: queued 1 s
    clock[0] = 101.0
    h.run()
    for rid in ("a", "b"):
        outs = h.outputs[rid]
        assert outs[-1].queued_time == pytest.approx(1.0)
        assert all(o.queued_time == 0.0 for o in outs[:-1])  # not on every output
    stats = h.sched.make_stats()
    assert stats.num_preemptions >= 1  # 6 blocks cannot hold both: b was preempted
    m = ServerMetrics("m", max_model_len=256)
    m.record(stats, None)
    assert _value(m, "vllm:num_preemptions_total") == stats.num_preemptions


def test_transfer_seconds_is_a_histogram_with_monotone_buckets():
    stats = transfer_hist.initial()
    for seconds in (0.002, 0.02, 0.2, 99.0):
        transfer_hist.observe(stats, seconds)
    assert stats["kv_transfer_seconds_count"] == 4
    assert stats["kv_transfer_seconds_bucket:0.0025"] == 1
    assert stats["kv_transfer_seconds_bucket:0.25"] == 3
    assert stats["kv_transfer_seconds_bucket:30.0"] == 3  # 99 s only in +Inf
    m = ServerMetrics("m", max_model_len=256)
    m.record(SchedulerStats(kv_connector=stats), None)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert fams["pdserve:kv_transfer_seconds"].type == "histogram"
    assert _value(m, "pdserve:kv_transfer_seconds_bucket", le="0.25") == 3
    assert _value(m, "pdserve:kv_transfer_seconds_bucket", le="+Inf") == 4
    assert _value(m, "pdserve:kv_transfer_seconds_sum") == pytest.approx(99.222)
    # racy reads across TP ranks (a bucket read after the count moved) stay monotone
    racy = {**stats, "kv_transfer_seconds_bucket:0.1": 5, "kv_transfer_seconds_bucket:x": 1}
    m2 = ServerMetrics("m", max_model_len=256)
    m2.record(SchedulerStats(kv_connector=racy), None)
    assert _value(m2, "pdserve:kv_transfer_seconds_bucket", le="0.25") == 5
    assert _value(m2, "pdserve:kv_transfer_seconds_bucket", le="+Inf") == 5
