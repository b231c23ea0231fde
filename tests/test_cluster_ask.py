"""status --cluster asks every peer at once (gather/cluster.py): with more peers than any
pool of threads, every one is asked before the first answer is due."""

from __future__ import annotations

import socket
import threading

from llmgw_systemd.gather.cluster import ask_peers

PEERS = 40  # more than the 16 threads the asking used to take


def test_every_peer_is_asked_at_once_and_each_silence_is_its_own() -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=PEERS)
    listener.settimeout(0.1)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []
    most = [0]
    stop = threading.Event()

    def silent() -> None:  # accepts and never answers
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            held.append(conn)
            most[0] = max(most[0], len(held))

    thread = threading.Thread(target=silent, daemon=True)
    thread.start()
    try:
        views = ask_peers({f"n{i:02d}": "127.0.0.1" for i in range(PEERS)}, port, 2.0, None)
    finally:
        stop.set()
        thread.join(timeout=10)
        for conn in held:
            conn.close()
        listener.close()
    # all held open at one moment: none waited for another's answer (or its timeout)
    assert most[0] == PEERS
    assert sorted(views) == [f"n{i:02d}" for i in range(PEERS)]
    assert all("no complete answer within 2 s" in view.error for view in views.values())
