"""`checkpoint.save_every_steps`: which steps save to storage, with `auto` chosen from measurement.

A number saves every that many steps and None never (save_at_end only), as before. `auto` with a known failure rate
(checkpoint.mtbf_s) saves once `FIRST_SAVE_STEP` steps after the start (or the resumed step), then every Young/Daly
optimum (training/checkpoint/interval.py) of the measured stall per save (the wall time the save held training, the
wait for the previous background save included) and step time, chosen again after every save from the medians of
the last `WINDOW` of each, so that one slow save on a shared machine stretches one sample, not the decision. Every
rank must save at the same steps: the trainer agrees on the figures (the largest of the ranks') before they get
here. `auto` without a failure rate saves only at the end, as None does: the interval is a trade of saves against
re-done work, and without a failure rate there is nothing to trade against.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from training.checkpoint.interval import interval_steps, young_daly_s

log = logging.getLogger(__name__)

FIRST_SAVE_STEP = 10
"""Under auto, steps from the start to the first save: past the first steps' warm-up, early enough to lose little
before it."""
WINDOW = 8
"""Saves (and step times) the interval is chosen from (medians)."""


@dataclass
class SaveSchedule:
    """The steps that save to storage (see the module docstring)."""

    setting: int | str | None
    """checkpoint.save_every_steps: N, "auto" or None."""
    mtbf_s: float | None = None
    every: int | None = None
    """Steps between saves now (None: no periodic save, or auto before its first measurement)."""
    last_saved: int = 0
    """The step of the last save (the resumed step at start)."""
    stalls_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    steps_s: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))

    def __post_init__(self) -> None:
        if isinstance(self.setting, int):
            self.every = self.setting

    @property
    def auto(self) -> bool:
        """save_every_steps=auto with a failure rate to choose from."""
        return self.setting == "auto" and self.mtbf_s is not None

    def due(self, step: int) -> bool:
        """Whether `step` saves."""
        if isinstance(self.setting, int):
            return step % self.setting == 0
        if not self.auto:
            return False
        return step - self.last_saved >= (FIRST_SAVE_STEP if self.every is None else self.every)

    def saved(self, step: int, stall_s: float, step_s: float | None) -> int | None:
        """Record a save at `step` that held training `stall_s` with steps of `step_s` (every rank's largest); under
        auto, the interval chosen from the medians so far (the same on every rank), else the fixed one."""
        self.last_saved = step
        if not self.auto:
            return self.every
        self.stalls_s.append(stall_s)
        if step_s is not None and step_s > 0:
            self.steps_s.append(step_s)
        if not self.steps_s:
            return self.every
        stall, step_time = statistics.median(self.stalls_s), statistics.median(self.steps_s)
        assert self.mtbf_s is not None
        chosen = interval_steps(stall, step_time, self.mtbf_s)
        if chosen != self.every:
            log.info(
                "checkpoint.save_every_steps=auto: every %s step(s) from step %d (Young/Daly %.1f s of training "
                "between saves: stall %.3f s per save, step %.3f s, MTBF %.3g h)",
                chosen, step, young_daly_s(stall, self.mtbf_s), stall, step_time, self.mtbf_s / 3600,
            )  # fmt: skip
        self.every = chosen
        return chosen
