"""The evidence a stopping supervisor leaves for the next (supervisor/saved_evidence.py):
it comes back as it was, is read once, and anything from another boot, from the future
or malformed is refused with a warning instead of being believed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmgw_systemd.health.evidence import PeerEvidence, PeerShard, ProbeEvidence, carried_over
from llmgw_systemd.supervisor import saved_evidence
from llmgw_systemd.supervisor.saved_evidence import SavedEvidence, decode, encode, save, take

NOW = 5000.0
GEN = "aa" * 16
SHARD = PeerShard("rep", 1, "b", "ready", "all units up for 40 s", "bb" * 16, up_for=40,
                  loaded_digest="d1", running_digest="d1")


def evidence(boot: str | None = None, at: float = NOW - 2) -> SavedEvidence:
    return SavedEvidence(
        boot if boot is not None else saved_evidence.boot_id(),
        {("rep", "health"): ProbeEvidence(True, "HTTP 200 in 3 ms", GEN, at),
         ("rep", "generation"): ProbeEvidence(False, "no answer within 5 s", GEN, at)},
        {"rep": GEN},
        {"b": PeerEvidence("b", at, True, (SHARD, PeerShard("other", 0, "b", "starting",
                                                          "waiting", "")))})


def test_what_was_saved_comes_back_once(tmp_path: Path) -> None:
    saved = evidence()
    save(str(tmp_path), saved)
    back, warning = take(str(tmp_path), NOW)
    assert warning == ""
    assert back == saved
    assert not (tmp_path / saved_evidence.FILE_NAME).exists(), "read twice would mislead"
    assert take(str(tmp_path), NOW) == (None, "")


def test_a_peer_that_failed_is_not_saved() -> None:
    failed = PeerEvidence("c", NOW, False, error="timed out")
    saved = SavedEvidence("x", {}, {}, {"c": failed})
    assert decode(encode(saved)).peers == {}


@pytest.mark.parametrize(("what", "saved", "warned"), [
    ("another boot: its monotonic clock means nothing now", evidence(boot="other"), ""),
    ("no boot recorded", evidence(boot=""), ""),
    ("a time in the future", evidence(at=NOW + 1), "times in the future"),
])
def test_evidence_that_cannot_be_true_now_is_dropped(
        tmp_path: Path, what: str, saved: SavedEvidence, warned: str) -> None:
    save(str(tmp_path), saved)
    back, warning = take(str(tmp_path), NOW)
    assert back is None, what
    assert warned in warning


@pytest.mark.parametrize(("what", "change", "expected"), [
    ("a state outside the vocabulary",
     lambda r: r["peers"][0]["shards"][0].update(state="fine"), "state"),
    ("a rank that is a bool", lambda r: r["peers"][0]["shards"][0].update(rank=True), "rank"),
    ("a probe's ok missing", lambda r: r["probes"][0].pop("ok"), "ok"),
    ("a time that is text", lambda r: r["probes"][0].update(taken_at="soon"), "taken_at"),
    ("peers not a list", lambda r: r.update(peers={}), "peers"),
])
def test_a_malformed_record_is_refused_with_a_warning(
        tmp_path: Path, what: str, change: object, expected: str) -> None:
    record = encode(evidence())
    change(record)  # type: ignore[operator]
    path = tmp_path / saved_evidence.FILE_NAME
    path.write_text(json.dumps({"format": 1, "evidence": record}))
    back, warning = take(str(tmp_path), NOW)
    assert back is None, what
    assert expected in warning and str(path) in warning, warning


def test_a_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / saved_evidence.FILE_NAME).write_text("{half")
    back, warning = take(str(tmp_path), NOW)
    assert back is None and "cannot read" in warning
    assert take(str(tmp_path), NOW) == (None, ""), "warned once, then gone"


@pytest.mark.parametrize(("what", "boot_readable", "saved_boot", "volatile", "kept"), [
    ("a sandbox that cannot read the boot ID, in a folder a reboot empties",
     False, "", True, True),
    ("the same sandbox, in a folder that survives a reboot", False, "", False, False),
    ("saved where the boot ID was readable, read where it is not", False, "x", True, False),
    ("saved in a sandbox, read outside it", True, "", True, False),
])
def test_this_boot_without_a_readable_boot_id(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, what: str, boot_readable: bool,
        saved_boot: str, volatile: bool, kept: bool) -> None:
    """The shipped unit's ProcSubset=pid hides /proc/sys: the boot ID reads as "" there,
    and only RuntimeDirectory= (on /run, a tmpfs) says the file is of this boot."""
    if not boot_readable:
        monkeypatch.setattr(saved_evidence, "BOOT_ID", str(tmp_path / "hidden"))
    save(str(tmp_path), evidence(boot=saved_boot))
    back, _ = take(str(tmp_path), NOW, volatile=volatile)
    assert (back is not None) == kept, what


@pytest.mark.parametrize(("what", "taken_at", "counts"), [
    ("taken just before a quick restart", NOW - 1, True),
    ("taken before a restart slower than the probe's freshness", NOW - 12, True),
    ("at the grace's edge", NOW - 20, True),
    ("a supervisor that stayed down longer than the grace", NOW - 21, False),
    ("a time after the start (cannot be)", NOW + 1, False),
])
def test_a_saved_probe_counts_from_the_restart_within_the_grace(
        what: str, taken_at: float, counts: bool) -> None:
    probe = ProbeEvidence(True, "HTTP 200 in 3 ms", GEN, taken_at)
    got = carried_over(probe, NOW, 20.0)
    assert (got is not None) == counts, what
    if got is not None:
        assert got.taken_at == NOW and got.generation == GEN and got.ok
