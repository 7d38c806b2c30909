"""Progress of long pipeline steps: which phase, how far, reported to whoever listens.

Steps call `report(...)` at each phase change ("acceptance: distributed run", step 40 of 200); the
event is logged (the Prefect UI shows it in the task's log) and handed to the listeners a front end
registered with `listening(...)` (the CLI draws a rich progress bar on a terminal, and `PlainLines` where its
output goes to a file or a pipe). With no listener it is a log line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.steps import Step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProgressEvent:
    """One step's phase and, where countable, how many of how many are done."""

    step: str
    phase: str
    done: int | None = None
    total: int | None = None

    def describe(self) -> str:
        """`acceptance: distributed run (40/200)`."""
        count = f" ({self.done}/{self.total})" if self.done is not None and self.total else ""
        return f"{self.step}: {self.phase}{count}"


Listener = Callable[[ProgressEvent], None]
_listeners: list[Listener] = []
_lock = threading.Lock()


def report(step: str, phase: str, done: int | None = None, total: int | None = None, *, quiet: bool = False) -> None:
    """Tell the listeners where `step` is; log it too unless `quiet` (frequent counters within a phase)."""
    event = ProgressEvent(step, phase, done, total)
    if not quiet:
        log.info("%s", event.describe())
    with _lock:
        listeners = list(_listeners)
    for listener in listeners:
        listener(event)


def report_step(flow: str, steps: Sequence[Step], name: str | None) -> None:
    """Tell the listeners that `flow` begins its step `name` (its title; step k of the flow's list in
    tasks/steps.py), or with None that it is done."""
    if name is None:
        report(flow, "done", len(steps), len(steps))
        return
    index = [step.name for step in steps].index(name)
    report(flow, steps[index].title, index, len(steps))


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    """Hand every progress event to `listener` while the block runs."""
    with _lock:
        _listeners.append(listener)
    try:
        yield
    finally:
        with _lock:
            _listeners.remove(listener)


class PlainLines:
    """A listener for output that is not a terminal (CI logs, `tee`), where a live progress bar draws nothing:
    one line per new phase, and within a phase a line at most every `every_s` seconds while its count moves, so
    that a long phase (a distributed run, a drill, a server start) shows that it advances."""

    def __init__(
        self,
        write: Callable[[str], None],
        every_s: float = 30.0,
        label: Callable[[ProgressEvent], str] = ProgressEvent.describe,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.write, self.every_s, self.label, self.clock = write, every_s, label, clock
        self.started = clock()
        self._phase: tuple[str, str] | None = None
        self._written_at = 0.0

    def __call__(self, event: ProgressEvent) -> None:
        """Write `event` as `progress 0:04:10 <label>` unless its phase was written less than every_s ago."""
        now = self.clock()
        phase = (event.step, event.phase)
        if phase == self._phase and now - self._written_at < self.every_s:
            return
        self._phase, self._written_at = phase, now
        elapsed = int(now - self.started)
        self.write(f"progress {elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d} {self.label(event)}")
