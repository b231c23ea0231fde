"""What the supervisor tells the journal (health/events.py): which events one judgement
yields, with which fields, and the native protocol they travel in (supervisor/journal.py).
That journald files them so that `journalctl REPLICA=... MESSAGE_ID=...` and `-x` find
them is the booted tier's; that the catalog explains each kind is below, with journalctl
itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from llmgw_systemd.health.drain import CUT_SHORT, FINISHED, STARTED, DrainEvent, DrainProgress
from llmgw_systemd.health.events import (
    DRAIN_CUT_SHORT,
    DRAIN_FINISHED,
    DRAIN_STARTED,
    GROUP_RESTART,
    KINDS,
    REPORT_IGNORED,
    STALL_RESTART,
    STATE_CHANGED,
    ignored_event,
    replica_events,
)
from llmgw_systemd.health.judge import DEATH, STALL, Memory, RestartShard, Verdict
from llmgw_systemd.health.rules import Health
from llmgw_systemd.supervisor.journal import Journal, Lines, encode, under_journald

ROOT = Path(__file__).resolve().parents[1]
CATALOG = ROOT / "packaging" / "journal" / "llmgw-systemd.catalog"

NOTE = "r: a rank died (rank 1 on b: failed); restarting this node's shard: group restart 1 of 6"


def verdict(state: str = "ready", reason: str = "all ranks ready", *,
            restarts: tuple[float, ...] = (), cause: str | None = None,
            notes: tuple[str, ...] = (), drain: DrainProgress | None = None) -> Verdict:
    actions = (RestartShard("r", "rank 1 died", cause),) if cause is not None else ()
    return Verdict(Memory(restarts=restarts), Health(state, reason), (), (),  # type: ignore[arg-type]
                   actions=actions, notes=notes, drain=drain)


READY = verdict(restarts=(1.0,))
DEGRADED = verdict("degraded", "rank 1 on b: failed")


@pytest.mark.parametrize(("before", "after", "drains", "kinds"), [
    (None, READY, (), [STATE_CHANGED]),  # first judgement: its state is news
    (READY, READY, (), []),  # nothing changed: nothing said
    (READY, DEGRADED, (), [STATE_CHANGED]),
    # a group restart decided here: the restart, the note its message
    (DEGRADED, verdict("degraded", "restarting", restarts=(5.0,), cause=DEATH, notes=(NOTE,)),
     (), [GROUP_RESTART]),
    # decided at the first look that saw the death: the new state, then the restart
    (READY, verdict("failed", "restarting", restarts=(1.0, 5.0), cause=DEATH, notes=(NOTE,)),
     (), [STATE_CHANGED, GROUP_RESTART]),
    # this node's shard had restarted already: counted, no action, still an event
    (DEGRADED, verdict("degraded", "rank 1 on b: failed", restarts=(5.0,), notes=(NOTE,)),
     (), [GROUP_RESTART]),
    (verdict("failed", "stalled"), verdict("failed", "stalled", restarts=(9.0,), cause=STALL,
                                           notes=("r: this rank stalled",)),
     (), [STALL_RESTART]),
    (READY, verdict("draining", "planned stop"), (DrainEvent(STARTED),),
     [STATE_CHANGED, DRAIN_STARTED]),
    (verdict("draining", "planned stop"),
     verdict("drained", "nothing in flight", drain=DrainProgress("drained", "nothing left")),
     (DrainEvent(FINISHED, 3.5),), [STATE_CHANGED, DRAIN_FINISHED]),
    (verdict("draining", "planned stop"),
     verdict("draining", "planned stop", drain=DrainProgress("drained", "timeout", True, 2)),
     (DrainEvent(CUT_SHORT, 30.0, 2),), [DRAIN_CUT_SHORT]),
])
def test_one_judgement_yields_its_events(before: Verdict | None, after: Verdict,
                                         drains: tuple[DrainEvent, ...],
                                         kinds: list[str]) -> None:
    events = replica_events("r", 0, "a", before, after, drains)
    assert [e.kind for e in events] == kinds
    for event in events:
        fields = dict(event.fields())
        assert fields["REPLICA"] == "r" and fields["NODE"] == "a" and fields["RANK"] == "0"
        assert fields["MESSAGE_ID"] == KINDS[event.kind][0]
        assert fields["STATE"] == after.health.state
        assert fields["MESSAGE"].startswith("r: ")
    restart = [e for e in events if e.kind in (GROUP_RESTART, STALL_RESTART)]
    if restart:
        assert restart[0].message == "; ".join(after.notes)


def test_an_ignored_report_names_the_peer_it_came_from() -> None:
    event = ignored_event("r", "mallory", "mallory reported rank 1 of r as node 'b'")
    fields = dict(event.fields())
    assert event.kind == REPORT_IGNORED and fields["NODE"] == "mallory"
    assert "RANK" not in fields and "ignored a report" in fields["MESSAGE"]


def test_message_ids_are_distinct_128_bit_ids() -> None:
    ids = [i for i, _ in KINDS.values()]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 and int(i, 16) >= 0 and i == i.lower() for i in ids)


def test_the_native_protocol() -> None:
    datagram = encode([("MESSAGE", "one line"), ("REASON", "two\nlines")])
    assert datagram == (b"MESSAGE=one line\nREASON\n" + struct.pack("<Q", 9)
                        + b"two\nlines\n")


def test_events_go_to_the_socket_only_when_stderr_is_the_journal(tmp_path: Path) -> None:
    """A datagram socket standing in for journald's (the real one is the booted tier's)."""
    path = str(tmp_path / "socket")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)
    receiver.settimeout(5)
    lines: list[str] = []
    st = os.fstat(2)
    stream = {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    assert under_journald(stream) and not under_journald({})
    assert not under_journald({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"})
    event = replica_events("r", 0, "a", None, READY, ())[0]
    journal = Journal(lines.append, env=stream, path=path)
    try:
        assert journal.native
        journal.send(event)
        got = receiver.recv(65536)
    finally:
        journal.close()
        receiver.close()
    assert b"MESSAGE_ID=" + KINDS[STATE_CHANGED][0].encode() + b"\n" in got
    assert b"REPLICA=r\n" in got and b"SYSLOG_IDENTIFIER=llmgw-supervisor\n" in got
    assert lines == []
    plain = Journal(lines.append, env={}, path=path)  # stderr elsewhere: the line
    plain.send(event)
    assert lines == [event.message] and not plain.native


def test_a_stopped_gone_or_flooded_journald_never_blocks_and_loses_no_line(
        tmp_path: Path) -> None:
    """journald stopped (its queue full: nobody reads), gone (its socket unbound) and a
    record larger than a datagram may be: every send returns at once, and what the
    socket did not take is the event's line instead (docs/monitoring.md, "Journal events")."""
    path = str(tmp_path / "socket")
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(path)  # bound, never read: a stopped journald
    lines: list[str] = []
    st = os.fstat(2)
    journal = Journal(lines.append, env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"},
                      path=path)
    events = [replica_events(f"r{i}", 0, "a", None, READY, ())[0] for i in range(200)]

    def send_all() -> None:
        for event in events:
            journal.send(event)

    sent = threading.Thread(target=send_all, daemon=True)
    try:
        sent.start()
        sent.join(60)  # a bound for a hang, not a timing: a blocking send never returns
        assert not sent.is_alive(), "a send blocked on a journald that does not read"
        queued = []
        receiver.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                queued.append(receiver.recv(65536))
        # the queue took some (net.unix.max_dgram_qlen), the rest are lines, in order
        assert 0 < len(queued) < len(events)
        assert lines == [e.message for e in events[len(queued):]]
        lines.clear()
        huge = replace(events[0], reason="x" * (4 << 20))  # over any socket's send size
        journal.send(huge)
        assert lines == [huge.message]
        lines.clear()
        receiver.close()
        os.unlink(path)  # journald gone (restarting): its socket is not there
        journal.send(events[0])
        assert lines == [events[0].message]
    finally:
        journal.close()
        receiver.close()


def test_lines_to_a_journal_that_does_not_read_never_block_and_say_what_was_left_out(
        ) -> None:
    """stderr a stream socket whose reader stopped (a stopped journald): every line
    returns at once, what waits is bounded, and when the reader reads again it gets the
    lines in order up to where they were left out, then how many were left out."""
    ours, journald = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    lines = Lines(ours.fileno(), limit=4096)
    said = [f"line {i:05d} " + "x" * 90 for i in range(20000)]  # 2 MB: over any buffer

    def say_all() -> None:
        for line in said:
            lines.write(line)

    try:
        writer = threading.Thread(target=say_all, daemon=True)
        writer.start()
        writer.join(60)  # a bound for a hang, not a timing: a blocking write never returns
        assert not writer.is_alive(), "a line blocked on a journal that does not read"
        assert 0 < lines.pending <= 4096
        got = bytearray()
        journald.setblocking(False)
        for _ in range(1000):  # read, flush, read, until the left-out count came out
            with contextlib.suppress(BlockingIOError):
                while chunk := journald.recv(1 << 16):
                    got += chunk
            if b"left out" in got:
                break
            lines.flush()
        lines.write("after")
        lines.flush()
        with contextlib.suppress(BlockingIOError):
            while chunk := journald.recv(1 << 16):
                got += chunk
    finally:
        ours.close()
        journald.close()
    text = got.decode().splitlines()
    kept = text.index(next(t for t in text if "left out" in t))
    assert 0 < kept < len(said) and text[:kept] == said[:kept]
    assert text[kept] == (f"llmgw-supervisor: {len(said) - kept} lines left out: stderr "
                          "(the journal) was not taking them")
    assert text[kept + 1:] == ["after"]


def test_the_catalog_explains_every_kind(tmp_path: Path) -> None:
    """journalctl builds its catalog database from the file as the packages install it,
    and lists an entry for every MESSAGE_ID."""
    journalctl = shutil.which("journalctl")
    assert journalctl, "journalctl not found (systemd)"
    folder = tmp_path / "usr" / "lib" / "systemd" / "catalog"
    folder.mkdir(parents=True)
    shutil.copy(CATALOG, folder / CATALOG.name)
    built = subprocess.run([journalctl, f"--root={tmp_path}", "--update-catalog"],
                           capture_output=True, text=True, timeout=60, check=False)
    assert built.returncode == 0, built.stderr
    listed = subprocess.run([journalctl, f"--root={tmp_path}", "--list-catalog"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert listed.returncode == 0, listed.stderr
    ids = {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
    assert ids == {i for i, _ in KINDS.values()}, listed.stdout
