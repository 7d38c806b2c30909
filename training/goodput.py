"""Goodput: the share of an allocation's time that became kept training progress, and where the rest went.

Definitions after Google's ml-goodput-measurement (github.com/google/cloud_tpu_goodput, `goodput.py` and its
README): goodput = productive training time / total job time, the total running from the job's start (here: its
submission, so queueing counts) to its end; badput is the rest, split by cause -- program start-up, data loading
(synchronous), checkpoint save and restore (the time training was held), "wasted progress from disruption" (steps
trained after the last checkpoint and trained again after a restart) and infrastructure recovery (from the failure
to the restarted program), plus custom events and "other". The package itself reads its records from Google Cloud
Logging and needs a cloud project, so the definitions are implemented here over the records the job writes.

Kinds (`BADPUT_KINDS`), each an interval of the allocation's timeline:

    queue               submitted -> the scheduler started the job (asked of the launcher: Launcher.queue_seconds)
    startup             the job started -> an attempt's first step began, less the gate and the restore in it
    health_gate         the node checks before rendezvous (training/health_gate.py's record), inside start-up
    checkpoint_save     the time a save held training: storage saves (checkpoints.jsonl's stall_s) and in-memory
                        copies (the next step record's memory_copy_before_s)
    checkpoint_restore  the time the restore of a restart took (recovery.jsonl's restore_s), inside start-up
    recovery            the last step of a failed attempt -> the next attempt's process started (detection, teardown,
                        relaunch), less a hang in it
    redone_steps        steps that ran in an attempt and ran again after its restart (the later attempt is kept)
    hang                the hung phase of a failed attempt (hangs.jsonl's elapsed_s), inside recovery
    data_wait           the kept steps' wait for their batches
    other               between steps: evaluation, logging, the part of a save that did not hold the first step
                        after it; after the last step: the final evaluation, save and exit

Productive time is the kept steps' time less their data wait. The kinds tile the timeline, so productive + badput
equals the allocation unless records overlap (clocks of different hosts, a record that is wrong): `Goodput`
refuses a sum that is off by more than 1% of the allocation.

It lives in the payload because the payload serves the live figure (training/telemetry.py's goodput gauges, from
rank 0's own records); reports, the ledger and the CLI take it through validation/goodput.py.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from training.health_gate import read_health_gate
from training.recovery_record import recovery_events
from training.run_output import RunOutput
from training.watchdog import hang_records

BADPUT_KINDS: tuple[str, ...] = (
    "queue", "startup", "health_gate", "checkpoint_save", "checkpoint_restore",
    "recovery", "redone_steps", "hang", "data_wait", "other",
)  # fmt: skip
SUM_TOLERANCE = 0.01
"""Productive + badput may differ from the allocation by this share of it (rounding, clock ticks)."""


class GoodputError(ValueError):
    """A run's records cannot give its goodput: missing, or adding up to more than its allocation."""

    def __init__(self, where: str, problem: str, fix: str) -> None:
        super().__init__(f"{where}: {problem}; {fix}")
        self.where, self.problem, self.fix = where, problem, fix


@dataclass(frozen=True)
class Goodput:
    """An allocation's time split into productive training and badput by kind (seconds)."""

    allocation_s: float
    productive_s: float
    badput_s: dict[str, float]

    def __post_init__(self) -> None:
        unknown = set(self.badput_s) - set(BADPUT_KINDS)
        if unknown:
            raise GoodputError("badput_s", f"unknown kinds {sorted(unknown)}", f"use {', '.join(BADPUT_KINDS)}")
        object.__setattr__(self, "badput_s", {k: float(self.badput_s.get(k, 0.0)) for k in BADPUT_KINDS})
        negative = {k: v for k, v in {"productive": self.productive_s, **self.badput_s}.items() if v < 0}
        if negative or self.allocation_s < 0:
            raise GoodputError("goodput", f"negative seconds {negative or self.allocation_s}", "records overlap")
        if abs(self.unaccounted_s) > SUM_TOLERANCE * self.allocation_s + 1e-6:
            raise GoodputError(
                "goodput",
                f"productive {self.productive_s:.3f}s + badput {sum(self.badput_s.values()):.3f}s differs from the "
                f"allocation {self.allocation_s:.3f}s by more than {SUM_TOLERANCE:.0%}",
                "the records overlap or miss an interval: check the hosts' clocks and the run's records",
            )

    @property
    def goodput(self) -> float:
        """Productive share of the allocation, 0..1 (0 for an empty allocation)."""
        return self.productive_s / self.allocation_s if self.allocation_s > 0 else 0.0

    @property
    def unaccounted_s(self) -> float:
        """Allocation less productive and badput time (within 1% of the allocation by construction)."""
        return self.allocation_s - self.productive_s - sum(self.badput_s.values())

    def shares(self) -> dict[str, float]:
        """Each badput kind's share of the allocation, 0..1."""
        total = self.allocation_s
        return {k: (v / total if total > 0 else 0.0) for k, v in self.badput_s.items()}

    def to_json(self) -> dict[str, Any]:
        """As stored in reports and the ledger."""
        return {
            "allocation_s": round(self.allocation_s, 3),
            "productive_s": round(self.productive_s, 3),
            "goodput": round(self.goodput, 4),
            "badput_s": {k: round(v, 3) for k, v in self.badput_s.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Goodput:
        """Inverse of to_json."""
        return cls(float(data["allocation_s"]), float(data["productive_s"]), dict(data["badput_s"]))

    def describe(self) -> str:
        """One line: goodput and the badput kinds that took time, largest first."""
        parts = [f"{k} {100 * s:.1f}%" for k, s in sorted(self.shares().items(), key=lambda kv: -kv[1]) if s >= 5e-4]
        badput = f"; badput: {', '.join(parts)}" if parts else ""
        return f"goodput {100 * self.goodput:.1f}% of {self.allocation_s:.1f}s{badput}"


@dataclass(frozen=True)
class StepTiming:
    """One step record: the step, when it ended, how long it took and how much of that waited for data."""

    step: int
    ended_unix_s: float
    step_s: float
    data_wait_s: float = 0.0
    copy_before_s: float = 0.0
    """The in-memory copy that held training between the previous step and this one."""

    @property
    def started_unix_s(self) -> float:
        """When the step began."""
        return self.ended_unix_s - self.step_s


@dataclass(frozen=True)
class AttemptTiming:
    """One start of the trainer: when its process started, and what its start-up and its failure spent."""

    started_unix_s: float
    restore_s: float = 0.0
    health_gate_s: float = 0.0
    hang_s: float = 0.0


@dataclass(frozen=True)
class GoodputInputs:
    """The timings goodput is computed from: the allocation (after its queue), every attempt, every step record in
    the order written (steps that ran again included), and the save stalls by the step they followed."""

    started_unix_s: float
    ended_unix_s: float
    attempts: Sequence[AttemptTiming]
    steps: Sequence[StepTiming]
    save_stalls_s: Sequence[tuple[int, float]] = ()
    queue_s: float = 0.0


@dataclass
class _Tally:
    productive: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BADPUT_KINDS, 0.0))

    def take(self, kind: str, seconds: float, most: float) -> float:
        """Book min(seconds, most) as `kind`; what is left of `most`."""
        booked = max(0.0, min(seconds, most))
        self.badput[kind] += booked
        return max(0.0, most - booked)


def goodput_of(inputs: GoodputInputs) -> Goodput:
    """Split the allocation of `inputs` into productive time and badput by kind (module docstring)."""
    start, end = inputs.started_unix_s, inputs.ended_unix_s
    if end < start:
        raise GoodputError("goodput", f"ended_unix_s={end} is before started_unix_s={start}", "pass the job's end")
    tally = _Tally()
    tally.badput["queue"] = inputs.queue_s
    attempts = sorted(inputs.attempts, key=lambda a: a.started_unix_s) or [AttemptTiming(start)]
    starts = [a.started_unix_s for a in attempts]
    by_attempt: list[list[tuple[int, StepTiming]]] = [[] for _ in attempts]
    for index, step in enumerate(inputs.steps):
        by_attempt[max(0, bisect.bisect_right(starts, step.started_unix_s) - 1)].append((index, step))
    kept = {step.step: index for index, step in enumerate(inputs.steps)}  # the last attempt of a step is kept
    stalls: dict[int, list[float]] = defaultdict(list)
    for step_number, stall in inputs.save_stalls_s:
        stalls[step_number].append(stall)

    def stall_after(step_number: int) -> float:
        return stalls[step_number].pop(0) if stalls[step_number] else 0.0

    for number, attempt in enumerate(attempts):
        final = number == len(attempts) - 1
        window_start = start if number == 0 else attempt.started_unix_s
        window_end = end if final else attempts[number + 1].started_unix_s
        steps = by_attempt[number]
        first_start = steps[0][1].started_unix_s if steps else window_end
        head = max(0.0, first_start - window_start)
        head = tally.take("health_gate", attempt.health_gate_s, head)
        head = tally.take("checkpoint_restore", attempt.restore_s, head)
        tally.badput["startup" if steps or final else "recovery"] += head
        if not steps:
            continue
        for position, (index, step) in enumerate(steps):
            redone = kept[step.step] != index
            wait = max(0.0, min(step.data_wait_s, step.step_s))
            if redone:
                tally.badput["redone_steps"] += step.step_s
            else:
                tally.productive += step.step_s - wait
                tally.badput["data_wait"] += wait
            after = steps[position + 1][1] if position + 1 < len(steps) else None
            following = after.started_unix_s if after is not None else window_end
            held = stall_after(step.step) + (after.copy_before_s if after is not None else 0.0)
            gap = tally.take("checkpoint_save", held, max(0.0, following - step.ended_unix_s))
            if position + 1 < len(steps):
                tally.badput["redone_steps" if redone else "other"] += gap
            elif final:
                tally.badput["other"] += gap
            else:
                tally.badput["recovery"] += tally.take("hang", attempt.hang_s, gap)
    return Goodput(inputs.queue_s + (end - start), tally.productive, tally.badput)


# ---- a run's own records ----------------------------------------------------------------------------------------


def _attempt_of(starts: list[float], when: float) -> int:
    return max(0, bisect.bisect_right(starts, when) - 1)


def _last_write(folder: Path) -> float | None:
    """The newest modification time of the run folder's files (the job's log is written until it exits)."""
    times = [p.stat().st_mtime for p in folder.rglob("*") if p.is_file()]
    return max(times) if times else None


def goodput_inputs_of_run(
    output_dir: str | Path,
    *,
    queue_s: float = 0.0,
    started_unix_s: float | None = None,
    ended_unix_s: float | None = None,
) -> GoodputInputs:
    """The goodput inputs from a run's records (rank 0's steps, attempts.jsonl, checkpoints.jsonl, recovery.jsonl,
    hangs.jsonl, health_gate.json). `started_unix_s`: when the launcher started the job (default: the first
    attempt's process start, or the health gate's if it ran before); `ended_unix_s`: when it ended (default: the
    run folder's last write)."""
    run = RunOutput(output_dir)
    records = run.attempts()
    if not records:
        raise GoodputError(str(run.dir), "no attempts.jsonl: the job never started training, or predates goodput "
                           "records", "run it with this version of the trainer")  # fmt: skip
    starts = sorted(r.started_unix_s for r in records)
    restore: dict[int, float] = defaultdict(float)
    for event in recovery_events(str(run.dir)):
        restore[_attempt_of(starts, event.time)] += event.restore_s
    hang: dict[int, float] = defaultdict(float)
    for record in hang_records(run.dir):
        slot = _attempt_of(starts, record.time_unix_s)
        hang[slot] = max(hang[slot], record.elapsed_s)
    gate_s: dict[int, float] = defaultdict(float)
    gate = read_health_gate(run.dir)
    if gate is not None:
        gate_s[_attempt_of(starts, gate.started_unix_s)] = gate.seconds
    attempts = [AttemptTiming(s, restore[i], gate_s[i], hang[i]) for i, s in enumerate(starts)]
    steps = [
        StepTiming(r.step, r.time_unix_s, r.step_time_s, r.data_wait_s or 0.0, r.memory_copy_before_s or 0.0)
        for r in run.metric_records(0)
        if r.time_unix_s is not None and r.step_time_s is not None
    ]
    stalls = [(c.step, c.stall_s) for c in run.checkpoints() if c.stall_s is not None]
    start = min([starts[0], *(t for t in (started_unix_s, gate and gate.started_unix_s) if t is not None)])
    end = ended_unix_s if ended_unix_s is not None else _last_write(run.dir)
    assert end is not None  # attempts.jsonl exists
    return GoodputInputs(start, max(end, start), attempts, steps, stalls, queue_s)


def goodput_of_run(
    output_dir: str | Path,
    *,
    queue_s: float = 0.0,
    started_unix_s: float | None = None,
    ended_unix_s: float | None = None,
) -> Goodput:
    """A run's goodput from its own records (goodput_inputs_of_run); `queue_s` from the launcher."""
    return goodput_of(
        goodput_inputs_of_run(output_dir, queue_s=queue_s, started_unix_s=started_unix_s, ended_unix_s=ended_unix_s)
    )

