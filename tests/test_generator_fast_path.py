"""The generator's decisions, as tables: where it logs, which node it is, which
replicas an admin's units override, where it reads and caches, and which spec files
lose their replicas (collect_spec)."""

from __future__ import annotations

import pytest

from llmgw_systemd.errors import SpecError
from llmgw_systemd.generator import fast_path as g
from llmgw_systemd.spec.document import Document, parse
from llmgw_systemd.spec.names import is_node_name
from llmgw_systemd.spec.replicas import collect_spec


@pytest.mark.parametrize(("scope", "stream", "stderr", "tty", "target"), [
    ("system", "8:42", (8, 42), False, "journal"),   # stderr is the journal's stream
    ("system", "8:42", (8, 43), False, "kmsg"),      # inherited, but stderr moved on
    ("system", None, (1, 2), False, "kmsg"),         # early boot: no journal yet
    ("system", None, (1, 2), True, "stderr"),        # run by hand in a terminal
    ("system", "junk", (1, 2), False, "kmsg"),
    ("user", None, (1, 2), False, "stderr"),         # a user manager's own stderr
    ("user", "3:4", (3, 4), False, "journal"),
    ("system", "8:42", None, False, "kmsg"),         # no stderr at all
])
def test_log_target(scope: str, stream: str | None, stderr: tuple[int, int] | None,
                    tty: bool, target: str) -> None:
    assert g.log_target(scope, stream, stderr, tty) == target


@pytest.mark.parametrize(("scope", "stream", "kmsg", "socket", "target"), [
    # a container: its /dev/kmsg leads nowhere
    ("system", None, False, True, "journal-socket"),  # daemon-reload: journald listens
    ("system", None, False, False, "deferred"),       # boot: no journald yet
    ("system", "8:42", False, False, "journal"),      # stderr is the journal after all
    ("user", None, False, True, "stderr"),            # a user manager's own stderr
    ("system", None, True, True, "kmsg"),             # a host: journald reads kmsg
])
def test_log_target_in_a_container(scope: str, stream: str | None, kmsg: bool, socket: bool,
                                   target: str) -> None:
    assert g.log_target(scope, stream, (8, 42), False, kmsg_is_kernel=kmsg,
                        journal_socket=socket) == target


@pytest.mark.parametrize(("virtualization", "device", "kernel"), [
    ("", (1, 11), True), ("vm:kvm", (1, 11), True), ("", (0, 0), True),  # a stand-in file
    ("container:systemd-nspawn", (1, 11), False), ("", (1, 3), False), ("", None, False),
])
def test_kmsg_is_kernel(virtualization: str, device: tuple[int, int] | None,
                        kernel: bool) -> None:
    assert g.kmsg_is_kernel(virtualization, device) is kernel


def test_journal_socket_datagrams_are_one_field_each() -> None:
    lines = g.log_lines("journal-socket", ((g.ERROR, "/etc/x\ny.yaml:2: bad"),), "prog")
    assert lines == ("PRIORITY=3\nSYSLOG_IDENTIFIER=prog\nMESSAGE=prog: /etc/x\\x0ay.yaml:2: "
                     "bad\n",)


def test_the_messages_unit_prints_the_deferred_file_under_the_generators_name() -> None:
    name, text = g.messages_unit("prog", "# header")
    assert name == g.MESSAGES_UNIT and not name.endswith(".target")
    assert f"ExecStart=/usr/bin/cat {g.MESSAGES_FILE}\n" in text
    assert "SyslogIdentifier=prog\n" in text and text.startswith("# header\n[Unit]\n")
    assert g.log_lines("deferred", ((g.ERROR, "bad"),), "prog") == ("<3>prog: bad",)


@pytest.mark.parametrize(("target", "lines"), [
    ("stderr", ("prog: error: bad", "prog: notice: fyi")),
    ("journal", ("<3>prog: bad", "<5>prog: fyi")),
    ("kmsg", ("<3>prog: bad", "<5>prog: fyi")),
])
def test_log_lines(target: str, lines: tuple[str, ...]) -> None:
    assert g.log_lines(target, ((g.ERROR, "bad"), (g.NOTICE, "fyi")), "prog") == lines


def test_kmsg_lines_are_bounded_in_number_and_length() -> None:
    many = tuple((g.ERROR, f"e{i} " + "x" * 2000) for i in range(20))
    lines = g.log_lines("kmsg", many, "prog")
    assert len(lines) == g.KMSG_MAX_LINES
    assert all(len(line.encode()) < 1000 for line in lines)
    assert lines[-1].startswith("<3>prog: and 13 more;")
    assert g.log_lines("kmsg", many[:8], "prog")[-1].startswith("<3>prog: e7 ")


@pytest.mark.parametrize(("text", "result"), [
    ("gpu-a1\n", ("gpu-a1", None)),
    ("  gpu-a1  # this box\n\n", ("gpu-a1", None)),
    ("# provisioned 2026-12-01\ngpu-a1\n", ("gpu-a1", None)),
    ("", (None, "F: expected one node name; got 0")),
    ("a\nb\nc\nd\n", (None, "F: expected one node name; got 4 (a, b, c, ...)")),
    ("a b\n", (None, "F: expected a node's host name (letters, digits, '.', '_', '-'); got "
                     "'a b'")),
    ("-a\n", (None, "F: expected a node's host name (letters, digits, '.', '_', '-'); got "
                    "'-a'")),
])
def test_node_from_file(text: str, result: tuple[str | None, str | None]) -> None:
    assert g.node_from_file(text, "F") == result


@pytest.mark.parametrize(("name", "ok"), [
    ("n1", True), ("gpu-a1.example.com", True), ("a_b", True), ("a", True), ("", False),
    ("a.", False), ("_a", False), ("a/b", False), ("ä", False), ("a" * 253, True),
    ("a" * 254, False),
])
def test_one_node_name_rule_for_the_node_file_and_the_spec(name: str, ok: bool) -> None:
    """spec/names.py's rule, which the node file (fast path) and the spec both apply."""
    from llmgw_systemd.spec.replicas import build_spec

    assert is_node_name(name) is ok
    text = ("replicas:\n  - {name: r, engine: command, serving_rank: null,\n"
            f"     nodes: [{{name: '{name}', address: 10.0.0.1}}],\n"
            "     ranks: [{commands: [{argv: [/bin/true]}]}]}\n")
    try:
        build_spec([parse(text.encode(), "f.yaml")])
        accepted = True
    except SpecError as exc:
        assert "nodes[0].name" in str(exc), exc
        accepted = False
    assert accepted is ok
    assert (g.node_from_file(name, "F")[0] == name) is ok


@pytest.mark.parametrize(("scope", "env", "expected"), [
    ("system", {}, ("/etc/llmgw", "/run/llmgw-systemd/generator.cache",
                    ("/etc/systemd/system", "/run/systemd/system"))),
    ("user", {"XDG_RUNTIME_DIR": "/run/user/7"}, (
        "/home/u/.config/llmgw", "/run/user/7/llmgw-systemd/generator.cache",
        ("/home/u/.config/systemd/user", "/etc/xdg/systemd/user", "/etc/systemd/user",
         "/run/user/7/systemd/user", "/run/systemd/user"))),
    ("user", {"XDG_CONFIG_HOME": "/c", "XDG_CONFIG_DIRS": "/x:relative:/y"}, (
        "/c/llmgw", None, ("/c/systemd/user", "/x/systemd/user", "/y/systemd/user",
                           "/etc/systemd/user", "/run/systemd/user"))),
    ("user", {"XDG_CONFIG_HOME": "relative"}, (  # the XDG rule: relative paths are ignored
        "/home/u/.config/llmgw", None, ("/home/u/.config/systemd/user",
                                        "/etc/xdg/systemd/user", "/etc/systemd/user",
                                        "/run/systemd/user"))),
])
def test_where_it_reads_caches_and_looks_for_admin_units(
        scope: str, env: dict[str, str],
        expected: tuple[str, str | None, tuple[str, ...]]) -> None:
    assert (g.llmgw_dir(scope, env, "/home/u"), g.cache_file(scope, env),
            g.override_dirs(scope, env, "/home/u")) == expected


def _replica(name: str, enable: bool = False) -> g.Replica:
    return (name, f"llmgw-{name}.target", "default.target", enable,
            ((f"llmgw-{name}-engine.service", "x"), (f"llmgw-{name}.target", "y")))


def test_an_admins_unit_overrides_its_whole_replica() -> None:
    output: g.Output = ((_replica("a", True), _replica("b", True)), ((g.ERROR, "earlier"),))
    kept = g.without_overridden(output, {"llmgw-a-engine.service": "/etc/x/llmgw-a-engine."
                                         "service"})
    assert [r[0] for r in kept[0]] == ["b"]
    assert kept[1][0] == (g.ERROR, "earlier")
    assert kept[1][1][1].startswith("replica a skipped: /etc/x/llmgw-a-engine.service takes "
                                    "precedence")
    assert g.without_overridden(output, {}) == output
    assert g.wants_links(kept) == (("default.target.wants", "llmgw-b.target"),)


ONE = """\
replicas:
  - name: {name}
    engine: sglang
    model: /m
    port: {port}
    nodes: [{{name: n1, address: {address}}}]
"""


def _doc(file: str, name: str, port: int = 30000, address: str = "10.0.0.1") -> Document:
    return parse(ONE.format(name=name, port=port, address=address).encode(), file)


@pytest.mark.parametrize(("files", "kept", "errors"), [
    # (file, replica name, port, address) per file; kept replicas; (file, line) per error
    ([("a", "x", 1, "10.0.0.1"), ("b", "y", 2, "10.0.0.1")], ["x", "y"], []),
    ([("a", "x", 1, "10.0.0.1"), ("b", "x", 2, "10.0.0.1"), ("c", "z", 3, "10.0.0.1")],
     ["z"], [("a", 2), ("b", 2)]),
    ([("a", "x", 1, "10.0.0.1"), ("b", "y", 1, "10.0.0.1")], [], [("a", 5), ("b", 5)]),
    ([("a", "x", 1, "10.0.0.1"), ("b", "y", 2, "10.0.0.2")], [], [("a", 6), ("b", 6)]),
    # three files on one port: each clash named; the first file is named twice
    ([("a", "x", 1, "10.0.0.1"), ("b", "y", 1, "10.0.0.1"), ("c", "z", 1, "10.0.0.1")],
     [], [("a", 5), ("a", 5), ("b", 5), ("c", 5)]),
])
def test_collect_spec_drops_the_files_at_fault(files: list[tuple[str, str, int, str]],
                                               kept: list[str],
                                               errors: list[tuple[str, int]]) -> None:
    docs = [_doc(f, n, p, a) for f, n, p, a in files]
    spec, found = collect_spec(docs)
    assert [r.name for r in spec.replicas] == kept
    assert sorted((e.file, e.line) for e in found) == sorted(errors)
    for error in found:  # a conflict names both places
        assert any(f" {other}:" in str(error) for other in "abc" if other != error.file)


def test_collect_spec_keeps_an_unreadable_file_as_its_error() -> None:
    unreadable = SpecError("u", None, "", "cannot read the file")
    spec, found = collect_spec([unreadable, _doc("a", "x")])
    assert [r.name for r in spec.replicas] == ["x"]
    assert found == (unreadable,)


def test_keep_last_good_carries_a_broken_files_replicas_over() -> None:
    from llmgw_systemd.spec.replicas import keep_last_good

    before, _ = collect_spec([_doc("a", "x", 1), _doc("b", "y", 2)])
    broken = SpecError("b", 3, "replicas[0].port", "expected a TCP port")
    now, errors = collect_spec([_doc("a", "x", 1), broken])
    assert [r.name for r in keep_last_good(now, errors, before).replicas] == ["x", "y"]
    assert keep_last_good(now, errors, None) == now  # at start: nothing to keep
    gone, none = collect_spec([_doc("a", "x", 1)])  # b removed, not broken: y goes
    assert [r.name for r in keep_last_good(gone, none, before).replicas] == ["x"]
    # y moved to a good file c while b broke: the new one is watched, once
    moved, errors = collect_spec([_doc("a", "x", 1), broken, _doc("c", "y", 2)])
    assert [r.source for r in keep_last_good(moved, errors, before).replicas] == ["a", "c"]
