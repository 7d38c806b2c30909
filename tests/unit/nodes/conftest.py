"""Helpers for the node-check unit tests: per-host results as the roles publish them, and the probe scripts."""

from __future__ import annotations

import dataclasses
import importlib.util
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tasks.launch.cluster import ClusterConfig
from tasks.nodes.config import NodesConfig
from tasks.nodes.facts import (
    Connect,
    Gpu,
    HostReport,
    Listener,
    ListenerStop,
    Mount,
    NetworkFacts,
    NodeFacts,
    PythonFacts,
    SecurityFacts,
    SystemFacts,
    TorchBuild,
)
from tasks.nodes.inventory import CheckPlan, plan_checks
from tasks.nodes.runner import PLAYBOOKS, PlaybookRun
from tests.conftest import deep_merge

CLOCK = 1_800_000_000.0

# What one healthy CPU node publishes through set_stats, built through the roles' typed report.
HEALTHY = HostReport(
    facts=NodeFacts(
        os="Debian 12.5",
        kernel="6.1.0-18-amd64",
        arch="x86_64",
        hostname="node",
        fqdn="node",
        system=SystemFacts(
            cpu_count=64,
            memory_bytes=512 * 2**30,
            container_runtimes={"docker": "Docker version 24.0.7, build afdd53b"},
        ),
        job_python="/opt/venv/bin/python",
        python=PythonFacts(
            executable="/opt/venv/bin/python",
            version="3.11.7",
            torch=TorchBuild(version="2.5.1", path="/opt/venv/lib/torch"),
        ),
        python_error="",
        clock_epoch_s=CLOCK,
    ),
    storage=[
        Mount(
            path="/data",
            min_free_gb=10.0,
            exists=True,
            writable=True,
            free_bytes=500 * 10**9,
            total_bytes=1000 * 10**9,
            mount_point="/data",
            fs_type="nfs4",
        )
    ],
    network=NetworkFacts(
        rdzv_host="node-a", rdzv_target="node-a", rdzv_port=29500, connect=Connect(connected=True, seconds=0.01)
    ),
    security=SecurityFacts(connection="ssh", key_auth=True, probe_rc=255, methods=["publickey"], probe_error=""),
)

GPU = Gpu(
    index=0,
    name="NVIDIA H100 80GB HBM3",
    memory_mib=81559,
    driver_version="550.54.15",
    ecc_mode="Enabled",
    ecc_uncorrected_errors=0,
)
GPU_SYSTEM = {"nvidia_smi": "/usr/bin/nvidia-smi", "driver_version": "550.54.15", "cuda_version": "12.4"}


def gpu_node(count: int = 8, **gpu: Any) -> dict[str, Any]:
    """Overrides that turn HEALTHY into a GPU node with `count` GPUs."""
    gpus = [Gpu.model_validate({**GPU.model_dump(), "index": i, **gpu}).model_dump() for i in range(count)]
    return {
        "facts": {
            "system": {**GPU_SYSTEM, "nccl_system": "2.21.5", "gpus": gpus},
            "python": {"torch": {"version": "2.5.1+cu124", "cuda": "12.4"}, "nccl_wheel": "2.21.5"},
        }
    }


def host(name: str, names: list[str], overrides: dict[str, Any] | None = None) -> HostReport:
    """One host's report: HEALTHY resolving the other names, with overrides merged in (and validated)."""
    result = HEALTHY.model_copy(deep=True)
    assert result.facts is not None and result.network is not None
    result.facts.hostname = result.facts.fqdn = name
    result.network.resolved = {n: [f"10.0.0.{names.index(n) + 2}"] for n in names if n != name}
    if name == names[0]:
        result.network.connect = Connect()
        result.network.listener = Listener(listening=True, pid=4242)
        result.network.listener_stop = ListenerStop(
            stopped=True, peers=[f"10.0.0.{i + 2}" for i in range(1, len(names))]
        )
    return HostReport.model_validate(deep_merge(result.model_dump(), overrides or {}))


@pytest.fixture
def make_run() -> Callable[..., PlaybookRun]:
    """A PlaybookRun as the runner returns it, from per-host overrides of a healthy node."""

    def factory(
        overrides: dict[str, dict[str, Any] | None],
        windows: dict[str, tuple[float, float]] | None = None,
        status: str = "successful",
    ) -> PlaybookRun:
        names = list(overrides)
        unreachable = {n: o["unreachable"] for n, o in overrides.items() if o and "unreachable" in o}
        results = {n: host(n, names, o).model_dump() for n, o in overrides.items() if n not in unreachable}
        return PlaybookRun(
            hosts=names,
            results=results,
            unreachable=unreachable,
            failed={},
            clock_windows={n: (windows or {}).get(n, (CLOCK - 0.1, CLOCK + 0.1)) for n in results},
            status=status,
            rc=0,
            elapsed_s=1.0,
        )

    return factory


@pytest.fixture
def make_plan() -> Callable[..., CheckPlan]:
    """The plan for hosts by name (over SSH), with cluster and nodes overrides."""

    def factory(names: list[str], cluster: dict[str, Any] | None = None, **nodes: Any) -> CheckPlan:
        cfg = ClusterConfig(**{"scheduler": "slurm", "nodes": len(names), "procs_per_node": 1, **(cluster or {})})
        nodes = {"python": "/opt/venv/bin/python", **nodes}
        return plan_checks(NodesConfig(hosts=[{"name": n} for n in names], **nodes), cfg)

    return factory


ANSIBLE_PATCH_TARGETS = ((sys, "intern"), (socket, "getaddrinfo"), (dataclasses, "_is_type"))
"""What ansible-core replaces on its first import (ansible.module_utils._internal._patches) for its own string
and int types. In production the roles' modules and plugins run in Ansible's processes; in a pytest worker the
replaced sys.intern makes a later `import torch._dynamo` fail, so `load_role_file` puts the originals back."""


def load_role_file(relative: str) -> ModuleType:
    """Import a module, plugin or script shipped in playbooks/roles/ (they are not a Python package), leaving
    the interpreter as it was (see ANSIBLE_PATCH_TARGETS)."""
    path = Path(PLAYBOOKS) / "roles" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    originals = [(container, name, getattr(container, name)) for container, name in ANSIBLE_PATCH_TARGETS]
    try:
        spec.loader.exec_module(module)
    finally:
        for container, name, original in originals:
            setattr(container, name, original)
    return module
