"""SSH launcher: one torchrun agent per host of the inventory, started over SSH (as DeepSpeed's pdsh runner does).

It is the local launcher with the agents elsewhere: each agent runs under the same `sh` wrapper on this
machine, whose child is `ssh HOST 'cd WORKDIR && exec env ... PYTHON -m tasks.launch.agent ...'`. ssh exits
with the remote agent's status, so the wrapper's exit file, the supervision (the job dies with its submitter)
and `cancel` work as they do locally: when the ssh client goes, sshd's session ends and the remote agent, whose
parent it was, gets its parent-death signal and stops its workers. The rendezvous is c10d on the first host's
address; the other hosts must resolve the first host's name (torchrun hands its host name to the workers as
MASTER_ADDR), which the node checks test before any job starts.

The run folder (run.json, logs, exit files, ranks.json) must be on a filesystem every host shows at the same
path, as Slurm jobs need. Credentials are not sent: storage keys live on the hosts (their environment, ~/.aws,
instance roles), never on a command line other users of a host could read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import UserError
from tasks.hosts import NodeHost
from tasks.launch.agent import AGENT_RECORD_ENV
from tasks.launch.base import Capabilities, JobHandle, excluded_host_names
from tasks.launch.config import SshLaunchConfig
from tasks.launch.local import AGENTS_DIR, CANCELLED_MARKER, REPLICAS_DIR, LocalLauncher
from tasks.launch.replica_host import processes_file
from tasks.launch.torchrun import job_env, preemption_args
from training.config import Problem

if TYPE_CHECKING:
    from tasks.launch.cluster import ClusterConfig
    from tasks.launch.environment import JobEnvironment
    from training.config import TrainConfig

log = logging.getLogger(__name__)

TORCHRUN_DEFAULT_PORT = 29500
PROJECT_ROOT = Path(__file__).resolve().parents[2]
# Controller variables that describe the job's communication, passed on to every host (never credentials).
FORWARDED_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCHELASTIC_")


def ssh_command(ssh: SshLaunchConfig, host: NodeHost, remote: str) -> list[str]:
    """`ssh` to `host` running the shell command `remote`: key-only, host keys checked, keep-alive probes on."""
    argv = [
        "ssh", "-T",
        "-o", "BatchMode=yes",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"ConnectTimeout={ssh.connect_timeout_s}",
        "-o", f"ServerAliveInterval={ssh.alive_interval_s}",
        "-o", "ServerAliveCountMax=3",
        "-p", str(host.port),
    ]  # fmt: skip
    if ssh.key_path:
        argv += ["-i", ssh.key_path, "-o", "IdentitiesOnly=yes"]
    if ssh.known_hosts_path:
        argv += ["-o", f"UserKnownHostsFile={ssh.known_hosts_path}"]
    target = host.address or host.name
    return [*argv, "--", f"{ssh.user}@{target}" if ssh.user else target, remote]


def remote_command(workdir: str, env: Mapping[str, str], argv: list[str]) -> str:
    """The shell command line a host runs: enter `workdir`, then exec `argv` with `env` added; every word quoted."""
    assignments = [f"{name}={value}" for name, value in env.items()]
    return f"cd {shlex.quote(workdir)} && exec {shlex.join(['env', *assignments, *argv])}"


_NODES_TO_SSH = {"ssh_user": "user", "ssh_key_path": "key_path", "known_hosts_path": "known_hosts_path",
                 "python": "python", "connect_timeout_s": "connect_timeout_s"}  # fmt: skip
"""The nodes section's fields that fill in cluster.ssh (nodes' name: ours)."""


def launch_config(cluster: ClusterConfig) -> SshLaunchConfig:
    """cluster.ssh, refused (with the fix) when missing or shorter than cluster.nodes."""
    ssh = cluster.ssh
    if ssh is None:
        raise UserError(
            "cluster.scheduler=ssh without hosts: cluster.ssh is not set",
            "list the hosts under nodes.hosts (the spec copies them into cluster.ssh) or give cluster.ssh.hosts",
        )
    if len(ssh.hosts) < cluster.nodes:
        raise UserError(
            f"cluster.nodes={cluster.nodes}: cluster.ssh lists {len(ssh.hosts)} host(s)",
            f"list {cluster.nodes} hosts or lower cluster.nodes",
        )
    return ssh


class SshLauncher(LocalLauncher):
    """Runs, watches and cancels torchrun jobs whose agents run on other hosts, one per host, over SSH."""

    scheduler = "ssh"
    capabilities = Capabilities(
        runs_image=False,  # the agents run the hosts' Python
        runs_on_this_machine_only=False,
        needs_shared_output=True,
        delivers_signals=True,
        can_lose_node=True,
        replaces_lost_host=True,
        has_hot_spares=True,  # cluster.spares: standby agents in the rendezvous (tasks/launch/spares.py)
        live_recovery=True,  # one replica group per host, the lighthouse on the first (tasks/launch/replica_host.py)
        replica_group_per_node=True,
    )

    @classmethod
    def cluster_defaults(cls, cluster: dict[str, Any], nodes: Any) -> dict[str, Any]:
        """Without a cluster.ssh section the agents' hosts and SSH settings are the nodes section's, so the node
        checks and the job see one inventory."""
        if cluster.get("ssh") is not None or not isinstance(nodes, dict) or not nodes.get("hosts"):
            return cluster  # cluster_problems names what is missing
        ssh = {"hosts": nodes["hosts"]}
        ssh |= {ours: nodes[theirs] for theirs, ours in _NODES_TO_SSH.items() if nodes.get(theirs) is not None}
        return {**cluster, "ssh": ssh}

    @classmethod
    def cluster_problems(cls, cluster: ClusterConfig) -> list[Problem]:
        """One agent per host: cluster.ssh must list at least cluster.nodes hosts."""
        if cluster.ssh is None:
            return [
                (
                    ("ssh",),
                    None,
                    "cluster.scheduler=ssh starts one torchrun agent per host: list the hosts under nodes.hosts "
                    "(name, address, port) or give cluster.ssh.hosts",
                )
            ]
        if len(cluster.ssh.hosts) < cluster.nodes:
            return [
                (
                    ("nodes",),
                    cluster.nodes,
                    f"cluster.scheduler=ssh has {len(cluster.ssh.hosts)} host(s) to start agents on; list "
                    f"{cluster.nodes} under nodes.hosts or lower cluster.nodes",
                )
            ]
        if len(cluster.ssh.hosts) < cluster.nodes + cluster.spares:
            return [
                (
                    ("spares",),
                    cluster.spares,
                    f"cluster.scheduler=ssh has {len(cluster.ssh.hosts)} host(s) for nodes={cluster.nodes} and "
                    f"spares={cluster.spares}; list {cluster.nodes + cluster.spares} under nodes.hosts (the spares "
                    "after the nodes) or lower cluster.spares",
                )
            ]
        return []

    @classmethod
    def hosts(cls, cluster: ClusterConfig) -> list[NodeHost] | None:
        """The first cluster.nodes + cluster.spares hosts of cluster.ssh, one agent each (the spares last)."""
        return None if cluster.ssh is None else cluster.ssh.hosts[: cluster.nodes + cluster.spares]

    @classmethod
    def relaunch_cluster(cls, cluster: ClusterConfig, lost_host: str) -> ClusterConfig:
        """A spare host of cluster.ssh takes the lost one's place where there is one; else the same hosts."""
        ssh = cluster.ssh
        if ssh is None:
            return cluster
        others = [h for h in ssh.hosts if h.name != lost_host]
        if len(others) < cluster.nodes:
            log.warning("no spare host for %s in cluster.ssh.hosts: relaunching on the same hosts", lost_host)
            return cluster
        spares = min(cluster.spares, len(others) - cluster.nodes)  # the lost host's place took a spare host
        return cluster.model_copy(update={"ssh": ssh.model_copy(update={"hosts": others}), "spares": spares})

    @classmethod
    def excluding(cls, cluster: ClusterConfig, hosts: Sequence[str]) -> ClusterConfig:
        """The inventory less `hosts`, in its order (the next hosts move up); UserError when too few are left."""
        names = set(excluded_host_names(hosts))
        ssh = launch_config(cluster)
        kept = [h for h in ssh.hosts if h.name not in names]
        needed = cluster.nodes + cluster.spares
        if len(kept) < needed:
            raise UserError(
                f"cluster.ssh lists {len(ssh.hosts)} host(s); without {', '.join(sorted(names))} {len(kept)} are left "
                f"for nodes={cluster.nodes} and spares={cluster.spares}",
                "list more hosts under nodes.hosts (a requeue runs on the next ones), or clear a quarantined host "
                "with `tdeploy nodes clear HOST --spec SPEC` once it is repaired",
            )
        return cluster.model_copy(update={"ssh": ssh.model_copy(update={"hosts": kept})})

    def kill_rank(self, handle: JobHandle, rank: Mapping[str, Any], sig: int) -> None:
        """`sig` to the rank's process on its host, over SSH."""
        signal_remote(handle, handle.details["hosts"].index(rank["host"]), rank["pid"], sig)

    def kill_node(self, handle: JobHandle, node: int, ranks: list[dict[str, Any]], sig: int) -> dict[str, Any]:
        """`sig` at once to agent `node` and every rank on its host, in one SSH command."""
        agent = self._agent_record(handle, node)
        host = handle.details["hosts"][node]
        victims = [r for r in ranks if r["host"] == host]
        signal_remote(handle, node, [agent["pid"], *(r["pid"] for r in victims)], sig)
        killed = sorted(r["rank"] for r in victims)
        return {"node": node, "host": host, "agent_pid": agent["pid"], "ranks": killed}

    def unreachable_hosts(self, handle: JobHandle) -> list[str]:
        """The job's hosts that do not answer over SSH within the connection timeout (probed at once)."""
        return unreachable_hosts(handle)

    def _endpoint(self, cluster: ClusterConfig) -> str:
        """c10d on the first host's address."""
        first = launch_config(cluster).hosts[0]
        return f"{first.address or first.name}:{cluster.rdzv_port or TORCHRUN_DEFAULT_PORT}"

    @staticmethod
    def _store_host(cluster: ClusterConfig, node: int) -> bool | None:
        """The first host's agent hosts the store (its address is the endpoint's); a spare never does."""
        return False if node >= cluster.nodes else None

    def _agent_command(
        self,
        cluster: ClusterConfig,
        node: int,
        args: list[str],
        environment: JobEnvironment | None,
        out: Path,
        spare: Mapping[str, str] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """`ssh HOST` running the agent there with the job's environment (not this machine's); `spare`: a hot
        spare's wait (the run folder is shared, so it sees the ranks meet)."""
        ssh = launch_config(cluster)
        forwarded = {k: v for k, v in self.env.items() if k.startswith(FORWARDED_PREFIXES)}
        remote_env = job_env(cluster, environment, inherited=forwarded)
        remote_env[AGENT_RECORD_ENV] = str(out / AGENTS_DIR / f"node{node}.json")
        remote_env.update(spare or {})
        agent = [ssh.python, "-m", "tasks.launch.agent", *args]
        remote = remote_command(ssh.workdir or str(PROJECT_ROOT), remote_env, agent)
        return ssh_command(ssh, ssh.hosts[node], remote), dict(self.env)

    def _replica_command(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        job_id: str,
        config_path: Path,
        environment: JobEnvironment | None,
        node: int,
    ) -> tuple[list[str], dict[str, str]]:
        """`ssh HOST` running replica group `node` there (tasks/launch/replica_host.py) with the job's environment;
        the first host also runs the lighthouse, on the rendezvous endpoint, until every group's exit file is in the
        shared run folder."""
        ssh = launch_config(cluster)
        out = config_path.parent
        first, here = ssh.hosts[0], ssh.hosts[node]
        forwarded = {k: v for k, v in self.env.items() if k.startswith(FORWARDED_PREFIXES)}
        remote_env = job_env(cluster, environment, inherited=forwarded)
        remote_env[AGENT_RECORD_ENV] = str(out / AGENTS_DIR / f"node{node}.json")
        lighthouse = ["--start-lighthouse", *(f"--wait-for={out / f'exit-{n}.txt'}" for n in range(1, cluster.nodes))]
        argv = [
            ssh.python, "-m", "tasks.launch.replica_host", "--config", str(config_path), "--job-id", job_id,
            f"--group={node}", f"--host={here.address or here.name}",
            f"--lighthouse-host={first.address or first.name}",
            f"--lighthouse-port={cluster.rdzv_port or TORCHRUN_DEFAULT_PORT}",
            f"--procs-per-group={cluster.world_size // train.fault_tolerance.replica_groups}",
            f"--max-restarts={cluster.max_restarts}", f"--workdir={out / REPLICAS_DIR}",
            f"--stop-file={out / CANCELLED_MARKER}", *(lighthouse if node == 0 else []),
            "--", *preemption_args(cluster),
        ]  # fmt: skip
        remote = remote_command(ssh.workdir or str(PROJECT_ROOT), remote_env, argv)
        return ssh_command(ssh, here, remote), dict(self.env)

    def gate_command(self, cluster: ClusterConfig, host: NodeHost, module_args: list[str]) -> list[str] | None:
        """`ssh HOST` running the health gate's probe there, with the hosts' Python in the agents' working folder."""
        ssh = launch_config(cluster)
        remote = remote_command(ssh.workdir or str(PROJECT_ROOT), {}, [ssh.python, "-m", *module_args])
        return ssh_command(ssh, host, remote)

    def _details(self, cluster: ClusterConfig) -> dict[str, object]:
        """The hosts and SSH settings, so that another process can reach the job's processes."""
        ssh = launch_config(cluster)
        hosts = [h.name for h in ssh.hosts[: cluster.nodes + cluster.spares]]
        return {"ssh": ssh.model_dump(mode="json"), "hosts": hosts, "spare_hosts": hosts[cluster.nodes :]}

    def cancel(self, handle: JobHandle, grace_s: float = 30.0, reason: str = "cancelled by the user") -> None:
        """On every host at once: SIGTERM its agent (torchrun stops its workers), wait up to `grace_s` for it to
        exit, SIGKILL it if it has not; then stop the local side (the wrappers and their ssh clients)."""
        (Path(handle.output_dir) / CANCELLED_MARKER).write_text(f"{reason} at {time.strftime('%Y-%m-%dT%H:%M:%S')}")
        stops = []
        for record in remote_agents(handle):
            with contextlib.suppress(OSError):
                stops.append(stop_remote(handle, record["node"], record["pid"], grace_s))
        _wait_stops(handle, stops, grace_s)
        # A replica-groups job: the lighthouse and the group agents its host-side processes recorded, by pid.
        stops = []
        for node, entry in replica_processes(handle):
            with contextlib.suppress(OSError):
                stops.append(stop_remote(handle, node, entry["pid"], grace_s, entry["start_time"]))
        _wait_stops(handle, stops, grace_s)
        super().cancel(handle, grace_s, reason)

    def signal(self, handle: JobHandle, sig: int = signal.SIGTERM) -> None:
        """SIGTERM or SIGUSR1 to every host's agent over SSH, as a scheduler would deliver it (the agent passes it
        to its workers, which checkpoint and exit 75; ssh then exits with the agent's 75). Not to the local ssh
        clients: ending one would end its remote agent before the workers' checkpoint is written."""
        sig = signal.Signals(sig)
        if sig not in (signal.SIGTERM, signal.SIGUSR1):
            raise UserError(f"signal {sig.name}: not a preemption signal", "send SIGTERM or SIGUSR1, or cancel the job")
        for record in remote_agents(handle):
            signal_remote(handle, record["node"], record["pid"], sig)


def _wait_stops(handle: JobHandle, stops: list[tuple[str, subprocess.Popen[bytes]]], grace_s: float) -> None:
    """Wait for the remote stops `stop_remote` started (warning about a host that does not answer)."""
    for host, proc in stops:
        try:
            proc.wait(timeout=grace_s + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            log.warning("host %s did not answer the stop of job %s: its processes may still run", host, handle.ref)


def replica_processes(handle: JobHandle) -> list[tuple[int, dict[str, Any]]]:
    """A replica-groups job's lighthouse and group agents as each host recorded them (host index, record with an
    int pid and a start time); [] for other jobs."""
    found = []
    for node in range(len(handle.details.get("agents", []))):
        path = processes_file(Path(handle.output_dir) / REPLICAS_DIR, node)
        with contextlib.suppress(OSError, ValueError):
            recorded = json.loads(path.read_text())
            for entry in recorded if isinstance(recorded, list) else []:
                pid, started = (entry.get("pid"), entry.get("start_time")) if isinstance(entry, dict) else (0, "")
                if type(pid) is int and pid > 1 and isinstance(started, str) and started.isdigit():
                    found.append((node, entry))
    return found


def remote_agents(handle: JobHandle) -> list[dict[str, Any]]:
    """The agents' own records (node index, host, pid, start time) of an SSH job, for those that wrote one."""
    found = []
    for node in range(len(handle.details.get("agents", []))):
        path = Path(handle.output_dir) / AGENTS_DIR / f"node{node}.json"
        with contextlib.suppress(OSError, ValueError):
            found.append({"node": node, **json.loads(path.read_text())})
    return found


# $1 pid, $2 grace in tenths of a second: SIGTERM, wait for the process to exit, SIGKILL it if it has not.
_STOP = (
    'kill -TERM "$1" 2>/dev/null || exit 0; i=0; while kill -0 "$1" 2>/dev/null; do [ "$i" -ge "$2" ] && '
    '{ kill -KILL "$1" 2>/dev/null; exit 0; }; i=$((i+1)); sleep 0.1; done'
)
# $1 pid, $2 grace, $3 start time (field 22 of /proc/PID/stat): _STOP, only while the pid is the process that started
# then (not a reused one).
_STOP_STARTED = (
    's=$(cat "/proc/$1/stat" 2>/dev/null) || exit 0; set -- "$1" "$2" "$3" ${s##*") "}; [ "${23}" = "$3" ] || exit 0; '
    + _STOP
)


def stop_remote(
    handle: JobHandle, node: int, pid: int, grace_s: float, started: str | None = None
) -> tuple[str, subprocess.Popen[bytes]]:
    """Start stopping process `pid` on the job's host `node` over SSH (TERM, wait, KILL; with `started`, only the
    process of that start time); the host and ssh."""
    ssh = SshLaunchConfig.model_validate(handle.details["ssh"])
    host = ssh.hosts[node]
    script, extra = (_STOP, []) if started is None else (_STOP_STARTED, [started])
    remote = shlex.join(["sh", "-c", script, "stop", str(int(pid)), str(int(grace_s * 10)), *extra])
    proc = subprocess.Popen(ssh_command(ssh, host, remote), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return host.name, proc


def signal_remote(handle: JobHandle, node: int, pid: int | list[int], sig: int, timeout_s: float = 30.0) -> None:
    """Send `sig` to process `pid` (or each of a list, at once) on the job's host `node` over SSH (UserError when
    that fails)."""
    ssh = SshLaunchConfig.model_validate(handle.details["ssh"])
    host = ssh.hosts[node]
    pids = [str(int(p)) for p in (pid if isinstance(pid, list) else [pid])]
    command = ssh_command(ssh, host, shlex.join(["kill", f"-{int(sig)}", *pids]))
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))
    except subprocess.TimeoutExpired as err:
        raise UserError(f"host {host.name}: `kill` over SSH timed out", "check the host and its link") from err
    if proc.returncode != 0:
        raise UserError(f"host {host.name}: kill -{int(sig)} {' '.join(pids)} failed: {proc.stderr.strip()}",
                        "see the message")  # fmt: skip


def unreachable_hosts(handle: JobHandle) -> list[str]:
    """The job's hosts that do not answer over SSH within the connection timeout (probed at once)."""
    ssh = SshLaunchConfig.model_validate(handle.details["ssh"])
    probes = [
        (
            host.name,
            subprocess.Popen(ssh_command(ssh, host, "true"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        )  # fmt: skip
        for host in ssh.hosts[: len(handle.details.get("agents", []))]
    ]
    silent = []
    for name, proc in probes:
        try:
            code = proc.wait(timeout=ssh.connect_timeout_s + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = None
        if code != 0:
            silent.append(name)
    return silent
