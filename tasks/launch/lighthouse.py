"""Replica groups on this machine: a torchft lighthouse and one torchrun job per replica group.

With `fault_tolerance.mode: replica_groups` (training/replica.py) each replica group is its own torchrun job with
its own rendezvous (`--standalone`), its own run output and checkpoint folder (`replica-<g>` under the spec's), and
its own `--max-restarts`: a group whose worker dies is restarted by its torchrun and heals from a healthy group
through the lighthouse's quorum, while the other groups go on. The lighthouse (torchft's `torchft_lighthouse`) runs
beside them for the job's lifetime.

The lighthouse listens on HOST, the address the groups' rendezvous use (loopback: they all run here), and the
trainers' checkpoint servers listen on and advertise it too (TDEPLOY_REPLICA_HOST, training/replica_transport.py).
torchft 0.2.0 leaves no choice for its manager server, which binds every interface ([::], advertising HOST).

Each group's torchrun runs through the local agent (tasks/launch/agent.py: it dies with whoever started it, and a
preemption ends it with PREEMPTED_EXIT_CODE), and the lighthouse is sent SIGKILL by Linux when its starter exits:
a group never outlives the process that owns the job. Used by the local launcher's jobs (tdeploy train, through
tasks/launch/replica_supervisor.py), the replica_loss drill (tasks/acceptance/ladder/replica_loss.py) and their
tests. The SSH launcher's jobs start the same pieces one host at a time (start_lighthouse, start_group, through
tasks/launch/replica_host.py): one group per host, on that host's inventory address instead of loopback, and the
lighthouse on the first host.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tasks.errors import UserError
from tasks.launch.torchrun import WORKER_ENV, free_port
from training.config import TrainConfig
from training.process import parent_death_signal, start_time
from training.job_env import HOST_ENV, LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from training.run_output import RunOutput
from training.storage import join

log = logging.getLogger(__name__)

LIGHTHOUSE_BIN = "torchft_lighthouse"
HOST = "127.0.0.1"
"""The address the groups' rendezvous use (torchrun --standalone: loopback); the lighthouse, the managers and the
checkpoint servers listen on it rather than on every interface."""


def lighthouse_command(
    cfg: TrainConfig, port: int, host: str = HOST, binary: Sequence[str] | None = None
) -> list[str]:
    """The lighthouse's command line: quorum of at least fault_tolerance.min_replicas groups, a group dropped after
    heartbeat_timeout_s without heartbeats. `binary`: how the cluster starts it (a Slurm job's Python's sibling, a
    container's); None: the torchft_lighthouse beside this Python, which must exist."""
    ft = cfg.fault_tolerance
    if binary is None:
        found = Path(sys.executable).parent / LIGHTHOUSE_BIN
        if not found.exists():
            raise UserError(
                f"{found} not found: fault_tolerance.mode=replica_groups needs torchft",
                "install the training extra (pip install 'transformer-deploy[training]') or set "
                "fault_tolerance.mode=none",
            )
        binary = [str(found)]
    join_ms = int(min(ft.quorum_timeout_s, 10.0) * 1000)  # how long a quorum waits for a group that heartbeats
    return [
        *binary, f"--bind={host}:{port}", f"--min_replicas={ft.min_replicas}",
        f"--heartbeat_timeout_ms={int(ft.heartbeat_timeout_s * 1000)}", f"--join_timeout_ms={join_ms}",
    ]  # fmt: skip


def group_config(cfg: TrainConfig, group: int) -> TrainConfig:
    """Replica group `group`'s config: its own run output and checkpoint folders (replica-<g> under the spec's)."""
    name = f"replica-{group}"
    run = cfg.run.model_copy(update={"output_url": join(cfg.run.output_url, name)})
    checkpoint = cfg.checkpoint.model_copy(update={"url": join(cfg.checkpoint.url, name)})
    return cfg.model_copy(update={"run": run, "checkpoint": checkpoint})


def start_lighthouse(cfg: TrainConfig, workdir: Path, port: int, host: str = HOST) -> subprocess.Popen:
    """Start the lighthouse on `host`:`port` in a session of its own, SIGKILLed by Linux when its starter exits
    (its log: `workdir`/lighthouse.log)."""
    return subprocess.Popen(  # noqa: S603 - a fixed binary and validated numbers
        lighthouse_command(cfg, port, host), stdout=(workdir / "lighthouse.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True, preexec_fn=parent_death_signal,
    )  # fmt: skip


def start_group(
    cfg: TrainConfig,
    group: int,
    workdir: Path,
    procs_per_group: int,
    max_restarts: int,
    lighthouse: str,
    host: str = HOST,
    env: dict[str, str] | None = None,
    torchrun_args: Sequence[str] = (),
) -> subprocess.Popen:
    """Start replica group `group`'s torchrun through the agent, in a session of its own: its config
    (`workdir`/run-replica-<g>.json) and log (replica-<g>.log) under `workdir`; its servers listen on `host` and its
    managers reach the lighthouse at `lighthouse` (http://host:port)."""
    base = {**os.environ, **(env or {})}
    for key, value in WORKER_ENV.items():
        base.setdefault(key, value)
    base.update({LIGHTHOUSE_ENV: lighthouse, HOST_ENV: host, REPLICA_GROUP_ENV: str(group)})
    config_path = workdir / f"run-replica-{group}.json"
    group_config(cfg, group).to_json_file(config_path)
    cmd = [
        sys.executable, "-m", "tasks.launch.agent", "--standalone", "--nnodes=1",
        f"--nproc-per-node={procs_per_group}", f"--max-restarts={max_restarts}", *torchrun_args,
        "-m", "training.train", "--config", str(config_path),
    ]  # fmt: skip
    return subprocess.Popen(  # noqa: S603 - our own interpreter and paths
        cmd, env=base, stdout=(workdir / f"replica-{group}.log").open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def stop_sessions(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> None:
    """Stop each process's session (SIGTERM, then SIGKILL after grace_s) and reap the process."""
    for proc in procs:
        with contextlib.suppress(ProcessLookupError):  # the session may be gone already
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class ReplicaGroupsJob:
    """A lighthouse and one torchrun per replica group, each in a session of its own (stopped by its pid)."""

    cfg: TrainConfig
    workdir: Path
    lighthouse: subprocess.Popen
    groups: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        cfg: TrainConfig,
        workdir: Path,
        procs_per_group: int,
        max_restarts: int,
        env: dict[str, str] | None = None,
        torchrun_args: Sequence[str] = (),
    ) -> ReplicaGroupsJob:
        """Start the lighthouse, then every group's torchrun (logs under `workdir`; `torchrun_args`: more of its
        arguments, the preemption signals and shutdown timeout)."""
        ft = cfg.fault_tolerance
        if ft.mode != "replica_groups":
            raise UserError(f"fault_tolerance.mode={ft.mode!r}: no replica groups to start", "set it to replica_groups")
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        job = cls(cfg, workdir, start_lighthouse(cfg, workdir, port))
        lighthouse = f"http://{HOST}:{port}"
        for g in range(ft.replica_groups):
            job.groups.append(start_group(cfg, g, workdir, procs_per_group, max_restarts, lighthouse, HOST, env,
                                          torchrun_args))  # fmt: skip
        return job

    def output(self, group: int) -> RunOutput:
        """Replica group `group`'s run output."""
        return RunOutput(group_config(self.cfg, group).run.output_url)

    def kill_group(self, group: int, sig: int = signal.SIGKILL) -> list[int]:
        """Signal every worker of `group` (the pids its ranks.json records); its torchrun restarts them."""
        ranks = self.output(group).ranks()
        if ranks is None:
            raise UserError(f"replica group {group} has not written ranks.json yet", "wait for its first step")
        pids = [int(r["pid"]) for r in ranks.ranks]
        for pid in pids:
            os.kill(pid, sig)
        return pids

    def processes(self) -> list[dict[str, str | int | None]]:
        """What this job started (the lighthouse, each group's torchrun agent): role, pid and start time."""
        procs = [("lighthouse", self.lighthouse), *((f"replica-{g}", p) for g, p in enumerate(self.groups))]
        return [{"role": role, "pid": proc.pid, "start_time": start_time(proc.pid)} for role, proc in procs]

    def signal(self, sig: int) -> None:
        """`sig` to each group's torchrun agent, which passes a preemption signal on to its workers (they
        checkpoint at the step boundary and exit PREEMPTED_EXIT_CODE)."""
        for proc in self.groups:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def wait(self, timeout_s: float) -> list[int | None]:
        """Wait for every group's torchrun (None: still running at the timeout); then stop the lighthouse."""
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for proc in self.groups:
            try:
                codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        self.stop()
        return codes

    def stop(self, grace_s: float = 5.0) -> None:
        """Stop every group's session and the lighthouse (SIGTERM, then SIGKILL after grace_s)."""
        stop_sessions([*self.groups, self.lighthouse], grace_s)

    def log_tail(self, group: int, chars: int = 3000) -> str:
        """The end of replica group `group`'s torchrun log."""
        return (self.workdir / f"replica-{group}.log").read_text(errors="replace")[-chars:]
