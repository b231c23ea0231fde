#!/usr/bin/python3
"""Stand-in for a rendezvous head (a Ray head's GCS): listens on a TCP port and, like
Ray, leaves a daemonized child behind it (double fork + setsid), so tests can prove
that stopping the unit kills its whole cgroup. Writes its and the child's PIDs to
--pid-file. Runs until killed. With --slow-stop N it takes N seconds to exit (status 0)
after SIGTERM, as a Ray head does whose drain waits for a GCS that is already gone.

    rendezvous_head.py --port P [--host H] [--pid-file F] [--slow-stop N]
"""

import argparse
import os
import signal
import socket
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--pid-file")
    parser.add_argument("--slow-stop", type=float)
    args = parser.parse_args()
    if args.slow_stop is not None:
        def slow_exit(*_: object) -> None:
            time.sleep(args.slow_stop)
            os._exit(0)
        signal.signal(signal.SIGTERM, slow_exit)
    server = socket.create_server((args.host, args.port), reuse_port=False)
    read_end, write_end = os.pipe()
    if os.fork() == 0:  # the daemon: setsid and fork again, like raylet and gcs_server
        os.setsid()
        if os.fork() == 0:
            os.write(write_end, str(os.getpid()).encode())
            while True:
                time.sleep(3600)
        os._exit(0)
    os.close(write_end)
    daemon_pid = os.read(read_end, 32).decode()
    if args.pid_file:
        with open(args.pid_file + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {daemon_pid}\n")
        os.replace(args.pid_file + ".tmp", args.pid_file)
    print(f"head listening on {args.host}:{args.port}; daemon {daemon_pid}", flush=True)
    clients = []
    while True:
        conn, _ = server.accept()
        clients.append(conn)  # keep members connected, as a GCS does


if __name__ == "__main__":
    main()
