"""What the node-check roles report per host, as typed models (the shape of their `set_stats` data).

Each role publishes one section under `tdeploy_nodes.<host>`: node_facts `facts`, node_storage `storage`,
node_network `network`, node_security `security`. A section is absent when its role did not finish on the
host, and a field is None when the node could not tell (no nvidia-smi, no torch, a probe that failed).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Reported(BaseModel):
    """A part of a role's report: every key the role writes is declared, so that a renamed one fails loudly."""

    model_config = ConfigDict(extra="forbid")


class Gpu(_Reported):
    """One GPU as `nvidia-smi --query-gpu` lists it; None where nvidia-smi says [N/A]."""

    index: int | None = Field(None, description="GPU index on the node")
    name: str | None = Field(None, description="product name, e.g. NVIDIA H100 80GB HBM3")
    memory_mib: int | None = Field(None, description="total GPU memory in MiB")
    driver_version: str | None = Field(None, description="driver version the GPU reports")
    ecc_mode: str | None = Field(None, description="Enabled or Disabled")
    ecc_uncorrected_errors: int | None = Field(None, description="volatile uncorrected ECC error count")


class SystemFacts(_Reported):
    """The node probe (module tdeploy_node_probe): CPUs, memory, container runtimes, NCCL, driver, GPUs."""

    cpu_count: int | None = Field(None, description="logical CPUs")
    memory_bytes: int | None = Field(None, description="MemTotal in bytes")
    container_runtimes: dict[str, str | None] | None = Field(None, description="runtime name -> its version line")
    nccl_system: str | None = Field(None, description="version of the libnccl the dynamic loader finds")
    nvidia_smi: str | None = Field(None, description="path of nvidia-smi, None when absent")
    driver_version: str | None = Field(None, description="NVIDIA driver version")
    cuda_version: str | None = Field(None, description="CUDA version the driver supports")
    gpus: list[Gpu] = Field(default_factory=list, description="the GPUs nvidia-smi lists")
    gpu_error: str | None = Field(None, description="why nvidia-smi failed, None when it worked or is absent")


class TorchBuild(_Reported):
    """torch as installed in the job's Python, read from torch/version.py."""

    version: str | None = Field(None, description="torch version, None when not installed")
    cuda: str | None = Field(None, description="CUDA version of the build, None for a CPU-only build")
    hip: str | None = Field(None, description="HIP version of the build")
    path: str | None = Field(None, description="folder of the torch package")


class PythonFacts(_Reported):
    """The job's Python (files/python_probe.py); empty when that Python did not run."""

    executable: str | None = Field(None, description="sys.executable of the job's Python")
    version: str | None = Field(None, description="Python version, e.g. 3.11.7")
    torch: TorchBuild = Field(default_factory=TorchBuild, description="the torch build")
    nccl_wheel: str | None = Field(None, description="version of the nvidia-nccl wheel torch loads")


class NodeFacts(_Reported):
    """Role node_facts: OS, kernel, hardware, the job's Python, and the node's clock."""

    os: str | None = Field(None, description="distribution and version, e.g. Debian 12.5")
    kernel: str | None = Field(None, description="kernel release")
    arch: str | None = Field(None, description="CPU architecture, e.g. x86_64")
    hostname: str | None = Field(None, description="short host name")
    fqdn: str | None = Field(None, description="fully qualified host name")
    system: SystemFacts = Field(default_factory=SystemFacts, description="the node probe")
    job_python: str | None = Field(None, description="the interpreter the job runs with (nodes.python)")
    python: PythonFacts = Field(default_factory=PythonFacts, description="what the job's Python reported")
    python_error: str = Field("", description="why the job's Python did not run; empty when it did")
    clock_epoch_s: float | None = Field(None, description="the node's clock when read, seconds since the epoch")


class Mount(_Reported):
    """Role node_storage: one storage path (module tdeploy_storage_probe)."""

    path: str = Field(description="the path checked")
    min_free_gb: float | None = Field(None, description="the free space the job needs, in GB")
    exists: bool = Field(False, description="the path exists and is a directory")
    writable: bool = Field(False, description="a file could be written, synced and removed")
    error: str | None = Field(None, description="what is wrong, None when usable")
    mount_point: str | None = Field(None, description="the mount holding the path")
    fs_type: str | None = Field(None, description="its filesystem type")
    free_bytes: int | None = Field(None, description="bytes available to the job user")
    total_bytes: int | None = Field(None, description="size of the filesystem in bytes")


class Listener(_Reported):
    """`rdzv_probe.py listen` on the rendezvous host."""

    listening: bool = Field(False, description="the listener started")
    pid: int | None = Field(None, description="its process id")
    error: str | None = Field(None, description="why it did not start")


class ListenerStop(_Reported):
    """`rdzv_probe.py stop`: the listener stopped, and who connected to it."""

    stopped: bool = Field(False, description="the listener was stopped")
    peers: list[str] = Field(default_factory=list, description="addresses that connected")
    error: str | None = Field(None, description="why it could not be stopped")


class Connect(_Reported):
    """`rdzv_probe.py connect` from a node to the rendezvous address."""

    connected: bool = Field(False, description="the TCP connection was made")
    seconds: float | None = Field(None, description="how long connecting took")
    error: str | None = Field(None, description="why it failed")


class NetworkFacts(_Reported):
    """Role node_network: name resolution of the other nodes, the rendezvous port test and the job's interface."""

    resolved: dict[str, list[str]] = Field(default_factory=dict, description="name -> addresses it resolves to")
    resolve_errors: dict[str, str] = Field(default_factory=dict, description="name -> why it did not resolve")
    rdzv_host: str | None = Field(None, description="the node that listened")
    rdzv_target: str | None = Field(None, description="the address the others connected to")
    rdzv_port: int | None = Field(None, description="the port tested")
    listener: Listener = Field(default_factory=Listener, description="the listener (rendezvous host only)")
    listener_stop: ListenerStop = Field(default_factory=ListenerStop, description="its stop (rendezvous host only)")
    connect: Connect = Field(default_factory=Connect, description="the connection test (other nodes only)")
    rdzv_error: str | None = Field(None, description="the failed task of the port test, if one failed")
    interface: str | None = Field(None, description="the interface the job needs (cluster.network.interface)")
    interfaces: list[str] | None = Field(None, description="the node's interfaces; None when not listed")
    interface_error: str | None = Field(None, description="why the interfaces could not be listed")


class SecurityFacts(_Reported):
    """Role node_security: how Ansible connected and which login methods sshd offers."""

    connection: str | None = Field(None, description="Ansible connection plugin, e.g. ssh or local")
    key_auth: bool | None = Field(None, description="Ansible reached the node with a key (BatchMode)")
    probe_rc: int | None = Field(None, description="exit code of the login-methods probe, None when not run")
    methods: list[str] = Field(default_factory=list, description="login methods sshd still offers")
    probe_error: str | None = Field(None, description="the probe's last line of stderr")


class HostReport(_Reported):
    """Everything the roles published for one host; a section is None when its role did not finish there."""

    facts: NodeFacts | None = None
    storage: list[Mount] | None = None
    network: NetworkFacts | None = None
    security: SecurityFacts | None = None

    @property
    def complete(self) -> bool:
        """Every role that the report needs (facts, storage, network) finished on this host."""
        return self.facts is not None and self.storage is not None and self.network is not None


def host_reports(results: dict[str, dict[str, Any]]) -> dict[str, HostReport]:
    """The runner's per-host `set_stats` data as typed reports."""
    return {host: HostReport.model_validate(sections) for host, sections in results.items()}
