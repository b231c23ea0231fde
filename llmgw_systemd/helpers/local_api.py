"""The local supervisor's view of one replica, as the units' helpers ask it: GET
/v1/replicas/NAME over plain HTTP on loopback (its --local listener). Standard library
only: the helpers run on every start and stop. None on any failure: a helper that cannot
ask goes on as if there were no supervisor."""

from __future__ import annotations

import http.client
import json

from llmgw_systemd.health.versions import RankVersion

MAX_ANSWER = 1 << 20  # bytes of a replica's view read at most


def ask_replica(address: str, replica: str, timeout: float, user_agent: str) -> object | None:
    """The decoded JSON of /v1/replicas/REPLICA from the supervisor at HOST:PORT, or
    None when it does not answer 200 with JSON in time."""
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)
    try:
        conn.request("GET", f"/v1/replicas/{replica}", headers={"User-Agent": user_agent})
        response = conn.getresponse()
        if response.status != 200:
            return None
        data: object = json.loads(response.read(MAX_ANSWER))
        return data
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()


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
