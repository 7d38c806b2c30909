"""Every row of the drift table, and every exception a row makes, flags a host that differs with its fix."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from tasks.nodes.check import build_report
from tasks.nodes.drift import DRIFT_CHECKS
from tests.conftest import deep_merge
from tests.unit.nodes.conftest import gpu_node

GPU_JOB = {"accelerator": "h100", "procs_per_node": 8}
PYTHON = "/opt/venv/bin/python"


@dataclass(frozen=True)
class Case:
    """node-b reports `odd` on top of `common` (which every host reports); the row must flag `hosts`."""

    check: str
    odd: dict[str, Any]
    severity: str
    remediation: str
    common: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)
    hosts: tuple[str, ...] = ("node-b",)
    finding: str | None = None

    def __str__(self) -> str:
        return self.check


def facts(**values: Any) -> dict[str, Any]:
    return {"facts": values}


def system(**values: Any) -> dict[str, Any]:
    return facts(system=values)


def python(**values: Any) -> dict[str, Any]:
    return facts(python=values)


# One plain drift per row of the table.
DRIFTS = [
    Case("OS", facts(os="Debian 12.4"), "warning", "rebuild node-b from the same OS image as the others (Debian 12.5)"),
    Case(
        "kernel",
        facts(kernel="6.1.0-20-amd64"),
        "warning",
        "boot kernel 6.1.0-18-amd64 on node-b (or reimage them like the others)",
    ),
    Case(
        "CPU architecture",
        facts(arch="aarch64"),
        "blocking",
        "use x86_64 nodes only: node-b cannot run the same image",
    ),
    Case(
        "CPUs",
        system(cpu_count=32),
        "warning",
        "node-b are a different node type; data loading runs at the slowest node",
    ),
    Case(
        "memory",
        system(memory_bytes=256 * 2**30),
        "warning",
        "node-b have another amount of memory (512 GiB elsewhere); check for failed DIMMs or a different node type",
    ),
    Case(
        "container runtime",
        system(container_runtimes={"docker": "Docker version 25.0.3, build 4debf41"}),
        "warning",
        "install the same container runtime (docker 24.0.7) on node-b",
    ),
    Case(
        "Python",
        python(version="3.12.1"),
        "blocking",
        f"give the job Python 3.11.7 at {PYTHON} on node-b (nodes.python)",
    ),
    Case(
        "torch",
        python(torch={"version": "2.4.0"}),
        "blocking",
        f"install torch 2.5.1 in {PYTHON} on node-b (pip install 'torch==2.5.1'), "
        "or rebuild them from the same image as the others",
    ),
    Case(
        "torch CUDA build",
        python(torch={"cuda": "11.8"}),
        "blocking",
        "install the same torch build as the others (the +cu124 wheel for CUDA 12.4) on node-b",
        common=python(torch={"cuda": "12.4"}),
    ),
    Case(
        "NCCL (torch wheel)",
        python(nccl_wheel=None),
        "blocking",
        f"install nvidia-nccl 2.21.5 in {PYTHON} on node-b",
        common=gpu_node(),
        cluster=GPU_JOB,
    ),
    Case(
        "NCCL (system)",
        system(nccl_system="2.18.1"),
        "warning",
        "install NCCL 2.21.5 (libnccl2) on node-b",
        common=gpu_node(),
        cluster=GPU_JOB,
    ),
    Case(
        "NVIDIA driver",
        system(driver_version="535.161.08"),
        "blocking",
        "install NVIDIA driver 550.54.15 on node-b (the same branch everywhere)",
        common=gpu_node(),
        cluster=GPU_JOB,
    ),
    Case(
        "CUDA (driver)",
        system(cuda_version="12.2"),
        "warning",
        "install a driver supporting CUDA 12.4 on node-b",
        common=gpu_node(),
        cluster=GPU_JOB,
    ),
    Case(
        "GPUs",
        gpu_node(count=9),
        "warning",
        "node-b show another GPU count than the others (8): check `nvidia-smi -L` "
        "and `dmesg | grep -i xid`, or take them out of the job",
        common=gpu_node(),
    ),
    Case(
        "GPU model",
        gpu_node(name="NVIDIA A100-SXM4-80GB"),
        "blocking",
        "use nodes with NVIDIA H100 80GB HBM3 81559 MiB only; node-b have other GPUs",
        common=gpu_node(),
        cluster=GPU_JOB,
    ),
]

# The rows that know more than "differs": the finding they make instead.
EXCEPTIONS = [
    Case(
        "Python",
        facts(python_error="/opt/venv/bin/python: No such file or directory"),
        "blocking",
        "install Python on the nodes or point nodes.python at the job's interpreter",
        common=facts(python=None),
        finding=f"the job's Python {PYTHON} does not run on any node: /opt/venv/bin/python: No such file or directory",
    ),
    Case(
        "Python",
        facts(python=None, python_error="Illegal instruction"),
        "blocking",
        f"give the job Python 3.11.7 at {PYTHON} on node-b (nodes.python)",
        finding="Python differs: 3.11.7 on node-a, node-c; absent on node-b; node-b: Illegal instruction",
    ),
    Case(
        "torch",
        {},
        "warning",
        "fine when the job runs in a container image; else install torch in nodes.python",
        common=python(torch=None),
        hosts=("node-a", "node-b", "node-c"),
        finding=f"torch is not installed in {PYTHON} on any node",
    ),
    Case(
        "torch CUDA build",
        python(torch={"cuda": None}),
        "blocking",
        f"install a CUDA build of torch in {PYTHON} on node-b",
        common=gpu_node(),
        cluster=GPU_JOB,
        finding="torch is a CPU-only build on node-b, the job needs GPUs",
    ),
    Case(
        "GPUs",
        gpu_node(count=6),
        "blocking",
        "check `nvidia-smi -L` and `dmesg | grep -i xid` on node-b, or drain them and use nodes with 8 GPUs",
        common=gpu_node(),
        cluster=GPU_JOB,
        finding="missing GPUs: node-b have fewer than 8 (cluster.procs_per_node)",
    ),
]


def test_every_row_of_the_drift_table_has_a_case_and_every_exception_too() -> None:
    assert [c.check for c in DRIFTS] == [check.name for check in DRIFT_CHECKS]
    assert {c.check for c in EXCEPTIONS} == {check.name for check in DRIFT_CHECKS if check.exception}


@pytest.mark.parametrize("case", [*DRIFTS, *EXCEPTIONS], ids=str)
def test_each_check_flags_the_host_that_differs_with_its_severity_and_remediation(
    make_run: Callable, make_plan: Callable, case: Case
) -> None:
    names = ["node-a", "node-b", "node-c"]
    overrides = {n: deep_merge(case.common, case.odd) if n == "node-b" else case.common for n in names}
    report = build_report(make_run(overrides), make_plan(names, case.cluster))
    row = report.row(case.check)
    assert (row.severity, row.hosts, row.remediation) == (case.severity, list(case.hosts), case.remediation)
    if case.finding:
        assert row.finding == case.finding
    else:
        assert row.finding.startswith(f"{case.check} differs: ")


def test_identical_hosts_flag_no_row_of_the_drift_table(make_run: Callable, make_plan: Callable) -> None:
    names = ["node-a", "node-b", "node-c"]
    report = build_report(make_run(dict.fromkeys(names, gpu_node())), make_plan(names, GPU_JOB))
    rows = [report.row(check.name) for check in DRIFT_CHECKS]
    assert [(r.check, r.severity) for r in rows] == [(check.name, "ok") for check in DRIFT_CHECKS]
