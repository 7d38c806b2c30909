"""The rendezvous probe as the roles run it on a node: a real listener, real connects, a port in use; the listener
started from the network probe module as on the rendezvous host."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from tasks.nodes.runner import PLAYBOOKS
from tests.integration.nodes.conftest import free_port
from tests.unit.nodes.conftest import load_role_file

pytestmark = pytest.mark.integration

PROBE = PLAYBOOKS / "roles" / "node_network" / "files" / "rdzv_probe.py"


def probe(*args: object) -> dict:
    """Run the probe the way the role does (the script on stdin) and return its JSON answer."""
    out = subprocess.run(
        [sys.executable, "-", *map(str, args)], input=PROBE.read_text(), capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_listener_reports_the_peers_that_connected_and_stops_on_request() -> None:
    port = free_port()
    started = probe("start", port, 60)
    assert started["listening"] is True
    try:
        assert probe("connect", "127.0.0.1", port, 5)["connected"] is True
        stopped = probe("stop", port)
        assert stopped == {"stopped": True, "peers": ["127.0.0.1"]}
    finally:
        try:
            os.kill(started["pid"], signal.SIGTERM)  # only if stop failed; it is ours either way
        except ProcessLookupError:
            pass
    assert probe("connect", "127.0.0.1", port, 1)["connected"] is False, "the listener is gone after stop"


def test_port_in_use_and_closed_port_are_reported_not_raised() -> None:
    with socket.create_server(("", 0)) as holder:
        port = holder.getsockname()[1]
        taken = probe("start", port, 60)
        assert taken["listening"] is False and f"cannot listen on port {port}" in taken["error"]
    refused = probe("connect", "127.0.0.1", free_port(), 1)
    assert refused["connected"] is False and "refused" in refused["error"]
    unknown = probe("connect", "no-such-node.invalid", free_port(), 1)
    assert unknown["connected"] is False and "cannot resolve no-such-node.invalid" in unknown["error"]


def test_the_network_probe_starts_the_listener_that_the_script_stops_and_reports_a_port_in_use() -> None:
    network = load_role_file("node_network/library/tdeploy_network_probe.py")
    port = free_port()
    started = network.start_listener(PROBE.read_text(), port, 60)
    assert started["listening"] is True, started
    try:
        assert probe("connect", "127.0.0.1", port, 5)["connected"] is True
        assert probe("stop", port) == {"stopped": True, "peers": ["127.0.0.1"]}
    finally:
        try:
            os.kill(started["pid"], signal.SIGTERM)  # only if stop failed; it is ours either way
        except ProcessLookupError:
            pass
    with socket.create_server(("", 0)) as holder:
        taken = network.start_listener(PROBE.read_text(), holder.getsockname()[1], 60)
    assert taken["listening"] is False and "cannot listen on port" in taken["error"]
