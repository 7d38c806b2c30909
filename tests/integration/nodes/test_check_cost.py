"""What one check costs each node, read back from a real run over SSH (counts, never timings).

- ControlPersist: all the tasks of a node go over one SSH login (the node's sshd log counts the logins);
- pipelining, and one module run per role where it runs several commands: one SSH session per remote step,
  no temporary files to copy first and remove after (the sshd log counts the sessions);
- fact subsets: Ansible holds only the facts the roles read (the runner events carry what it gathered).
"""

from __future__ import annotations

from typing import Any

import pytest

import tasks.nodes.runner as runner
from tasks.nodes.check import run_node_checks
from tasks.nodes.config import NodesConfig
from tests.integration.nodes.conftest import free_port, two_node_cluster
from tests.integration.nodes.testhosts import SshdCluster

pytestmark = pytest.mark.integration

# The node's own steps: the facts probe, the clock, the storage probe, the network probe (names, interfaces and,
# on the rendezvous host, the listener), then the rendezvous connect (other nodes) or the listener's stop.
SESSIONS_PER_NODE = 5
# What node_facts reports and node_network reads (the other nodes' FQDNs, the Python to run the probe with).
FACTS_THE_ROLES_READ = {"distribution", "distribution_version", "kernel", "architecture", "hostname", "fqdn", "python"}


def test_a_check_logs_into_each_node_once_and_opens_one_session_per_remote_step(consistent: SshdCluster) -> None:
    offsets = {host.name: host.log_path.stat().st_size for host in consistent.hosts}
    report = run_node_checks(NodesConfig(**consistent.nodes_section(rdzv_port=free_port())), two_node_cluster())
    assert report.ok, [(r.check, r.finding) for r in report.blocking]
    for host in consistent.hosts:
        log = host.log_path.read_text()[offsets[host.name] :]
        assert log.count("Accepted publickey for root") == 1, f"{host.name}: one login for every task:\n{log}"
        assert log.count("Starting session: command") == SESSIONS_PER_NODE, f"{host.name}:\n{log}"
        # The password-login probe is a connection of its own that offers no key and is turned away.
        assert log.count("Connection closed by authenticating user root") == 1, f"{host.name}:\n{log}"


def test_ansible_gathers_only_the_facts_the_checks_read(
    consistent: SshdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    gathered: dict[str, set[str]] = {}
    collect = runner._Collector.__call__

    def recording(self: runner._Collector, event: dict[str, Any]) -> bool:
        data = event.get("event_data") or {}
        facts = (data.get("res") or {}).get("ansible_facts") or {}
        if event.get("event") == "runner_on_ok" and not str(data.get("task_action")).endswith("set_fact"):
            gathered.setdefault(data["host"], set()).update(name.removeprefix("ansible_") for name in facts)
        return collect(self, event)

    monkeypatch.setattr(runner._Collector, "__call__", recording)
    report = run_node_checks(NodesConfig(**consistent.nodes_section(rdzv_port=free_port())), two_node_cluster())
    assert report.ok, [(r.check, r.finding) for r in report.blocking]
    assert gathered == {"node-a": FACTS_THE_ROLES_READ, "node-b": FACTS_THE_ROLES_READ}
    assert report.row("OS").values["node-a"] == report.row("OS").values["node-b"] != "absent"
