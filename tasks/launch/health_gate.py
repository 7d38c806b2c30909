"""The health gate before a job's rendezvous, on the launchers that place the job on hosts themselves (local, SSH).

The launch step calls `run_health_gate` before each submission: every host the job would run on runs the payload's
probes (training/health_gate.py) at once, through its launcher's `gate_command` (a subprocess here, `ssh HOST`
there); `judge` compares them; health_gate.json goes into the run's output folder. A host outside the band is
recorded in the deployment's node memory (it counts towards its quarantine, tasks/recovery/quarantine.py) and left
out: the next host of the inventory takes its place (and is probed in its turn), or an elastic job
(cluster.min_nodes) starts with the rest; where neither is possible the gate fails with `HealthGateFailed`, naming
the hosts and the fix. Slurm and Kubernetes place the job themselves: their gate runs inside the allocation (a step
of the batch script, an init container), rendered by their launchers.
"""

from __future__ import annotations

import logging
import os
import subprocess
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tasks.errors import TransientError, UserError
from tasks.hosts import NodeHost
from tasks.launch.base import Launcher
from tasks.launch.cluster import ClusterConfig
from tasks.recovery.quarantine import NodeMemory
from training.config import TrainConfig
from training.health_gate import (
    GATE_DIR,
    HealthGateConfig,
    HealthGateRecord,
    NodeProbe,
    judge,
    probe_node,
    storage_folders,
    write_health_gate,
)
from training.job_env import DEFAULT_MEMORY_DIR
from training.storage import StorageConfig, filesystem, is_local, local_path, write_bytes_atomic

log = logging.getLogger(__name__)

_ROUNDS = 4
"""Probe rounds at most: the first hosts, then the replacements of excluded ones."""


class HealthGateFailed(TransientError):
    """The gate excluded hosts and the job cannot start without them (no host left to take their place, and not
    elastic enough): retried, the gate probes again; twice excluded, a host is quarantined and left out."""

    def __init__(self, record: HealthGateRecord, why: str) -> None:
        bad = "; ".join(f"{v.name}: {', '.join(v.reasons)}" for v in record.nodes if not v.healthy)
        super().__init__(
            f"health gate: {why}: {bad}",
            "repair the hosts (the reasons above), list more hosts under nodes.hosts, or lower cluster.min_nodes so "
            "the job may start with the rest (cluster.health_gate.level=off skips the gate)",
        )
        self.record = record


@dataclass(frozen=True)
class GateOutcome:
    """The gate's record (None: the launcher runs it inside the allocation, or it is off) and the cluster the job
    starts on (the excluded hosts left out)."""

    record: HealthGateRecord | None
    cluster: ClusterConfig


def probe_argv(
    config: HealthGateConfig,
    host: NodeHost,
    folders: list[str],
    gate_dir: Path,
    names: list[str],
    peer: NodeHost | None,
) -> list[str]:
    """The payload's probe command line for `host` (module arguments, after `python -m`)."""
    argv = ["training.health_gate", "probe", "--name", host.name, "--config", config.model_dump_json(),
            "--gate-dir", str(gate_dir), "--names", ",".join(names)]  # fmt: skip
    for folder in folders:
        argv += ["--storage", folder]
    if peer is not None:
        argv += ["--address", "0.0.0.0" if host.address is None else host.address,
                 "--peer", f"{peer.name}={peer.address or peer.name}"]  # fmt: skip
    return argv


def _probe(
    launcher: Launcher, cluster: ClusterConfig, hosts: list[NodeHost], folders: list[str], gate_dir: Path
) -> tuple[list[NodeProbe], dict[str, str]]:
    """Every host's probe at once; the probes that reported and why the others did not. This machine alone (the
    local launcher) is probed in this process, which has the payload's imports loaded already."""
    config = cluster.health_gate
    if len(hosts) == 1 and hosts[0].connection == "local":
        return [probe_node(hosts[0].name, config, folders)], {}
    names = [h.name for h in hosts]
    running: dict[str, subprocess.Popen[str]] = {}
    for i, host in enumerate(hosts):
        peer = hosts[(i + 1) % len(hosts)] if len(hosts) > 1 else None
        command = launcher.gate_command(cluster, host, probe_argv(config, host, folders, gate_dir, names, peer))
        assert command is not None, "run_health_gate asks only launchers that have a gate command"
        running[host.name] = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                              stdin=subprocess.DEVNULL)  # fmt: skip
    deadline = time.monotonic() + config.timeout_s
    probes, missing = [], {}
    for name, proc in running.items():
        try:
            out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            missing[name] = f"its probe did not finish within cluster.health_gate.timeout_s={config.timeout_s:g}"
            continue
        lines = out.strip().splitlines()
        try:
            probes.append(NodeProbe.model_validate_json(lines[-1]))
        except (IndexError, ValueError):
            tail = " ".join(err.strip().splitlines()[-3:])[-500:]
            missing[name] = f"its probe failed (exit {proc.returncode}): {tail or 'no output'}"
    return probes, missing


class GateBaseline(BaseModel):
    """The ledger's health-gate baseline: the rates per CPU-second the deployment's gates measured on healthy
    nodes, newest last (at most BASELINE_RATES); the baseline is their median."""

    model_config = ConfigDict(extra="forbid")
    rates_gflops: list[float] = Field(default_factory=list)

    @property
    def gflops(self) -> float | None:
        """The median rate (None: no gate recorded one yet)."""
        return statistics.median(self.rates_gflops) if self.rates_gflops else None


BASELINE_RATES = 200


def read_baseline(url: str, storage: StorageConfig | None = None) -> float | None:
    """The baseline rate at `url` (None: none yet); a file that is not one is named in a warning and not used."""
    fs, path = filesystem(url, storage)
    if not fs.exists(path):
        return None
    try:
        return GateBaseline.model_validate_json(fs.cat_file(path)).gflops
    except (OSError, ValueError) as err:
        log.warning("health gate baseline %s not used: %s; remove it to start a new one", url, err)
        return None


def record_baseline(url: str, record: HealthGateRecord, storage: StorageConfig | None = None) -> None:
    """Add the healthy nodes' rates of `record` to the baseline at `url` (two gates at once may lose one's rates:
    a baseline, not a ledger of events)."""
    healthy = {v.name for v in record.nodes if v.healthy}
    rates = [p.compute_cpu_gflops for p in record.probes if p.name in healthy and p.compute_cpu_gflops]
    if not rates:
        return
    fs, path = filesystem(url, storage)
    try:
        kept = GateBaseline.model_validate_json(fs.cat_file(path)).rates_gflops if fs.exists(path) else []
    except (OSError, ValueError):
        kept = []
    data = GateBaseline(rates_gflops=[*kept, *rates][-BASELINE_RATES:]).model_dump_json().encode()
    write_bytes_atomic(fs, path, data)


def _folders(cluster: ClusterConfig, train: TrainConfig) -> list[str]:
    memory = (train.checkpoint.memory_dir or DEFAULT_MEMORY_DIR) if train.checkpoint.memory_tier_on else None
    return storage_folders(train.run.output_url, memory, cluster.health_gate.storage_paths)


def run_health_gate(
    launcher: Launcher,
    cluster: ClusterConfig,
    train: TrainConfig,
    memory: NodeMemory | None = None,
    *,
    job: str | None = None,
    baseline_url: str | None = None,
) -> GateOutcome:
    """Probe the hosts `cluster` runs on, leave out those outside the band (recorded in `memory`), write
    health_gate.json; the cluster to submit on. HealthGateFailed when the job cannot start without them. With
    `baseline_url` (the ledger's), a lone node is judged against the rates earlier gates measured on healthy
    nodes, and this gate's healthy rates are added to them."""
    config = cluster.health_gate
    hosts = launcher.hosts(cluster)
    if not config.on or hosts is None or not is_local(train.run.output_url):
        return GateOutcome(None, cluster)
    if launcher.gate_command(cluster, hosts[0], ["training.health_gate"]) is None:
        return GateOutcome(None, cluster)
    started = time.time()
    baseline = read_baseline(baseline_url, train.storage) if baseline_url else None
    gate_root = Path(local_path(train.run.output_url)) / GATE_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    folders = _folders(cluster, train)
    probes: dict[str, NodeProbe] = {}
    missing: dict[str, str] = {}
    record: HealthGateRecord | None = None
    for round_ in range(_ROUNDS):
        hosts = launcher.hosts(cluster) or []
        new = [h for h in hosts if h.name not in probes and h.name not in missing]
        if new:
            found, lost = _probe(launcher, cluster, new, folders, gate_root / f"round-{round_}")
            probes |= {p.name: p for p in found}
            missing |= lost
        names = list(dict.fromkeys([*probes, *missing]))
        record = judge(list(probes.values()), config, names, started_unix_s=started, missing_reasons=missing,
                       baseline_gflops=baseline)  # fmt: skip
        bad = [v.name for v in record.nodes if not v.healthy and v.name in {h.name for h in hosts}]
        if not bad:
            break
        _remember(launcher, cluster, record, bad, memory, job)
        try:
            cluster = _without(launcher, cluster, hosts, bad, record)
        except HealthGateFailed:
            write_health_gate(train.run.output_url, record, train.storage)
            raise
    assert record is not None
    write_health_gate(train.run.output_url, record, train.storage)
    if baseline_url:
        record_baseline(baseline_url, record, train.storage)
    log.info("%s", record.describe())
    return GateOutcome(record, cluster)


def _remember(
    launcher: Launcher,
    cluster: ClusterConfig,
    record: HealthGateRecord,
    bad: list[str],
    memory: NodeMemory | None,
    job: str | None,
) -> None:
    """Record each excluded host's reasons in the node memory (towards its quarantine) where the launcher places
    the job on hosts it can leave out (not the local launcher: every node is this machine)."""
    if memory is None:
        return
    try:
        if launcher.excluding(cluster, bad) == cluster:
            return
    except UserError:
        pass  # too few hosts left to requeue on: the hosts still count
    for verdict in record.nodes:
        if verdict.name in bad:
            memory.record_failure(verdict.name, f"health_gate: {'; '.join(verdict.reasons)}"[:2000], job=job)


def _without(
    launcher: Launcher, cluster: ClusterConfig, hosts: list[NodeHost], bad: list[str], record: HealthGateRecord
) -> ClusterConfig:
    """`cluster` without `bad`: other hosts take their places, else an elastic job starts with fewer nodes."""
    try:
        excluded = launcher.excluding(cluster, bad)
    except UserError:
        excluded = None
    if excluded is not None and excluded != cluster:
        return excluded
    if excluded == cluster:  # every node is this machine (local): nothing to leave out
        raise HealthGateFailed(record, "this machine failed the gate and the job has no other host")
    job_hosts = [h.name for h in hosts[: cluster.nodes]]
    nodes = cluster.nodes - len([h for h in bad if h in job_hosts])
    if cluster.min_nodes is not None and nodes >= cluster.min_nodes:
        try:
            shrunk = launcher.excluding(cluster.model_copy(update={"nodes": nodes}), bad)
        except UserError as err:
            raise HealthGateFailed(record, f"too few hosts are left: {err}") from err
        log.warning("health gate: starting the elastic job on %d of %d nodes (cluster.min_nodes=%d)", nodes,
                    cluster.nodes, cluster.min_nodes)  # fmt: skip
        return shrunk
    needed = "" if cluster.min_nodes is None else f" (cluster.min_nodes={cluster.min_nodes})"
    raise HealthGateFailed(record, f"no host is left to take the place of {', '.join(bad)} for nodes={cluster.nodes}"
                           f"{needed}")  # fmt: skip
