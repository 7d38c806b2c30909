"""Slurm launcher: an sbatch script with one srun task per node, each running a torchrun agent.

The rendezvous is c10d on the first node of the allocation (`scontrol show
hostnames`). Status comes from the controller's record (`squeue --json`) while
it holds the job, then `sacct`, falling back to the job-completion log (`sacct
-c`) on clusters without accounting storage. Where squeue has no `--json`, the
text of `squeue -o` and `scontrol show job` takes the controller's part.

Preemption (cluster.preemption, on by default): the script asks for `--signal=B:USR1@grace_period_s` and
`--requeue`. The batch shell forwards the time-limit warning to the job's steps; Slurm's preemption SIGTERM goes
to the tasks directly; torchrun's agent passes either to the workers and waits for them. The trainer checkpoints
at the next step boundary, records the preemption and exits 75; the script then requeues the job (`scontrol
requeue`), which waits PENDING (BeginTime, then Priority or Resources) and resumes from that checkpoint.

A priority pool: the spec picks the job's priority with cluster.slurm.partition (with partition_prio
preemption, a partition of a higher PriorityTier preempts the lower ones over the same nodes; the partitions'
GraceTime should be at least grace_period_s), cluster.slurm.qos (with preempt/qos and accounting) and
cluster.slurm.nice (lower priority within a partition). All three are validated by the spec (Slurm names, an
integer) and written as quoted `#SBATCH` directives.

Live recovery (fault_tolerance.mode=replica_groups, one replica group per node, which the spec holds to): the
script starts the torchft lighthouse in the background on the head node (cluster.slurm.rdzv_port), then one srun
step whose task on node i runs replica group i's own torchrun (--standalone, --max-restarts, its `replica-<i>`
config written by `submit`), advertising the node's name; a lost group's torchrun restarts it and it heals from
another node's group while the others go on. After the step the lighthouse is stopped by its pid and
tasks/launch/replica_step.py ends the job with the groups' outcome (group 0's result.json, a group's
failure.json, or the preemption, which requeues the job as above).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.errors import TransientError, UserError
from tasks.launch.base import (
    Capabilities,
    JobHandle,
    JobState,
    JobStatus,
    Launcher,
    RenderedFile,
    excluded_host_names,
    parse_root_cause,
    read_log,
    record_job,
)
from tasks.launch.environment import JobEnvironment
from tasks.launch.lighthouse import LIGHTHOUSE_BIN, group_config, lighthouse_command
from tasks.launch.local import REPLICAS_DIR
from tasks.launch.network import ENV_NAME
from tasks.launch.replica_step import EXIT_FILE
from tasks.launch.torchrun import LOG_ARGS, agent_args, job_env, payload_args, preemption_args
from training.config import TrainConfig
from training.health_gate import GATE_DIR, HEALTH_GATE_EXIT_CODE, storage_folders
from training.job_env import DEFAULT_MEMORY_DIR, HOST_ENV, LIGHTHOUSE_ENV, REPLICA_GROUP_ENV
from training.preemption import PREEMPTED_EXIT_CODE, PREEMPTIONS_FILE
from training.run_output import RESULT
from training.spares import AGENT_KEY, NODE_KEY
from training.storage import is_local, local_path

if TYPE_CHECKING:
    from tasks.launch.cluster import ClusterConfig

_STATES = {
    JobState.PENDING: {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SUSPENDED"},
    JobState.RUNNING: {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"},
    JobState.SUCCEEDED: {"COMPLETED"},
    JobState.CANCELLED: {"CANCELLED"},
    JobState.FAILED: {
        "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "REVOKED", "SPECIAL_EXIT",
    },
    # Slurm shows PREEMPTED only for a job it did not requeue (PreemptMode=CANCEL, or --no-requeue): it stays
    # stopped, and resubmitting resumes from the checkpoint the trainer wrote on the SIGTERM. A requeued job is
    # REQUEUED, then PENDING (reason BeginTime while the old credential expires, then Priority or Resources).
    JobState.PREEMPTED: {"PREEMPTED"},
}  # fmt: skip
# Pending reasons that no amount of waiting fixes: the request exceeds what the partition or account allows.
HOPELESS_REASONS = {
    "PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "AccountNotAllowed",
    "QOSMaxNodePerJobLimit", "QOSMaxWallDurationPerJobLimit", "InvalidAccount", "InvalidQOS", "JobHeldAdmin",
}  # fmt: skip
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# File-wide (after the shebang, before any command; sbatch reads #SBATCH lines after comments): the single-quoted
# scripts that `sh -c` runs in each task expand their variables there, on the node, which is what SC2016 flags.
SHELLCHECK_DIRECTIVE = "# shellcheck disable=SC2016"
# Run by `sh -c` in every task: $1 is the logs folder; the rest is the torchrun command.
PER_NODE_LOG_DIR = 'PET_LOG_DIR="$1/$SLURMD_NODENAME"; export PET_LOG_DIR; shift; exec "$@"'
# Run by `sh -c` in every task of a replica-groups job: $1 is the logs folder, $2 the groups' folder, the rest is
# the group's torchrun command without its --config. The node's index in the job is its group; the managers and
# checkpoint servers advertise the node's name (the rendezvous' address), as torchrun does for the group's store.
# The shell stays to record the exit code; it takes the signals that torchrun passes on (a trap, not an ignore,
# which torchrun would inherit) and waits.
REPLICA_TASK = (
    f'g="$SLURM_NODEID"; PET_LOG_DIR="$1/$SLURMD_NODENAME"; PET_LOCAL_ADDR="$SLURMD_NODENAME"; '
    f'{REPLICA_GROUP_ENV}="$g"; {HOST_ENV}="$SLURMD_NODENAME"; '
    f"export PET_LOG_DIR PET_LOCAL_ADDR {REPLICA_GROUP_ENV} {HOST_ENV}; workdir=\"$2\"; shift 2; "
    'trap : TERM USR1 INT HUP; rc=0; "$@" --config "$workdir/run-replica-$g.json" || rc=$?; '
    f'echo "$rc" > "$workdir/{EXIT_FILE.format(group="$g")}"; exit "$rc"'
)
_TRANSIENT = re.compile(
    r"Socket timed out|Unable to contact slurm controller|Connection refused|Zero Bytes were transmitted|"
    r"Slurm temporarily unable|Resource temporarily unavailable|Communication connection failure",
    re.I,
)


def slurm_state(raw: str, exit_code: int | None = None) -> JobState:
    """Map a Slurm state (e.g. 'CANCELLED by 0') to the launcher's states.

    A job that ended FAILED or TIMEOUT with PREEMPTED_EXIT_CODE checkpointed on the signal and was not requeued
    (the script's `scontrol requeue` was refused): preempted, resumable, not failed.
    """
    word = raw.split()[0].rstrip("+") if raw.strip() else "PENDING"
    if word in ("FAILED", "TIMEOUT") and exit_code == PREEMPTED_EXIT_CODE:
        return JobState.PREEMPTED
    for state, names in _STATES.items():
        if word in names:
            return state
    return JobState.FAILED


def slurm_queue_seconds(submit: str, start: str) -> float | None:
    """Seconds from Slurm's submit time to its start time (both `YYYY-MM-DDTHH:MM:SS` in the controller's zone);
    None when the job has not started (Start is Unknown, None or in the future as an estimate)."""
    try:
        submitted, started = datetime.fromisoformat(submit.strip()), datetime.fromisoformat(start.strip())
    except ValueError:
        return None
    if started > datetime.now(started.tzinfo):  # a pending job's estimated start
        return None
    return max(0.0, (started - submitted).total_seconds())


@dataclass(frozen=True)
class ControllerJob:
    """A job as the Slurm controller holds it (`squeue --json`), until MinJobAge after it ended."""

    state: str
    reason: str
    exit_code: int | None
    restarts: int | None
    submit_unix_s: int | None
    start_unix_s: int | None

    def queue_seconds(self) -> float | None:
        """Start less submit time; None while pending (a pending job's start is an estimate, or 0)."""
        if slurm_state(self.state) is JobState.PENDING or not self.start_unix_s or self.submit_unix_s is None:
            return None
        return max(0.0, float(self.start_unix_s - self.submit_unix_s))


def _number(value: Any) -> int | None:
    """An integer field of Slurm's JSON: a plain number (openapi v0.0.38, Slurm 22.05) or, from data_parser
    v0.0.39 on (Slurm 23.02+), `{"set": bool, "infinite": bool, "number": N}`."""
    if isinstance(value, dict):
        return int(value["number"]) if value.get("set", True) and "number" in value else None
    return int(value) if isinstance(value, (int, float)) else None


def controller_job(squeue_json: str, job_id: str) -> ControllerJob | None:
    """Job `job_id` in `squeue --json`'s output (Slurm 22.05 lists every job the controller holds whatever the
    filters); None when it is not there."""
    for job in json.loads(squeue_json).get("jobs", []):
        if str(job.get("job_id")) != job_id:
            continue
        state = job.get("job_state", "")
        state = " ".join(state) if isinstance(state, list) else str(state)  # a list of flags from 23.02 on
        code = job.get("exit_code")
        if isinstance(code, dict):  # 23.02+: {"status": [...], "return_code": N or {"number": N}, "signal": ...}
            exit_code = _number(code.get("return_code"))
        else:  # 22.05: the wait status, exit code in the high byte (`scontrol show job`'s ExitCode=3:0 is 768)
            raw = _number(code)
            exit_code = None if raw is None else (raw >> 8) & 0xFF
        return ControllerJob(
            state=state,
            reason=str(job.get("state_reason") or ""),
            exit_code=exit_code,
            restarts=_number(job.get("restart_cnt")),
            submit_unix_s=_number(job.get("submit_time")),
            start_unix_s=_number(job.get("start_time")),
        )
    return None


class SlurmLauncher(Launcher):
    """Submits, watches and cancels jobs through the Slurm command-line tools."""

    scheduler = "slurm"
    capabilities = Capabilities(
        runs_image=True,
        runs_on_this_machine_only=False,
        needs_shared_output=True,
        delivers_signals=False,
        can_lose_node=True,  # kill_node: through a step of the job on the node's host
        replaces_lost_host=False,
        has_hot_spares=True,  # cluster.spares: standby agents in the rendezvous (tasks/launch/spares.py)
        live_recovery=True,  # one replica group per node under a lighthouse on the head node (_replica_groups)
        replica_group_per_node=True,
    )

    @classmethod
    def rdzv_port(cls, cluster: ClusterConfig) -> int | None:
        """cluster.slurm.rdzv_port: the port on the job's first node."""
        return cluster.slurm.rdzv_port

    @classmethod
    def excluding(cls, cluster: ClusterConfig, hosts: Sequence[str]) -> ClusterConfig:
        """cluster.slurm.extra_args with `--exclude=` naming `hosts` (merged with an --exclude the spec gives)."""
        names = excluded_host_names(hosts)
        given = [a for a in cluster.slurm.extra_args if a.startswith("--exclude=")]
        others = [a for a in cluster.slurm.extra_args if not a.startswith("--exclude=")]
        merged = ",".join([*(a.removeprefix("--exclude=") for a in given), *names])  # host lists join with commas
        slurm = cluster.slurm.model_copy(update={"extra_args": [*others, f"--exclude={merged}"]})
        return cluster.model_copy(update={"slurm": slurm})

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        """`env`: added to this process's environment for the Slurm tools (SLURM_CONF, PATH, ...)."""
        self.env = dict(os.environ, **(env or {}))
        self._json: bool | None = None  # whether this Slurm's squeue has --json (known after the first call)

    # ---- commands -----------------------------------------------------------------------

    def _run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        tool = shutil.which(cmd[0], path=self.env.get("PATH"))
        if tool is None:
            raise UserError(
                f"cluster.scheduler=slurm: `{cmd[0]}` is not on PATH",
                "install the Slurm client tools (Debian: slurm-client) or run tdeploy on a login node",
            )
        proc = subprocess.run([tool, *cmd[1:]], capture_output=True, text=True, env=self.env, timeout=60)
        if check and proc.returncode != 0:
            message = (proc.stderr or proc.stdout).strip()
            if _TRANSIENT.search(message):
                raise TransientError(f"{cmd[0]} failed: {message}", "the Slurm controller may be busy; retried")
            raise UserError(f"{cmd[0]} failed: {message}", "see Slurm's message above")
        return proc

    def check(self, cluster: ClusterConfig) -> None:
        """Refuse before submitting what Slurm would refuse: missing tools, an unknown partition."""
        for tool in ("sbatch", "squeue", "scontrol", "scancel"):
            if shutil.which(tool, path=self.env.get("PATH")) is None:
                self._run(tool)  # raises the UserError naming the tool
        partition = cluster.slurm.partition
        if partition:
            # --all: a Hidden partition (a priority pool's) exists for those who name it
            proc = self._run("scontrol", "--all", "show", "partition", partition, check=False)
            if proc.returncode != 0:
                raise UserError(
                    f"cluster.slurm.partition={partition}: no such partition", f"use one of {self._partitions()}"
                )

    def _partitions(self) -> list[str]:
        """The partitions offered to users: Hidden=YES ones (a priority pool's, say) are left out, as sinfo does."""
        listing = self._run("scontrol", "show", "partition", "--oneliner").stdout
        return sorted(
            found.group(1)
            for line in listing.splitlines()
            if (found := re.match(r"PartitionName=(\S+)", line)) and "Hidden=YES" not in line.split()
        )

    # ---- script -------------------------------------------------------------------------

    @classmethod
    def rendered_files(
        cls, cluster: ClusterConfig, train: TrainConfig, name: str, image: str | None
    ) -> list[RenderedFile]:
        """job.sbatch as `submit` writes it into run.output_url (which it reads run.json from)."""
        out = Path(local_path(train.run.output_url)).resolve()
        script = cls().render(cluster, str(out / "run.json"), name, str(out), image, train=train)
        return [RenderedFile("slurm/job.sbatch", script, "the Slurm batch script of the training job",
                             "every spec value quoted for sbatch or the shell", shell=True)]  # fmt: skip

    def render(
        self,
        cluster: ClusterConfig,
        config_path: str,
        name: str,
        output_dir: str,
        image: str | None,
        environment: JobEnvironment | None = None,
        *,
        train: TrainConfig | None = None,
    ) -> str:
        """The sbatch script: every value from the spec is quoted for sbatch (directives) or the shell (commands).

        It exports cluster.env and cluster.network's variables, and `environment`'s (a drill's points, a test
        plugin) where given. With `train`'s fault_tolerance.mode=replica_groups, each node runs its own replica
        group under a lighthouse on the head node (`_replica_groups`).
        """
        slurm = cluster.slurm
        directives = [
            f"--job-name={name}",
            f"--nodes={cluster.nodes + cluster.spares}",  # hot spares: allocated with the job, standing by in it
            "--ntasks-per-node=1",
            f"--time={slurm.time_limit}",
            f"--output={_slurm_filename(output_dir)}/slurm-%j.out",
            "--open-mode=append",
        ]
        if cluster.accelerator != "cpu":
            directives.append(f"--gpus-per-node={cluster.procs_per_node}")
        optional = {
            "--cpus-per-task": slurm.cpus_per_node,
            "--mem": f"{slurm.mem_per_node_mb}M" if slurm.mem_per_node_mb else None,
            "--partition": slurm.partition,
            "--account": slurm.account,
            "--qos": slurm.qos,
            "--nice": slurm.nice,
        }
        directives += [f"{flag}={value}" for flag, value in optional.items() if value is not None]
        preemption = cluster.preemption
        if preemption.enabled:
            # B: the warning goes to the batch shell only, which forwards it to the job's steps (every process
            # of them: agents and workers) and so knows that the exit that follows asks for a requeue.
            directives += [f"--signal=B:USR1@{preemption.grace_period_s:d}", "--requeue"]
        if cluster.spares:  # a failed node must not end the job (or its step) that a spare is there to keep going
            directives.append("--no-kill")
        directives += slurm.extra_args
        env = job_env(cluster, environment)
        bad_names = [key for key in env if not ENV_NAME.fullmatch(key)]
        if bad_names:  # names cannot be quoted: `export` takes them as shell words
            raise UserError(f"cluster.env: {bad_names} are not variable names", "use letters, digits and _")
        if image and slurm.container and re.search(r"[,:]", output_dir):
            raise UserError(
                f"run.output_url={output_dir}: a folder mounted into the container cannot hold ',' or ':'",
                "use a folder without them",
            )
        mounts = ",".join([f"{output_dir}:{output_dir}", *slurm.container_mounts])
        if image and slurm.container == "pyxis":
            srun_options, launch = [f"--container-image={image}", f"--container-mounts={mounts}"], ["python"]
        elif image and slurm.container == "apptainer":
            binds = [part for mount in mounts.split(",") for part in ("--bind", mount)]
            srun_options, launch = [], ["apptainer", "exec", "--nv", *binds, image, "python"]
        else:
            srun_options, launch = [], [slurm.python or sys.executable]
        # $head_node and $SLURM_JOB_ID are the same for every node: the batch shell expands them. Each task
        # sets its own log folder (torchrun reads --log-dir from PET_LOG_DIR), as only there $SLURMD_NODENAME
        # names the node the task runs on. Everything else is data and quoted.
        agent = [
            _shell(["srun", "--ntasks-per-node=1", f"--kill-on-bad-exit={0 if cluster.spares else 1}", *srun_options]),
            _shell(["sh", "-c", PER_NODE_LOG_DIR, "tdeploy-task", f"{output_dir}/logs"]),
            # With hot spares torchrun runs inside training.preemption, whose exit is 0 for a spare left standing
            # when the finished job's rendezvous store goes away (torchrun alone exits 1, failing the step).
            _shell([*launch, "-m", "training.preemption" if cluster.spares else "torch.distributed.run",
                    *agent_args(cluster)]),  # fmt: skip
            f'"--rdzv-endpoint=$head_node:{slurm.rdzv_port:d}" "--rdzv-id=$SLURM_JOB_ID"',
            _shell([*LOG_ARGS, *payload_args(config_path)]),
        ]
        lines = ["#!/bin/bash", SHELLCHECK_DIRECTIVE, *(f"#SBATCH {_sbatch_quote(d)}" for d in directives),
                 "set -euo pipefail"]  # fmt: skip
        lines += [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
        lines += [
            'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            'echo "tdeploy: job $SLURM_JOB_ID on $SLURM_JOB_NODELIST, rendezvous $head_node"',
        ]
        if cluster.health_gate.on:
            replicas = train is not None and train.fault_tolerance.mode == "replica_groups"
            lines += _health_gate(cluster, train, output_dir, srun_options, launch, elastic=not replicas)
            agent[0] += ' ${gate_options[@]+"${gate_options[@]}"}'
        if train is not None and train.fault_tolerance.mode == "replica_groups":
            container = slurm.container if image else None
            setup, step = _replica_groups(cluster, train, config_path, output_dir, srun_options, launch, container)
            lines += setup
            agent = [step]
        if cluster.spares:
            # A lost node's task fails the step even when a spare took its place and the job finished: the step's
            # exit is the job's only where the trainer wrote no result since this run began.
            lines += _finished_with_spares(f"{output_dir}/{RESULT}")
            agent.append("|| finished_with_spares")
        if not cluster.preemption.enabled:
            return "\n".join([*lines, " ".join(agent)]) + "\n"
        return "\n".join([*lines, *_preemptible(" ".join(agent), f"{output_dir}/{PREEMPTIONS_FILE}")]) + "\n"

    # ---- launcher interface -------------------------------------------------------------

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
        """Write run.json and the script into the output folder (shared storage), sbatch it, record the job.

        A Slurm job always runs on its own: `supervised` does not apply.
        """
        if not is_local(train.run.output_url):
            raise UserError(
                f"run.output_url={train.run.output_url}: Slurm jobs need a shared filesystem path",
                "use a folder on the cluster's shared storage",
            )
        self.check(cluster)
        out = Path(local_path(train.run.output_url)).resolve()
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / "run.json"
        train.to_json_file(config_path)
        if train.fault_tolerance.mode == "replica_groups":  # each node's group reads its own (replica-<g> folders)
            (out / REPLICAS_DIR).mkdir(exist_ok=True)
            for group in range(train.fault_tolerance.replica_groups):
                group_config(train, group).to_json_file(out / REPLICAS_DIR / f"run-replica-{group}.json")
        script = out / "job.sbatch"
        script.write_text(self.render(cluster, str(config_path), name, str(out), image, environment, train=train))
        job_id = self._run("sbatch", "--parsable", str(script)).stdout.strip().split(";")[0]
        handle = JobHandle(
            scheduler=self.scheduler,
            job_id=job_id,
            name=name,
            output_dir=str(out),
            log_path=str(out / f"slurm-{job_id}.out"),
            details={"script": str(script), "image": image},
            env=dict(cluster.env),
            extra_env=(environment or JobEnvironment()).variables(),
        )
        record_job(handle)
        return handle

    def status(self, handle: JobHandle) -> JobStatus:
        """The controller's record (`squeue --json`) while it holds the job; afterwards sacct or the completion
        log. Where squeue has no --json, the text of `squeue -o` and `scontrol show job` instead."""
        known, job = self._controller_job(handle)
        if job is not None:
            return self._status(job.state, job.reason, job.exit_code, handle)
        if not known:
            queued = self._run("squeue", "-h", "-j", handle.job_id, "-o", "%T|%r", check=False)
            line = queued.stdout.strip()
            if queued.returncode == 0 and line:
                raw, reason = (line.split("|", 1) + [""])[:2]
                return self._status(raw, reason, None, handle)
        # `scontrol show job` reads the same controller record that squeue --json just did not have.
        probes = [self._from_sacct, *([] if known else [self._from_scontrol]), self._from_jobcomp]
        for probe in probes:
            found = probe(handle)
            if found:
                return found
        raise TransientError(f"Slurm knows nothing of job {handle.job_id} yet", "retried")

    def _status(self, raw: str, reason: str, exit_code: int | None, handle: JobHandle) -> JobStatus:
        state = slurm_state(raw, exit_code)
        failure = None
        if state is JobState.FAILED:
            failure = (
                parse_root_cause(Path(handle.log_path).read_text(errors="replace"))
                if Path(handle.log_path).exists()
                else None
            )
        return JobStatus(state, raw.strip(), reason.strip(), exit_code, failure)

    def _controller_job(self, handle: JobHandle) -> tuple[bool, ControllerJob | None]:
        """(whether `squeue --json` answered, the job in it). The JSON comes from Slurm's own serializer, so no
        field is read from text meant for people; the text probes remain for a squeue without --json (before
        21.08, or without the serializer/json plugin) and for a controller that cannot be reached."""
        if self._json is False:
            return False, None
        # -t all -j ID: a filter where squeue applies it with --json (22.05 ignores both and lists every job).
        proc = self._run("squeue", "--json", "-t", "all", "-j", handle.job_id, check=False)
        if proc.returncode != 0:
            if "unrecognized option" in proc.stderr or "serializer" in proc.stderr:
                self._json = False
            return False, None
        try:
            job = controller_job(proc.stdout, handle.job_id)
        except ValueError:
            self._json = False
            return False, None
        self._json = True
        return True, job

    def _from_sacct(self, handle: JobHandle) -> JobStatus | None:
        proc = self._run("sacct", "-n", "-P", "-X", "-j", handle.job_id, "-o", "State,ExitCode,Reason", check=False)
        if proc.returncode != 0 or not proc.stdout.strip():
            return None
        state, exit_code, reason = (proc.stdout.strip().splitlines()[0].split("|") + ["", ""])[:3]
        return self._status(state, reason, int(exit_code.split(":")[0] or 0), handle)

    def _from_scontrol(self, handle: JobHandle) -> JobStatus | None:
        proc = self._run("scontrol", "show", "job", handle.job_id, check=False)
        state = re.search(r"JobState=(\S+)", proc.stdout)
        if proc.returncode != 0 or not state:
            return None
        reason = re.search(r"Reason=(\S+)", proc.stdout)
        exit_code = re.search(r"\bExitCode=(\d+):", proc.stdout)
        return self._status(
            state.group(1), reason.group(1) if reason else "", int(exit_code.group(1)) if exit_code else None, handle
        )

    def _from_jobcomp(self, handle: JobHandle) -> JobStatus | None:
        proc = self._run("sacct", "-c", "-n", "-P", "-j", handle.job_id, "-o", "JobID,State", check=False)
        for row in proc.stdout.splitlines():
            job, _, state = row.partition("|")
            if job.strip() == handle.job_id:
                return self._status(state, "", None, handle)
        return None

    def queue_seconds(self, handle: JobHandle) -> float | None:
        """Start less submit time of the job's (last) allocation: sacct's Submit and Start, else `scontrol show job`'s
        SubmitTime and StartTime (clusters without accounting storage); None while it is pending or forgotten."""
        proc = self._run("sacct", "-n", "-P", "-X", "-j", handle.job_id, "-o", "Submit,Start", check=False)
        rows = proc.stdout.strip().splitlines() if proc.returncode == 0 else []
        if rows:
            return slurm_queue_seconds(*(rows[-1].split("|") + [""])[:2])
        known, job = self._controller_job(handle)
        if known:
            return job.queue_seconds() if job is not None else None
        proc = self._run("scontrol", "show", "job", handle.job_id, check=False)
        submit, start = (re.search(rf"\b{key}=(\S+)", proc.stdout) for key in ("SubmitTime", "StartTime"))
        if proc.returncode != 0 or submit is None or start is None:
            return None
        return slurm_queue_seconds(submit.group(1), start.group(1))

    def restarts(self, handle: JobHandle) -> int | None:
        """How often Slurm requeued the job (the controller's restart count; None once it forgot the job)."""
        known, job = self._controller_job(handle)
        if known:
            return job.restarts if job is not None else None
        proc = self._run("scontrol", "show", "job", handle.job_id, check=False)
        found = re.search(r"\bRestarts=(\d+)", proc.stdout)
        return int(found.group(1)) if proc.returncode == 0 and found else None

    def kill_rank(self, handle: JobHandle, rank: Mapping[str, Any], sig: int) -> None:
        """`sig` to the rank's process: directly on this host, else through a step of the job on its node
        (`srun --overlap`, which runs beside the training step)."""
        if rank["host"] == socket.gethostname():
            os.kill(rank["pid"], sig)
            return
        self._run("srun", f"--jobid={handle.job_id}", "--overlap", "-w", rank["host"], "-N1", "-n1",
                  "kill", f"-{int(sig)}", str(rank["pid"]))  # fmt: skip

    def kill_node(self, handle: JobHandle, node: int, ranks: list[dict[str, Any]], sig: int) -> dict[str, Any]:
        """`sig` at once to node `node`'s torchrun agent (its workers' parent, as their ranks.json records name it)
        and its workers, through a step of the job on that host (`srun --overlap`): a lost node. Without spares the
        job step ends with it (`--kill-on-bad-exit=1`); with spares the others go on (`--no-kill`)."""
        victims = [r for r in ranks if int(r.get(NODE_KEY, -1)) == node]
        if not victims or not victims[0].get(AGENT_KEY):
            raise UserError(
                f"job {handle.ref}: ranks.json names no rank of node {node} with its agent",
                "lose a node of a running job whose ranks recorded their node and agent (training.spares)",
            )
        host, agent_pid = str(victims[0][AGENT_KEY]).rsplit(":", 1)
        pids = [agent_pid, *(str(r["pid"]) for r in victims)]
        self._run("srun", f"--jobid={handle.job_id}", "--overlap", "-w", host, "-N1", "-n1",
                  "kill", f"-{int(sig)}", *pids)  # fmt: skip
        return {"node": node, "host": host, "agent_pid": int(agent_pid), "ranks": sorted(r["rank"] for r in victims)}

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[list[str], int]:
        """Lines of the job's output file."""
        return read_log(handle.log_path, offset)

    def cancel(self, handle: JobHandle) -> None:
        """scancel the job (Slurm signals every step on every node)."""
        self._run("scancel", handle.job_id)

    @staticmethod
    def hopeless(status: JobStatus) -> bool:
        """A pending job whose reason means it can never start."""
        return status.state is JobState.PENDING and status.reason in HOPELESS_REASONS


def _preemptible(step: str, preemptions: str) -> list[str]:
    """The job step run in the background so that the batch shell can take Slurm's signals while it waits.

    USR1 (the time-limit warning, `--signal=B:USR1@N`) is forwarded to the steps (every process of them, agents
    and workers); on TERM (scancel and the time limit signal the steps too; a preemption signals the tasks only,
    and the batch shell at the end of the partition's GraceTime) the shell keeps waiting for the checkpoint.
    When the trainer recorded a preemption during this run, the job exits PREEMPTED_EXIT_CODE, and first requeues
    itself when the signal was the time-limit warning or a preemption (`PreemptTime` set): Slurm 22.05 requeues a
    preempted job only when it kills it at the end of GraceTime, and completes one that stopped by itself within
    it. After a plain scancel (no PreemptTime, not warned) it stays cancelled.
    """
    return [
        f"preemptions={shlex.quote(preemptions)}",
        'recorded() { if [ -f "$preemptions" ]; then wc -l < "$preemptions"; else echo 0; fi; }',
        "before=$(recorded)",
        "warned=0",
        'trap \'warned=1; echo "tdeploy: time-limit warning (SIGUSR1): the trainer checkpoints and stops"; '
        'scancel --signal=USR1 "$SLURM_JOB_ID"\' USR1',
        # Slurm has sent TERM to the steps already (scancel, time limit, end of GraceTime): passing it on
        # again would make torchrun's agent abandon its wait for the workers' checkpoint.
        "trap 'echo \"tdeploy: SIGTERM: waiting for the job step to checkpoint and stop\"' TERM",
        "job_step() {",
        step,
        "}",
        "job_step &",
        "step=$!",
        'while kill -0 "$step" 2>/dev/null; do wait "$step" || true; done',
        'rc=0; wait "$step" || rc=$?',
        'if [ "$(recorded)" -gt "$before" ]; then',
        '  if [ "$warned" = 1 ] || scontrol show job "$SLURM_JOB_ID" | grep -Eq "PreemptTime=[0-9]"; then',
        '    echo "tdeploy: checkpointed on the signal; requeueing job $SLURM_JOB_ID to resume from it"',
        '    scontrol requeue "$SLURM_JOB_ID" || echo "tdeploy: requeue refused: resubmit the job to resume"',
        "  fi",
        f"  exit {PREEMPTED_EXIT_CODE:d}",
        "fi",
        'exit "$rc"',
    ]


def _replica_groups(
    cluster: ClusterConfig,
    train: TrainConfig,
    config_path: str,
    output_dir: str,
    srun_options: list[str],
    launch: list[str],
    container: str | None,
) -> tuple[list[str], str]:
    """The batch script's lines for fault_tolerance.mode=replica_groups (one group per node, which the spec holds
    to): the set-up (the lighthouse on the head node, started in the background) and the job step (one srun task
    per node running its group's torchrun, the lighthouse stopped by its pid, then the job's outcome from the
    groups': tasks/launch/replica_step.py).

    The lighthouse listens on cluster.slurm.rdzv_port of the node that runs it (the rendezvous' port: each group's
    torchrun has its own, --standalone). Outside a pyxis container it is a child of the batch shell, which
    Slurm's warning and a preemption's SIGTERM to the tasks do not reach: it lives while the groups checkpoint. In
    a pyxis container it runs in a step of its own on the job's first node (`--relative=0`).
    """
    workdir = f"{output_dir}/{REPLICAS_DIR}"
    groups = train.fault_tolerance.replica_groups
    if container == "pyxis":  # the container exists only in a step
        first_node = ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--relative=0", *srun_options]
        binary, lighthouse_host, outcome_python = [*first_node, LIGHTHOUSE_BIN], "$head_node", [*first_node, "python"]
    elif container == "apptainer":  # `apptainer exec ... IMAGE python`: the image's lighthouse
        binary, lighthouse_host, outcome_python = [*launch[:-1], LIGHTHOUSE_BIN], "$SLURMD_NODENAME", launch
    else:  # the cluster's Python (cluster.slurm.python): torchft's lighthouse is installed beside it (or on PATH)
        python = Path(launch[0])
        binary = [str(python.parent / LIGHTHOUSE_BIN) if python.is_absolute() else LIGHTHOUSE_BIN]
        lighthouse_host, outcome_python = "$SLURMD_NODENAME", launch
    port = cluster.slurm.rdzv_port
    words = lighthouse_command(train, port, binary=binary)
    lighthouse = " ".join(
        f'"--bind=$lighthouse_host:{port:d}"' if word.startswith("--bind=") else shlex.quote(word) for word in words
    )
    setup = [
        f"replicas={shlex.quote(workdir)}",
        f"lighthouse_host={lighthouse_host}",
        f'export {LIGHTHOUSE_ENV}="http://$lighthouse_host:{port:d}"',
        'rm -f "$replicas"/exit-*.txt',
        f'{lighthouse} > "$replicas/lighthouse.log" 2>&1 &',
        "lighthouse=$!",
        f'echo "tdeploy: {groups:d} replica groups, one per node; lighthouse at ${LIGHTHOUSE_ENV}"',
        "began=$(date +%s)",
    ]
    torchrun = [
        *launch, "-m", "training.preemption", "--standalone", "--nnodes=1",
        f"--nproc-per-node={cluster.world_size // groups}", f"--max-restarts={cluster.max_restarts}",
        *preemption_args(cluster), *LOG_ARGS, "-m", "training.train",
    ]  # fmt: skip
    step = [
        "rc=0",
        # A lost group must not end the others' tasks: they go on in the quorum, and the outcome names the group.
        _shell(["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", *srun_options])
        + " " + _shell(["sh", "-c", REPLICA_TASK, "tdeploy-replica", f"{output_dir}/logs", workdir, *torchrun])
        + " || rc=$?",
        'echo "tdeploy: the replica groups\' step exited $rc"',
        'kill "$lighthouse" 2>/dev/null || true',
        _shell([*outcome_python, "-m", "tasks.launch.replica_step", "--config", config_path, "--workdir", workdir])
        + ' --job-id "$SLURM_JOB_ID" --since "$began"',
    ]
    return setup, "\n".join(step)


def _finished_with_spares(result: str) -> list[str]:
    """`finished_with_spares`, run after a failed job step: its exit status, or 0 (with a note) where the trainer
    wrote `result` since the script began (the job finished on its nodes; a lost node or a spare ended badly)."""
    return [
        f"result={shlex.quote(result)}",
        "began=$(date +%s)",
        "finished_with_spares() {",
        "  rc=$?",
        '  if [ "$(stat -c %Y "$result" 2>/dev/null || echo 0)" -ge "$began" ]; then',
        '    echo "tdeploy: the job finished (hot spares): step exit $rc came from a lost node or a standing spare"',
        "    return 0",
        "  fi",
        '  return "$rc"',
        "}",
    ]


def _health_gate(
    cluster: ClusterConfig,
    train: TrainConfig | None,
    output_dir: str,
    srun_options: list[str],
    launch: list[str],
    *,
    elastic: bool,
) -> list[str]:
    """The health gate inside the allocation, before the trainer's srun: one probe task per node (a ring of
    bandwidth probes, the barrier in the shared output folder), then the verdict on the head node into
    health_gate.json. Excluded nodes: the trainer's srun runs without them (`gate_options`) where the spares or
    cluster.min_nodes leave enough, else the script exits HEALTH_GATE_EXIT_CODE naming them."""
    gate = cluster.health_gate
    memory = None
    if train is not None and train.checkpoint.memory_tier_on:
        memory = train.checkpoint.memory_dir or DEFAULT_MEMORY_DIR
    folders = storage_folders(output_dir, memory, gate.storage_paths)
    config = gate.model_dump_json()
    gate_dir = f"{output_dir}/{GATE_DIR}"
    needed = cluster.min_nodes if elastic and cluster.min_nodes is not None else cluster.nodes
    probe = [*launch, "-m", "training.health_gate", "probe", "--config", config, "--peer", "auto",
             *(word for folder in folders for word in ("--storage", folder))]  # fmt: skip
    judge = [*launch, "-m", "training.health_gate", "judge", "--config", config, "--output", output_dir]
    return [
        # One folder per run of the script: a requeued job keeps its id, and the first run's barrier files would
        # let the probes start before their peers listen (a ring probe refused: a healthy node excluded).
        f'gate_dir={shlex.quote(gate_dir)}/slurm-"$SLURM_JOB_ID"-"${{SLURM_RESTART_COUNT:-0}}"',
        "gate_started=$(date +%s.%N)",
        'gate_names=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)',
        "{ " + _shell(["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=0", *srun_options, "sh", "-c",
                       'exec "$@" --name "$SLURMD_NODENAME"', "tdeploy-gate", *probe])
        + ' --gate-dir "$gate_dir" --names "$gate_names" > /dev/null || true; }',
        "gate_excluded=$(" + _shell(["srun", "--nodes=1", "--ntasks=1", "--relative=0", *srun_options, *judge])
        + ' --gate-dir "$gate_dir" --names "$gate_names" --started "$gate_started") || '
        "echo \"tdeploy: the health gate's verdict failed; starting without it\" >&2",
        "gate_options=()",
        'if [ -n "${gate_excluded:-}" ]; then',
        "  gate_left=$(( $(echo \"$gate_names\" | tr , '\\n' | wc -l)"
        " - $(echo \"$gate_excluded\" | tr , '\\n' | wc -l) ))",
        f'  if [ "$gate_left" -ge {needed:d} ]; then',
        '    echo "tdeploy: health gate excluded $gate_excluded; the job runs on the other $gate_left node(s)"',
        '    gate_options=(--exclude="$gate_excluded" --nodes="$gate_left")',
        "  else",
        f'    echo "tdeploy: health gate excluded $gate_excluded: $gate_left node(s) left, {needed:d} needed" >&2',
        f"    exit {HEALTH_GATE_EXIT_CODE:d}",
        "  fi",
        "fi",
    ]


def _shell(words: list[str]) -> str:
    """Words as shell text that gives exactly these words back (shlex quoting; a NUL cannot be written)."""
    if any("\0" in word for word in words):
        raise UserError(f"{[w for w in words if chr(0) in w]} hold a NUL character, which no script can", "remove it")
    return shlex.join(words)


def _slurm_filename(path: str) -> str:
    """`path` as a literal part of a Slurm filename pattern: % doubled; a backslash cannot be written."""
    if "\\" in path:
        # Slurm drops a backslash from --output and stops expanding %j after it
        raise UserError(f"run.output_url={path}: Slurm cannot write its log under a path with a backslash", "rename it")
    return path.replace("%", "%%")


def _sbatch_quote(directive: str) -> str:
    """One `#SBATCH` argument as sbatch reads it: quoted and backslash-escaped unless plain."""
    if _CONTROL.search(directive):
        # a newline would end the directive and start a line of shell code
        raise UserError(f"#SBATCH {directive!r} has a control character", "remove it from the spec")
    if re.fullmatch(r"[\w./:=%@+,&\[\]-]+", directive):
        return directive
    return '"' + directive.replace("\\", "\\\\").replace('"', '\\"') + '"'
