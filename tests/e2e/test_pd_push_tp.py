"""P/D push with tensor parallelism (docs/design.md §8): P TP=2 → D TP=2 through the proxy.

Each rank owns its NIXL agent and side channel (kv_port + rank) and pairs with the same rank
of the other engine; D's request runs only once every rank's KV landed. Outputs must equal
colocated TP=1 token for token, the KV must really move, and nothing may leak on any rank.
"""

from __future__ import annotations

import asyncio

import httpx
import psutil
import pytest
from pd_harness import assert_no_leaks, deployment, engine_core, metric
from test_pd_first_token_push import _window_cpu, park_stray_legs
from test_pd_push import REMOTE_TOKENS, _complete_all, _detok, _prompts
from test_pd_push import reference as reference  # noqa: F401 - the module fixture

from kvconnector.handshake import HandshakeError, fetch_peer_metadata

TP2 = ("--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def pd_tp2(tiny_model: str):
    with deployment(tiny_model, "push", num_blocks=256, engine_args=TP2) as dep:
        yield dep


def test_kv_transfer_info_lists_every_rank_side_channel(pd_tp2):
    info = httpx.get(f"{pd_tp2.p.url}/kv_transfer/info", timeout=10).json()
    assert info["tp_size"] == 2
    assert info["kv_ports"] == [info["kv_port"], info["kv_port"] + 1]
    # rank r's side channel serves rank r's own agent, and refuses a peer asking for another
    for rank, port in enumerate(info["kv_ports"]):
        meta = fetch_peer_metadata(info["kv_host"], port, None, tp_rank=rank)
        assert (meta.agent_name, meta.tp_rank, meta.tp_size) == (f"P0-tp{rank}", rank, 2)
    with pytest.raises(HandshakeError, match="serves tp_rank 1, not 0"):
        fetch_peer_metadata(info["kv_host"], info["kv_ports"][1], None, tp_rank=0)


def test_tp2_push_matches_colocated_tp1_and_moves_the_kv(pd_tp2, reference, tiny_model):
    prompts = _prompts(8, seed=11)
    before = metric(pd_tp2.d, REMOTE_TOKENS)
    writes = metric(pd_tp2.p, "pdserve:kv_push_writes_total")
    texts = asyncio.run(_complete_all(pd_tp2.proxy.url, prompts))
    assert texts == _detok(tiny_model, reference(prompts))
    assert metric(pd_tp2.d, REMOTE_TOKENS) - before == sum(len(p) - 1 for p in prompts)
    # one WRITE per request from each P rank (the counters are summed over the ranks)
    assert metric(pd_tp2.p, "pdserve:kv_push_writes_total") - writes == 2 * len(prompts)
    assert_no_leaks(pd_tp2.engines)


@pytest.mark.parametrize(("tp_size", "why"), [(3, "one to divide the other"),
                                              (4, "KV heads do not split over 4 ranks")])
def test_decode_refuses_a_prefill_of_a_tp_size_it_cannot_pair(pd_tp2, tp_size, why):
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2,
            "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "P0",
                                   "remote_host": "127.0.0.1", "remote_port": 1234,
                                   "tp_size": tp_size}}
    r = httpx.post(f"{pd_tp2.d.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "kv_transfer_params.tp_size" in message and why in message
    assert f"tensor_parallel_size {tp_size}, this decode engine 2" in message


def test_tp2_d_waiting_for_kv_does_not_poll(pd_tp2):
    """At TP=2 the ranks' connectors wake D's engine loop through the executor's wake bells
    (one pipe per rank, read by its monitor thread), so four D legs waiting for KV that P
    never writes (their transfer ids reach no P leg) leave the loop blocked on its input
    queue: it wakes at most 5 times a second (the 1 s backstop and the proxy's stats call),
    where without the hook it stepped the parked requests every millisecond."""
    api = psutil.Process(pd_tp2.d.pid)
    core = engine_core(api.pid)
    procs = [api, *api.children(recursive=True)]
    # every D rank registers each leg with its P rank
    legs = park_stray_legs(pd_tp2, first=800, registrations_per_leg=2)
    failed = metric(pd_tp2.d, "pdserve:kv_recv_failed_total")
    used, loop_wakes = _window_cpu(procs, core.pid)
    assert metric(pd_tp2.d, "pdserve:kv_recv_failed_total") == failed, "a leg stopped waiting"
    assert loop_wakes <= 5, (f"D's engine loop woke {loop_wakes:.1f} times a second while "
                             f"parked ({used:.1%} of a core)")
    for t in legs:
        t.join(30)
    assert_no_leaks(pd_tp2.engines, timeout=60)
