"""The typed model of what the roles report: the test fixtures and the roles' own probes produce that shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from tasks.nodes.facts import Gpu, HostReport, Mount, PythonFacts, SystemFacts
from tasks.nodes.runner import PLAYBOOKS
from tests.unit.nodes.conftest import HEALTHY, gpu_node, host, load_role_file
from tests.unit.nodes.test_probes import GPU_QUERY_OUTPUT

NAMES = ["node-a", "node-b"]


@pytest.mark.parametrize("overrides", [None, gpu_node(), gpu_node(count=7, ecc_mode="Disabled")])
def test_fixture_hosts_validate_against_the_typed_report_and_round_trip(overrides: dict | None) -> None:
    for name in NAMES:
        report = host(name, NAMES, overrides)
        assert HostReport.model_validate(report.model_dump()) == report
        assert report.complete and report.facts is not None and report.facts.hostname == name
    assert HostReport.model_validate(HEALTHY.model_dump(mode="json")) == HEALTHY


@pytest.mark.parametrize(
    "overrides",
    [
        {"facts": {"kernal": "6.1.0"}},
        {"facts": {"system": {"gpus": [{"index": 0, "memory_gib": 80}]}}},
        {"network": {"connect": {"connected": True, "secs": 0.1}}},
        {"security": {"probe_rc": "not a number"}},
    ],
)
def test_a_misspelled_or_mistyped_field_is_refused(overrides: dict) -> None:
    with pytest.raises(ValidationError):
        host("node-a", NAMES, overrides)


def test_a_role_that_did_not_finish_leaves_its_section_absent() -> None:
    report = HostReport.model_validate({"facts": HEALTHY.model_dump()["facts"]})
    assert report.facts is not None and report.network is None and not report.complete


def test_what_the_probes_print_on_this_machine_validates_against_the_model(tmp_path: Path) -> None:
    script = PLAYBOOKS / "roles" / "node_facts" / "files" / "python_probe.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
    assert PythonFacts.model_validate(json.loads(out.splitlines()[-1])).version

    probe = load_role_file("node_facts/library/tdeploy_node_probe.py")
    assert [Gpu.model_validate(g).index for g in probe.parse_gpu_query(GPU_QUERY_OUTPUT)] == [0, 1, 2]
    found = {
        "cpu_count": os.cpu_count(),
        "memory_bytes": probe.memory_bytes(),
        "container_runtimes": probe.container_runtimes(10),
        "nccl_system": probe.system_nccl(10),
        **probe.nvidia(30),
    }
    assert SystemFacts.model_validate(found).cpu_count == os.cpu_count()

    storage = load_role_file("node_storage/library/tdeploy_storage_probe.py")
    for mount in (storage.check(str(tmp_path), 0.001), storage.check(str(tmp_path / "nope"), None)):
        assert Mount.model_validate(mount).path == mount["path"]
