"""What the trainer measures: peak memory and the time gradient reductions take.

The records they end up in are written through training/run_output.py.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import torch


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory on a GPU, peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class CommTimer:
    """Times gradient reductions by wrapping a DDP communication hook.

    A reduction counts from the hook call until its future completes; the
    communication time of a step is the union of those intervals, so time that
    overlaps backward compute is attributed to communication (an upper bound of
    the exposed share).
    """

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []

    def wrap(self, hook: Any) -> Any:
        """A comm hook that times `hook`."""

        # No annotations: DDP checks them and `from __future__ import annotations` makes them strings.
        def timed(state, bucket):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            future = hook(state, bucket)

            def finished(fut):  # noqa: ANN001, ANN202
                self._intervals.append((start, time.perf_counter()))
                return fut.value()

            return future.then(finished)

        return timed

    def take(self) -> float:
        """Seconds with a reduction in flight since the last call."""
        total, end = 0.0, float("-inf")
        for start, stop in sorted(self._intervals):
            if stop <= end:
                continue
            total += stop - max(start, end)
            end = stop
        self._intervals.clear()
        return total
