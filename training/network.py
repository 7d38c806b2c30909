"""The network settings a rank runs with: the collective timeout the launcher passes, and what ranks.json records.

The launcher renders the spec's `cluster.network` section into environment variables (NCCL_*, GLOO_*, and
TDEPLOY_COLLECTIVE_TIMEOUT_S for the process group's timeout). Only this module reads the timeout variable
on the training side; the launcher imports its name from here (so this module imports torch only where it must).
"""

from __future__ import annotations

import math
import os
import random
import socket
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

COLLECTIVE_TIMEOUT_ENV = "TDEPLOY_COLLECTIVE_TIMEOUT_S"
# The distributed variables a rank records: NCCL's, gloo's and torch's own (TORCH_NCCL_*, TORCH_DISTRIBUTED_*, ...).
RECORDED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_")


_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LISTEN_PORTS_FROM = 20000
_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def listen_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, for a server started next (a rendezvous store, a daemon, a probe listener).

    Chosen at random below the kernel's ephemeral range: a port from bind(0) is an ephemeral one, which the kernel
    may give to any outgoing connection (another job's gloo mesh) before the server binds it, and the server then
    fails with EADDRINUSE (seen as a torchrun "connection to the C10d store has failed" and a slurmd that never
    started, on a busy machine). A port is not handed out twice by one process. Falls back to bind(0) where the
    ephemeral range starts too low to leave room.
    """
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    high = min(low, 32768)
    rng = random.Random()
    for _ in range(200 if high - _LISTEN_PORTS_FROM >= 1000 else 0):
        port = rng.randrange(_LISTEN_PORTS_FROM, high)
        with _handed_out_lock:
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def collective_timeout() -> timedelta | None:
    """The process group's timeout from TDEPLOY_COLLECTIVE_TIMEOUT_S; None = torch's default."""
    raw = os.environ.get(COLLECTIVE_TIMEOUT_ENV, "")
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError as err:
        raise ValueError(
            f"{COLLECTIVE_TIMEOUT_ENV}={raw!r} is not a number of seconds; set cluster.network.collective_timeout_s"
        ) from err
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{COLLECTIVE_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return timedelta(seconds=seconds)


def network_record(backend: str) -> dict[str, Any]:
    """This rank's network as ranks.json records it: the distributed variables it sees and its collective timeout."""
    from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout  # torch is not needed above

    timeout = collective_timeout()
    effective = timeout or (default_pg_nccl_timeout if backend == "nccl" else default_pg_timeout)
    return {
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(RECORDED_PREFIXES)},
        "collective_timeout_s": effective.total_seconds() if effective is not None else None,
        "collective_timeout_from": "cluster.network.collective_timeout_s" if timeout else "torch default",
    }
