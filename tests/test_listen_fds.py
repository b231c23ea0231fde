"""sd_listen_fds(3) as the supervisor reads it, and which kept socket a listener takes
over (llmgw_systemd/helpers/listen_fds.py): tables, plus one real socket pair."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from llmgw_systemd.helpers.listen_fds import (
    Inherited,
    adopt,
    listening_address,
    parse_listen_fds,
    wanted_address,
)

PID = 4242
INET, INET6 = int(socket.AF_INET), int(socket.AF_INET6)


@pytest.mark.parametrize(("environ", "expected"), [
    ({}, ()),
    ({"LISTEN_PID": str(PID), "LISTEN_FDS": "1"}, ((3, "unknown"),)),
    ({"LISTEN_PID": str(PID), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "api:local"},
     ((3, "api"), (4, "local"))),
    # another process's descriptors (inherited through a fork): not ours
    ({"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "api"}, ()),
    ({"LISTEN_FDS": "1", "LISTEN_FDNAMES": "api"}, ()),
    # names that do not match the count are ignored, as libsystemd does
    ({"LISTEN_PID": str(PID), "LISTEN_FDS": "2", "LISTEN_FDNAMES": "api"},
     ((3, "unknown"), (4, "unknown"))),
    ({"LISTEN_PID": str(PID), "LISTEN_FDS": "0"}, ()),
    ({"LISTEN_PID": str(PID), "LISTEN_FDS": "-1"}, ()),
    ({"LISTEN_PID": str(PID), "LISTEN_FDS": "x"}, ()),
    ({"LISTEN_PID": str(PID), "LISTEN_FDS": "100000"}, ()),
])
def test_parse_listen_fds(environ: dict[str, str], expected: tuple[tuple[int, str], ...]
                          ) -> None:
    assert parse_listen_fds(environ, PID) == expected


API = (INET, "127.0.0.1", 9470)
LOCAL = (INET, "127.0.0.1", 9471)


@pytest.mark.parametrize(("wanted", "inherited", "use", "dropped"), [
    # the same address under the same name: taken over
    ({"api": API}, [Inherited(3, "api", API)], {"api": 3}, ()),
    ({"api": API, "local": LOCAL},
     [Inherited(3, "api", API), Inherited(4, "local", LOCAL)], {"api": 3, "local": 4}, ()),
    # --listen changed since the socket was kept: bind anew, drop the old one
    ({"api": (INET, "127.0.0.1", 9480)}, [Inherited(3, "api", API)], {}, (3,)),
    ({"api": (INET6, "::1", 9470)}, [Inherited(3, "api", API)], {}, (3,)),
    # --local no longer given: its socket is dropped
    ({"api": API}, [Inherited(3, "api", API), Inherited(4, "local", LOCAL)], {"api": 3}, (4,)),
    # names swapped: each listener only takes its own name
    ({"api": API, "local": LOCAL},
     [Inherited(3, "api", LOCAL), Inherited(4, "local", API)], {}, (3, 4)),
    # not a listening TCP socket, an unknown name, a second socket of one name
    ({"api": API}, [Inherited(3, "api", None)], {}, (3,)),
    ({"api": API}, [Inherited(3, "unknown", API)], {}, (3,)),
    ({"api": API}, [Inherited(3, "api", API), Inherited(4, "api", API)], {"api": 3}, (4,)),
    # port 0 (any free port) is never wanted: nothing to take over
    ({}, [Inherited(3, "api", API)], {}, (3,)),
    ({"api": API}, [], {}, ()),
])
def test_adopt(wanted: dict[str, tuple[int, str, int]], inherited: list[Inherited],
               use: dict[str, int], dropped: tuple[int, ...]) -> None:
    adoption = adopt(wanted, inherited)
    assert dict(adoption.use) == use
    assert tuple(item.fd for item in adoption.drop) == dropped


def test_a_listening_socket_is_what_it_was_asked_for() -> None:
    with socket.socket() as listener, socket.socket() as bound, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as datagram:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert listening_address(listener) == wanted_address("127.0.0.1", port)
        bound.bind(("127.0.0.1", 0))
        assert listening_address(bound) is None  # bound, not listening
        assert listening_address(datagram) is None
    assert wanted_address("127.0.0.1", 0) is None
    assert wanted_address("not an address", 9470) is None
    assert wanted_address("::1", 9470) == (INET6, "::1", 9470)


def test_a_kept_socket_reaches_the_next_process() -> None:
    """The protocol end to end with a real child: a socket passed as fd 3 with
    LISTEN_PID set to the child is found, listening, and the environment is cleared."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        os.set_inheritable(listener.fileno(), True)
        child = (
            "import os, sys\n"
            f"os.dup2({listener.fileno()}, 3)\n"
            "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1',"
            " LISTEN_FDNAMES='api')\n"
            "from llmgw_systemd.helpers.listen_fds import inherited_sockets\n"
            "got = inherited_sockets()\n"
            "print(got[0][0], 'LISTEN_PID' in os.environ)\n")
        out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                             timeout=30, check=True, pass_fds=(listener.fileno(),)).stdout
    assert out.strip() == (f"Inherited(fd=3, name='api', address=({INET}, '127.0.0.1', "
                           f"{port})) False")
