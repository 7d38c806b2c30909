"""Why Ansible could not reach a host over SSH, what to do about it, and whether it may pass by itself."""

from __future__ import annotations

import re

# What ssh said, in the order they are tested, and what to do about it. Only a timeout or a dropped
# connection may pass by itself; a refused port, a missing route or an unknown name stays until someone acts.
_CAUSES = [
    ("auth", ("permission denied",)),
    ("host key", ("host key verification failed", "identification has changed")),
    (
        "name",
        (
            "could not resolve",
            "name or service not known",
            "temporary failure in name resolution",
            "nodename nor servname",
            "no address associated with hostname",
        ),
    ),
    ("no route", ("no route to host", "network is unreachable")),
    ("refused", ("connection refused",)),
    ("reset", ("connection reset", "connection closed", "broken pipe", "kex_exchange_identification")),
]
TRANSIENT_CAUSES = {"timeout", "reset"}
UNREACHABLE_FIXES = {
    "auth": "authorise the controller's key (nodes.ssh_key_path) for nodes.ssh_user on {hosts} "
    "(~/.ssh/authorized_keys); passwords are never used",
    "host key": "add the verified host keys of {hosts} to nodes.known_hosts_path "
    "(`ssh-keyscan -p PORT HOST`, compared against the node's own keys)",
    "name": "fix the address of {hosts} in nodes.hosts, or DNS on the controller",
    "no route": "no network route from the controller to {hosts}: check their address in nodes.hosts, "
    "that they are up, and the routes and firewalls in between",
    "refused": "start sshd on {hosts} (or fix their port in nodes.hosts)",
    "reset": "{hosts} dropped the SSH connection: check that sshd there is not restarting or overloaded "
    "(MaxStartups, load)",
    "timeout": "{hosts} did not answer within nodes.connect_timeout_s: check that they are up and not hung "
    "(load, memory, a stuck sshd) and that their SSH port is open to the controller",
}


def ssh_reason(message: str) -> str:
    """The ssh client's own words from Ansible's unreachable message."""
    reason = message.split("reached over ssh:", 1)[-1].strip()
    return re.sub(r"^(Task failed: )?(ssh: )?", "", reason)


def unreachable_cause(message: str) -> str:
    """The key of UNREACHABLE_FIXES for Ansible's unreachable message (a timeout when nothing else matches)."""
    text = message.lower()
    return next((cause for cause, needles in _CAUSES if any(n in text for n in needles)), "timeout")


def is_transient(message: str) -> bool:
    """The failure may pass by itself (a timeout or a dropped connection): worth another try."""
    return unreachable_cause(message) in TRANSIENT_CAUSES
