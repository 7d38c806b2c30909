"""The rendezvous finding names the hosts and the port from torchrun's own lines (captured on a 2-host netns
cluster: host-a firewalling port 29500; host-b unable to resolve host-a)."""

from __future__ import annotations

from tasks.diagnose import diagnose

# host-b's agent, host-a dropping TCP to 29500 (torch 2.x); the reason is the SSH launcher's.
BLOCKED_LOG = """\
torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError
[E1202 14:06:00.864109910 socket.cpp:1028] [c10d] The client socket has timed out after 60000ms while trying to \
connect to (10.204.163.2, 29500).
[E1202 14:06:00.868532747 TCPStore.cpp:328] [c10d] TCP client failed to connect/validate to host \
10.204.163.2:29500 - timed out (try=0, timeout=60000ms): The client socket has timed out after 60000ms while \
trying to connect to (10.204.163.2, 29500).
torch.distributed.DistNetworkError: The client socket has timed out after 60000ms while trying to connect to \
(10.204.163.2, 29500).
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed. \
See inner exception for details.
"""
BLOCKED_REASON = "training failed: torchrun exited with 1 on host-a (node 0); node 1 (host-b): exit 1"

# host-b's worker: the rendezvous met on host-a's IP, then MASTER_ADDR=host-a does not resolve there.
UNRESOLVED_LOG = """\
[default0]:[W1202 14:16:37.917601931 socket.cpp:764] [c10d] The IPv6 network addresses of (host-a, 37253) cannot \
be retrieved (gai error: -3 - Temporary failure in name resolution).
"""


def _rendezvous_fix(error: str, log: str) -> str:
    [finding] = [f for f in diagnose(error, log).findings if f.cause.startswith("rendezvous")]
    return finding.fix


def test_a_blocked_rendezvous_port_names_the_host_that_could_not_connect_the_port_and_the_firewall_fix() -> None:
    fix = _rendezvous_fix(BLOCKED_REASON, BLOCKED_LOG)
    assert fix.startswith("host-b could not connect to the rendezvous at 10.204.163.2:29500")
    assert "open port 29500 on 10.204.163.2 (host-a) to host-b" in fix


def test_an_unresolvable_master_address_names_the_host_name_and_the_hosts_file_fix() -> None:
    fix = _rendezvous_fix("training failed: torchrun exited with 1 on host-b (node 1)", UNRESOLVED_LOG)
    assert fix.startswith("host-b cannot resolve 'host-a' (port 37253")
    assert "make host-b resolve host-a's name (/etc/hosts or DNS)" in fix


def test_without_the_launchers_reason_the_unresolved_name_is_still_named() -> None:
    fix = _rendezvous_fix("", UNRESOLVED_LOG)
    assert "cannot resolve 'host-a'" in fix and "/etc/hosts or DNS" in fix
