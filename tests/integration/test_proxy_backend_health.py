"""What takes a backend out of the proxy's rotation, over real HTTP with fake backends
(test_proxy's): a request must never do it. A leg that fails once the backend had the request
(a 5xx, a reset, a timeout) may be the request's own doing: it is counted and triggers one
immediate health check, whose verdict decides. Issue 26: three requests a backend answered
with 500 took it out, and every client got 503 until the next health check.
"""

from __future__ import annotations

from pd_harness import wait_until
from test_proxy import BODY, Cluster, post
from test_proxy import cluster as cluster  # the fixture

RECHECKS = "pdserve:proxy_backend_rechecks_total"


def _count(metrics: str, name: str, *labels: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + "{") and all(lb in line for lb in labels))


def test_5xx_answers_never_take_a_backend_that_passes_its_health_check_out(
        cluster: Cluster) -> None:
    p, d = cluster.fake("p"), cluster.fake("d")
    p.behaviour = d.behaviour = "error500"
    d.delay = 0.3  # D's 500 comes after P's is recorded (a failed D cancels P's leg)
    proxy = cluster.proxy([p], [d], health_interval=60,  # only the failures could tell
                          retries=0)  # each failure reaches the client: counted once
    for _ in range(5):
        assert post(proxy, BODY).status_code == 502
    assert proxy.healthy(p.url) and proxy.healthy(d.url)
    metrics = proxy.metrics()
    for fake in (p, d):
        assert _count(metrics, "pdserve:proxy_backend_failures_total", "http_500",
                      fake.url) == 5
    wait_until(lambda: _count(proxy.metrics(), RECHECKS, 'outcome="healthy"') >= 2,
               what="the rechecks of P and D to find them healthy")
    p.behaviour = d.behaviour = "ok"
    assert post(proxy, BODY).status_code == 200


def test_a_failing_leg_to_a_backend_failing_its_health_check_takes_it_out_at_once(
        cluster: Cluster) -> None:
    p, d1, d2 = cluster.fake("p"), cluster.fake("d1"), cluster.fake("d2")
    proxy = cluster.proxy([p], [d1, d2], health_interval=60, retries=0)  # no retry: 502
    d2.behaviour, d2.health_status = "error500", 503
    failed = [post(proxy, BODY).status_code for _ in range(2)]
    assert sorted(failed) == [200, 502]  # round robin: one leg went to d2
    wait_until(lambda: not proxy.healthy(d2.url), what="d2 out after one failed leg")
    assert _count(proxy.metrics(), RECHECKS, 'outcome="unhealthy"', d2.url) == 1
    assert all(post(proxy, BODY).status_code == 200 for _ in range(3))
    assert len(d1.legs) == 4 and len(d2.legs) == 1
