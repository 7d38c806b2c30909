"""A launched job's goodput: its run records (validation/goodput.py) with the queue time its launcher knows."""

from __future__ import annotations

import logging

from tasks.launch.base import JobHandle, Launcher
from training.storage import is_local
from validation.goodput import Goodput, GoodputError, goodput_of_run

log = logging.getLogger(__name__)


def job_goodput(
    launcher: Launcher, handle: JobHandle, submitted_unix_s: float | None = None, ended_unix_s: float | None = None
) -> Goodput | None:
    """The goodput of `handle`'s job from its submission (default: the handle's; the queue asked of the launcher)
    to `ended_unix_s` (default: its output's last write); None, logged, where its records do not give it (a
    remote output folder, a trainer from before the records, records that overlap)."""
    if not is_local(handle.output_dir):
        return None
    queue_s = launcher.queue_seconds(handle) or 0.0
    submitted = handle.submitted_unix_s if submitted_unix_s is None else submitted_unix_s
    try:
        return goodput_of_run(
            handle.output_dir, queue_s=queue_s, started_unix_s=submitted + queue_s, ended_unix_s=ended_unix_s
        )
    except GoodputError as err:
        log.info("no goodput for job %s: %s", handle.ref, err)  # a pending job has none yet: no warning
        return None
