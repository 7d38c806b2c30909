#!/usr/bin/python
"""Ansible module: the OS facts the checks use, CPUs, memory, container runtimes, NVIDIA driver, CUDA, GPUs,
system NCCL and the job's Python of a node, in one module run (each separate run costs the node an SSH
session, a Python start and an AnsiballZ unpack, and the controller a round trip)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.facts import ansible_collector
from ansible.module_utils.facts.namespace import PrefixFactNamespace
from ansible.module_utils.facts.system.distribution import DistributionFactCollector
from ansible.module_utils.facts.system.platform import PlatformFactCollector
from ansible.module_utils.facts.system.python import PythonFactCollector

DOCUMENTATION = r"""
module: tdeploy_node_probe
short_description: Gather the OS facts, hardware, accelerator stack and job Python of a node
description:
  - The OS facts the node checks read (distribution and version, kernel, architecture, host name, FQDN,
    Ansible's Python), gathered with Ansible's own fact collectors for only those subsets and returned as
    ansible_facts, as M(ansible.builtin.setup) with a gather_subset and a filter would.
  - CPU count, memory, container runtimes and their versions, NVIDIA driver and CUDA version,
    GPUs (model, memory, ECC mode, uncorrected ECC errors) from nvidia-smi, and the system NCCL.
  - The job's Python and its torch build, from a probe script run under that Python.
  - Absent pieces (no nvidia-smi on a CPU node, a job Python that does not run) are reported, never a failure.
options:
  command_timeout_s:
    description: Seconds one probe command (the job's Python included) may take before it counts as hung.
    type: int
    default: 30
  job_python:
    description: Path or name of the Python the training job runs with; run without a shell.
    type: str
    required: true
  job_python_probe:
    description: Source of the probe script the job's Python runs from stdin; it prints one JSON line last.
    type: str
    required: true
"""

RETURN = r"""
ansible_facts:
  description: The facts listed in FACTS, from the distribution, platform and python collectors.
  returned: always
  type: dict
probe:
  description: What the node has; null where a piece is absent.
  returned: always
  type: dict
python:
  description: What the job's Python reported; empty when it did not run.
  returned: always
  type: dict
python_error:
  description: Why the job's Python did not run (its last 300 characters of stderr); empty when it did.
  returned: always
  type: str
"""

# The fact subsets the checks need, and the facts of them that the roles read (tasks/nodes and node_network).
FACT_COLLECTORS = (DistributionFactCollector, PlatformFactCollector, PythonFactCollector)
FACTS = (
    "ansible_distribution",
    "ansible_distribution_version",
    "ansible_kernel",
    "ansible_architecture",
    "ansible_hostname",
    "ansible_fqdn",
    "ansible_python",
)

CONTAINER_RUNTIMES = ("docker", "podman", "apptainer", "singularity", "enroot")
GPU_QUERY = "index,name,memory.total,driver_version,ecc.mode.current,ecc.errors.uncorrected.volatile.total"
NOT_AVAILABLE = {"[N/A]", "N/A", "[Not Supported]", "[Unknown Error]", ""}


def run(argv, timeout_s):
    """(returncode, stdout, stderr) of a command; returncode None when it hung past timeout_s."""
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout_s}s"
    except OSError as err:
        return 127, "", str(err)
    return proc.returncode, proc.stdout, proc.stderr


def memory_bytes():
    """MemTotal of /proc/meminfo in bytes."""
    with open("/proc/meminfo", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def container_runtimes(timeout_s):
    """Version line of every container runtime on PATH."""
    found = {}
    for name in CONTAINER_RUNTIMES:
        path = shutil.which(name)
        if path:
            rc, out, err = run([path, "--version"], timeout_s)
            found[name] = (out or err).strip().splitlines()[0] if rc == 0 and (out or err).strip() else "unknown"
    return found


def _number(text):
    text = text.strip()
    if text in NOT_AVAILABLE:
        return None
    try:
        return int(float(text))
    except ValueError:
        return None


def parse_gpu_query(text):
    """GPUs from `nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader,nounits` output."""
    gpus = []
    for line in text.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            continue
        index, name, memory, driver, ecc_mode, ecc_errors = fields
        gpus.append(
            {
                "index": _number(index),
                "name": name,
                "memory_mib": _number(memory),
                "driver_version": None if driver in NOT_AVAILABLE else driver,
                "ecc_mode": None if ecc_mode in NOT_AVAILABLE else ecc_mode,
                "ecc_uncorrected_errors": _number(ecc_errors),
            }
        )
    return gpus


def parse_cuda_version(text):
    """The driver's CUDA version from the header of plain `nvidia-smi` output."""
    match = re.search(r"CUDA Version:\s*([0-9.]+)", text)
    return match.group(1) if match else None


def nvidia(timeout_s):
    """Driver, CUDA version and GPUs from nvidia-smi; all null when nvidia-smi is absent."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"nvidia_smi": None, "driver_version": None, "cuda_version": None, "gpus": [], "gpu_error": None}
    rc, out, err = run([smi, "--query-gpu=" + GPU_QUERY, "--format=csv,noheader,nounits"], timeout_s)
    if rc != 0:
        reason = "hung" if rc is None else f"exit code {rc}"
        return {
            "nvidia_smi": smi,
            "driver_version": None,
            "cuda_version": None,
            "gpus": [],
            "gpu_error": f"nvidia-smi failed ({reason}): {(err or out).strip()[-300:]}",
        }
    gpus = parse_gpu_query(out)
    rc, header, _ = run([smi], timeout_s)
    return {
        "nvidia_smi": smi,
        "driver_version": gpus[0]["driver_version"] if gpus else None,
        "cuda_version": parse_cuda_version(header) if rc == 0 else None,
        "gpus": gpus,
        "gpu_error": None,
    }


def nccl_version_from_filename(path):
    """`2.21.5` from a path like /usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5."""
    match = re.search(r"libnccl\.so\.(\d+(?:\.\d+)*)$", path)
    return match.group(1) if match else None


def system_nccl(timeout_s):
    """Version of the libnccl the dynamic loader finds, from the library's file name."""
    candidates = []
    rc, out, _ = run(["ldconfig", "-p"], timeout_s) if shutil.which("ldconfig") else (1, "", "")
    if rc == 0:
        candidates = [line.split("=>")[-1].strip() for line in out.splitlines() if "libnccl.so" in line]
    if not candidates:
        for pattern in ("/usr/lib/*/libnccl.so*", "/usr/lib64/libnccl.so*", "/usr/local/cuda*/lib64/libnccl.so*"):
            candidates.extend(glob.glob(pattern))
    versions = sorted({v for v in (nccl_version_from_filename(os.path.realpath(c)) for c in candidates) if v})
    return versions[-1] if versions else None


def os_facts(module, timeout_s):
    """FACTS, gathered by Ansible's collectors for the distribution, platform and python subsets only."""
    collector = ansible_collector.get_ansible_collector(
        all_collector_classes=list(FACT_COLLECTORS),
        namespace=PrefixFactNamespace(namespace_name="ansible", prefix="ansible_"),
        filter_spec=list(FACTS),
        gather_subset=[c.name for c in FACT_COLLECTORS],
        gather_timeout=timeout_s,
    )
    return collector.collect(module=module)


def job_python(argv0, script, timeout_s):
    """(report, error) of the probe script run by the job's Python; ({}, why) when it did not run."""
    try:
        proc = subprocess.run(
            [argv0, "-"], input=script, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {}, f"{argv0} did not answer within {timeout_s}s"
    except OSError as err:
        return {}, str(err)
    if proc.returncode != 0:
        return {}, (proc.stderr.strip() or f"{argv0} exited with code {proc.returncode}")[-300:]
    # The probe prints one JSON line last; whatever the interpreter printed before it is ignored.
    lines = proc.stdout.strip().splitlines()
    try:
        return json.loads(lines[-1]), ""
    except (IndexError, ValueError):
        return {}, f"{argv0} printed no probe result: {proc.stdout.strip()[-200:]!r}"


def main():
    """Entry point."""
    module = AnsibleModule(
        argument_spec={
            "command_timeout_s": {"type": "int", "default": 30},
            "job_python": {"type": "str", "required": True},
            "job_python_probe": {"type": "str", "required": True},
        },
        supports_check_mode=True,
    )
    timeout_s = module.params["command_timeout_s"]
    facts = os_facts(module, timeout_s)
    python, python_error = job_python(module.params["job_python"], module.params["job_python_probe"], timeout_s)
    probe = {
        "cpu_count": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "container_runtimes": container_runtimes(timeout_s),
        "nccl_system": system_nccl(timeout_s),
    }
    probe.update(nvidia(timeout_s))
    module.exit_json(changed=False, ansible_facts=facts, probe=probe, python=python, python_error=python_error)


if __name__ == "__main__":
    main()
