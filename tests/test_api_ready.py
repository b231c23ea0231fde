"""The readiness routes a load balancer checks (supervisor/http/api.py): a replica's, and
each serving endpoint's, `NAME.RANK` (one HAProxy server per endpoint: docs/loadbalancer.md)."""

from __future__ import annotations

import asyncio

import pytest

from llmgw_systemd.supervisor.http import api
from llmgw_systemd.supervisor.http.server import Changes, Request

PUBLISHED = api.Published(node="a", version=1, ready={
    # data parallel, hybrid: ranks 0 and 1 serve
    "ds": api.Readiness(True, "ready: every rank ready", (0, 1)),
    # one serving rank, out of rotation
    "tp": api.Readiness(False, "degraded: rank 1 on b failed", (0,)),
    # no rank serves HTTP
    "batch": api.Readiness(False, "ready: no serving rank", ()),
})

ROWS = [
    # (path, status, first line of the body)
    ("/v1/replicas/ds/ready", 200, "ready: every rank ready"),
    ("/v1/replicas/ds.0/ready", 200, "ready: every rank ready"),
    ("/v1/replicas/ds.1/ready", 200, "ready: every rank ready"),
    ("/v1/replicas/ds.2/ready", 404, "rank 2 of 'ds' serves no HTTP (its serving ranks: 0, 1)"),
    ("/v1/replicas/tp/ready", 503, "degraded: rank 1 on b failed"),
    ("/v1/replicas/tp.0/ready", 503, "degraded: rank 1 on b failed"),
    ("/v1/replicas/tp.1/ready", 404, "rank 1 of 'tp' serves no HTTP (its serving ranks: 0)"),
    ("/v1/replicas/batch.0/ready", 404,
     "rank 0 of 'batch' serves no HTTP (its serving ranks: none)"),
    ("/v1/replicas/nope.0/ready", 404, "no replica 'nope' on this node"),
    ("/v1/replicas/nope/ready", 404, "no replica 'nope' on this node"),
    # not a replica name, nor one with an endpoint: refused before any lookup
    ("/v1/replicas/ds.x/ready", 404, '{'),
    ("/v1/replicas/ds.12345/ready", 404, '{'),
    ("/v1/replicas/.0/ready", 404, '{'),
    ("/v1/replicas/ds.0", 404, '{'),
]


@pytest.mark.parametrize(("path", "status", "line"), ROWS, ids=[r[0] for r in ROWS])
def test_readiness_routes(path: str, status: int, line: str) -> None:
    request = Request("GET", path, (), ("127.0.0.1", 1), None)
    response = asyncio.run(api.handle(request, lambda: PUBLISHED, Changes(),
                                      lambda: (b"", "text/plain")))
    assert (response.status, response.body.decode().splitlines()[0]) == (status, line)


@pytest.mark.parametrize(("name", "expected"), [
    ("ds", ("ds", None)), ("ds.1", ("ds", 1)), ("ds.x", ("ds.x", None)),
    ("ds.", ("ds.", None)), (".1", (".1", None)), ("a.b.2", ("a.b", 2))])
def test_endpoint_names(name: str, expected: tuple[str, int | None]) -> None:
    assert api.endpoint(name) == expected
