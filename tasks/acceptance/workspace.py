"""Runs of the acceptance suite and the drills: per-run workspaces, config variants, watched jobs, killing a rank.

Every acceptance (or drill) invocation writes into a fresh workspace `<base>/<run-id>/` (drills under
`<run-id>/drills/`), so no job ever resumes from an earlier invocation's checkpoints. The run id sorts by
time (UTC, microseconds) and ends in a random suffix. `latest.json` beside the workspaces (and the `latest`
symlink) name the last run whose reports were written; older workspaces beyond `keep_runs` are pruned.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from tasks.errors import TransientError, UserError
from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.launch.goodput import job_goodput
from tasks.launch.history import StepsLost, steps_lost
from tasks.launch.submit import submit
from tasks.progress import report
from tasks.run_id import RUN_ID, new_run_id
from training.config import TrainConfig
from training.layout import data_parallel_degree
from training.run_output import Ranks, RunOutput, StepRecord
from validation.goodput import Goodput

log = logging.getLogger(__name__)

LATEST = "latest.json"
"""Beside the run workspaces: the last run whose reports were written (see `mark_latest`, `latest_run`)."""
LATEST_LINK = "latest"
"""A symlink beside the run workspaces to the same run, for people (`ls runs/<name>/acceptance/latest/`)."""
@dataclass(frozen=True)
class Workspace:
    """One acceptance invocation's folder: `root` = base/run_id, the drills' jobs and reports under `drills`."""

    base: Path
    run_id: str

    @property
    def root(self) -> Path:
        """base/run_id: the acceptance jobs and their reports (the JSON report, junit.xml, loss_curve.png)."""
        return self.base / self.run_id

    @property
    def drills(self) -> Path:
        """root/drills: the drill jobs and the drills' reports."""
        return self.root / "drills"

    @classmethod
    def at(cls, root: str | Path) -> Workspace:
        """The workspace whose root is `root` (a path `workspace_root` returned)."""
        path = Path(root)
        if not RUN_ID.match(path.name):
            raise ValueError(f"{path}: not a run workspace (its name must be a run id such as {new_run_id()})")
        return cls(path.parent, path.name)


def run_workspaces(base: Path) -> list[Path]:
    """The run workspaces under `base`, oldest first."""
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if RUN_ID.match(p.name) and p.is_dir() and not p.is_symlink())


def prune_workspaces(base: Path, keep: int, current: Path) -> list[Path]:
    """Delete all but the newest `keep` run workspaces; never `current` nor the one latest.json names."""
    protected = {current.resolve()}
    latest = latest_run(base)
    if latest is not None:
        protected.add(latest.resolve())
    others = [p for p in run_workspaces(base) if p.resolve() not in protected]
    room = max(0, keep - len(protected))
    doomed = others[: max(0, len(others) - room)]
    for path in doomed:
        log.info("pruning acceptance workspace %s (acceptance.keep_runs=%d)", path, keep)
        shutil.rmtree(path)
    return doomed


def _fresh(path: Path) -> None:
    if path.exists():  # a retry of the same step: start it over, never resume from the failed attempt
        shutil.rmtree(path)
    path.mkdir(parents=True)


def open_workspace(root: str | Path, keep: int, part: Literal["acceptance", "drills"] = "acceptance") -> Workspace:
    """Make `root` (base/run_id) ready for a step: acceptance empties the whole workspace, drills only its
    drills folder (the acceptance reports beside it stay); older workspaces beyond `keep` are pruned."""
    workspace = Workspace.at(root)
    if part == "acceptance":
        _fresh(workspace.root)
        workspace.drills.mkdir()
    else:
        workspace.root.mkdir(parents=True, exist_ok=True)
        _fresh(workspace.drills)
    prune_workspaces(workspace.base, keep, workspace.root)
    return workspace


def mark_latest(workspace: Workspace) -> Path:
    """Point latest.json (and the `latest` symlink) at `workspace`, atomically; call once its reports exist."""
    record = {
        "run_id": workspace.run_id,
        "root": str(workspace.root),
        "finished_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    fd, tmp = tempfile.mkstemp(dir=workspace.base, prefix=".latest-", suffix=".json")
    with os.fdopen(fd, "w") as handle:
        json.dump(record, handle, indent=2)
    os.replace(tmp, workspace.base / LATEST)
    link_tmp = workspace.base / f".latest-{workspace.run_id}"
    link_tmp.unlink(missing_ok=True)
    link_tmp.symlink_to(workspace.run_id, target_is_directory=True)
    os.replace(link_tmp, workspace.base / LATEST_LINK)
    return workspace.base / LATEST


def latest_run(base: Path) -> Path | None:
    """The root of the last run whose reports were written (latest.json), or None before the first."""
    path = base / LATEST
    if not path.exists():
        return None
    run_id = json.loads(path.read_text())["run_id"]
    return base / run_id if RUN_ID.match(run_id) else None


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def variant(train: TrainConfig, root: Path, name: str, **sections: dict[str, Any]) -> TrainConfig:
    """A copy of `train` writing under root/name (output, checkpoints), with sections merged in and re-validated.

    Every acceptance job is one torchrun group (fault_tolerance.mode none) unless `sections` ask for replica groups
    (the replica_loss drill): the dimensions and the other drills read one run output, not a folder per group.
    Its in-memory copies are off (memory_every_steps 0) unless `sections` set them (memory_restore): the storage
    drills restore from storage, and the runs compared with them must not differ in what a restart reads."""
    paths = {
        "run": {"output_url": str(root / name / "output")},
        "checkpoint": {"url": str(root / name / "checkpoints"), "keep_last": 1000, "resume": True,
                       "memory_every_steps": 0},
        "fault_tolerance": {"mode": "none"},
    }  # fmt: skip
    return TrainConfig.model_validate(_merge(_merge(train.model_dump(), paths), sections))


def threads_per_rank(cluster: ClusterConfig, train: TrainConfig) -> int:
    """The intra-op threads each rank of `cluster` gets."""
    return train.run.threads_per_rank or max(1, (os.cpu_count() or 1) // cluster.procs_per_node)


def data_parallel_ranks(cluster: ClusterConfig, train: TrainConfig) -> int:
    """The job's data-parallel degree on `cluster`: its global batch is micro_batch x grad_accum_steps x this."""
    return data_parallel_degree(train.parallel, cluster.world_size)


DATA_PARALLEL_ONLY: dict[str, Any] = {
    "tensor_parallel": 1,
    "sequence_parallel": False,
    "pipeline_parallel": 1,
    "pipeline_schedule": "1f1b",
    "virtual_stages": 1,
    "pipeline_microbatches": None,
    "pipeline_split": None,
    "expert_parallel": 1,
}
"""The `parallel` fields that turn a model-parallel layout into a data-parallel one (the model whole on every
rank); data parallelism and the batch fields are left as they are."""


def single_process(cluster: ClusterConfig, train: TrainConfig) -> tuple[ClusterConfig, dict[str, Any]]:
    """The one-process cluster and the sections that keep data, seed and global batch of `train` on `cluster`
    (the micro-batch times the data-parallel degree; a model-parallel layout's model whole on the one rank)."""
    one = cluster.model_copy(update={"nodes": 1, "procs_per_node": 1, "max_restarts": 0})
    dp = data_parallel_ranks(cluster, train)
    parallel: dict[str, Any] = {"micro_batch": train.parallel.micro_batch * dp, "data_parallel": None}
    if train.parallel.model_parallel:
        parallel |= DATA_PARALLEL_ONLY
    sections = {"parallel": parallel, "run": {"threads_per_rank": threads_per_rank(cluster, train)}}
    if train.parallel.sharding == "hsdp":
        sections["parallel"]["sharding"] = "fsdp"
        sections["parallel"]["hsdp_shard_size"] = None
    return one, sections


def data_parallel_layout(cluster: ClusterConfig, train: TrainConfig) -> dict[str, Any] | None:
    """The `parallel` section that runs model-parallel `train` as pure data parallelism on the same processes with
    the same global batch (micro_batch x grad_accum_steps x data-parallel degree), or None when the batch does
    not divide over them (or `train` is data-parallel already)."""
    if not train.parallel.model_parallel:
        return None
    world, par = cluster.world_size, train.parallel
    sequences = par.micro_batch * par.grad_accum_steps * data_parallel_ranks(cluster, train)
    if sequences % world:
        return None
    per_rank = sequences // world
    accum = next((a for a in range(min(par.grad_accum_steps, per_rank), 0, -1) if per_rank % a == 0), 1)
    section: dict[str, Any] = {**DATA_PARALLEL_ONLY, "micro_batch": per_rank // accum, "grad_accum_steps": accum}
    section |= {"data_parallel": None}
    if par.sharding == "hsdp" and world % (par.hsdp_shard_size or cluster.procs_per_node):
        section |= {"sharding": "fsdp", "hsdp_shard_size": None}
    return section


@dataclass
class RunOutcome:
    """A finished (or stopped) acceptance job."""

    handle: JobHandle
    status: JobStatus
    output_dir: Path
    stalled_after_step: int | None = None
    unreachable_hosts: list[str] = field(default_factory=list)
    """Hosts that did not answer when the job stalled (SSH jobs): where a hang started."""
    steps_lost: StepsLost | None = None
    """A failed, cancelled or preempted job: the steps it trained after its newest checkpoint (None: it finished)."""
    checkpoint_url: str | None = None
    """Where the job saved its checkpoints (its checkpoint.url; None: not known to whoever made this outcome)."""

    @property
    def ok(self) -> bool:
        """It succeeded."""
        return self.status.state is JobState.SUCCEEDED

    @property
    def run(self) -> RunOutput:
        """What the job wrote."""
        return RunOutput(self.output_dir)

    def metrics(self, rank: int = 0) -> dict[int, StepRecord]:
        """Per-step metrics of a rank (later attempts win)."""
        return self.run.metrics(rank)

    def ranks(self) -> Ranks:
        """Who took part (fails if the job never wrote it)."""
        return _ranks_of(self.run, self.handle.ref)


def _ranks_of(run: RunOutput, ref: str) -> Ranks:
    ranks = run.ranks()
    if ranks is None:
        raise UserError(f"job {ref} never recorded its ranks in {run.dir}", "see its log: it did not get to training")
    return ranks


def last_step(output_dir: Path) -> int:
    """The last step rank 0 has recorded (0 before the first)."""
    return RunOutput(output_dir).last_step()


class Job:
    """A submitted acceptance or drill job, watched for progress (reported as `step`: `phase`, k of n steps)."""

    def __init__(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        name: str,
        environment: JobEnvironment | None,
        image: str | None,
        step: str = "acceptance",
        phase: str | None = None,
    ) -> None:
        self.cluster, self.train = cluster, train
        self.progress_step, self.phase = step, phase or name
        self.launcher, self.handle = submit(cluster, train, name, image, environment=environment)
        self.output_dir = Path(self.handle.output_dir)
        self.run = RunOutput(self.output_dir)

    def status(self) -> JobStatus:
        """The state now (a transient scheduler error reads as 'still running')."""
        try:
            return self.launcher.status(self.handle)
        except TransientError:
            return JobStatus(JobState.RUNNING, "unknown")

    def wait(self, timeout_s: float, stall_timeout_s: float | None = None) -> RunOutcome:
        """Until it ends; a job without step progress for stall_timeout_s is cancelled and reported as a hang."""
        deadline = time.monotonic() + timeout_s
        progress_at, seen = time.monotonic(), last_step(self.output_dir)
        total = self.train.run.stop_after_steps or self.train.run.steps
        report(self.progress_step, self.phase, seen, total, quiet=True)
        while True:
            status = self.status()
            if status.state.terminal:
                return RunOutcome(self.handle, status, self.output_dir, steps_lost=self._lost(status),
                                  checkpoint_url=self.train.checkpoint.url)  # fmt: skip
            step = last_step(self.output_dir)
            if step != seen:
                progress_at, seen = time.monotonic(), step
                report(self.progress_step, self.phase, step, total, quiet=True)
            elif stall_timeout_s and seen > 0 and time.monotonic() - progress_at > stall_timeout_s:
                silent = self.unreachable_hosts()
                where = f"; not answering: {', '.join(silent)}" if silent else ""
                log.warning("job %s made no progress for %.0fs after step %d%s: stopping it", self.handle.ref,
                            stall_timeout_s, seen, where)  # fmt: skip
                self.launcher.stop_stalled(self.handle)
                status = self.status()
                return RunOutcome(self.handle, status, self.output_dir, stalled_after_step=seen,
                                  unreachable_hosts=silent, steps_lost=self._lost(status),
                                  checkpoint_url=self.train.checkpoint.url)  # fmt: skip
            if time.monotonic() > deadline:
                self.launcher.cancel(self.handle)
                raise UserError(f"job {self.handle.ref} did not finish in {timeout_s:.0f}s", "raise job_timeout_s")
            time.sleep(0.2)

    def _lost(self, status: JobStatus) -> StepsLost | None:
        """The steps a job that ended in `status` lost (None when it succeeded)."""
        if status.state is JobState.SUCCEEDED:
            return None
        lost = steps_lost(self.train, self.output_dir)
        log.warning("job %s %s: %s", self.handle.ref, status.state.value, lost.describe())
        return lost

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 0.02) -> None:
        """Poll until predicate() holds; fails if the job ends first (with how it ended)."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            status = self.status()
            if status.state.terminal:
                fix = ("give the drill more steps (acceptance.steps)" if status.state is JobState.SUCCEEDED
                       else f"see its log {self.handle.log_path}")  # fmt: skip
                raise UserError(f"job {self.handle.ref} ended before {what}: {status.describe()}", fix)
            if time.monotonic() > deadline:
                raise UserError(f"timed out waiting for {what} in job {self.handle.ref}", "see its log")
            time.sleep(poll_s)

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> dict[str, Any]:
        """Send `sig` to one rank's process, through the job's launcher (which knows how to reach its host)."""
        record = next(r for r in self.ranks_record().ranks if r["rank"] == rank)
        self.launcher.kill_rank(self.handle, record, sig)
        return record

    def unreachable_hosts(self) -> list[str]:
        """The job's hosts that do not answer now (as far as its launcher can tell)."""
        return self.launcher.unreachable_hosts(self.handle)

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> dict[str, Any]:
        """Send `sig` to every process of agent `node` (the torchrun agent and its workers) at once: a lost node,
        on the launchers that can lose one (`Capabilities.can_lose_node`)."""
        return self.launcher.kill_node(self.handle, node, self.ranks_record().ranks, sig)

    def ranks_record(self) -> Ranks:
        """The ranks of the current attempt."""
        return _ranks_of(self.run, self.handle.ref)

    def fresh_ranks(self) -> bool:
        """The ranks were recorded by this attempt."""
        written = self.run.ranks_written_at()
        return written is not None and written >= self.handle.submitted_unix_s

    def cancel(self) -> None:
        """Stop the job."""
        self.launcher.cancel(self.handle)

    def goodput(self) -> Goodput | None:
        """The ended job's goodput, from its submission to its last record (None where its records do not give it)."""
        return job_goodput(self.launcher, self.handle)


def first_step_time_after(output_dir: Path, step: int, since_unix_s: float) -> float | None:
    """When rank 0 recorded `step` after `since_unix_s` (a resumed run's first step)."""
    for record in RunOutput(output_dir).metric_records():
        if record.step == step and record.time_unix_s is not None and record.time_unix_s >= since_unix_s:
            return float(record.time_unix_s)
    return None
