#!/usr/bin/python
"""Ansible module: CPUs, memory, container runtimes, NVIDIA driver, CUDA, GPUs and system NCCL of a node."""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess

from ansible.module_utils.basic import AnsibleModule

DOCUMENTATION = r"""
module: tdeploy_node_probe
short_description: Report the hardware and accelerator stack of a node
description:
  - CPU count, memory, container runtimes and their versions, NVIDIA driver and CUDA version,
    GPUs (model, memory, ECC mode, uncorrected ECC errors) from nvidia-smi, and the system NCCL.
  - Absent pieces (no nvidia-smi on a CPU node) are reported as null, never as a failure.
options:
  command_timeout_s:
    description: Seconds one probe command may take before it counts as hung.
    type: int
    default: 30
"""

RETURN = r"""
probe:
  description: What the node has; null where a piece is absent.
  returned: always
  type: dict
"""

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


def main():
    """Entry point."""
    module = AnsibleModule(
        argument_spec={"command_timeout_s": {"type": "int", "default": 30}}, supports_check_mode=True
    )
    timeout_s = module.params["command_timeout_s"]
    probe = {
        "cpu_count": os.cpu_count(),
        "memory_bytes": memory_bytes(),
        "container_runtimes": container_runtimes(timeout_s),
        "nccl_system": system_nccl(timeout_s),
    }
    probe.update(nvidia(timeout_s))
    module.exit_json(changed=False, probe=probe)


if __name__ == "__main__":
    main()
