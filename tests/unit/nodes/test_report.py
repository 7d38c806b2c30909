"""The consistency report: which drift blocks, which warns, who is named, and what retries."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tasks.errors import TransientError, UserError, retry_on_transient
from tasks.nodes.check import NodeCheckFailed, NodesUnreachable, build_report, raise_for_blocking
from tasks.nodes.report import NodeReport, grouped_values
from tests.unit.nodes.conftest import CLOCK, gpu_node

ABC = ["node-a", "node-b", "node-c"]


def report_of(
    make_run: Callable,
    make_plan: Callable,
    overrides: dict,
    cluster: dict | None = None,
    windows: dict[str, tuple[float, float]] | None = None,
) -> NodeReport:
    return build_report(make_run(overrides, windows), make_plan(list(overrides), cluster))


def test_identical_healthy_nodes_have_no_finding(make_run: Callable, make_plan: Callable) -> None:
    report = report_of(make_run, make_plan, dict.fromkeys(ABC))
    assert report.ok and not report.warnings, [r.finding for r in report.rows if r.finding]
    assert report.row("torch").values == dict.fromkeys(ABC, "2.5.1")
    assert report.row("NVIDIA driver").values == dict.fromkeys(ABC, "absent"), "absent on CPU nodes, not an error"


def test_torch_minor_version_drift_blocks_and_names_the_odd_host_with_both_values(
    make_run: Callable, make_plan: Callable
) -> None:
    odd = {"facts": {"python": {"torch": {"version": "2.4.0"}}}}
    report = report_of(make_run, make_plan, {"node-a": None, "node-b": odd, "node-c": None})
    row = report.row("torch")
    assert row.severity == "blocking" and row.hosts == ["node-b"]
    assert row.finding == "torch differs: 2.5.1 on node-a, node-c; 2.4.0 on node-b"
    assert "install torch 2.5.1 in /opt/venv/bin/python on node-b" in row.remediation
    assert report.blocking_hosts == ["node-b"]


@pytest.mark.parametrize(
    ("path", "reference", "other", "severity"),
    [
        (("facts", "kernel"), "6.1.0-18-amd64", "6.1.0-20-amd64", "warning"),
        (("facts", "os"), "Debian 12.5", "Debian 12.4", "warning"),
        (("facts", "python", "version"), "3.11.7", "3.11.2", "warning"),
        (("facts", "python", "version"), "3.11.7", "3.12.1", "blocking"),
        (("facts", "python", "torch", "version"), "2.5.1", "2.5.0", "warning"),
        (("facts", "system", "driver_version"), "550.54.15", "550.90.07", "warning"),
        (("facts", "system", "driver_version"), "550.54.15", "535.161.08", "blocking"),
        (("facts", "system", "cuda_version"), "12.4", "12.2", "warning"),
        (("facts", "system", "cuda_version"), "12.4", "11.8", "blocking"),
        (("facts", "system", "nccl_system"), "2.21.5", "2.18.1", "warning"),
        (("facts", "arch"), "x86_64", "aarch64", "blocking"),
    ],
)
def test_drift_severity_follows_the_version_part_that_differs(
    make_run: Callable, make_plan: Callable, path: tuple[str, ...], reference: str, other: str, severity: str
) -> None:
    def set_value(value: str) -> dict:
        out: dict = {}
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
        return out

    overrides = {"node-a": set_value(reference), "node-b": set_value(other), "node-c": set_value(reference)}
    report = report_of(make_run, make_plan, overrides)
    drifted = [r for r in report.rows if r.hosts == ["node-b"]]
    assert [r.severity for r in drifted] == [severity], [(r.check, r.severity) for r in report.rows]
    assert reference in drifted[0].finding and other in drifted[0].finding


def test_gpu_job_blocks_on_missing_gpu_absent_nccl_and_cpu_only_torch(make_run: Callable, make_plan: Callable) -> None:
    gpus = {"accelerator": "h100", "procs_per_node": 8}
    broken = gpu_node(count=7)
    broken["facts"]["system"]["nccl_system"] = None
    broken["facts"]["python"]["torch"] = {"version": "2.5.1", "cuda": None}
    report = report_of(make_run, make_plan, {"node-a": gpu_node(), "node-b": broken, "node-c": gpu_node()}, gpus)
    assert report.row("GPUs").severity == "blocking"
    assert report.row("GPUs").finding == "missing GPUs: node-b have fewer than 8 (cluster.procs_per_node)"
    assert report.row("NCCL (system)").severity == "blocking", "absent NCCL matters once the spec asks for GPUs"
    assert report.row("torch CUDA build").finding == "torch is a CPU-only build on node-b, the job needs GPUs"
    assert report.blocking_hosts == ["node-b"]


def test_uncorrected_ecc_errors_block_and_disabled_ecc_warns(make_run: Callable, make_plan: Callable) -> None:
    gpus = {"accelerator": "h100", "procs_per_node": 8}
    report = report_of(
        make_run,
        make_plan,
        {"node-a": gpu_node(), "node-b": gpu_node(ecc_uncorrected_errors=3), "node-c": gpu_node(ecc_mode="Disabled")},
        gpus,
    )
    row = report.row("GPU health")
    assert row.severity == "blocking" and row.hosts == ["node-b"]
    assert row.values["node-b"] == "uncorrected ECC errors on GPU 0, 1, 2, 3, 4, 5, 6, 7"
    assert row.values["node-c"] == "ok, ECC disabled"


def test_clock_skew_beyond_the_threshold_names_the_host_that_is_off(make_run: Callable, make_plan: Callable) -> None:
    late = {"facts": {"clock_epoch_s": CLOCK + 30}}
    report = report_of(make_run, make_plan, {"node-a": None, "node-b": None, "node-c": late})
    row = report.row("clock")
    assert row.severity == "blocking" and row.hosts == ["node-c"]
    assert "clocks differ by at least 29.80 s (nodes.max_clock_skew_s=1.0)" in row.finding


def test_clock_reading_within_the_measurement_window_is_not_skew(make_run: Callable, make_plan: Callable) -> None:
    # node-c answered slowly: its reading is 2 s after node-a's, but inside the window its task ran in.
    slow = {"facts": {"clock_epoch_s": CLOCK + 2}}
    windows = {"node-c": (CLOCK - 0.1, CLOCK + 2.5)}
    report = report_of(make_run, make_plan, {"node-a": None, "node-b": None, "node-c": slow}, windows=windows)
    assert report.row("clock").severity == "ok"


def test_closed_rendezvous_port_blocks_with_firewall_remediation(make_run: Callable, make_plan: Callable) -> None:
    dropped = {"network": {"connect": {"connected": False, "error": "timed out after 5s (packets dropped)"}}}
    report = report_of(make_run, make_plan, {"node-a": None, "node-b": dropped, "node-c": None})
    row = report.row("rendezvous port 29500")
    assert row.severity == "blocking" and row.hosts == ["node-b"]
    assert row.values["node-c"].startswith("connected")
    assert "open TCP port 29500 on node-a" in row.remediation


def test_rendezvous_port_in_use_on_the_first_node_blocks(make_run: Callable, make_plan: Callable) -> None:
    taken = {"network": {"listener": {"listening": False, "error": "cannot listen on port 29500: Address in use"}}}
    report = report_of(make_run, make_plan, {"node-a": taken, "node-b": None})
    row = report.row("rendezvous port 29500")
    assert row.severity == "blocking" and row.hosts == ["node-a"]
    assert "ss -ltnp 'sport = :29500'" in row.remediation


def test_only_connection_failures_are_transient(make_run: Callable, make_plan: Callable) -> None:
    timed_out = {
        "unreachable": (
            'Task failed: Data could not be sent to remote host "10.0.0.3". Make sure this host can be reached over '
            "ssh: ssh: connect to host 10.0.0.3 port 22: Connection timed out"
        )
    }
    report = report_of(make_run, make_plan, {"node-a": None, "node-b": timed_out, "node-c": None})
    expected = "unreachable: connect to host 10.0.0.3 port 22: Connection timed out"
    assert report.row("reachable").values["node-b"] == expected
    with pytest.raises(NodesUnreachable) as unreachable:
        raise_for_blocking(report)
    assert isinstance(unreachable.value, TransientError) and unreachable.value.hosts == ["node-b"]

    denied = {"unreachable": "Failed to connect to the host via ssh: root@10.0.0.3: Permission denied (publickey)."}
    report = report_of(make_run, make_plan, {"node-a": None, "node-b": denied})
    assert "authorise the controller's key (nodes.ssh_key_path)" in report.row("reachable").remediation
    with pytest.raises(NodeCheckFailed):
        raise_for_blocking(report)

    drift = {"facts": {"python": {"torch": {"version": "2.4.0"}}}}
    report = report_of(make_run, make_plan, {"node-a": None, "node-b": timed_out, "node-c": drift})
    with pytest.raises(NodeCheckFailed) as failed:
        raise_for_blocking(report)
    assert isinstance(failed.value, UserError) and failed.value.hosts == ["node-b", "node-c"]
    assert "torch differs: 2.5.1 on node-a; 2.4.0 on node-c" in str(failed.value)


class _State:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def result(self) -> None:
        raise self.error


def test_prefect_retry_rule_retries_unreachable_nodes_and_never_drift(make_run: Callable, make_plan: Callable) -> None:
    refused = {"unreachable": "ssh: connect to host 10.0.0.3 port 22: Connection timed out"}
    errors = []
    for overrides in ({"node-a": None, "node-b": refused}, {"node-a": None, "node-b": {"facts": {"arch": "aarch64"}}}):
        with pytest.raises(Exception) as err:
            raise_for_blocking(report_of(make_run, make_plan, overrides))
        errors.append(err.value)
    assert [retry_on_transient(None, None, _State(e)) for e in errors] == [True, False]


def test_table_groups_values_so_a_thousand_hosts_stay_readable() -> None:
    values = {f"node-{i:04d}": "2.5.1" for i in range(1000)} | {"node-0500": "2.4.0"}
    text = grouped_values(values)
    assert text.startswith(
        "2.5.1 (node-0000, node-0001, node-0002, node-0003, node-0004 and 994 more); 2.4.0 (node-0500)"
    )
    assert grouped_values({f"n{i}": "ok" for i in range(20)}) == "ok (all 20)"
