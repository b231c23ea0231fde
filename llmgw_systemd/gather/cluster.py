"""`llmgw-systemd status --cluster`'s reads of the other nodes: every peer supervisor
asked once, all at once on one event loop, so 64 nodes take one `timeout` at most
(the table itself is health/cluster_view's, pure)."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping

from llmgw_systemd.errors import PeerError
from llmgw_systemd.gather.peer_client import PeerSession
from llmgw_systemd.gather.tls import names_node
from llmgw_systemd.health.cluster_view import PeerView


async def ask_peer(node: str, address: str, port: int, timeout: float,
                   tls: ssl.SSLContext | None) -> PeerView:
    """One node's supervisor's shards, or why not; authenticated when its certificate
    names the node we dialed."""
    session = PeerSession(address, port, ssl_context=tls, server_hostname=address,
                          keep=False)
    try:
        answer = await session.fetch_shards(deadline=timeout)
    except PeerError as exc:
        return PeerView(node, error=str(exc), tls=tls is not None)
    finally:
        session.close()
    named = bool(answer.peer_cert) and names_node(answer.peer_cert or {}, node, address)
    return PeerView(answer.node, answer.shards, authenticated=named, tls=tls is not None)


def ask_peers(addresses: Mapping[str, str], port: int, timeout: float,
              tls: ssl.SSLContext | None) -> dict[str, PeerView]:
    """Every node in `addresses` (name -> address) asked at once: its view by name."""
    async def ask_all() -> list[PeerView]:
        return list(await asyncio.gather(*(ask_peer(node, address, port, timeout, tls)
                                           for node, address in addresses.items())))

    return dict(zip(addresses, asyncio.run(ask_all())))
