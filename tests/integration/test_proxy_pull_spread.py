"""Pull mode leases D before it awaits P (as push does): requests arriving together see each
other's D leases and spread over the decode backends. The backends are test_proxy's fakes
(real HTTP servers on loopback); P answers each leg only after a delay, so every request is
routed while all the others wait for P."""

from __future__ import annotations

import threading

import pytest
from test_proxy import BODY, Cluster, post
from test_proxy import cluster as cluster  # the fixture

pytestmark = pytest.mark.timeout(60)

N = 6


@pytest.mark.parametrize("routing", ["kv-aware", "least-outstanding"])
def test_concurrent_pull_requests_spread_over_the_decode_backends(cluster: Cluster,
                                                                  routing: str) -> None:
    p, d1, d2 = cluster.fake("p"), cluster.fake("d1"), cluster.fake("d2")
    p.delay = 0.5  # every request is routed before the first P leg answers
    proxy = cluster.proxy([p], [d1, d2], mode="pull", routing=routing)
    codes: list[int] = []
    threads = [threading.Thread(target=lambda: codes.append(post(proxy, BODY).status_code),
                                name=f"pull-request-{i}", daemon=True) for i in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert codes == [200] * N
    counts = sorted((len(d1.generation_legs()), len(d2.generation_legs())))
    # before: the D was chosen after P's answer from a route made at arrival, so all N
    # requests (routed while no D lease was taken) went to the same D: [0, N]
    assert counts[0] >= 2 and sum(counts) == N, counts
