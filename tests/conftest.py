"""Fixtures for the integration tier: real systemd user managers, one per node."""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from systemd_harness import Nodes, UserManager, two_node_network


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item, so fixtures can tell that a test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    report = getattr(request.node, "report_call", None)
    return report is None or report.failed


@pytest.fixture
def one_node(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[UserManager]:
    """One manager in the host's network namespace (talks to loopback only)."""
    manager = UserManager(f"llmgw-test-{os.getpid()}-{abs(hash(request.node.nodeid)) % 10**6}",
                          tmp_path / "node")
    manager.start()
    try:
        yield manager
    finally:
        if _failed(request):
            print(manager.dump())
        manager.stop()


@pytest.fixture
def two_nodes(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Nodes]:
    """Two nodes for one test."""
    tag = f"{os.getpid() % 10000}{abs(hash(request.node.nodeid)) % 100}"
    with two_node_network("llmgw-test", tag, tmp_path, lambda: _failed(request)) as nodes:
        yield nodes


@pytest.fixture(scope="module")
def shared_two_nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[Nodes]:
    """Two nodes for every test of one module: for replicas that take minutes to start and
    serve several scenarios in turn (the module's fixtures then run them in file order)."""
    tag = f"{os.getpid() % 10000}m{abs(hash(request.node.nodeid)) % 10}"
    failures = request.session.testsfailed
    with two_node_network("llmgw-test", tag, tmp_path_factory.mktemp("nodes"),
                lambda: request.session.testsfailed > failures) as nodes:
        yield nodes
