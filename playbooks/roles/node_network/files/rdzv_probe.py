"""Rendezvous port probe: a throw-away TCP listener on the rendezvous host, and the connect from the others.

    python3 - start PORT DEADLINE_S     bind PORT, detach a listener that lives until `stop` or DEADLINE_S
    python3 - connect HOST PORT TIMEOUT_S    one real TCP connect, retried on refusal until TIMEOUT_S
    python3 - stop PORT                 stop the listener; it reports which peers connected

Every command prints one JSON object and exits 0; a failed check is data, not an error.
Runs under the node's Python (3.8+), standard library only.
"""

import errno
import json
import os
import select
import socket
import sys
import time

STOP = b"tdeploy-rdzv-probe-stop\n"


def emit(**result):
    """Print the result as JSON and exit 0."""
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    sys.exit(0)


def bind(port):
    """A listening socket on every address of the node, IPv6 and IPv4 where the node has both."""
    if socket.has_dualstack_ipv6():
        try:
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, reuse_port=False)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise
    return socket.create_server(("0.0.0.0", port))


def serve(server, deadline):
    """Accept connections until STOP arrives or the deadline passes; answer STOP with the peers seen."""
    peers = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([server], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
        if not ready:
            continue
        conn, addr = server.accept()
        with conn:
            conn.settimeout(2.0)
            try:
                data = conn.recv(len(STOP))
            except OSError:
                data = b""
            if data == STOP:
                conn.sendall((json.dumps({"peers": sorted(set(peers))}) + "\n").encode())
                return
            host = addr[0]
            peers.append(host[7:] if host.startswith("::ffff:") else host)


def start(port, deadline_s):
    """Bind in the foreground (so a port in use is reported), then serve from a detached process."""
    try:
        server = bind(port)
    except OSError as err:
        emit(listening=False, error=f"cannot listen on port {port}: {err.strerror or err}")
    deadline = time.monotonic() + deadline_s
    pid = os.fork()
    if pid:
        emit(listening=True, pid=pid)
    # Detach from the session of the ssh connection, and close its pipes so the task can finish.
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    try:
        serve(server, deadline)
    finally:
        os._exit(0)


def connect(host, port, timeout_s):
    """Connect once the listener answers; retry a refusal until the timeout (the listener may still be starting)."""
    deadline = time.monotonic() + timeout_s
    started = time.monotonic()
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, left)):
                emit(connected=True, seconds=round(time.monotonic() - started, 3))
        except (socket.gaierror, UnicodeError) as err:  # UnicodeError: not a host name (a label over 63 characters)
            emit(connected=False, error=f"cannot resolve {host}: {getattr(err, 'strerror', None) or err}")
        except TimeoutError:
            emit(
                connected=False,
                error=f"timed out after {timeout_s}s (packets dropped: a firewall, or no route)",
            )
        except OSError as err:
            if err.errno != errno.ECONNREFUSED or time.monotonic() + 0.5 > deadline:
                reason = (
                    "refused (nothing listening, or a firewall rejects)" if err.errno == errno.ECONNREFUSED else err
                )
                emit(connected=False, error=f"{host}:{port} {reason}")
            time.sleep(0.5)


def stop(port):
    """Tell the listener to stop; it answers with the peers that connected."""
    try:
        with socket.create_connection(("localhost", port), timeout=5) as conn:
            conn.sendall(STOP)
            conn.settimeout(5)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                reply += chunk
        emit(stopped=True, **json.loads(reply.decode() or "{}"))
    except (OSError, ValueError) as err:
        emit(stopped=False, error=f"could not stop the listener on port {port}: {err}")


def main(argv):
    """Dispatch the sub-command."""
    command = argv[1] if len(argv) > 1 else ""
    if command == "start" and len(argv) == 4:
        start(int(argv[2]), float(argv[3]))
    elif command == "connect" and len(argv) == 5:
        connect(argv[2], int(argv[3]), float(argv[4]))
    elif command == "stop" and len(argv) == 3:
        stop(int(argv[2]))
    sys.stderr.write(__doc__)
    sys.exit(2)


if __name__ == "__main__":
    main(sys.argv)
