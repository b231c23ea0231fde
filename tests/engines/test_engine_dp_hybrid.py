"""The engine tier's data parallel in vLLM's hybrid mode (issue 36; docs/engines.md,
"Data parallel"; docs/loadbalancer.md, "A replica with several serving endpoints"): the
real vLLM (CPU build) with data parallel 4 over two network namespaces, two ranks per
node, every node serving its own two on its own endpoint, behind a real HAProxy with one
server per endpoint (`dp.0`, `dp.1`), four clients throughout, `standby` beside it
(test_engine_dp.py holds the harness; there the internal mode, a killed rank and a
planned restart of the headless node).

1. Both endpoints come into rotation and serve completions; each node's supervisor
   probes its own endpoint, and the replica's body names both.

A killed rank, a planned restart of a serving node and a roll over two endpoints are
tests/integration/test_endpoints.py's (stand-ins); the real vLLM's killed rank is
test_engine_dp.py's (internal mode). In the hybrid mode the killed rank passed run alone
and in three CI runs and failed in a fourth beside the other lane, with no systemd
stall; the cause is not known yet (issue 36). The planned restart and the roll passed
run alone with the real vLLM (0 of 1750 and 0 of 2304 requests failed for the planned
restart of node-b; 0 of 2154 and 0 of 1928 for the roll), but beside the other CI lane
requests slowed to ~10 s and outlasted this spec's 10 s drain timeout: node-b's ranks
stopped under requests still in flight (2 of 2380 failed in one run). They come back
with a longer drain (docs/engines.md, issue 36)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from loadbalancer import summary
from systemd_harness import Nodes
from test_engine_dp import Cluster, running

pytestmark = [pytest.mark.integration, pytest.mark.engines]


@pytest.fixture(scope="module")
def cluster(shared_two_nodes: Nodes, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[Cluster]:
    with running(shared_two_nodes, tmp_path_factory.mktemp("engine-dp-hybrid"),
                 "hybrid") as cluster:
        yield cluster


def test_both_endpoints_serve_behind_haproxy(cluster: Cluster) -> None:
    started = time.monotonic()
    cluster.serving()
    print(f"figure: data parallel 4, hybrid: both endpoints in rotation "
          f"{time.monotonic() - started:.0f} s after the start")
    with cluster.traffic(seconds=20) as traffic:
        pass
    print(f"figure: 20 s of load: {summary(traffic.requests)}")
    assert not traffic.failed, traffic.failed[:5]
    served = traffic.served_by()
    assert served.get("dp.0", 0) > 0 and served.get("dp.1", 0) > 0, served
    for node, sup in cluster.sups.items():
        body = sup.replica("dp")
        assert body["state"] == "ready", body
        assert [(e["rank"], e["node"], e["check"]) for e in body["endpoints"]] == [
            (0, "node-a", "dp.0"), (1, "node-b", "dp.1")], body
        mine = body["ranks"][0 if node == "node-a" else 1]
        assert "HTTP 200" in mine["reason"], body  # its own endpoint, probed
