"""Ports for servers started next come from below the kernel's ephemeral range (training.network.listen_port).

CI saw a torchrun rendezvous store and a slurmd fail to bind a port from bind(0): an ephemeral port, which the
kernel had meanwhile given to another job's outgoing connection.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from tasks.launch.torchrun import free_port
from training import network
from training.network import listen_port


def _ephemeral_low() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


def test_the_launchers_port_is_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    assert low > 21000, "this machine's ephemeral range leaves no room below it"
    ports = [free_port() for _ in range(50)]
    assert all(20000 <= port < low for port in ports), ports


def test_one_process_never_gets_the_same_port_twice() -> None:
    ports = [listen_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_a_port_in_use_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", listen_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        network._handed_out.discard(busy)
        picks = iter([busy, busy, busy + 1 if busy + 1 < _ephemeral_low() else busy - 1])
        monkeypatch.setattr(random.Random, "randrange", lambda self, a, b: next(picks))
        network._handed_out.difference_update({busy - 1, busy + 1})
        port = listen_port()
    assert port != busy
    assert port in (busy - 1, busy + 1)
