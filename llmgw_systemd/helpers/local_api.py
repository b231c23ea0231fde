"""The local supervisor's view of one replica, as the units' helpers and `llmgw-render
--apply` ask it: GET /v1/replicas/NAME over plain HTTP on loopback (its --local
listener). Standard library only, no asyncio or h11: the helpers run on every start and
stop, and llmgw-render must run where the supervisor's dependencies are not installed."""

from __future__ import annotations

import http.client
import json
import socket

from llmgw_systemd.errors import PeerError
from llmgw_systemd.health.versions import RankVersion

MAX_ANSWER = 1 << 20  # bytes of a replica's view read at most


def get_replica(address: str, replica: str, timeout: float, user_agent: str) -> bytes:
    """The body of /v1/replicas/REPLICA from the supervisor at HOST:PORT (each socket
    operation bounded by `timeout`); PeerError saying what failed otherwise (a 404: it
    does not watch the replica)."""
    host, _, port = address.rpartition(":")
    where = f"the supervisor at {address}"
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request("GET", f"/v1/replicas/{replica}", headers={"User-Agent": user_agent})
        response = conn.getresponse()
        if response.status != 200:
            raise PeerError("http-status",
                            f"{where} answered HTTP {response.status} {response.reason}")
        body = response.read(MAX_ANSWER + 1)
        if len(body) > MAX_ANSWER:
            raise PeerError("too-large", f"{where}: the answer is over {MAX_ANSWER} bytes")
        return body
    except socket.timeout:
        raise PeerError("timeout", f"{where}: no answer within {timeout:g} s") from None
    except OSError as exc:
        raise PeerError("connect", f"{where}: {exc.strerror or exc}") from None
    except http.client.HTTPException as exc:
        raise PeerError("malformed", f"{where}: {type(exc).__name__}: {exc}") from None
    finally:
        conn.close()


def ask_replica(address: str, replica: str, timeout: float, user_agent: str) -> object | None:
    """The decoded JSON of /v1/replicas/REPLICA from the supervisor at HOST:PORT, or
    None when it does not answer 200 with JSON in time: a helper that cannot ask goes
    on as if there were no supervisor."""
    try:
        data: object = json.loads(get_replica(address, replica, timeout, user_agent))
    except (PeerError, ValueError):
        return None
    return data


def rank_versions(data: object) -> tuple[RankVersion, ...]:
    """Each rank's spec versions in a replica's view (ranks[].spec); () when the view has
    none (a supervisor of an earlier release), skipping what is not as expected."""
    ranks = data.get("ranks") if isinstance(data, dict) else None
    out = []
    for item in ranks if isinstance(ranks, list) else ():
        if not isinstance(item, dict):
            continue
        rank, node, spec = item.get("rank"), item.get("node"), item.get("spec")
        if not isinstance(rank, int) or isinstance(rank, bool) or not isinstance(node, str):
            continue
        loaded = spec.get("loaded") if isinstance(spec, dict) else None
        running = spec.get("running") if isinstance(spec, dict) else None
        out.append(RankVersion(rank, node, loaded if isinstance(loaded, str) else "",
                               running if isinstance(running, str) else ""))
    return tuple(out)
