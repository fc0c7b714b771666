"""The DP balancing choice and the coordinator's bookkeeping, without processes."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.dp.balancer import Balancer
from engine.dp.config import check_request_rank, default_request_rank, rank_config
from engine.dp.coordinator import Coordinator
from engine.dp.messages import (
    ENCODER,
    EngineStats,
    StartDPWave,
    StartWave,
    WaveComplete,
    front_decoder,
)


def test_score_prefers_short_queues_and_counts_own_sends():
    b = Balancer(2, "score")
    b.publish([[4, 2], [0, 3]])  # rank 0: 4*4+2 = 18, rank 1: 3
    picks = []
    for _ in range(5):
        rank = b.pick()
        b.sent(rank)
        picks.append(rank)
    # rank 1's score grows by 4 per send since the publication: 3, 7, 11, 15, 19 > 18
    assert picks == [1, 1, 1, 1, 0]
    b.publish([[0, 0], [0, 0]])
    assert b.sent_since == [0, 0] and b.outstanding == [1, 4]


def test_sends_count_until_the_engine_reports_again():
    b = Balancer(2, "score")
    b.publish([[0, 0], [0, 0]], [1, 1])
    b.sent(0)
    b.sent(0)
    b.publish([[0, 1], [0, 0]], [1, 2])  # rank 0 (inside a long step) did not report
    assert b.sent_since == [2, 0]
    assert b.score(0) == 2 * 4 + 1
    b.publish([[2, 1], [0, 0]], [2, 2])
    assert b.sent_since == [0, 0]


def test_ties_rotate_and_dead_engines_are_skipped():
    b = Balancer(3, "score")
    assert [b.pick() for _ in range(3)] == [0, 1, 2]
    b.alive[1] = False
    assert {b.pick() for _ in range(6)} == {0, 2}
    b.alive = [False] * 3
    with pytest.raises(LookupError):
        b.pick()


def test_without_coordinator_own_outstanding_counts():
    b = Balancer(2, "score")
    b.have_coordinator = False
    b.sent(0)
    b.sent(0)
    assert b.pick() == 1
    b.finished(0)
    b.finished(0)
    b.sent(1)
    assert b.pick() == 0


def test_round_robin_ignores_load():
    b = Balancer(2, "round_robin")
    b.publish([[100, 100], [0, 0]])
    assert [b.pick() for _ in range(4)] == [0, 1, 0, 1]
    with pytest.raises(ValueError):
        Balancer(2, "random")


def test_coordinator_counts_and_malformed():
    c = Coordinator(2, lockstep=False, interval_s=0.1)
    assert c.on_engine_message(ENCODER.encode(EngineStats(1, 3, 2))) == []
    assert c.on_engine_message(b"\x93garbage") == []
    assert c.on_engine_message(ENCODER.encode(EngineStats(7, 1, 1))) == []  # no such rank
    assert c.num_malformed == 2
    front = front_decoder.decode(c.front_stats())
    assert front.counts == [[0, 0], [3, 2]] and front.stamps == [0, 1]
    assert c.on_engine_message(ENCODER.encode(StartWave(0, 0))) == []  # no waves: ignored


def test_wave_starts_on_first_request_and_ends_when_all_idle():
    c = Coordinator(2, lockstep=True, interval_s=0.1)
    assert c.on_engine_message(ENCODER.encode(StartWave(0, 0))) == [StartDPWave(0)]
    assert c.running and c.busy == [True, False]
    assert c.on_engine_message(ENCODER.encode(StartWave(1, 0))) == []  # already running
    assert c.on_engine_message(ENCODER.encode(EngineStats(0, 0, 1))) == []
    assert c.on_engine_message(ENCODER.encode(EngineStats(1, 0, 0))) == []  # 0 still busy
    assert c.on_engine_message(ENCODER.encode(EngineStats(0, 0, 0))) == [WaveComplete(0)]
    assert (c.wave, c.running) == (1, False)
    assert c.on_engine_message(ENCODER.encode(StartWave(1, 1))) == [StartDPWave(1)]


def test_config_rules(tiny_model):
    p = EngineConfig(model=tiny_model, data_parallel_size=2,
                     kv_transfer_config={"kv_connector": "NixlPushConnector", "engine_id": "p",
                                         "kv_role": "kv_producer", "kv_port": 7100})
    assert rank_config(p, 1).kv_transfer_config.engine_id == "p_dp1"
    # an unpinned push P leg goes to rank 0 (the top level of /kv_transfer/info)
    assert default_request_rank(p, {"do_remote_decode": True}) == 0
    assert default_request_rank(p, {"do_remote_prefill": True}) is None
    assert default_request_rank(p, None) is None
    d = EngineConfig(model=tiny_model, data_parallel_size=2,
                     kv_transfer_config={"kv_connector": "NixlPushConnector", "engine_id": "d",
                                         "kv_role": "kv_consumer", "kv_port": 7000})
    assert [(c.kv_transfer_config.engine_id, c.kv_transfer_config.kv_port)
            for c in (rank_config(d, 0), rank_config(d, 1))] == [("d_dp0", 7000), ("d_dp1", 7001)]
    with pytest.raises(ValueError, match="needs data_parallel_rank"):
        EngineConfig(model=tiny_model, data_parallel_size=2, data_parallel_external_lb=True)
    with pytest.raises(ValueError, match="out of range"):
        EngineConfig(model=tiny_model, data_parallel_size=2, data_parallel_rank=2)
    with pytest.raises(ValueError, match="lockstep needs"):
        EngineConfig(model=tiny_model, data_parallel_lockstep=True)
    cfg = EngineConfig(model=tiny_model, data_parallel_size=2, data_parallel_external_lb=True,
                       data_parallel_rank=1,
                       kv_transfer_config={"kv_connector": "NixlPushConnector",
                                           "engine_id": "p"})
    assert rank_config(cfg, 1).kv_transfer_config.engine_id == "p_dp1"
    check_request_rank(cfg, 1)
    with pytest.raises(ValueError, match="data_parallel_rank 0"):
        check_request_rank(cfg, 0)
