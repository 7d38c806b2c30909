"""The launcher interface: job handles, one small set of job states, failure reports, waiting.

A job's environment has two sources, kept apart: the spec's `cluster.env` (every launcher applies it
itself) and, for drills and tests only, a `JobEnvironment` (tasks/launch/environment.py: drill points, a test
plugin).
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from tasks.errors import TransientError, UserError
from tasks.hosts import NodeHost
from training.config import Problem, TrainConfig

if TYPE_CHECKING:
    from tasks.launch.cluster import ClusterConfig
    from tasks.launch.environment import JobEnvironment

log = logging.getLogger(__name__)


class JobState(StrEnum):
    """Every scheduler's states mapped to six.

    PREEMPTED: the job stopped because its scheduler took its resources back (or its time ran out) after the
    trainer checkpointed on the warning signal; resubmitting it resumes from that checkpoint. A job that its
    scheduler requeues by itself is PENDING or RUNNING again, with the preemption in its history.
    """

    PENDING = "pending"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    PREEMPTED = "preempted"

    @property
    def terminal(self) -> bool:
        """The job will not change state any more."""
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.PREEMPTED)


TERMINAL = frozenset(s for s in JobState if s.terminal)


@dataclass
class FailureReport:
    """Which rank failed first, and with what (from torchrun's root-cause report and error file)."""

    rank: int | None
    local_rank: int | None
    host: str | None
    exitcode: int | None
    error: str
    time: str | None = None

    def describe(self) -> str:
        """One line for people."""
        where = f"rank {self.rank} (local rank {self.local_rank}) on {self.host}" if self.rank is not None else "a rank"
        return f"{where} failed first with exit code {self.exitcode}: {self.error}"


@dataclass
class JobStatus:
    """Where a job is: the mapped state, the scheduler's own state and reason, and why it failed."""

    state: JobState
    scheduler_state: str
    reason: str = ""
    exit_code: int | None = None
    failure: FailureReport | None = None
    host: str | None = None
    """The host of the node that failed first, where the launcher knows it (the restart policy blames it)."""

    def describe(self) -> str:
        """One line for people."""
        text = f"{self.state.value} ({self.scheduler_state}"
        text += f", reason: {self.reason})" if self.reason and self.reason != "None" else ")"
        if self.failure:
            text += f"; {self.failure.describe()}"
        return text


@dataclass
class JobHandle:
    """Everything needed to find a submitted job again, from any process."""

    scheduler: str
    job_id: str
    name: str
    output_dir: str
    log_path: str
    submitted_unix_s: float = field(default_factory=time.time)
    details: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # the spec's cluster.env, as the job got it
    extra_env: dict[str, str] = field(default_factory=dict)  # the JobEnvironment's variables, never part of `env`

    @property
    def ref(self) -> str:
        """`<scheduler>:<id>`, what `tdeploy status` and `tdeploy cancel` take."""
        return f"{self.scheduler}:{self.job_id}"

    def to_json(self) -> dict[str, Any]:
        """As a dict."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobHandle:
        """Inverse of to_json."""
        return cls(**data)


@dataclass(frozen=True)
class RenderedFile:
    """One file a step generates (`tdeploy render`): its path under the output folder, its text, what it is and what
    checked it; `shell` marks a script (shellcheck runs on it where installed)."""

    name: str
    text: str
    what: str
    checked: str
    shell: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What a scheduler's launcher can do: what callers ask instead of which scheduler it is."""

    runs_image: bool
    """The job runs in the built image; False: the hosts' own Python runs it (the image step may be skipped)."""
    runs_on_this_machine_only: bool
    """Every process of the job runs on this machine (`tdeploy train`; the node checks check localhost)."""
    needs_shared_output: bool
    """run.output_url must be a folder: on this machine, or on a filesystem every node shares (not an object store)."""
    delivers_signals: bool
    """`signal` delivers a preemption signal to the job (the preemption drill asks first)."""
    can_lose_node: bool
    """`kill_node` kills every process of one node at once (the node-loss drill asks first)."""
    replaces_lost_host: bool
    """A relaunch after a lost node runs on a spare host, so the lost one must not be among the job's ranks."""
    has_hot_spares: bool = False
    """cluster.spares: spare hosts wait in the job's rendezvous and take a lost node's place without a requeue."""
    live_recovery: bool = False
    """fault_tolerance.mode=replica_groups: `submit` runs the job as replica groups under a torchft lighthouse, a
    lost group healing from a peer (training/replica.py); False: the spec refuses the mode for this scheduler."""
    replica_group_per_node: bool = False
    """With live_recovery: each node (host) of the job runs one replica group, so fault_tolerance.replica_groups
    must equal cluster.nodes; False: the groups split the ranks of this machine as they divide them."""


class Launcher(Protocol):
    """Submit, inspect, stop and wait for training jobs on one kind of scheduler, and answer what callers would
    otherwise branch on the scheduler for: its capabilities, its hosts, killing a rank or a node, relaunching.

    Implementations subclass it explicitly and so share the defaults here (`wait`; `hopeless`, which a scheduler
    that can tell a job that will never start overrides; the refusals of what a scheduler cannot do). The
    class methods answer from the cluster section alone, without the scheduler's tools.
    """

    scheduler: str
    capabilities: ClassVar[Capabilities]

    @classmethod
    def cluster_defaults(cls, cluster: dict[str, Any], nodes: Any) -> dict[str, Any]:
        """The raw cluster section with what this scheduler takes from the spec's raw nodes section filled in."""
        return cluster

    @classmethod
    def cluster_problems(cls, cluster: ClusterConfig) -> list[Problem]:
        """What this scheduler cannot run in the cluster section (paths relative to it), fix included."""
        return []

    @classmethod
    def hosts(cls, cluster: ClusterConfig) -> list[NodeHost] | None:
        """The hosts the job runs on, where the launcher decides them (None: the scheduler places the job)."""
        return None

    @classmethod
    def rdzv_port(cls, cluster: ClusterConfig) -> int | None:
        """The rendezvous port the job's agents meet on (None: torchrun's default or a free one)."""
        return cluster.rdzv_port

    @classmethod
    def relaunch_cluster(cls, cluster: ClusterConfig, lost_host: str) -> ClusterConfig:
        """Restart policy after losing `lost_host`: the cluster the relaunched job runs on (the same by default:
        the host came back, or the scheduler replaces it)."""
        return cluster

    @classmethod
    def excluding(cls, cluster: ClusterConfig, hosts: Sequence[str]) -> ClusterConfig:
        """The cluster a requeued job runs on without `hosts` (rung 5 of the recovery ladder: the failing and the
        quarantined hosts). By default the same: the launcher has no hosts to leave out (every node of a local job
        is this machine). `hosts` are checked here (`excluded_host_names`), at the boundary to the scheduler."""
        excluded_host_names(hosts)
        return cluster

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
        """Start the job with `cluster.env` (and `environment`'s variables, if any) in its environment; returns at
        once."""
        ...

    def status(self, handle: JobHandle) -> JobStatus:
        """The job's state now."""
        ...

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[list[str], int]:
        """Log lines from byte `offset` on, and the offset after them."""
        ...

    def cancel(self, handle: JobHandle) -> None:
        """Stop the job and every process it started."""
        ...

    def stop_stalled(self, handle: JobHandle) -> None:
        """Stop a job whose ranks made no step progress for the stall timeout (a hang, a cut link): none of them
        will reach the step boundary a stop's grace is for, so a launcher that can skip that grace does; by
        default `cancel`."""
        self.cancel(handle)

    def signal(self, handle: JobHandle, sig: int) -> None:
        """Deliver a preemption signal (SIGTERM or SIGUSR1) to the job as its scheduler would: the trainer
        checkpoints at its step boundary and the job ends PREEMPTED. Launchers that can do so override this."""
        raise UserError(
            f"job {handle.ref}: the {self.scheduler} launcher cannot deliver signals",
            "preempt it through its scheduler (scancel --signal=USR1 JOBID, kubectl delete pod)",
        )

    def kill_rank(self, handle: JobHandle, rank: Mapping[str, Any], sig: int) -> None:
        """Send `sig` to one rank's process (`rank`: its record in ranks.json: rank, host, pid)."""
        raise UserError(
            f"job {handle.ref}: the {self.scheduler} launcher cannot signal rank {rank['rank']} on {rank['host']}",
            "drill rank kills on the local, ssh or slurm scheduler",
        )

    def kill_node(self, handle: JobHandle, node: int, ranks: list[dict[str, Any]], sig: int) -> dict[str, Any]:
        """Send `sig` to every process of node `node` at once (its agent and its workers among `ranks`): a lost
        node. Returns node, host, agent_pid and the ranks killed."""
        raise UserError(
            f"job {handle.ref}: the {self.scheduler} launcher cannot kill node {node}",
            "node loss is drilled on the local, ssh and slurm schedulers",
        )

    def unreachable_hosts(self, handle: JobHandle) -> list[str]:
        """The job's hosts that do not answer now (none known, unless the launcher reaches its hosts itself)."""
        return []

    def restarts(self, handle: JobHandle) -> int | None:
        """How often the scheduler restarted (requeued) the job by itself; None when it does not count them."""
        return None

    def hopeless(self, status: JobStatus) -> bool:
        """A pending job that can never start (none, unless the scheduler says so)."""
        return False

    def queue_seconds(self, handle: JobHandle) -> float | None:
        """How long the job waited for its allocation, from submission to start (goodput's queue share); None when
        the scheduler does not say (yet)."""
        return None

    def gate_command(self, cluster: ClusterConfig, host: NodeHost, module_args: list[str]) -> list[str] | None:
        """The command that runs `python -m MODULE_ARGS` on `host` before the job starts, for the health gate
        (tasks/launch/health_gate.py); None: the scheduler places the job, and its gate runs inside the allocation
        (a step of the batch script, an init container)."""
        return None

    @classmethod
    def rendered_files(
        cls, cluster: ClusterConfig, train: TrainConfig, name: str, image: str | None
    ) -> list[RenderedFile]:
        """The files submitting this job would write for the scheduler (a batch script, manifests), rendered and
        checked as `submit` checks them; none where the job is started directly (local, SSH)."""
        return []

    def wait(
        self,
        handle: JobHandle,
        until: frozenset[JobState] = TERMINAL,
        timeout_s: float | None = None,
        on_line: Callable[[str], None] | None = None,
        poll_s: float = 0.5,
    ) -> JobStatus:
        """Poll until the job reaches a state in `until` or ends, streaming its log lines (see `wait_for`)."""
        return wait_for(self, handle, until, timeout_s, on_line, poll_s, hopeless=self.hopeless)


_EXCLUDABLE_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,252})")


def excluded_host_names(hosts: Sequence[str]) -> list[str]:
    """`hosts` sorted and without repeats, each a plain host name (letters, digits, . _ -; no list syntax, paths
    or spaces, which a scheduler would read as more than one host); UserError naming the first one that is not."""
    for host in hosts:
        if not isinstance(host, str) or not _EXCLUDABLE_HOST.fullmatch(host):
            raise UserError(
                f"host {host!r} cannot be excluded: it is not a host name",
                "host names are letters, digits and . _ - (as the job's ranks record them in ranks.json)",
            )
    return sorted(set(hosts))


def registry_dir() -> Path:
    """Where job records are kept so that later commands find jobs by reference ($TDEPLOY_HOME/jobs)."""
    return Path(os.environ.get("TDEPLOY_HOME", Path.home() / ".tdeploy")) / "jobs"


def _record_name(handle: JobHandle) -> str:
    """The registry file of `handle`: by reference and output folder, since two clusters of one scheduler number
    their jobs independently (two Slurm clusters both have a job 12) and one must not overwrite the other's."""
    where = hashlib.sha256(str(handle.output_dir).encode()).hexdigest()[:12]
    return f"{handle.scheduler}-{handle.job_id}@{where}.json"


def record_job(handle: JobHandle) -> None:
    """Save the handle in the output folder (job.json) and in the registry."""
    text = json.dumps(handle.to_json(), indent=2)
    Path(handle.output_dir, "job.json").write_text(text)
    registry = registry_dir()
    registry.mkdir(parents=True, exist_ok=True)
    (registry / _record_name(handle)).write_text(text)


_REF = re.compile(r"(?P<scheduler>[a-z][a-z0-9_-]*):(?P<job_id>[A-Za-z0-9_+-][A-Za-z0-9_.+-]*)")


def find_job(ref: str) -> JobHandle:
    """A handle from `<scheduler>:<id>`, a job.json path, or a run's output folder."""
    path = Path(ref)
    if path.is_dir():
        path = path / "job.json"
    if path.is_file():
        return JobHandle.from_json(json.loads(path.read_text()))
    match = _REF.fullmatch(ref)
    if match and ".." not in match["job_id"]:
        registry, stem = registry_dir(), f"{match['scheduler']}-{match['job_id']}"
        records = sorted(registry.glob(f"{glob.escape(stem)}@*.json"))
        if (registry / f"{stem}.json").is_file():  # recorded by a version that named records by reference alone
            records.append(registry / f"{stem}.json")
        handles = {}
        for record in records:
            handle = JobHandle.from_json(json.loads(record.read_text()))
            handles[handle.output_dir] = handle
        if len(handles) == 1:
            return next(iter(handles.values()))
        if handles:
            raise UserError(
                f"job {ref!r} is ambiguous: {len(handles)} jobs of that reference were recorded (clusters of one "
                f"scheduler number their jobs independently), with output folders {', '.join(sorted(handles))}",
                "pass the run's output folder instead of the reference",
            )
    raise UserError(
        f"job {ref!r} is unknown",
        f"pass the reference `tdeploy submit` printed (scheduler:id, recorded under {registry_dir()}), "
        "or the run's output folder",
    )


_SUMMARY = re.compile(r"^\S+ FAILED\n-+\n(?P<body>.*?)\n=+", re.S | re.M)
_ENTRY = re.compile(r"^\[\d+\]:\n(?P<fields>(?:^ +.*\n?)+)", re.M)
# Errors a rank gets because a peer died first: they are echoes, not causes.
_ECHO = re.compile(
    r"Connection closed by peer|remote worker crashing|Connection reset by peer|Broken pipe|"
    r"communicator was aborted|Socket Timeout|timed out|SIGTERM|Signal 15",
    re.I,
)


def parse_failures(log_text: str) -> list[FailureReport]:
    """Every failed rank of torchrun's last failure summary, with its error (error file or traceback)."""
    summaries = list(_SUMMARY.finditer(log_text))
    if not summaries:
        return []
    reports = []
    for entry in _ENTRY.finditer(summaries[-1].group("body")):
        body = entry.group("fields")

        def field_of(name: str, body: str = body) -> str | None:
            found = re.search(rf"^\s*{name}\s*:\s*(.*)$", body, re.M)
            return found.group(1).strip() if found else None

        rank = re.match(r"(\d+) \(local_rank: (\d+)\)", field_of("rank") or "")
        exitcode = re.match(r"(-?\d+)", field_of("exitcode") or "")
        error = _error_file_message(field_of("error_file")) or _last_traceback_line(body) or "no traceback"
        if exitcode and int(exitcode.group(1)) < 0:
            error = f"killed by signal {-int(exitcode.group(1))}" + ("" if error == "no traceback" else f"; {error}")
        reports.append(
            FailureReport(
                rank=int(rank.group(1)) if rank else None,
                local_rank=int(rank.group(2)) if rank else None,
                host=field_of("host"),
                exitcode=int(exitcode.group(1)) if exitcode else None,
                error=error,
                time=field_of("time"),
            )
        )
    return reports


def parse_root_cause(log_text: str) -> FailureReport | None:
    """The rank that failed first: not one that only saw a peer die (torchrun's own pick ties on whole seconds)."""
    reports = parse_failures(log_text)
    if not reports:
        return None
    causes = [r for r in reports if not _ECHO.search(r.error) or r.error.startswith("killed by signal 9")]
    return min(causes or reports, key=lambda r: (r.time or "", r.rank is None, r.rank or 0))


def _error_file_message(path: str | None) -> str | None:
    if not path or path == "<N/A>" or not Path(path).is_file():
        return None
    try:
        data = json.loads(Path(path).read_text())
        message = data["message"]
        text = message["message"] if isinstance(message, dict) else str(message)
    except (ValueError, KeyError, TypeError):
        return None
    text = text.split("\n\nAt:\n", 1)[0].strip()  # a C++ error's Python frames ("At:"), not its message
    return text.splitlines()[-1] if text else None


def _last_traceback_line(body: str) -> str | None:
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b.*", line) or ": " in line:
            if not re.match(r"^(time|host|rank|exitcode|error_file|traceback)\s*:", line):
                return line
    return None


def wait_for(
    launcher: Launcher,
    handle: JobHandle,
    until: frozenset[JobState] = TERMINAL,
    timeout_s: float | None = None,
    on_line: Callable[[str], None] | None = None,
    poll_s: float = 0.5,
    hopeless: Callable[[JobStatus], bool] | None = None,
) -> JobStatus:
    """Poll until the job reaches a state in `until` (or any terminal state), streaming its log lines.

    `hopeless` tells a pending job that can never start (the scheduler's reason says so); it is
    returned as failed with that reason rather than waited on.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    offset = 0
    while True:
        try:
            status = launcher.status(handle)
        except TransientError as err:  # a busy controller must not fail (or resubmit) a running job
            log.warning("status of %s unavailable, retrying: %s", handle.ref, err)
            if deadline is not None and time.monotonic() > deadline:
                raise
            time.sleep(poll_s)
            continue
        if on_line:
            lines, offset = launcher.logs(handle, offset)
            for line in lines:
                on_line(line)
        if status.state in until or status.state.terminal:
            if on_line and status.state.terminal:
                lines, offset = launcher.logs(handle, offset)
                for line in lines:
                    on_line(line)
            return status
        if hopeless and hopeless(status):
            return JobStatus(JobState.FAILED, status.scheduler_state, status.reason)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {handle.ref} still {status.describe()} after {timeout_s:.0f}s")
        time.sleep(poll_s)


def read_log(path: str | Path, offset: int) -> tuple[list[str], int]:
    """Complete lines of a log file from `offset` on (a partial last line waits for the next call)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            data = handle.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    return data[:end].decode(errors="replace").splitlines(), offset + end
