"""What each (re)start of the trainer recovered from: `<output>/recovery.jsonl`, one RecoveryEvent per line.

Rank 0 appends one event at every start of the trainer (TORCHELASTIC_RESTART_COUNT is the attempt): the rung of
the recovery ladder that restored the state ("memory": the host-memory copies of training/checkpoint/memory.py,
"storage": a checkpoint on storage, "fresh": nothing to restore; "live" and "spare" are appended by live recovery
and hot spares), the step restored, where each rank's state came from, every copy that was refused and why, and
how long the restore took. Drills and acceptance read it with `recovery_events`, never the logs.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from training.storage import StorageConfig, append_control_line, read_control_lines

RECOVERY_FILE = "recovery.jsonl"
RUNGS = ("live", "spare", "memory", "storage", "fresh")
"""The ladder's rungs, in the order a failure walks them (requeueing is the launch step's, not the trainer's)."""


class RecoveryFileError(ValueError):
    """recovery.jsonl holds a line that is not a RecoveryEvent."""

    def __init__(self, path: str, line: int, problem: str) -> None:
        super().__init__(
            f"{path} line {line}: {problem}; it is written only by the trainer: remove that line (or the file) "
            "if it was edited by hand"
        )
        self.path, self.line, self.problem = path, line, problem


@dataclass(frozen=True)
class Refusal:
    """A copy (or checkpoint) a rung would not use, and why."""

    copy: str
    reason: str


@dataclass(frozen=True)
class RecoveryEvent:
    """One line of recovery.jsonl: what one start of the trainer restored, from where, and what it refused."""

    rung: str
    restored_step: int | None
    world_size: int
    attempt: int = 0
    source: dict[str, str] = field(default_factory=dict)
    refused: list[Refusal] = field(default_factory=list)
    restore_s: float = 0.0
    reason: str = ""
    """Why this rung and not a higher one (e.g. why the memory copies were not used)."""
    time: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        """The JSON object of one line."""
        return asdict(self)


def _event(data: Any, path: str, line: int) -> RecoveryEvent:
    if not isinstance(data, dict):
        raise RecoveryFileError(path, line, "not a JSON object")
    rung, step, world = data.get("rung"), data.get("restored_step"), data.get("world_size")
    if rung not in RUNGS:
        raise RecoveryFileError(path, line, f"rung {rung!r} is not one of {', '.join(RUNGS)}")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise RecoveryFileError(path, line, f"restored_step {step!r} is not a step number")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise RecoveryFileError(path, line, f"world_size {world!r} is not a positive integer")
    source, refused = data.get("source", {}), data.get("refused", [])
    if not isinstance(source, dict) or not all(isinstance(v, str) for v in source.values()):
        raise RecoveryFileError(path, line, "source is not an object of strings")
    if not isinstance(refused, list) or not all(
        isinstance(r, dict) and isinstance(r.get("copy"), str) and isinstance(r.get("reason"), str) for r in refused
    ):
        raise RecoveryFileError(path, line, "refused is not a list of {copy, reason}")
    numbers = {k: data.get(k, 0) for k in ("attempt", "restore_s", "time")}
    for name, value in numbers.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise RecoveryFileError(path, line, f"{name} {value!r} is not a number")
    reason = data.get("reason", "")
    return RecoveryEvent(
        rung=rung, restored_step=step, world_size=world, attempt=int(numbers["attempt"]),
        source={str(k): v for k, v in source.items()},
        refused=[Refusal(r["copy"], r["reason"]) for r in refused],
        restore_s=float(numbers["restore_s"]), reason=reason if isinstance(reason, str) else "",
        time=float(numbers["time"]),
    )  # fmt: skip


def recovery_events(output_url: str, storage: StorageConfig | None = None) -> list[RecoveryEvent]:
    """The recovery events of a run's output folder, oldest first ([] when none); RecoveryFileError for a
    malformed line."""
    path, lines = read_control_lines(output_url, RECOVERY_FILE, storage)
    events = []
    for number, text in lines:
        try:
            data = json.loads(text)
        except ValueError as err:
            raise RecoveryFileError(path, number, f"not JSON ({err})") from None
        events.append(_event(data, path, number))
    return events


def append_event(output_url: str, event: RecoveryEvent, storage: StorageConfig | None = None) -> None:
    """Add one line to recovery.jsonl, replacing the file as a whole (readers never see half a line)."""
    append_control_line(output_url, RECOVERY_FILE, json.dumps(event.to_json()), storage)
