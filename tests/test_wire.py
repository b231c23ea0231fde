"""The wire format has one home (gather/wire.py): what the daemon writes is what the peer
client reads back, field for field."""

from __future__ import annotations

import json

import pytest

from llmgw_systemd.errors import PeerError
from llmgw_systemd.gather.wire import (
    RankLine,
    ReplicaAnswer,
    ShardReport,
    decode,
    parse_answer,
    parse_replica,
    replica_rank,
    shard_report,
    shards_answer,
    wire_reader,
)

DIGEST = "0123456789abcdef"


@pytest.mark.parametrize(("started", "clock", "up_for"), [(900, 1000, 100), (None, 1000, None)])
@pytest.mark.parametrize(("draining", "drained"), [(None, False), ("llmgw-stop-group", True)])
def test_a_shard_report_reads_back_as_written(started: int | None, clock: int,
                                              up_for: int | None, draining: str | None,
                                              drained: bool) -> None:
    report = shard_report(replica="llama-70b", rank=1, ranks=2, node="gpu-b", serving=False,
                          state="ready", reason="all units up", generation="3f2a",
                          started=started, draining=draining, drained=drained,
                          loaded=DIGEST, running=DIGEST,
                          units={"llmgw-llama-70b-engine.service": {"active": "active"}})
    body = json.dumps(shards_answer("gpu-b", 7, clock, [report])).encode()
    node, version, shards = parse_answer(wire_reader("gpu-b:9470"), decode("gpu-b", body))
    assert (node, version) == ("gpu-b", 7)
    assert shards == (ShardReport("llama-70b", 1, "gpu-b", "ready", "all units up", "3f2a",
                                  False, up_for, draining, drained, DIGEST, DIGEST),)


def test_a_replica_view_reads_back_as_written() -> None:
    ranks = [replica_rank(rank=r, node=f"gpu-{r}", state="ready", reason="up",
                          loaded=DIGEST, running="") for r in range(2)]
    body = json.dumps({"name": "llama-70b", "state": "ready", "reason": "every rank",
                       "routable": True, "ranks": ranks}).encode()
    assert parse_replica(wire_reader("local"), decode("local", body)) == ReplicaAnswer(
        "ready", "every rank", True,
        tuple(RankLine(r, f"gpu-{r}", "ready", "up", DIGEST, "") for r in range(2)))


def test_a_writer_key_the_reader_does_not_know_fails_loudly() -> None:
    """A misspelt state never passes as another: the reader names the path."""
    report = shard_report(replica="r", rank=0, ranks=1, node="n", serving=True,
                          state="redy", reason="", generation="", started=None,
                          draining=None, drained=False, loaded="", running="", units={})
    body = json.dumps(shards_answer("n", 1, 5, [report])).encode()
    with pytest.raises(PeerError) as caught:
        parse_answer(wire_reader("n:9470"), decode("n", body))
    assert "shards[0].state" in str(caught.value)
