"""Runs of the acceptance suite and the drills: config variants, watched jobs, killing a rank."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.cluster import ClusterConfig
from tasks.errors import TransientError, UserError
from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.launch.submit import submit
from training.config import TrainConfig
from validation.acceptance import latest_by_step, read_jsonl

log = logging.getLogger(__name__)


def _merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def variant(train: TrainConfig, root: Path, name: str, **sections: dict[str, Any]) -> TrainConfig:
    """A copy of `train` writing under root/name (output, checkpoints), with sections merged in and re-validated."""
    paths = {
        "run": {"output_url": str(root / name / "output")},
        "checkpoint": {"url": str(root / name / "checkpoints"), "keep_last": 1000, "resume": True},
    }
    return TrainConfig.model_validate(_merge(_merge(train.model_dump(), paths), sections))


def threads_per_rank(cluster: ClusterConfig, train: TrainConfig) -> int:
    """The intra-op threads each rank of `cluster` gets."""
    return train.run.threads_per_rank or max(1, (os.cpu_count() or 1) // cluster.procs_per_node)


def single_process(cluster: ClusterConfig, train: TrainConfig) -> tuple[ClusterConfig, dict[str, Any]]:
    """The one-process cluster and the sections that keep data, seed and global batch of `train` on `cluster`."""
    one = cluster.model_copy(update={"nodes": 1, "procs_per_node": 1, "max_restarts": 0})
    sections = {
        "parallel": {"micro_batch": train.parallel.micro_batch * cluster.world_size, "data_parallel": None},
        "run": {"threads_per_rank": threads_per_rank(cluster, train)},
    }
    if train.parallel.sharding == "hsdp":
        sections["parallel"]["sharding"] = "fsdp"
        sections["parallel"]["hsdp_shard_size"] = None
    return one, sections


@dataclass
class RunOutcome:
    """A finished (or stopped) acceptance job."""

    handle: JobHandle
    status: JobStatus
    output_dir: Path
    stalled_after_step: int | None = None

    @property
    def ok(self) -> bool:
        """It succeeded."""
        return self.status.state is JobState.SUCCEEDED

    def metrics(self, rank: int = 0) -> dict[int, dict[str, Any]]:
        """Per-step metrics of a rank (later attempts win)."""
        return latest_by_step(read_jsonl(self.output_dir / "metrics" / f"rank-{rank:05d}.jsonl"))

    def ranks(self) -> dict[str, Any]:
        """ranks.json."""
        return json.loads((self.output_dir / "ranks.json").read_text())


def last_step(output_dir: Path) -> int:
    """The last step rank 0 has recorded (0 before the first)."""
    path = output_dir / "metrics" / "rank-00000.jsonl"
    if not path.exists():
        return 0
    with open(path, "rb") as handle:
        handle.seek(0, os.SEEK_END)
        handle.seek(max(0, handle.tell() - 4096))
        lines = [line for line in handle.read().decode(errors="replace").splitlines() if line.startswith("{")]
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


class Job:
    """A submitted acceptance or drill job, watched for progress."""

    def __init__(
        self, cluster: ClusterConfig, train: TrainConfig, name: str, env: dict[str, str] | None, image: str | None
    ) -> None:
        self.cluster, self.train = cluster, train
        self.launcher, self.handle = submit(cluster, train, name, image, env)
        self.output_dir = Path(self.handle.output_dir)

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
        while True:
            status = self.status()
            if status.state.terminal:
                return RunOutcome(self.handle, status, self.output_dir)
            step = last_step(self.output_dir)
            if step != seen:
                progress_at, seen = time.monotonic(), step
            elif stall_timeout_s and seen > 0 and time.monotonic() - progress_at > stall_timeout_s:
                log.warning("job %s made no progress for %.0fs after step %d: cancelling it", self.handle.ref,
                            stall_timeout_s, seen)  # fmt: skip
                self.launcher.cancel(self.handle)
                return RunOutcome(self.handle, self.status(), self.output_dir, stalled_after_step=seen)
            if time.monotonic() > deadline:
                self.launcher.cancel(self.handle)
                raise UserError(f"job {self.handle.ref} did not finish in {timeout_s:.0f}s", "raise job_timeout_s")
            time.sleep(0.2)

    def wait_until(self, predicate: Callable[[], bool], what: str, timeout_s: float, poll_s: float = 0.02) -> None:
        """Poll until predicate() holds; fails if the job ends first."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            if self.status().state.terminal:
                raise UserError(
                    f"job {self.handle.ref} ended before {what}", "give the drill more steps (acceptance.steps)"
                )
            if time.monotonic() > deadline:
                raise UserError(f"timed out waiting for {what} in job {self.handle.ref}", "see its log")
            time.sleep(poll_s)

    def kill_rank(self, rank: int, sig: int = signal.SIGKILL) -> dict[str, Any]:
        """Send `sig` to one rank's process (directly on this host, through srun on another)."""
        record = next(r for r in self.ranks_record()["ranks"] if r["rank"] == rank)
        if record["host"] == socket.gethostname() or self.cluster.scheduler == "local":
            os.kill(record["pid"], sig)
        else:
            subprocess.run(
                ["srun", f"--jobid={self.handle.job_id}", "--overlap", "-w", record["host"], "-N1", "-n1",
                 "kill", f"-{int(sig)}", str(record["pid"])],
                check=True, timeout=60,
            )  # fmt: skip
        return record

    def ranks_record(self) -> dict[str, Any]:
        """ranks.json of the current attempt."""
        return json.loads((self.output_dir / "ranks.json").read_text())

    def fresh_ranks(self) -> bool:
        """ranks.json was written by this attempt."""
        path = self.output_dir / "ranks.json"
        return path.exists() and path.stat().st_mtime >= self.handle.submitted_unix_s

    def cancel(self) -> None:
        """Stop the job."""
        self.launcher.cancel(self.handle)


def first_step_time_after(output_dir: Path, step: int, since_unix_s: float) -> float | None:
    """When rank 0 recorded `step` after `since_unix_s` (a resumed run's first step)."""
    for record in read_jsonl(output_dir / "metrics" / "rank-00000.jsonl"):
        if record["step"] == step and record["time_unix_s"] >= since_unix_s:
            return float(record["time_unix_s"])
    return None
