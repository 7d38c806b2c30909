"""What the trainer measures: peak memory and the time gradient reductions and parameter gathers take.

The records they end up in are written through training/run_output.py.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated memory on a GPU, peak resident set size of the process on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


class CommTimer:
    """Times the data-parallel collectives of a step: DDP's gradient all-reduce, FSDP2's all-gather and reduce-scatter.

    DDP: `wrap` puts a timing layer around the DDP communication hook; a reduction counts from the hook call
    until its future completes. FSDP2: `all_gather` and `reduce_scatter` are FSDP's own default collectives
    with a timing layer, installed through `FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter`; a
    collective counts from its call until it returns (a synchronous call) or its work's future completes (an
    asynchronous one). The communication time of a step is the union of those intervals, so time that overlaps
    compute is attributed to communication (an upper bound of the exposed share), and a rank that waits in a
    collective for a slower peer books the wait as communication, not compute.

    Limits: the timing is host-side. With gloo on CPU a collective runs while the host waits, so that is its
    time; with NCCL the host only enqueues the kernel, so on GPUs the figure is the host's view of it. HSDP's
    all-reduce across replicas is issued by FSDP directly (not through a custom collective) and is not counted.
    A step in which no collective ran (DDP never synchronising gradients) measures exactly 0.
    """

    def __init__(self) -> None:
        self._intervals: list[tuple[float, float]] = []
        self._lock = threading.Lock()  # futures complete on the process group's threads

    def _record(self, start: float) -> None:
        stop = time.perf_counter()
        with self._lock:
            self._intervals.append((start, stop))

    def finished(self, start: float, work: dist.Work | None) -> dist.Work | None:
        """Record a collective started at `start`: now if it ran synchronously, else when its future completes."""
        if work is None:
            self._record(start)
        else:
            work.get_future().then(lambda _: self._record(start))
        return work

    def wrap(self, hook: Any) -> Any:
        """A comm hook that times `hook`."""

        # No annotations: DDP checks them and `from __future__ import annotations` makes them strings.
        def timed(state, bucket):  # noqa: ANN001, ANN202
            start = time.perf_counter()
            future = hook(state, bucket)

            def finished(fut):  # noqa: ANN001, ANN202
                self._record(start)
                return fut.value()

            return future.then(finished)

        return timed

    def all_gather(self) -> TimedAllGather:
        """FSDP2's default all-gather, timed (for `FSDPModule.set_custom_all_gather`)."""
        return TimedAllGather(self)

    def reduce_scatter(self) -> TimedReduceScatter:
        """FSDP2's default reduce-scatter, timed (for `FSDPModule.set_custom_reduce_scatter`)."""
        return TimedReduceScatter(self)

    def take(self) -> float:
        """Seconds with a collective in flight since the last call."""
        with self._lock:
            intervals, self._intervals = sorted(self._intervals), []
        total, end = 0.0, float("-inf")
        for start, stop in intervals:
            if stop <= end:
                continue
            total += stop - max(start, end)
            end = stop
        return total


class TimedAllGather(DefaultAllGather):
    """FSDP2's default all-gather; each call is recorded by a CommTimer."""

    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        """The default all-gather, timed."""
        start = time.perf_counter()
        return self.timer.finished(start, super().__call__(*args, **kwargs))


class TimedReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter; each call is recorded by a CommTimer."""

    def __init__(self, timer: CommTimer) -> None:
        self.timer = timer

    def __call__(self, *args: Any, **kwargs: Any) -> dist.Work | None:
        """The default reduce-scatter, timed."""
        start = time.perf_counter()
        return self.timer.finished(start, super().__call__(*args, **kwargs))
