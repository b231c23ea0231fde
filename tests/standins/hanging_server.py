#!/usr/bin/python3
"""Stand-in for a server that hangs: accepts TCP connections on HOST:PORT and never
answers (a wedged engine, a wedged peer supervisor).

    hanging_server.py HOST PORT
"""

import socket
import sys

server = socket.create_server((sys.argv[1], int(sys.argv[2])))
held = []
while True:
    held.append(server.accept())  # keep them open, say nothing
