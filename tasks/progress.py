"""Progress of long pipeline steps: which phase, how far, reported to whoever listens.

Steps call `report(...)` at each phase change ("acceptance: distributed run", step 40 of 200); the
event is logged (the Prefect UI shows it in the task's log) and handed to the listeners a front end
registered with `listening(...)` (the CLI draws a rich progress bar). With no listener it is a log line.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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
