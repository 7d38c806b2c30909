"""A job's history across preemptions: when it ran, where it stopped, what it waits for now.

Built from what the job left in its output folder and what its scheduler says now: the trainer's
preemptions.jsonl (one line per checkpoint-and-stop on a signal), its metrics (each step's time; a step
recorded again means a restart re-ran it; the first step after a preemption is where the resume went on) and
the scheduler's current state and reason (Slurm's `scontrol show job` also counts the requeues: Restarts=).
Works the same for any launcher's output folder.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from tasks.errors import UserError
from tasks.launch.base import JobHandle, JobState, JobStatus, Launcher
from tasks.launch.goodput import job_goodput
from training.config import TrainConfig
from training.preemption import PreemptionFileError, PreemptionRecord, read_records
from training.run_output import RunOutput, StepRecord
from validation.goodput import Goodput

EventKind = Literal["running", "preempted", "restarted", "resumed", "pending", "finished", "stopped"]


@dataclass(frozen=True)
class HistoryEvent:
    """One line of the history: what happened, at which step, when (unix seconds, None when unknown)."""

    kind: EventKind
    text: str
    step: int | None = None
    time_unix_s: float | None = None
    steps_lost: int = 0


@dataclass(frozen=True)
class JobHistory:
    """The events in order and the scheduler's view now."""

    events: list[HistoryEvent]
    status: JobStatus | None = None
    restarts: int | None = None
    preemptions: list[PreemptionRecord] = field(default_factory=list)
    goodput: Goodput | None = None
    """The job's goodput so far (None: its records do not give it)."""

    def steps_lost(self) -> int:
        """Steps that ran before a stop and ran again after it (0: every resume went on where the job stopped)."""
        return sum(event.steps_lost for event in self.events)

    def lines(self) -> list[str]:
        """The history as text, one event a line, with UTC times where known."""
        out = []
        for event in self.events:
            when = datetime.fromtimestamp(event.time_unix_s, UTC).strftime("%H:%M:%S") if event.time_unix_s else ""
            out.append(f"  {when:>8}  {event.text}")
        if self.restarts is not None:
            out.append(f"  scheduler restarts (requeues): {self.restarts}")
        if self.goodput is not None:
            out.append(f"  {self.goodput.describe()}")
        return out


def _unix_s(value: Any) -> float | None:
    """A metrics record's time (None when absent or not a finite number)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def build_history(output_dir: str | Path, status: JobStatus | None = None, restarts: int | None = None) -> JobHistory:
    """The events of a run's output folder, closed by the scheduler's current `status` where given."""
    out = RunOutput(output_dir)
    records = out.metric_records(0)
    try:
        preemptions = read_records(str(out.dir))
    except PreemptionFileError as err:
        raise UserError(str(err), "then run `tdeploy status` again") from err
    pending = list(preemptions)
    events: list[HistoryEvent] = []
    previous: StepRecord | None = None
    for record in records:
        step, when = record.step, _unix_s(record.time_unix_s)
        if previous is None:
            events.append(HistoryEvent("running", f"running from step {step - 1}", step - 1, when))
        else:
            stopped = previous.step
            # the preemptions between the previous record and this one (by time; by step where times are missing)
            while pending and _before(pending[0], when, stopped):
                events.append(_preempted_event(pending.pop(0)))
            resumed = events[-1].kind == "preempted"
            if resumed or step <= stopped:
                lost = max(0, stopped - (step - 1))  # steps recorded before the stop that ran again
                note = f" ({lost} steps ran again)" if lost else ""
                kind: EventKind = "resumed" if resumed else "restarted"
                text = f"running again from step {step - 1}" if resumed else f"restarted from step {step - 1}"
                events.append(HistoryEvent(kind, text + note, step - 1, when, lost))
        previous = record
    events += [_preempted_event(p) for p in pending]
    last_step = previous.step if previous else None
    if status is not None:
        events += _now(status, events, last_step, _unix_s(previous.time_unix_s) if previous else None)
    return JobHistory(events, status, restarts, preemptions)


def _before(preemption: PreemptionRecord, when: float | None, stopped_step: int) -> bool:
    """Whether `preemption` happened before a metrics record of time `when` that follows step `stopped_step`."""
    if when is not None:
        return preemption.time <= when
    return preemption.step <= stopped_step


def _preempted_event(p: PreemptionRecord) -> HistoryEvent:
    text = f"preempted at step {p.step} ({p.signal}, {p.signal_to_exit_s:.1f} s from signal to exit, checkpoint saved)"
    return HistoryEvent("preempted", text, p.step, p.time)


def _now(
    status: JobStatus, events: list[HistoryEvent], last_step: int | None, last_unix_s: float | None
) -> list[HistoryEvent]:
    """The closing event from the scheduler's current state (`last_*`: the last step recorded and its time)."""
    reason = f" ({status.reason})" if status.reason and status.reason != "None" else ""
    stopped_at = events[-1].step if events and events[-1].kind == "preempted" else None
    if status.state is JobState.PENDING:
        after = f" to resume from step {stopped_at}" if stopped_at is not None else ""
        return [HistoryEvent("pending", f"pending{reason}{after}")]
    if status.state is JobState.RUNNING:
        if stopped_at is None:
            return [] if events else [HistoryEvent("running", "running (no step recorded yet)")]
        text = f"running again from step {stopped_at} (no new step recorded yet)"
        return [HistoryEvent("resumed", text, stopped_at)]
    if status.state is JobState.SUCCEEDED:
        return [HistoryEvent("finished", f"finished at step {last_step}", last_step, last_unix_s)]
    if status.state is JobState.PREEMPTED:
        resume = f"; resubmit to resume from step {stopped_at}" if stopped_at is not None else ""
        return [HistoryEvent("stopped", f"stopped: preempted{reason}{resume}", stopped_at)]
    return [HistoryEvent("stopped", f"{status.state.value}{reason}" + (f" at step {last_step}" if last_step else ""))]


@dataclass(frozen=True)
class StepsLost:
    """What a stopped job loses when it is resubmitted: the steps it trained after its newest committed
    checkpoint (a resubmission resumes there and trains them again)."""

    trained_to_step: int
    checkpoint_step: int | None

    @property
    def steps(self) -> int:
        """The steps trained after the checkpoint (0: it stopped at a checkpoint)."""
        return self.trained_to_step - (self.checkpoint_step or 0)

    def describe(self) -> str:
        """One line for people."""
        where = "no checkpoint" if self.checkpoint_step is None else f"the checkpoint of step {self.checkpoint_step}"
        return f"{self.steps} step(s) lost: trained to step {self.trained_to_step}, a resubmission resumes from {where}"


def steps_lost(train: TrainConfig, output_dir: str | Path) -> StepsLost:
    """The steps a failed, cancelled or preempted job of `train` loses: from its run output (the last step rank 0
    recorded) and its checkpoint folder (the newest commit at or before that step)."""
    from training.checkpoint import CheckpointManager  # torch: `tdeploy status` reads no checkpoint

    trained = RunOutput(output_dir).last_step()
    manager = CheckpointManager(train.checkpoint, train.storage)
    return StepsLost(trained, max((s for s in manager.committed_steps() if s <= trained), default=None))


def job_history(handle: JobHandle, launcher: Launcher) -> JobHistory:
    """The history of a submitted job: its output folder and its scheduler's current state (and the restarts
    it counts: Slurm's requeues)."""
    history = build_history(handle.output_dir, launcher.status(handle), launcher.restarts(handle))
    return dataclasses.replace(history, goodput=job_goodput(launcher, handle))
