"""Local launcher: torchrun agents as subprocesses of this machine, one per (acted-out) node.

Each agent runs under a small `sh` wrapper that records torchrun's exit code, in a
session of its own, so that `cancel` can end exactly the job's processes and any
later command can tell how the job ended.

A supervised job (the default: `tdeploy train`, `tdeploy run`, acceptance, drills)
dies with the process that submitted it, however that process ends: the wrapper
polls the supervisor's pid and start time and stops torchrun when it is gone; the
agent dies with its wrapper and the workers with their agent (parent-death signals).
A detached job (`tdeploy submit`) outlives its submitter. A new job is refused in an
output folder whose previous job still runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from tasks.errors import UserError
from tasks.hosts import NodeHost
from tasks.launch.agent import AGENT_RECORD_ENV
from tasks.launch.base import (
    Capabilities,
    JobHandle,
    JobState,
    JobStatus,
    Launcher,
    parse_root_cause,
    read_log,
    record_job,
)
from tasks.launch.environment import JobEnvironment
from tasks.launch.replica_supervisor import PROCESSES_FILE
from tasks.launch.spares import SPARE_WAIT_ENV, spare_nodes, spare_wait_value
from tasks.launch.torchrun import free_port, job_env, preemption_args, torchrun_args
from training.config import TrainConfig
from training.preemption import PREEMPTED_EXIT_CODE, PreemptionFileError, PreemptionRecord, records_since
from training.process import alive, start_time
from training.run_output import RESULT, RunOutput
from training.storage import is_local, local_path

if TYPE_CHECKING:
    from tasks.launch.cluster import ClusterConfig

log = logging.getLogger(__name__)

CANCELLED_MARKER = "cancelled"  # holds why the job was stopped
REPLICAS_DIR = "replicas"  # a replica-groups job's group configs and logs, and the lighthouse's log
AGENTS_DIR = "agents"  # node<N>.json: where agent N runs (host, pid, start time), written by the agent itself
SUPERVISOR_ENV = ("TDEPLOY_SUPERVISOR_PID", "TDEPLOY_SUPERVISOR_START")
STOP_GRACE_S = 30  # what `cancel` gives a job too
STALLED_STOP_GRACE_S = 3.0
"""What `stop_stalled` gives a stalled job's agents between SIGTERM and SIGKILL: its ranks made no progress for the
stall timeout, so none reaches the step boundary where SIGTERM would checkpoint, and torchrun would otherwise wait
its whole shutdown timeout (30 s) for them; a few seconds let an agent that can still exit do so."""
# Records torchrun's exit code; on SIGTERM (SIGUSR1) it passes SIGTERM (SIGUSR1) on and stays until torchrun has
# stopped its workers.
# Supervised, a watchdog stops torchrun once the supervisor (pid + start time) is gone, or the wrapper itself:
# SIGTERM (the workers checkpoint at their step boundary), then SIGKILL after STOP_GRACE_S (a hung job).
_WRAPPER = r"""
"$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM INT
trap 'kill -USR1 "$child" 2>/dev/null' USR1
started() {
  stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
  set -- ${stat##*") "}
  [ "$1" = Z ] || [ "$1" = X ] || echo "${20}"
}
if [ -n "${TDEPLOY_SUPERVISOR_PID:-}" ]; then
  (
    while [ "$(started "$TDEPLOY_SUPERVISOR_PID")" = "$TDEPLOY_SUPERVISOR_START" ] && kill -0 $$ 2>/dev/null; do
      sleep 1
    done
    echo "stopped: its supervising process (pid $TDEPLOY_SUPERVISOR_PID) exited" > "$TDEPLOY_STOP_FILE"
    kill -TERM "$child" 2>/dev/null
    i=0
    while kill -0 "$child" 2>/dev/null && [ "$i" -lt "$TDEPLOY_STOP_GRACE_S" ]; do sleep 1; i=$((i+1)); done
    kill -KILL "$child" 2>/dev/null
  ) &
  watchdog=$!
fi
while :; do
  wait "$child"; code=$?
  kill -0 "$child" 2>/dev/null || break
done
[ -z "${watchdog:-}" ] || kill "$watchdog" 2>/dev/null
echo "$code" > "$TDEPLOY_EXIT_FILE"
"""


class JobsStopped(RuntimeError):
    """This process is being interrupted: it stopped its supervised jobs and starts no new one."""


# The supervised jobs this process started, by job id: what `stop_supervised_jobs` ends on an interrupt.
_supervised: dict[str, JobHandle] = {}
_stopping = threading.Event()


def supervised_jobs() -> list[JobHandle]:
    """The supervised jobs this process started whose agents still run."""
    return [handle for handle in list(_supervised.values()) if running_agents(handle)]


def stop_supervised_jobs(grace_s: float = 10.0) -> list[JobHandle]:
    """Refuse new jobs from now on and stop every supervised job this process started (agents and workers, by
    pid); the jobs that were still running."""
    _stopping.set()
    running = supervised_jobs()
    for handle in running:
        log.warning(
            "stopping job %s (agent pid %s)", handle.ref, ", ".join(str(a["pid"]) for a in handle.details["agents"])
        )
        _launcher_of(handle).cancel(handle, grace_s=grace_s, reason="its `tdeploy run` was interrupted")
    return running


def _launcher_of(handle: JobHandle) -> LocalLauncher:
    """The launcher that started a supervised job: local, or SSH (its agents on other hosts)."""
    if handle.scheduler == "ssh":
        from tasks.launch.ssh import SshLauncher

        return SshLauncher()
    return LocalLauncher()


def kill_supervised_jobs() -> None:
    """SIGKILL every supervised job's agents and workers at once (a second interrupt: no grace)."""
    _stopping.set()
    for handle in list(_supervised.values()):
        processes = [(a["pid"], a["start_time"]) for a in handle.details["agents"]]
        processes += LocalLauncher._workers(Path(handle.output_dir))
        for pid, started in processes:
            if alive(pid, started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


class TrainingFailed(RuntimeError):
    """The training job did not succeed; says which rank failed first and with what."""

    def __init__(self, status: JobStatus, log_path: Path, log_tail: str) -> None:
        super().__init__(f"training {status.describe()}; log: {log_path}\n{log_tail}")
        self.status, self.log_path, self.log_tail = status, log_path, log_tail
        self.returncode = status.exit_code


def running_agents(handle: JobHandle) -> list[dict[str, str | int | None]]:
    """The agents of a local job that still run (pid and start time as job.json recorded them)."""
    return [a for a in handle.details.get("agents", []) if alive(a["pid"], a["start_time"])]


def _refuse_if_running(out: Path) -> None:
    """UserError when job.json in `out` records a local job whose agents still run."""
    record = out / "job.json"
    try:
        previous = JobHandle.from_json(json.loads(record.read_text()))
    except (OSError, ValueError, TypeError):
        return  # no job there, or not one this launcher can check
    if previous.scheduler not in ("local", "ssh") or not (agents := running_agents(previous)):
        return
    pids = ", ".join(str(a["pid"]) for a in agents)
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(previous.submitted_unix_s))
    raise UserError(
        f"run.output_url={out}: job {previous.ref} still runs there (agent pid {pids}, since {since})",
        f"wait for it to end, stop it with `tdeploy cancel {previous.ref}`, or use another run.output_url",
    )


class LocalLauncher(Launcher):
    """Runs, watches and cancels torchrun jobs on this machine."""

    scheduler = "local"
    capabilities = Capabilities(
        runs_image=False,  # the agents run this machine's Python
        runs_on_this_machine_only=True,
        needs_shared_output=True,
        delivers_signals=True,
        can_lose_node=True,
        replaces_lost_host=False,
        has_hot_spares=True,  # cluster.spares: standby agents in the rendezvous (tasks/launch/spares.py)
        live_recovery=True,  # one replica-groups supervisor in place of the agents (tasks/launch/replica_supervisor.py)
    )

    @classmethod
    def hosts(cls, cluster: ClusterConfig) -> list[NodeHost] | None:
        """This machine, reached without SSH."""
        return [NodeHost(name="localhost", connection="local")]

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """`env`: added to this process's environment, which the agents start from."""
        self.env = dict(os.environ, **(env or {}))

    def submit(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        name: str,
        image: str | None = None,
        *,
        environment: JobEnvironment | None = None,
        supervised: bool = True,
    ) -> JobHandle:
        """Write run.json, start the agents with cluster.env (and `environment`) set, record the job; returns at
        once.

        Supervised, the job stops when this process ends; detached, it runs on without it.
        Refused (UserError) while the previous job in the output folder still runs. `image` is not used:
        a local job runs this machine's Python.
        """
        if image:
            log.info("the local launcher runs this machine's Python; image %s is not used", image)
        if not is_local(train.run.output_url):
            raise UserError(
                f"run.output_url={train.run.output_url}: the local launcher needs a local folder",
                "use a path on this machine",
            )
        if _stopping.is_set():
            raise JobsStopped(f"job {name} not started: this process is being interrupted")
        out = Path(local_path(train.run.output_url)).resolve()
        _refuse_if_running(out)  # before anything of that job's is touched
        supervisor = self._supervisor() if supervised else None
        out.mkdir(parents=True, exist_ok=True)
        for stale in [*out.glob("exit-*.txt"), out / CANCELLED_MARKER]:
            stale.unlink(missing_ok=True)
        config_path = out / "run.json"
        train.to_json_file(config_path)
        endpoint = self._endpoint(cluster)
        job_id = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        log_path = RunOutput(out).train_log
        offset = log_path.stat().st_size if log_path.exists() else 0
        agents = []
        (out / AGENTS_DIR).mkdir(exist_ok=True)
        for stale in (out / AGENTS_DIR).glob("node*.json"):
            stale.unlink()
        submitted = time.time()
        replicas = train.fault_tolerance.mode == "replica_groups"
        exit_files = [out / f"exit-{node}.txt" for node in range(cluster.nodes)]
        with open(log_path, "ab") as log_file:
            # Replica groups: one process per node where each node runs a group, else one that runs them all.
            per_node = self.capabilities.replica_group_per_node
            agents_count = (cluster.nodes if per_node else 1) if replicas else cluster.nodes + cluster.spares
            for node in range(agents_count):
                if replicas:  # in place of the agents: here one process runs every replica group
                    argv, env = self._replica_command(cluster, train, job_id, config_path, environment, node)
                else:
                    standby = node >= cluster.nodes
                    args = torchrun_args(cluster, endpoint, job_id, str(config_path),
                                         str(out / "logs" / f"node{node}"), self._store_host(cluster, node))  # fmt: skip
                    spare = {SPARE_WAIT_ENV: spare_wait_value(out, submitted, exit_files)} if standby else {}
                    argv, env = self._agent_command(cluster, node, args, environment, out, spare)
                env["TDEPLOY_EXIT_FILE"] = str(out / f"exit-{node}.txt")
                env["TDEPLOY_STOP_FILE"] = str(out / CANCELLED_MARKER)
                env["TDEPLOY_STOP_GRACE_S"] = str(STOP_GRACE_S)
                for key in SUPERVISOR_ENV:
                    env.pop(key, None)  # a detached job must not inherit its submitter's supervisor
                if supervisor:
                    env.update(TDEPLOY_SUPERVISOR_PID=str(supervisor["pid"]),
                               TDEPLOY_SUPERVISOR_START=str(supervisor["start_time"]))  # fmt: skip
                proc = subprocess.Popen(
                    ["/bin/sh", "-c", _WRAPPER, "sh", *argv],
                    env=env,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                agents.append({"pid": proc.pid, "start_time": start_time(proc.pid)})
        handle = JobHandle(
            scheduler=self.scheduler,
            job_id=job_id,
            name=name,
            output_dir=str(out),
            log_path=str(log_path),
            details={
                "agents": agents,
                "log_offset": offset,
                "endpoint": endpoint,
                "supervisor": supervisor,
                "min_nodes": None if replicas else cluster.min_nodes,
                "spare_nodes": [] if replicas else spare_nodes(cluster.nodes, cluster.spares),
                "replica_groups": train.fault_tolerance.replica_groups if replicas else None,
                **self._details(cluster),
            },
            env=dict(cluster.env),
            extra_env=(environment or JobEnvironment()).variables(),
        )
        record_job(handle)
        if supervisor:
            _supervised[job_id] = handle
        if replicas:
            log.info("started %d replica group(s) under a torchft lighthouse; job %s; log %s (each group's: %s)",
                     train.fault_tolerance.replica_groups, handle.ref, log_path, out / REPLICAS_DIR)  # fmt: skip
        else:
            log.info("started %d torchrun agent(s) at %s; job %s; log %s", len(agents), endpoint, handle.ref, log_path)
        return handle

    @staticmethod
    def _store_host(cluster: ClusterConfig, node: int) -> bool | None:
        """With hot spares, agent 0 hosts the rendezvous store: every agent here matches the endpoint's address, and
        the store must outlive the lost node and not open beside a gone one in a late spare (None: the first to
        bind hosts it, as torchrun does)."""
        return node == 0 if cluster.spares else None

    def _endpoint(self, cluster: ClusterConfig) -> str:
        """The c10d rendezvous endpoint: this machine's loopback (the agents all run here)."""
        return f"127.0.0.1:{cluster.rdzv_port or free_port()}"

    def _agent_command(
        self,
        cluster: ClusterConfig,
        node: int,
        args: list[str],
        environment: JobEnvironment | None,
        out: Path,
        spare: Mapping[str, str] | None = None,
    ) -> tuple[list[str], dict[str, str]]:
        """The command the wrapper runs for agent `node` (torchrun `args`) and the environment it starts with
        (`spare`: a hot spare's wait, tasks/launch/spares.py)."""
        env = job_env(cluster, environment, inherited=self.env)
        env[AGENT_RECORD_ENV] = str(out / AGENTS_DIR / f"node{node}.json")
        env.update(spare or {})
        return [sys.executable, "-m", "tasks.launch.agent", *args], env

    def _replica_command(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        job_id: str,
        config_path: Path,
        environment: JobEnvironment | None,
        node: int,
    ) -> tuple[list[str], dict[str, str]]:
        """The command and environment of a replica-groups job's one process (tasks/launch/replica_supervisor.py):
        fault_tolerance.replica_groups torchruns of world_size / replica_groups ranks each, with the job's restarts
        (how a lost group comes back) and preemption signals."""
        env = job_env(cluster, environment, inherited=self.env)
        groups = train.fault_tolerance.replica_groups
        argv = [
            sys.executable, "-m", "tasks.launch.replica_supervisor", "--config", str(config_path), "--job-id", job_id,
            f"--procs-per-group={cluster.world_size // groups}", f"--max-restarts={cluster.max_restarts}",
            "--workdir", str(config_path.parent / REPLICAS_DIR), "--", *preemption_args(cluster),
        ]  # fmt: skip
        return argv, env

    def gate_command(self, cluster: ClusterConfig, host: NodeHost, module_args: list[str]) -> list[str] | None:
        """The health gate's probe on this machine, with this machine's Python."""
        return [sys.executable, "-m", *module_args]

    def _details(self, cluster: ClusterConfig) -> dict[str, object]:
        """What job.json keeps beyond the agents, for status and cancel from another process."""
        return {}

    @staticmethod
    def _supervisor() -> dict[str, str | int] | None:
        """This process, as the wrapper's watchdog recognises it (None where start times are unknown)."""
        started = start_time(os.getpid())
        return None if started is None else {"pid": os.getpid(), "start_time": started, "host": socket.gethostname()}

    def queue_seconds(self, handle: JobHandle) -> float | None:
        """No queue: the agents start when the job is submitted (here and over SSH)."""
        return 0.0

    def status(self, handle: JobHandle) -> JobStatus:
        """Running while an agent lives; then succeeded, failed (with the root cause) or cancelled."""
        out = Path(handle.output_dir)
        agents = handle.details["agents"]
        if running_agents(handle):
            written = self._ranks_written_at(handle)
            started = written is not None and written >= handle.submitted_unix_s
            return JobStatus(JobState.RUNNING if started else JobState.PENDING, "running" if started else "rendezvous")
        marker = out / CANCELLED_MARKER
        if marker.exists():
            return JobStatus(JobState.CANCELLED, "cancelled", marker.read_text().strip() or "cancelled")
        codes = []
        for node in range(len(agents)):
            exit_file = out / f"exit-{node}.txt"
            codes.append(int(exit_file.read_text().strip()) if exit_file.exists() else None)
        if all(code == 0 for code in codes):
            return JobStatus(JobState.SUCCEEDED, "exited", exit_code=0)
        try:
            preempted = self._preemption(handle)
        except PreemptionFileError as err:
            return JobStatus(JobState.FAILED, "exited", str(err), exit_code=next(c for c in codes if c))
        if preempted is not None:
            others = [f"node {n} ({self._node_name(handle, n)}): exit {c}" for n, c in enumerate(codes)
                      if c != PREEMPTED_EXIT_CODE]  # fmt: skip
            reason = preempted.describe() + "".join(f"; {other}" for other in others)
            return JobStatus(JobState.PREEMPTED, "exited", reason, exit_code=PREEMPTED_EXIT_CODE)
        finished = [node for node, code in enumerate(codes) if code == 0]
        spares = handle.details.get("spare_nodes") or []
        if spares and len(finished) >= len(codes) - len(spares) and self._finished_since(handle):
            # Hot spares: `nodes` agents finished the job; the others are a lost node or a spare left standing.
            ends = ", ".join(f"node {n} ({self._node_name(handle, n)}, {'spare, ' if n in spares else ''}"
                             f"{'no exit status' if c is None else f'exit {c}'})" for n, c in enumerate(codes) if c != 0)
            return JobStatus(JobState.SUCCEEDED, "exited", f"finished on {len(finished)} of {len(codes)} agents "
                             "(hot spares)" + (f"; not finishing: {ends}" if ends else ""), exit_code=0)  # fmt: skip
        min_nodes = handle.details.get("min_nodes")
        if min_nodes is not None and len(finished) >= min_nodes:  # elastic: it finished without the lost nodes
            lost = ", ".join(f"node {n} ({self._node_name(handle, n)}, exit {c})" for n, c in enumerate(codes) if c)
            return JobStatus(JobState.SUCCEEDED, "exited", f"finished on {len(finished)} of {len(codes)} nodes; "
                             f"lost {lost}", exit_code=0)  # fmt: skip
        failed = [node for node, c in enumerate(codes) if c != 0]
        first = min(failed, key=lambda node: self._exit_time(out, node))  # the first to exit, by its exit file
        code = codes[first]
        name = self._node_name(handle, first)
        reason = (
            f"an agent exited without an exit status on {name} (node {first})"
            if code is None
            else f"torchrun exited with {code} on {name} (node {first})"
        )
        ends = {n: "no exit status" if codes[n] is None else f"exit {codes[n]}" for n in failed}
        others = [f"node {n} ({self._node_name(handle, n)}): {ends[n]}" for n in failed if n != first]
        reason += "".join(f"; {other}" for other in others)
        text = self._log_text(handle)
        return JobStatus(JobState.FAILED, "exited", reason, exit_code=code, failure=parse_root_cause(text),
                         host=name)  # fmt: skip

    @staticmethod
    def _ranks_written_at(handle: JobHandle) -> float | None:
        """When the job's ranks first wrote ranks.json: its own, or with replica groups the first group's."""
        out = Path(handle.output_dir)
        if not handle.details.get("replica_groups"):
            return RunOutput(out).ranks_written_at()
        times = [t for g in range(handle.details["replica_groups"])
                 if (t := RunOutput(out / f"replica-{g}").ranks_written_at()) is not None]  # fmt: skip
        return min(times) if times else None

    @staticmethod
    def _finished_since(handle: JobHandle) -> bool:
        """The trainer wrote this job's result (result.json, at the end of its last step) since it was submitted."""
        try:
            return (Path(handle.output_dir) / RESULT).stat().st_mtime >= handle.submitted_unix_s
        except OSError:
            return False

    @staticmethod
    def _preemption(handle: JobHandle) -> PreemptionRecord | None:
        """The trainer's record of this job's preemption (after its checkpoint), or None: the last one written
        since the job was submitted under its run id."""
        found = records_since(handle.output_dir, handle.submitted_unix_s, run_id=handle.job_id)
        return found[-1] if found else None

    def signal(self, handle: JobHandle, sig: int = signal.SIGTERM) -> None:
        """Deliver SIGTERM or SIGUSR1 to the job as a scheduler does: to each agent, which passes it to its workers
        (they checkpoint at the step boundary and exit 75: the job ends preempted). Only the agents' wrappers get
        it (they forward it to torchrun): a second copy to torchrun would cut its wait for the workers short."""
        sig = signal.Signals(sig)
        if sig not in (signal.SIGTERM, signal.SIGUSR1):
            raise UserError(f"signal {sig.name}: not a preemption signal", "send SIGTERM or SIGUSR1, or cancel the job")
        for agent in running_agents(handle):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(agent["pid"]), sig)

    def kill_rank(self, handle: JobHandle, rank: Mapping[str, Any], sig: int) -> None:
        """`sig` to the rank's process on this machine."""
        os.kill(rank["pid"], sig)

    def kill_node(self, handle: JobHandle, node: int, ranks: list[dict[str, Any]], sig: int) -> dict[str, Any]:
        """`sig` at once to agent `node` (where its own record says it runs) and the workers it started."""
        agent = self._agent_record(handle, node)
        victims = [r for r in ranks if parent_pid(r["pid"]) == agent["pid"]]
        for pid in [agent["pid"], *(r["pid"] for r in victims)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        killed = sorted(r["rank"] for r in victims)
        return {"node": node, "host": agent["host"], "agent_pid": agent["pid"], "ranks": killed}

    @staticmethod
    def _agent_record(handle: JobHandle, node: int) -> dict[str, Any]:
        """What agent `node` recorded about itself (host, pid, start time); UserError when it wrote nothing."""
        record_path = Path(handle.output_dir) / AGENTS_DIR / f"node{node}.json"
        try:
            record: dict[str, Any] = json.loads(record_path.read_text())
        except (OSError, ValueError) as err:
            raise UserError(f"job {handle.ref}: agent {node} left no record ({record_path})",
                            "node loss is drilled on the local and ssh schedulers") from err  # fmt: skip
        return record

    @staticmethod
    def _exit_time(out: Path, node: int) -> float:
        """When agent `node`'s exit file was written (never written: last)."""
        try:
            return (out / f"exit-{node}.txt").stat().st_mtime
        except OSError:
            return float("inf")

    @staticmethod
    def _node_name(handle: JobHandle, node: int) -> str:
        """Agent `node`'s host: the inventory's name over SSH, else where its own record says it ran."""
        hosts = handle.details.get("hosts")
        if hosts and node < len(hosts):
            return str(hosts[node])
        try:
            return str(json.loads((Path(handle.output_dir) / AGENTS_DIR / f"node{node}.json").read_text())["host"])
        except (OSError, ValueError, KeyError):
            return "host unknown"

    def _log_text(self, handle: JobHandle) -> str:
        with open(handle.log_path, "rb") as log_file:
            log_file.seek(handle.details.get("log_offset", 0))
            return log_file.read().decode(errors="replace")

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[list[str], int]:
        """Combined log lines of this job (all agents and ranks, as torchrun tees them)."""
        start = max(offset, handle.details.get("log_offset", 0))
        return read_log(handle.log_path, start)

    def cancel(self, handle: JobHandle, grace_s: float = STOP_GRACE_S, reason: str = "cancelled by the user") -> None:
        """SIGTERM the agents' process groups (torchrun stops its workers), then SIGKILL whatever is left."""
        out = Path(handle.output_dir)
        (out / CANCELLED_MARKER).write_text(f"{reason} at {time.strftime('%Y-%m-%dT%H:%M:%S')}")
        agents = [(a["pid"], a["start_time"]) for a in handle.details["agents"] if alive(a["pid"], a["start_time"])]
        for pid, _ in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
        # Workers run in sessions of their own (torchrun starts them so), and so do a replica-groups job's
        # torchruns and lighthouse: follow them by pid too.
        processes = agents + self._workers(out) + self._replica_processes(out)
        deadline = time.monotonic() + grace_s
        while any(alive(*p) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid, started in agents:
            if alive(pid, started):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        for pid, started in processes:
            if alive(pid, started):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(*p) for p in processes) and time.monotonic() < deadline:
            time.sleep(0.1)

    def stop_stalled(self, handle: JobHandle) -> None:
        """`cancel` with STALLED_STOP_GRACE_S: the stalled ranks are SIGKILLed instead of waited for."""
        self.cancel(handle, grace_s=STALLED_STOP_GRACE_S, reason="stalled: no step progress for the stall timeout")

    @staticmethod
    def _replica_processes(out: Path) -> list[tuple[int, str | None]]:
        """A replica-groups job's lighthouse and group agents still running (their supervisor's record)."""
        try:
            recorded = json.loads((out / REPLICAS_DIR / PROCESSES_FILE).read_text())
        except (OSError, ValueError):
            return []
        found = []
        for entry in [e for e in recorded if isinstance(e, dict)] if isinstance(recorded, list) else []:
            pid, started = entry.get("pid"), entry.get("start_time")
            if type(pid) is int and pid > 1 and isinstance(started, str) and alive(pid, started):
                found.append((pid, started))
        return found

    @staticmethod
    def _workers(out: Path) -> list[tuple[int, str | None]]:
        """The job's worker processes still running (from ranks.json, its own and its replica groups', checked
        against their command line)."""
        recorded = [RunOutput(folder).ranks() for folder in [out, *sorted(out.glob("replica-*"))]]
        found = []
        for rank in [rank for ranks in recorded if ranks is not None for rank in ranks.ranks]:
            pid = rank["pid"]
            try:
                cmdline = psutil.Process(pid).cmdline()
            except psutil.Error:  # gone, or not ours to read
                continue
            if any("training.train" in arg for arg in cmdline) and any(str(out) in arg for arg in cmdline):
                found.append((pid, start_time(pid)))
        return found


def parent_pid(pid: int) -> int | None:
    """A process's parent on this machine (None when it is gone)."""
    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


@dataclass
class LocalJob:
    """A local job with the launcher that runs it (convenience for the CLI, drills and tests)."""

    handle: JobHandle
    launcher: LocalLauncher

    @property
    def output_dir(self) -> Path:
        """The run's output folder."""
        return Path(self.handle.output_dir)

    @property
    def log_path(self) -> Path:
        """The combined log."""
        return Path(self.handle.log_path)

    def wait(self, timeout_s: float | None = None, on_line: Callable[[str], None] | None = None) -> JobStatus:
        """Wait until the job ends."""
        return self.launcher.wait(self.handle, timeout_s=timeout_s, on_line=on_line)

    def status(self) -> JobStatus:
        """The job's state now."""
        return self.launcher.status(self.handle)

    def cancel(self) -> None:
        """Stop it."""
        self.launcher.cancel(self.handle)

    def log_tail(self, lines: int = 40) -> str:
        """The last lines this job wrote."""
        return "\n".join(self.launcher._log_text(self.handle).splitlines()[-lines:])


def start_local(
    cluster: ClusterConfig,
    train: TrainConfig,
    name: str = "train",
    *,
    environment: JobEnvironment | None = None,
) -> LocalJob:
    """Start a local job (cluster.env and `environment` in its environment) and return at once."""
    launcher = LocalLauncher()
    return LocalJob(launcher.submit(cluster, train, name, environment=environment), launcher)


def run_local(
    cluster: ClusterConfig,
    train: TrainConfig,
    on_line: Callable[[str], None] | None = None,
    name: str = "train",
    *,
    environment: JobEnvironment | None = None,
) -> LocalJob:
    """Run a local job to the end (cluster.env and `environment` in its environment); raises TrainingFailed (with
    the first failing rank) unless it succeeded."""
    job = start_local(cluster, train, name, environment=environment)
    try:
        status = job.wait(on_line=on_line)
    except BaseException:
        job.cancel()
        raise
    if status.state is not JobState.SUCCEEDED:
        raise TrainingFailed(status, job.log_path, job.log_tail())
    return job
