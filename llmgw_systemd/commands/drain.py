"""`llmgw-systemd drain` and `resume`: a drain request written to (or removed from) the
supervisor's state directory, where the daemon reads it (supervisor/drain_requests.py)."""

from __future__ import annotations

import getpass
import os
import time
from datetime import datetime, timezone

from llmgw_systemd.commands.common import DEFAULT_SPECS, default_state_dir, say, this_node
from llmgw_systemd.errors import LlmgwError, UsageError
from llmgw_systemd.gather.shard_reader import local_shards
from llmgw_systemd.health.drain import DRAINED, DrainRequest
from llmgw_systemd.helpers.stop_group import ask_supervisor
from llmgw_systemd.spec.files import read_documents
from llmgw_systemd.spec.model import Replica
from llmgw_systemd.spec.replicas import build_spec
from llmgw_systemd.supervisor import drain_requests


def drain(name: str | None, *, all_on_node: bool, specs: tuple[str, ...], node: str | None,
          user_manager: bool, state_dir: str | None, reason: str, wait: bool,
          timeout: float | None, supervisor: str) -> None:
    """Ask for the drain; with `wait`, until the local supervisor says drained."""
    node_name, replicas = _targets(name, all_on_node, specs, node)
    who = os.environ.get("SUDO_USER") or getpass.getuser()
    since = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    folder = state_dir or default_state_dir(user_manager)
    path = drain_requests.save(folder, DrainRequest(name, who, since, reason))
    say(f"drain of {name or f'every replica on {node_name}'} asked by {who} ({path}); "
        f"undo with: llmgw-systemd resume {name or '--node'}")
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
                say(f"{replica}: drained")
                left.discard(replica)
        if left:
            time.sleep(0.5)
    if left:
        raise LlmgwError(f"not drained within {bound:g} s: {', '.join(sorted(left))} "
                         f"(is the supervisor answering on {supervisor}? the request "
                         "stays in effect)")


def resume(name: str | None, *, all_on_node: bool, specs: tuple[str, ...],
           node: str | None, user_manager: bool, state_dir: str | None) -> None:
    """Withdraw this node's drain request."""
    node_name, _ = _targets(name, all_on_node, specs, node)
    folder = state_dir or default_state_dir(user_manager)
    removed = drain_requests.remove(folder, name)
    what = name or f"every replica on {node_name}"
    say(f"resumed {what}" if removed else f"{what} had no drain request here")
    requests, _ = drain_requests.load(folder)
    if name is not None and any(r.replica is None for r in requests):
        say(f"note: a drain of every replica on {node_name} is still in effect "
            "(llmgw-systemd resume --node)")


def _targets(name: str | None, all_on_node: bool, specs: tuple[str, ...],
             node: str | None) -> tuple[str, list[Replica]]:
    """This node's name and the replicas a drain or resume acts on (NAME, or every one
    with a shard here)."""
    if (name is None) == (not all_on_node):
        raise UsageError("NAME", "name one replica, or pass --node for every replica with a "
                         "shard on this node")
    spec = build_spec(read_documents(specs or DEFAULT_SPECS))
    node_name = this_node(node)
    shards = local_shards(spec, node_name)
    here = [s.replica for s in shards if name is None or s.replica.name == name]
    if name is not None and not here:
        known = ", ".join(s.replica.name for s in shards) or "none"
        raise UsageError("NAME", f"no replica '{name}' has a shard on node '{node_name}' "
                         f"(replicas here: {known})")
    return node_name, here
