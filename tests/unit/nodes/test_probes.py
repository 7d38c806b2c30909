"""The probes the roles run on the nodes: nvidia-smi parsing, storage, name resolution, the job's Python."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from tasks.nodes.runner import PLAYBOOKS
from tests.unit.nodes.conftest import load_role_file

# `nvidia-smi --query-gpu=...` on an 8 x H100 node with one GPU whose ECC counter is unsupported.
GPU_QUERY_OUTPUT = """\
0, NVIDIA H100 80GB HBM3, 81559, 550.54.15, Enabled, 0
1, NVIDIA H100 80GB HBM3, 81559, 550.54.15, Enabled, 2
2, NVIDIA H100 80GB HBM3, 81559, 550.54.15, [N/A], [N/A]
"""
NVIDIA_SMI_HEADER = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
|-----------------------------------------+------------------------+----------------------+
"""


def test_gpu_query_output_becomes_one_record_per_gpu_with_unavailable_fields_as_none() -> None:
    probe = load_role_file("node_facts/library/tdeploy_node_probe.py")
    gpus = probe.parse_gpu_query(GPU_QUERY_OUTPUT)
    assert [g["index"] for g in gpus] == [0, 1, 2]
    assert gpus[0] == {
        "index": 0,
        "name": "NVIDIA H100 80GB HBM3",
        "memory_mib": 81559,
        "driver_version": "550.54.15",
        "ecc_mode": "Enabled",
        "ecc_uncorrected_errors": 0,
    }
    assert gpus[1]["ecc_uncorrected_errors"] == 2
    assert gpus[2]["ecc_mode"] is None and gpus[2]["ecc_uncorrected_errors"] is None
    assert probe.parse_cuda_version(NVIDIA_SMI_HEADER) == "12.4"
    assert probe.nccl_version_from_filename("/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5") == "2.21.5"
    assert probe.nccl_version_from_filename("/usr/lib/x86_64-linux-gnu/libnccl.so") is None


def test_node_without_nvidia_smi_reports_gpus_absent_not_an_error() -> None:
    probe = load_role_file("node_facts/library/tdeploy_node_probe.py")
    if shutil.which("nvidia-smi"):
        found = probe.nvidia(30)
        assert found["gpus"] and found["driver_version"] and found["gpu_error"] is None, found
        return
    assert probe.nvidia(5) == {
        "nvidia_smi": None,
        "driver_version": None,
        "cuda_version": None,
        "gpus": [],
        "gpu_error": None,
    }


def test_storage_probe_writes_for_real_and_reports_missing_paths_and_free_space(tmp_path: Path) -> None:
    storage = load_role_file("node_storage/library/tdeploy_storage_probe.py")
    ok = storage.check(str(tmp_path), 0.001)
    assert ok["exists"] and ok["writable"] and ok["error"] is None and ok["free_bytes"] > 0
    assert list(tmp_path.iterdir()) == [], "the write check removes its file"
    assert storage.check(str(tmp_path / "nope"), None)["error"] == "does not exist"
    (tmp_path / "file").write_text("x")
    assert storage.check(str(tmp_path / "file"), None)["error"] == "is not a directory"
    full = storage.check(str(tmp_path), 10**9)
    assert full["writable"] and full["error"].endswith("GB free, needs 1e+09 GB")


def test_resolver_reports_each_name_and_the_error_of_those_that_do_not_resolve() -> None:
    resolve = load_role_file("node_network/library/tdeploy_network_probe.py")
    addresses, errors = resolve.resolve_all(["localhost", "no-such-node.invalid"], timeout_s=10)
    assert addresses["localhost"] and addresses["no-such-node.invalid"] == []
    assert list(errors) == ["no-such-node.invalid"]


def test_python_probe_reads_torch_build_without_importing_torch() -> None:
    script = PLAYBOOKS / "roles" / "node_facts" / "files" / "python_probe.py"
    code = "import sys, runpy; runpy.run_path(sys.argv[1]); print(int('torch' in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code, str(script)], capture_output=True, text=True, check=True)
    report, imported = out.stdout.splitlines()
    report = json.loads(report)
    assert report["version"] == ".".join(map(str, sys.version_info[:3]))
    assert report["torch"]["version"] == metadata.version("torch")
    assert imported == "0"
