"""When a peer's answer wakes the judge (health/evidence.same_news): only when it tells
something new. How long an engine has run grows with every answer and is no news."""

from __future__ import annotations

from dataclasses import replace

import pytest

from llmgw_systemd.health.evidence import PeerEvidence, PeerShard, same_news

SHARD = PeerShard("rep", 1, "node-b", "ready", "all units up", "ab" * 16, False, up_for=30)
BEFORE = PeerEvidence("node-b", 100.0, True, (SHARD,))


@pytest.mark.parametrize(("after", "same"), [
    (replace(BEFORE, received_at=102.0), True),  # only fresher
    (replace(BEFORE, received_at=102.0, shards=(replace(SHARD, up_for=32),)), True),
    (replace(BEFORE, shards=(replace(SHARD, up_for=None),)), True),  # an older peer's
    (replace(BEFORE, shards=(replace(SHARD, state="failed"),)), False),
    (replace(BEFORE, shards=(replace(SHARD, generation="cd" * 16, up_for=0),)), False),
    (replace(BEFORE, shards=(replace(SHARD, reason="up for longer"),)), False),
    (replace(BEFORE, shards=(replace(SHARD, draining="a planned stop"),)), False),
    (replace(BEFORE, shards=(replace(SHARD, running_digest="0" * 16),)), False),
    (replace(BEFORE, shards=(SHARD, replace(SHARD, rank=2))), False),  # one more shard
    (replace(BEFORE, shards=()), False),
    (replace(BEFORE, authenticated=False), False),
    (PeerEvidence("node-b", 102.0, False, error="timeout"), False),
    (replace(BEFORE, source="node-c"), False),
])
def test_an_answer_is_news_when_it_says_something_new(after: PeerEvidence, same: bool
                                                      ) -> None:
    assert same_news(BEFORE, after) is same


def test_the_first_answer_and_a_recovery_are_news() -> None:
    assert same_news(None, BEFORE) is False
    failed = PeerEvidence("node-b", 100.0, False, error="timeout")
    assert same_news(failed, BEFORE) is False
    assert same_news(failed, replace(failed, received_at=104.0)) is True  # still failing
