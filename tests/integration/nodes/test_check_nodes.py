"""Node checks over real SSH against real test nodes: what passes, what blocks, and who is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.nodes.check import NodeCheckFailed, raise_for_blocking, run_node_checks
from tasks.nodes.config import NodesConfig
from tasks.nodes.inventory import plan_checks
from tasks.nodes.report import NodeReport
from tasks.nodes.runner import PlaybookDidNotRun, RoleArgumentsRejected, run_playbook
from tests.conftest import TINY_SPEC, deep_merge
from tests.integration.nodes.conftest import RDZV_PORT, FaultyRun, free_port, two_node_cluster
from tests.integration.nodes.testhosts import SshdCluster

pytestmark = pytest.mark.integration


def test_two_consistent_hosts_pass(consistent: SshdCluster) -> None:
    nodes = NodesConfig(**consistent.nodes_section(rdzv_port=free_port()))
    report = run_node_checks(nodes, two_node_cluster())
    assert report.ok, [(r.check, r.finding) for r in report.blocking]
    assert report.warnings == [], [(r.check, r.finding) for r in report.warnings]
    assert report.hosts == ["node-a", "node-b"]
    torch = report.row("torch").values
    assert torch["node-a"] == torch["node-b"] != "absent"
    rdzv = report.row(f"rendezvous port {nodes.rdzv_port}")
    assert rdzv.values["node-a"] == "listening (1 peers connected)"
    assert rdzv.values["node-b"].startswith("connected in")
    storage = report.row(f"storage {consistent.scratch}").values
    assert list(storage) == ["node-a", "node-b"] and all(v.startswith("ok, ") for v in storage.values())
    assert report.row("SSH password login").values == {
        "node-a": "disabled (publickey)",
        "node-b": "disabled (publickey)",
    }
    assert report.row("name resolution").values == {"node-a": "ok (1 names)", "node-b": "ok (1 names)"}
    raise_for_blocking(report)


def test_bad_role_variable_is_rejected_by_the_argument_spec_before_any_check(consistent: SshdCluster) -> None:
    plan = plan_checks(NodesConfig(**consistent.nodes_section()), two_node_cluster())
    extravars = {**plan.extravars, "node_storage_mounts": [{"path": "/data", "min_free_gb": "lots"}]}
    with pytest.raises(RoleArgumentsRejected) as err:
        run_playbook(plan.inventory, extravars, forks=2, connect_timeout_s=5, task_timeout_s=60, run_timeout_s=120)
    assert any("min_free_gb" in e and "node_storage_mounts" in e and "float" in e for e in err.value.errors), (
        err.value.errors
    )
    checks = [line for line in err.value.log.splitlines() if line.startswith("TASK [node_")]
    assert all("Validating arguments" in line for line in checks), f"no check may run with a bad variable: {checks}"


def test_cli_with_an_existing_inventory_exits_1_naming_hosts_and_fix(consistent: SshdCluster, tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.ini"
    inventory.write_text(
        "[trainers]\n"
        + "".join(f"{h.name} ansible_host={h.address} ansible_port={h.port}\n" for h in consistent.hosts)
        + "[others]\nnot-a-trainer ansible_host=192.0.2.1\n"
    )
    section = consistent.nodes_section(storage=[{"path": consistent.scratch, "min_free_gb": 10**9}])
    del section["hosts"]
    section.update(inventory_path=str(inventory), inventory_pattern="trainers", rdzv_port=free_port())
    spec = deep_merge(
        TINY_SPEC,
        {
            "data": {"dataset_url": str(tmp_path / "d")},
            "checkpoint": {"url": str(tmp_path / "c")},
            "run": {"output_url": str(tmp_path / "o")},
            "nodes": section,
        },
    )
    (tmp_path / "d").mkdir()  # every command's preflight wants the dataset to exist
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    out = CliRunner().invoke(app, ["check-nodes", str(tmp_path / "spec.yaml"), "--out", str(tmp_path)])
    assert out.exit_code == 1, out.output
    assert "2 node(s) NOT ready (blocking on node-a, node-b)" in out.output
    report = NodeReport.read(tmp_path / "node-check.json")
    assert report.hosts == ["node-a", "node-b"], "only the hosts of the pattern, in inventory order"
    (row,) = report.blocking
    assert row.check == f"storage {consistent.scratch}"
    assert "needs 1e+09 GB" in (row.finding or "") and "with at least 1e+09 GB free" in (row.remediation or "")
    assert (tmp_path / "node-check.log").read_text().count("PLAY RECAP") == 1


def test_host_with_a_different_python_is_blocking_drift_with_both_values(faulty: FaultyRun) -> None:
    torch = faulty.report.row("torch")
    assert torch.severity == "blocking" and torch.hosts == ["node-b"]
    version = torch.values["node-a"]
    assert torch.values == {"node-a": version, "node-b": "absent"}
    assert torch.finding == f"torch differs: {version} on node-a; absent on node-b"
    assert f"install torch {version} in {faulty.cluster.job_python} on node-b" in torch.remediation


def test_closed_rendezvous_port_is_caught(faulty: FaultyRun) -> None:
    row = faulty.report.row(f"rendezvous port {RDZV_PORT}")
    assert row.severity == "blocking" and row.hosts == ["node-b"]
    assert row.values["node-a"] == "listening (0 peers connected)"
    assert "timed out" in row.values["node-b"] and "firewall" in row.values["node-b"]
    assert f"open TCP port {RDZV_PORT} on node-a to the other nodes" in row.remediation


def test_stopped_and_hung_sshd_are_unreachable_while_the_others_report(faulty: FaultyRun) -> None:
    report = faulty.report
    reachable = report.row("reachable")
    assert reachable.severity == "blocking" and reachable.hosts == ["node-c", "node-d"]
    assert reachable.values["node-a"] == reachable.values["node-b"] == "ok"
    assert "Connection refused" in reachable.values["node-c"]
    assert "timed out" in reachable.values["node-d"].lower(), "the frozen sshd is cut off by the connect timeout"
    assert report.run_status != "timeout", "the run finished by itself; it was not stopped by run_timeout_s"
    assert "start sshd on node-c" in reachable.remediation
    assert "node-d did not answer within nodes.connect_timeout_s" in reachable.remediation
    assert set(report.row("OS").values) == {"node-a", "node-b"}, "the reachable nodes still report"


def test_missing_mount_unresolvable_peer_and_password_login_are_blocking(faulty: FaultyRun) -> None:
    report = faulty.report
    storage = report.row(f"storage {faulty.cluster.scratch}")
    assert storage.hosts == ["node-b"] and storage.values["node-b"] == "does not exist"
    resolution = report.row("name resolution")
    assert resolution.hosts == ["node-b"] and resolution.values["node-b"] == "cannot resolve node-c"
    password = report.row("SSH password login")
    assert password.hosts == ["node-b"] and password.values["node-b"] == "enabled (publickey, password)"
    assert report.blocking_hosts == ["node-b", "node-c", "node-d"]
    with pytest.raises(NodeCheckFailed, match="node checks failed on node-b, node-c, node-d"):
        raise_for_blocking(report)


def test_inventory_pattern_matching_no_host_is_an_error_not_an_empty_pass(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.ini"
    inventory.write_text("[trainers]\nnode-a ansible_host=192.0.2.1\n")
    nodes = NodesConfig(inventory_path=str(inventory), inventory_pattern="gpu_nodes")
    with pytest.raises(PlaybookDidNotRun, match="reached no node") as err:
        run_node_checks(nodes, two_node_cluster())
    assert "does any host match?" in str(err.value)
