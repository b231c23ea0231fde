"""Specs for the integration tests: command-engine shards made of the stand-ins."""

from __future__ import annotations

import socket
from pathlib import Path

from systemd_harness import STANDINS

PYTHON = "/usr/bin/python3"  # Debian's: no pyenv shim between systemd and the stand-in


def free_port() -> int:
    """A port nobody listens on now (picked by the kernel)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def head_argv(port: int, host: str, pid_file: Path, slow_stop: int | None = None
              ) -> list[str]:
    return [PYTHON, str(STANDINS / "rendezvous_head.py"), "--port", str(port), "--host", host,
            "--pid-file", str(pid_file),
            *(["--slow-stop", str(slow_stop)] if slow_stop is not None else [])]


def member_argv(join: str, http_port: int | None = None, host: str = "0.0.0.0",
                exit_on_term: int | None = None, child_lingers: int | None = None
                ) -> list[str]:
    argv = [PYTHON, str(STANDINS / "member.py"), "--join", join]
    if child_lingers is not None:
        argv += ["--child-lingers", str(child_lingers)]
    if exit_on_term is not None:
        argv += ["--exit-on-term", str(exit_on_term)]
    if http_port:
        argv += ["--http-port", str(http_port), "--http-host", host]
    return argv


def yaml_list(items: list[str]) -> str:
    import json

    return json.dumps(items)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def one_node_shard(path: Path, *, name: str, http: int, head: int, pid_file: Path,
                   delay: int = 2, burst: int = 5, interval: int = 120,
                   rendezvous_timeout: int = 20, port_release_timeout: int = 3,
                   engine_exit_on_term: int | None = None,
                   head_slow_stop: int | None = None,
                   engine_child_lingers: int | None = None) -> Path:
    """A leader shard on 127.0.0.1: a head sidecar, then a member that joins it and
    serves HTTP."""
    return write(path, f"""\
replicas:
  - name: {name}
    engine: command
    port: {http}
    rendezvous_timeout: {rendezvous_timeout}
    port_release_timeout: {port_release_timeout}
    restart: {{delay: {delay}, burst: {burst}, interval: {interval}}}
    nodes: [{{name: node, address: 127.0.0.1}}]
    ranks:
      - commands:
          - name: head
            argv: {yaml_list(head_argv(head, "127.0.0.1", pid_file, head_slow_stop))}
            binds: [{head}]
          - argv: {yaml_list(member_argv(f"127.0.0.1:{head}", http, "127.0.0.1",
                                         engine_exit_on_term, engine_child_lingers))}
            wait_for: ["127.0.0.1:{head}"]
""")


def two_node_replica(path: Path, *, name: str, leader: str, worker: str, http: int,
                     head: int, pid_file: Path, delay: int = 2, burst: int = 5,
                     interval: int = 120, rendezvous_timeout: int = 60,
                     head_slow_stop: int | None = None, engine_exit_on_term: int | None = None,
                     extra: str = "") -> Path:
    """Rank 0 on node-a: head sidecar + serving member; rank 1 on node-b: a member that
    joins the head across the link (as a Ray worker does). extra: more replica keys,
    each a line indented by four."""
    return write(path, f"""\
replicas:
  - name: {name}
    engine: command
    port: {http}
    rendezvous_timeout: {rendezvous_timeout}
    port_release_timeout: 3
    restart: {{delay: {delay}, burst: {burst}, interval: {interval}}}
{extra}    nodes:
      - {{name: node-a, address: {leader}}}
      - {{name: node-b, address: {worker}}}
    ranks:
      - commands:
          - name: head
            argv: {yaml_list(head_argv(head, "0.0.0.0", pid_file, head_slow_stop))}
            binds: [{head}]
          - argv: {yaml_list(member_argv(f"{leader}:{head}", http,
                                         exit_on_term=engine_exit_on_term))}
            wait_for: ["{leader}:{head}"]
      - commands:
          - argv: {yaml_list(member_argv(f"{leader}:{head}"))}
            wait_for: ["{leader}:{head}"]
""")


