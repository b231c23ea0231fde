"""Command-line entry points. The only module that imports click, and the only place
that turns errors into exit statuses: 0 done, 2 bad input, 1 anything else."""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from llmgw_systemd import __version__
from llmgw_systemd.errors import BadInput, LlmgwError, NoShard, UsageError
from llmgw_systemd.spec.endpoint import SUPERVISOR_LOCAL, SUPERVISOR_PORT
from llmgw_systemd.spec.files import read_documents
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.spec.names import DIGEST_SHOWN
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.supervisor.config import SupervisorConfig
from llmgw_systemd.supervisor.drain_requests import DEFAULT_STATE_DIR
from llmgw_systemd.units.install import (
    CREATE,
    KEEP,
    REMOVE,
    UPDATE,
    Survey,
    apply,
    survey,
    unified_diff,
)
from llmgw_systemd.units.plan import Manager, ShardPlan, plan_node
from llmgw_systemd.units.render import render_shards

if TYPE_CHECKING:
    import ssl

    from llmgw_systemd.apply.rollout import SystemctlShow, Versions
    from llmgw_systemd.gather.shard_reader import ShardStatus
    from llmgw_systemd.health.versions import RankVersion

SYSTEM_UNIT_DIR = "/etc/systemd/system"
WAIT_FOR_PORT = "llmgw-wait-for-port"


def _default_user_dir() -> str:
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
    return os.path.join(config, "systemd", "user")


def _find_helper() -> str:
    """llmgw-wait-for-port beside this very llmgw-render (same install), else on PATH."""
    beside = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), WAIT_FOR_PORT)
    if os.access(beside, os.X_OK):
        return beside
    import shutil  # only when not installed side by side

    found = shutil.which(WAIT_FOR_PORT)
    if found:
        return os.path.abspath(found)
    raise LlmgwError(f"cannot find {WAIT_FOR_PORT} beside {sys.argv[0]} or on PATH; "
                     "is llmgw-systemd installed?")


def _print_version(ctx: click.Context, value: bool) -> None:
    # click.version_option would import locale (~1.5 ms) on every run
    if value:
        click.echo(f"{ctx.find_root().info_name or 'llmgw-systemd'} {__version__}")
        ctx.exit()


def _fail(prog: str, exc: LlmgwError) -> NoReturn:
    click.echo(f"{prog}: error: {exc}", err=True)
    sys.exit(2 if isinstance(exc, BadInput) else 1)


# Options every command shares, defined once.
VERSION_OPTION = click.option("--version", is_flag=True, is_eager=True, expose_value=False,
                              callback=lambda ctx, _param, value: _print_version(ctx, value),
                              help="Show the version and exit.")
NODE_OPTION = click.option("--node", metavar="NAME",
                           help="This node's name, as the spec's nodes[].name says it "
                                "[default: this machine's host name].")
USER_OPTION = click.option("--user", "user_manager", is_flag=True,
                           help="Work with the per-user manager (systemctl --user) "
                                "instead of the system one, as the tests do.")


F = TypeVar("F", bound=Callable[..., Any])


def tls_options(when: str, defaults: str) -> Callable[[F], F]:
    """--tls-cert, --tls-key, --tls-ca: the same three files wherever a command speaks
    TLS to the supervisors; only where their defaults come from differs."""
    def decorate(function: F) -> F:
        for flag, what in (("--tls-ca", "the cluster CA's certificate (PEM) [default for "
                                        f"all three: {defaults}; none: plain HTTP]"),
                           ("--tls-key", "this node's private key (PEM)"),
                           ("--tls-cert", "this node's certificate (PEM)")):
            text = f"{when}{what}" if when else what[0].upper() + what[1:]
            function = click.option(flag, metavar="FILE", help=f"{text}.")(function)
        return function
    return decorate


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("specs", nargs=-1, required=True, metavar="SPEC...")
@NODE_OPTION
@click.option("--output", metavar="DIR",
              help=f"Unit directory [default: {SYSTEM_UNIT_DIR}, or the user unit directory "
                   "with --user].")
@click.option("--dry-run", is_flag=True,
              help="Print what would be created, changed and removed (and, with --apply, "
                   "restarted, started and stopped); change nothing.")
@USER_OPTION
@click.option("--allow-empty", is_flag=True,
              help="Accept a node that has no shard (its old units are then removed).")
@click.option("--apply", "apply_", is_flag=True,
              help="Then make systemd follow: stop removed replicas before their files go, "
                   "daemon-reload, restart running replicas whose units changed, start new "
                   "ones that are enabled; leave the rest alone.")
@click.option("--start", "start_new", is_flag=True,
              help="With --apply: start new replicas even when their spec does not say "
                   "enable: true.")
@click.option("--no-wait", is_flag=True,
              help="With --apply: the behaviour before rolling: restart every changed "
                   "replica at once, even one whose other nodes have not applied, and wait "
                   "for none to come back.")
@VERSION_OPTION
def render_command(specs: tuple[str, ...], node: str | None, output: str | None,
                   dry_run: bool, user_manager: bool, allow_empty: bool, apply_: bool,
                   start_new: bool, no_wait: bool) -> None:
    """Render replica SPEC files (or folders of *.yaml) into systemd units for one node."""
    try:
        if start_new and not apply_:
            raise UsageError("--start", "starts new replicas as part of --apply; add --apply")
        if no_wait and not apply_:
            raise UsageError("--no-wait", "is part of --apply; add --apply")
        node_name = node if node is not None else os.uname().nodename  # = gethostname()
        if not node_name:
            raise UsageError("--node", "this machine has no host name; pass --node NAME")
        directory = output or (_default_user_dir() if user_manager else SYSTEM_UNIT_DIR)
        spec = build_spec(read_documents(specs))
        manager = Manager(user=user_manager, wait_for_port=_find_helper())
        try:
            plans = plan_node(spec, node_name, manager, allow_empty=allow_empty)
        except NoShard as exc:
            raise UsageError("--node", f"{exc}; pass --node NAME, or --allow-empty to remove "
                             "this node's units") from None
        rendered = render_shards(plans)
        for plan in plans:
            for note in plan.notes:
                click.echo(f"note: {note}", err=True)
        if apply_:
            _check_apply_target(directory, user_manager)
            _render_and_apply(directory, rendered, plans, user_manager, dry_run=dry_run,
                              start_new=start_new, generator_too=output is None,
                              replicas={r.name: r for r in spec.replicas}, wait=not no_wait)
            return
        result = survey(directory, rendered)
        notes = (*result.notes, *(_generator_notes(rendered, user_manager)
                                  if output is None else ()))
        for note in notes:
            click.echo(f"note: {note}", err=True)
        if dry_run:
            click.echo(unified_diff(result.changes, directory), nl=False)
            click.echo(_summary(result, directory, would=True))
            return
        apply(directory, result.changes)
        verbs = {CREATE: "created", UPDATE: "updated", REMOVE: "removed"}
        lines = [f"{verbs[c.action]} {os.path.join(directory, c.name)}"
                 for c in result.changes if c.action != KEEP]
        click.echo("\n".join([*lines, _summary(result, directory, would=False)]))
        if result.dirty:
            flag = " --user" if user_manager else ""
            click.echo(f"next: systemctl{flag} daemon-reload, then restart what changed "
                       f"(or run again with --apply)")
    except LlmgwError as exc:
        _fail("llmgw-render", exc)


def _check_apply_target(directory: str, user_manager: bool) -> None:
    """--apply writes where the manager reads units, or it would restart the old ones."""
    from llmgw_systemd.apply.systemctl import unit_path

    searched = unit_path(user_manager)
    if os.path.realpath(directory) not in {os.path.realpath(p) for p in searched}:
        raise UsageError("--output", f"--apply needs a folder the "
                         f"{'user' if user_manager else 'system'} manager reads units from; "
                         f"'{directory}' is not one of {', '.join(searched)}")


def _render_and_apply(directory: str, rendered: dict[str, str], plans: tuple[ShardPlan, ...],
                      user_manager: bool, *, dry_run: bool, start_new: bool,
                      generator_too: bool, replicas: dict[str, Replica], wait: bool) -> None:
    """Write and make systemd follow, as rollout.decide says, under the directory's
    lock so two applies never interleave. Stops at the first failing step."""
    from llmgw_systemd.apply.rollout import decide, group_files
    from llmgw_systemd.apply.systemctl import systemctl, unit_states
    from llmgw_systemd.units.install import apply_locked, locked

    with locked(directory):
        result = survey(directory, rendered)
        for note in (*result.notes, *(_generator_notes(rendered, user_manager)
                                      if generator_too else ())):
            click.echo(f"note: {note}", err=True)
        groups = group_files([(c.name, c.action, c.old) for c in result.changes], plans)
        states = unit_states(user_manager, [u for g in groups for u in g.existing])
        versions = _versions(plans, replicas, states)
        rollout = decide(groups, states, files_dirty=result.dirty, start_new=start_new,
                         versions=versions, wait=wait)
        if dry_run:
            click.echo(unified_diff(result.changes, directory), nl=False)
            click.echo("\n".join(o.line(dry_run=True) for o in rollout.outcomes))
            return
        done: list[str] = []
        for step in rollout.steps:
            try:
                if step.verb == "write":
                    apply_locked(directory, result.changes)
                elif step.verb == "wait":
                    plan = next(p for p in plans if p.replica == step.replica)
                    _wait_routable(step.replica, step.digest, step.within, user_manager,
                                   (plan.target.name, *(s.name for s in plan.services)),
                                   notice=step.notice)
                else:
                    systemctl(user_manager, step.verb,
                              *(("--", *step.units) if step.units else ()))
            except LlmgwError as exc:
                already = f" (done before it: {'; '.join(done)})" if done else ""
                raise LlmgwError(f"{exc}{already}; nothing after it was done") from None
            done.append(f"wrote {directory}" if step.verb == "write" else
                        f"{step.replica} routable again" if step.verb == "wait" else
                        " ".join((step.verb, *step.units)))
    click.echo("\n".join(o.line(dry_run=False) for o in rollout.outcomes))


def _versions(plans: Sequence[ShardPlan], replicas: dict[str, Replica],
              states: dict[str, SystemctlShow]) -> dict[str, Versions]:
    """Per replica of this node, its spec versions as an apply can know them: what its
    engine here started with (its own environment), and which other ranks' units do not
    carry the new version yet (this node's supervisor's view)."""
    from llmgw_systemd.apply.rollout import Versions, behind_ranks
    from llmgw_systemd.apply.systemctl import running_digest
    from llmgw_systemd.errors import PeerError
    from llmgw_systemd.gather.peer_client import fetch_replica
    from llmgw_systemd.units.plan import ready_within

    out = {}
    for plan in plans:
        engine = states.get(plan.services[-1].name)
        running = running_digest(engine.main_pid) if engine is not None else ""
        behind: tuple[str, ...] | None = ()
        why = ""
        if plan.ranks > 1:
            try:
                view = fetch_replica(SUPERVISOR_LOCAL.host, SUPERVISOR_LOCAL.port,
                                     plan.replica, deadline=SUPERVISOR_ASK_TIMEOUT)
            except PeerError as exc:
                behind, why = None, f"this node's supervisor: {exc}"
            else:
                behind, why = behind_ranks([(r.rank, r.node, r.loaded_digest)
                                            for r in view.ranks if r.rank != plan.rank],
                                           plan.spec_digest)
        replica = replicas[plan.replica]
        out[plan.replica] = Versions(plan.spec_digest, plan.ranks, running, behind, why,
                                     ready_within(replica), replica.drain.delay)
    return out


def _wait_routable(name: str, digest: str, within: int, user_manager: bool,
                   units: tuple[str, ...], *, notice: int) -> None:
    """Until the replica is routable again on its supervisor's cluster-wide view, every
    rank running `digest`, and then `notice` seconds more, so that the gateways have it
    back in rotation before anything else goes out; without a supervisor, until its
    units here are active."""
    import time

    from llmgw_systemd.apply.rollout import not_back_yet
    from llmgw_systemd.apply.systemctl import unit_states
    from llmgw_systemd.errors import NotBackError, PeerError
    from llmgw_systemd.gather.peer_client import fetch_replica

    click.echo(f"replica {name}: waiting up to {within} s for it to be routable again",
               err=True)
    started = time.monotonic()
    ends = started + within
    last = "no answer yet"
    supervised = True
    while True:
        if supervised:
            try:
                view = fetch_replica(SUPERVISOR_LOCAL.host, SUPERVISOR_LOCAL.port, name,
                                     deadline=SUPERVISOR_ASK_TIMEOUT)
            except PeerError as exc:
                supervised = False
                click.echo(f"note: cannot wait for replica {name} to be routable: this "
                           f"node's supervisor does not say ({exc}); waiting for its units "
                           "to be active instead", err=True)
                continue
            last = not_back_yet(view.state, view.reason, view.routable,
                                [(r.rank, r.node, r.running_digest) for r in view.ranks],
                                digest)
            if not last:
                break
        else:
            states = unit_states(user_manager, list(units))
            down = [u for u in units if states.get(u) is None or states[u].active != "active"]
            if not down:
                break
            last = f"not active: {', '.join(down)}"
        if time.monotonic() >= ends:
            raise NotBackError(f"replica {name} was not routable again within {within} s "
                               f"of its restart ({last})")
        time.sleep(WAIT_POLL)
    if not supervised:
        click.echo(f"replica {name}: its units here are active after "
                   f"{time.monotonic() - started:.0f} s", err=True)
        return
    click.echo(f"replica {name}: routable again after {time.monotonic() - started:.0f} s; "
               f"{notice} s more for the gateways to take it back into rotation", err=True)
    time.sleep(notice)


def _generator_notes(rendered: dict[str, str], user_manager: bool) -> list[str]:
    """Replicas the generator also makes units for: ours take precedence (systemd's
    search order), and the generator skips them from the next daemon-reload on."""
    from llmgw_systemd.units.header import is_generated

    if user_manager:
        runtime = os.environ.get("XDG_RUNTIME_DIR", "")
        if not runtime.startswith("/"):
            return []
        folder = os.path.join(runtime, "systemd", "generator")
    else:
        folder = "/run/systemd/generator"
    notes = []
    for name in sorted(n for n in rendered if n.endswith(".target")):
        try:
            with open(os.path.join(folder, name), encoding="utf-8", errors="replace") as f:
                head = f.read(4096)
        except OSError:
            continue
        if is_generated(head):
            notes.append(f"{name} is also made by llmgw-systemd-generator from its spec "
                         f"folder; the units written here take precedence, and the generator "
                         "skips this replica from the next daemon-reload on. Keep each "
                         "replica in one place (docs/generator.md).")
    return notes


def _summary(result: Survey, directory: str, *, would: bool) -> str:
    if not result.dirty:
        return f"nothing to do: {result.count(KEEP)} units in {directory} are up to date"
    prefix = "would have: " if would else ""
    return (f"{prefix}{result.count(CREATE)} created, {result.count(UPDATE)} updated, "
            f"{result.count(REMOVE)} removed, {result.count(KEEP)} unchanged in {directory}")


def render_main() -> None:
    _run(cli=render_command, prog="llmgw-render")


DEFAULT_SPECS = ("/etc/llmgw/replicas.d",)
SUPERVISOR_ASK_TIMEOUT = 3.0  # seconds for this node's supervisor to answer an apply
WAIT_POLL = 1.0  # seconds between looks while an apply waits for a replica
DEFAULT_TLS_DIR = "/etc/llmgw/tls"


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@VERSION_OPTION
def systemd_group() -> None:
    """Operate llmgw-systemd shards on this node."""


@systemd_group.command("status")
@click.argument("name", required=False)
@click.option("--spec", "specs", multiple=True, metavar="PATH",
              help=f"Spec file or folder (repeatable) [default: {DEFAULT_SPECS[0]}].")
@NODE_OPTION
@USER_OPTION
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--cluster", is_flag=True,
              help="Every rank of these replicas, the other nodes' as their own supervisors "
                   "report them.")
@click.option("--peer-port", type=click.IntRange(1, 65535), default=SUPERVISOR_PORT,
              show_default=True,
              metavar="PORT", help="With --cluster: the port the supervisors listen on.")
@click.option("--peer-timeout", type=click.FloatRange(0.1, 120), default=3.0,
              show_default=True, metavar="SECONDS",
              help="With --cluster: bound on each supervisor's answer.")
@tls_options("With --cluster: ", f"node.crt, node.key, ca.crt in {DEFAULT_TLS_DIR} when "
             "there")
def status_command(name: str | None, specs: tuple[str, ...], node: str | None,
                   user_manager: bool, as_json: bool, cluster: bool, peer_port: int,
                   peer_timeout: float, tls_cert: str | None, tls_key: str | None,
                   tls_ca: str | None) -> None:
    """Health of this node's shards, straight from systemd (no supervisor needed); with
    --cluster, of every rank of their replicas.

    Exit 0 when every shard (or rank) shown is ready, 3 when one is not, 2 on bad input,
    1 when systemd cannot be reached."""
    import json
    import time

    from llmgw_systemd.gather.probes import http_probe  # noqa: F401 - keeps the import error here, early
    from llmgw_systemd.gather.shard_reader import local_shards, probe_shard, read_status
    from llmgw_systemd.gather.systemd_bus import SystemdBus
    from llmgw_systemd.health.rules import READY

    try:
        spec = build_spec(read_documents(specs or DEFAULT_SPECS))
        node_name = node if node is not None else os.uname().nodename
        shards = [s for s in local_shards(spec, node_name)
                  if name is None or s.replica.name == name]
        if name is not None and not shards:
            raise UsageError("NAME", f"replica '{name}' has no shard on node '{node_name}'")
        tls = _cluster_tls(tls_cert, tls_key, tls_ca) if cluster else None
        bus = SystemdBus(user=user_manager)
        try:
            probes = {s.replica.name: probe_shard(s) for s in shards}
            # CLOCK_MONOTONIC, as systemd's timestamps (after the probes: they take time)
            statuses = read_status(bus, shards, probes, int(time.monotonic() * 1e6))
        finally:
            bus.close()
        versions = {s.replica: _local_version(s, shard.plan.services[-1].name)
                    for s, shard in zip(statuses, shards)}
        if cluster:
            _print_cluster([s.replica for s in shards], node_name, statuses, versions,
                           as_json, peer_port=peer_port, timeout=peer_timeout, tls=tls)
    except LlmgwError as exc:
        _fail("llmgw-systemd status", exc)
    if as_json:
        click.echo(json.dumps([{
            "replica": s.replica, "rank": s.rank, "ranks": s.ranks, "node": s.node,
            "state": s.health.state, "reason": s.health.reason,
            "spec": {"loaded": versions[s.replica].loaded,
                     "running": versions[s.replica].running},
            "units": {u.name: {"active": u.active_state, "sub": u.sub_state,
                               "result": u.result, "restarts": u.n_restarts}
                      for u in s.units}} for s in statuses], indent=2))
    else:
        _table([("REPLICA", "RANK", "NODE", "STATE", "REASON")] + [
            (s.replica, f"{s.rank}/{s.ranks}", s.node, s.health.state, s.health.reason)
            for s in statuses])
        for line in _drain_notes([s.replica for s in statuses], user_manager):
            click.echo(line)
        for replica, v in versions.items():
            if v.staged:
                click.echo(f"replica {replica}: staged on this node: its engine runs "
                           f"{v.running[:DIGEST_SHOWN]}, its units carry "
                           f"{v.loaded[:DIGEST_SHOWN]}; it restarts "
                           "once when the last of its nodes applies (--cluster: how many)")
    sys.exit(0 if all(s.health.state == READY for s in statuses) else 3)


def _local_version(status: ShardStatus, engine: str) -> RankVersion:
    """This node's rank's spec versions: what its engine unit carries, and what the
    engine process started with (its own environment)."""
    from llmgw_systemd.apply.systemctl import running_digest
    from llmgw_systemd.health.versions import RankVersion

    unit = next((u for u in status.units if u.name == engine), None)
    if unit is None:
        return RankVersion(status.rank, status.node)
    return RankVersion(status.rank, status.node, unit.spec_digest,
                       running_digest(unit.main_pid))


def _drain_notes(replicas: list[str], user_manager: bool) -> list[str]:
    """Who took which replica out of rotation on this node, and since when."""
    from llmgw_systemd.supervisor import drain_requests

    requests, _ = drain_requests.load(_default_state_dir(user_manager))
    return [f"drained on this node: {r.replica or 'every replica'} by {r.by} since {r.since}"
            + (f" ({r.reason})" if r.reason else "")
            + f"; llmgw-systemd resume {r.replica or '--node'} puts it back"
            for r in requests if r.replica is None or r.replica in replicas]


def _table(rows: Sequence[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell; the last one (a reason) left as it is."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1])


def _cluster_tls(cert: str | None, key: str | None, ca: str | None
                 ) -> ssl.SSLContext | None:
    from llmgw_systemd.errors import TlsError
    from llmgw_systemd.gather.tls import client_context, find_tls_files

    try:
        files = find_tls_files(cert, key, ca, credentials_dir=DEFAULT_TLS_DIR
                               if os.path.isdir(DEFAULT_TLS_DIR) else None)
        return client_context(files) if files is not None else None
    except (TlsError, OSError) as exc:
        raise UsageError("--tls-cert/--tls-key/--tls-ca", str(exc)) from None


def _print_cluster(replicas: list[Replica], node: str, statuses: list[ShardStatus],
                   versions: dict[str, RankVersion], as_json: bool, *, peer_port: int,
                   timeout: float, tls: ssl.SSLContext | None) -> NoReturn:
    """Ask every other node's supervisor once, all at once (gather/cluster.py), then one
    table."""
    import json

    from llmgw_systemd.gather.cluster import ask_peers
    from llmgw_systemd.health.cluster_view import all_ready, cluster_rows, staged_lines

    address = {n.name: n.address for r in replicas for n in r.nodes if n.name != node}
    views = ask_peers(address, peer_port, timeout, tls)
    local = {s.replica: (s.health.state, s.health.reason) for s in statuses}
    where = {peer: f"{addr}:{peer_port}" for peer, addr in address.items()}
    rows = cluster_rows(replicas, node, local, views, where)
    if as_json:
        click.echo(json.dumps([{"replica": r.replica, "rank": r.rank, "ranks": r.ranks,
                                "node": r.node, "state": r.state, "reason": r.reason,
                                "source": r.source} for r in rows], indent=2))
    else:
        _table([("REPLICA", "RANK", "NODE", "STATE", "SOURCE", "REASON")] + [
            (r.replica, f"{r.rank}/{r.ranks}", r.node, r.state, r.source, r.reason)
            for r in rows])
        for line in staged_lines(replicas, node, versions, views):
            click.echo(line)
    sys.exit(0 if all_ready(rows) else 3)


def _drain_targets(name: str | None, all_on_node: bool, specs: tuple[str, ...],
                   node: str | None) -> tuple[str, list[Replica]]:
    """This node's name and the replicas a drain or resume acts on (NAME, or every one
    with a shard here)."""
    from llmgw_systemd.gather.shard_reader import local_shards

    if (name is None) == (not all_on_node):
        raise UsageError("NAME", "name one replica, or pass --node for every replica with a "
                         "shard on this node")
    spec = build_spec(read_documents(specs or DEFAULT_SPECS))
    node_name = node if node is not None else os.uname().nodename
    shards = local_shards(spec, node_name)
    here = [s.replica for s in shards if name is None or s.replica.name == name]
    if name is not None and not here:
        known = ", ".join(s.replica.name for s in shards) or "none"
        raise UsageError("NAME", f"no replica '{name}' has a shard on node '{node_name}' "
                         f"(replicas here: {known})")
    return node_name, here


DRAIN_OPTIONS = (
    click.argument("name", required=False),
    click.option("--node", "all_on_node", is_flag=True,
                 help="Every replica with a shard on this node (before hardware work)."),
    click.option("--spec", "specs", multiple=True, metavar="PATH",
                 help=f"Spec file or folder (repeatable) [default: {DEFAULT_SPECS[0]}]."),
    click.option("--node-name", "node", metavar="NAME",
                 help="This node's name, as the spec's nodes[].name says it [default: this "
                      "machine's host name]."),
    USER_OPTION,
    click.option("--state-dir", metavar="DIR",
                 help="The supervisor's state directory, where drain requests are kept "
                      "[default: /var/lib/llmgw-supervisor].")
)


def drain_options(function: F) -> F:
    for option in reversed(DRAIN_OPTIONS):
        function = option(function)
    return function


@systemd_group.command("drain")
@drain_options
@click.option("--reason", default="", metavar="TEXT", help="Why, for the API and the logs.")
@click.option("--wait", is_flag=True,
              help="Return once the local supervisor says the replica is drained (nothing "
                   "in flight on its serving rank).")
@click.option("--timeout", type=click.FloatRange(1, 86400), metavar="SECONDS",
              help="With --wait: give up after this long [default: drain.delay + "
                   "drain.timeout + 30].")
@click.option("--supervisor", default=str(SUPERVISOR_LOCAL), show_default=True,
              metavar="HOST:PORT", help="With --wait: the local supervisor's plain listener.")
def drain_command(name: str | None, all_on_node: bool, specs: tuple[str, ...],
                  node: str | None, user_manager: bool, state_dir: str | None, reason: str,
                  wait: bool, timeout: float | None, supervisor: str) -> None:
    """Take replica NAME (or, with --node, every replica with a shard on this node) out of
    rotation on all its nodes, without stopping anything, until `llmgw-systemd resume`.
    The request is kept in the supervisor's state directory: it survives a restart of the
    supervisor and of the node.

    Exit 0 once asked (with --wait: once drained), 2 on bad input, 1 when the request
    cannot be written or (with --wait) the replica was not drained in time."""
    import getpass
    import time
    from datetime import datetime, timezone

    from llmgw_systemd.health.drain import DRAINED, DrainRequest
    from llmgw_systemd.helpers.stop_group import ask_supervisor
    from llmgw_systemd.supervisor import drain_requests

    try:
        node_name, replicas = _drain_targets(name, all_on_node, specs, node)
        who = os.environ.get("SUDO_USER") or getpass.getuser()
        since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        folder = state_dir or _default_state_dir(user_manager)
        path = drain_requests.save(folder, DrainRequest(name, who, since, reason))
        click.echo(f"drain of {name or f'every replica on {node_name}'} asked by {who} "
                   f"({path}); undo with: llmgw-systemd resume "
                   f"{name or '--node'}")
        if not wait:
            return
        bound = timeout if timeout is not None else max(
            r.drain.delay + r.drain.timeout for r in replicas) + 30
        deadline = time.monotonic() + bound
        left = {r.name for r in replicas}
        while left and time.monotonic() < deadline:
            for replica in sorted(left):
                view = ask_supervisor(supervisor, replica)
                if view is not None and view.phase == DRAINED:
                    click.echo(f"{replica}: drained")
                    left.discard(replica)
            if left:
                time.sleep(0.5)
        if left:
            raise LlmgwError(f"not drained within {bound:g} s: {', '.join(sorted(left))} "
                             f"(is the supervisor answering on {supervisor}? the request "
                             "stays in effect)")
    except LlmgwError as exc:
        _fail("llmgw-systemd drain", exc)


@systemd_group.command("resume")
@drain_options
def resume_command(name: str | None, all_on_node: bool, specs: tuple[str, ...],
                   node: str | None, user_manager: bool, state_dir: str | None) -> None:
    """Put replica NAME (or, with --node, what `drain --node` took out) back into rotation:
    withdraw this node's drain request. Exit 0 done, 2 on bad input, 1 when the request
    cannot be removed."""
    from llmgw_systemd.supervisor import drain_requests

    try:
        node_name, _ = _drain_targets(name, all_on_node, specs, node)
        folder = state_dir or _default_state_dir(user_manager)
        removed = drain_requests.remove(folder, name)
        what = name or f"every replica on {node_name}"
        click.echo(f"resumed {what}" if removed else f"{what} had no drain request here")
        requests, _ = drain_requests.load(folder)
        if name is not None and any(r.replica is None for r in requests):
            click.echo(f"note: a drain of every replica on {node_name} is still in effect "
                       "(llmgw-systemd resume --node)")
    except LlmgwError as exc:
        _fail("llmgw-systemd resume", exc)


def systemd_main() -> None:
    _run(cli=systemd_group, prog="llmgw-systemd")


def _default_state_dir(user_manager: bool) -> str:
    """systemd's StateDirectory= (it sets $STATE_DIRECTORY), else the usual place."""
    if os.environ.get("STATE_DIRECTORY"):
        return os.environ["STATE_DIRECTORY"].split(":")[0]
    if user_manager:
        base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        return os.path.join(base, "llmgw-supervisor")
    return DEFAULT_STATE_DIR


def _endpoint_option(option: str, text: str) -> tuple[str, int]:
    from llmgw_systemd.spec.endpoint import is_ip, parse_endpoint

    endpoint = parse_endpoint(text)
    if isinstance(endpoint, str):
        raise UsageError(option, endpoint)
    if not is_ip(endpoint.host):
        raise UsageError(option, f"expected an IP address to listen on; got '{endpoint.host}'")
    return endpoint.host, endpoint.port


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("specs", nargs=-1, metavar="[SPEC]...")
@NODE_OPTION
@USER_OPTION
@click.option("--listen", default=str(SUPERVISOR_LOCAL), show_default=True, metavar="ADDR:PORT",
              help="Where the API listens (TLS when configured); the node's address to "
                   "serve its peers; IPv6 as [ADDR]:PORT.")
@click.option("--local", "local", metavar="ADDR:PORT",
              help="An extra plain-HTTP listener for tools on this node; loopback only.")
@click.option("--peer-port", type=click.IntRange(1, 65535), metavar="PORT",
              help="The port peer supervisors listen on [default: --listen's port].")
@tls_options("", "tls_node.crt, tls_node.key, tls_ca.crt (or the names without tls_) in "
             "$CREDENTIALS_DIRECTORY")
@click.option("--state-dir", metavar="DIR",
              help="Where group restarts are recorded [default: $STATE_DIRECTORY, else "
                   "/var/lib/llmgw-supervisor].")
@click.option("--dbus-timeout", type=click.FloatRange(0.1, 120),
              default=SupervisorConfig.dbus_timeout,
              show_default=True, metavar="SECONDS",
              help="Bound on every D-Bus call, connecting included.")
@click.option("--peer-timeout", type=click.FloatRange(0.1, 120),
              default=SupervisorConfig.peer_timeout,
              show_default=True, metavar="SECONDS",
              help="Bound on a peer fetch beyond its long-poll wait (connect, TLS, body).")
@VERSION_OPTION
def supervisor_command(specs: tuple[str, ...], node: str | None, user_manager: bool,
                       listen: str, local: str | None, peer_port: int | None,
                       tls_cert: str | None, tls_key: str | None, tls_ca: str | None,
                       state_dir: str | None, dbus_timeout: float, peer_timeout: float
                       ) -> None:
    """Watch this node's shards through systemd, judge replica health with the peer
    supervisors, restart replicas as a group, and serve the result as JSON and metrics."""
    import gc as collector
    import signal

    from llmgw_systemd.errors import TlsError
    from llmgw_systemd.gather.tls import client_context, find_tls_files, server_context
    from llmgw_systemd.supervisor.daemon import is_loopback, serve
    from llmgw_systemd.supervisor.state_file import check_writable

    collector.enable()  # a long-running daemon: _run turned it off for the short-lived CLIs
    try:
        host, port = _endpoint_option("--listen", listen)
        extra = _endpoint_option("--local", local) if local else None
        if extra is not None and not is_loopback(extra[0]):
            raise UsageError("--local", f"plain HTTP listens on loopback only; got '{local}'")
        try:
            tls = find_tls_files(tls_cert, tls_key, tls_ca,
                                 credentials_dir=os.environ.get("CREDENTIALS_DIRECTORY"))
            if tls is not None:  # every file read and checked now, not at the first peer
                server_context(tls)
                client_context(tls)
        except TlsError as exc:
            raise UsageError("--tls-cert/--tls-key/--tls-ca", str(exc)) from None
        directory = state_dir or _default_state_dir(user_manager)
        check_writable(directory)
        config = SupervisorConfig(
            specs=specs or DEFAULT_SPECS, node=node or os.uname().nodename,
            state_dir=directory, user=user_manager, listen_host=host, listen_port=port,
            local=extra, peer_port=peer_port or port, tls=tls, dbus_timeout=dbus_timeout,
            peer_timeout=peer_timeout)
        serve(config, (signal.SIGTERM, signal.SIGINT))
    except OSError as exc:
        _fail("llmgw-supervisor", LlmgwError(f"cannot listen: {exc.strerror or exc}"))
    except LlmgwError as exc:
        _fail("llmgw-supervisor", exc)


def supervisor_main() -> None:
    _run(cli=supervisor_command, prog="llmgw-supervisor")


def _run(cli: click.Command, prog: str) -> None:
    """Run a click command as an entry point: usage errors come back to us as one line in
    our own format rather than click's three-line usage block (standalone_mode=False)."""
    # A short-lived process whose garbage is freed by reference counting; the cyclic
    # collector would only re-scan the spec's YAML node tree again and again (a third
    # of the run time for large specs). The daemon turns it back on.
    gc.disable()
    try:
        cli.main(prog_name=prog, standalone_mode=False)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        click.echo(f"{prog}: error: {exc.format_message()} (see {prog} --help)", err=True)
        sys.exit(exc.exit_code)
