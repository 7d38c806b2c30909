"""Memory growth of every process of a soak's job: RSS sampled with psutil, and a leak verdict from the measured noise.

A process's samples are judged from its rank's first step: the window starts at the first sample taken after the
first step record (metrics, with its time) that the rank wrote after the process started, so the start-up (imports,
model build, restore, the first step) is never judged however long it took; a torchrun agent is judged from the same
step of its rank. A straight line is fitted to the window (least squares over the sample index): the growth is the
line's rise over the window, the noise the spread of the samples around the line (90th less 10th percentile of the
residuals), so a leak's own slope does not count as noise. A leak is a growth beyond max(LEAK_NOISE_FACTOR x the
noise, LEAK_FLOOR_FRACTION x the median RSS) with the window's later half's 10th percentile above its earlier half's
90th (the whole distribution moved, not a spike), and with the growth sustained: the later half's own rate, over the
whole window, would rise beyond the tolerance too, and is no less than SUSTAINED_FRACTION of the earlier half's rate.
A leak grows at an even rate, so a straight line's halves each rise by half its growth; a process still settling
(the allocator, caches and the page cache warming: ranks' RSS keeps rising for minutes after their first steps, most
in the first of them, and a rank restarted late in a soak is judged on that alone) flattens out, and its later half
rises by little. A process sampled fewer than MIN_SAMPLES times after its rank's first step (a rank killed early, one
that never trained a step) has not enough samples to judge (verdict "short").
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import psutil
from pydantic import BaseModel, ConfigDict

from training.run_output import RunOutput

MIN_SAMPLES = 8
LEAK_NOISE_FACTOR = 3.0
LEAK_FLOOR_FRACTION = 0.02
"""Growth below 2% of a process's RSS is not called a leak, however quiet the process (page-granular RSS of a
quiet process has a spread near 0)."""
SUSTAINED_FRACTION = 0.5
"""A leak's later half grows at least at this fraction of its earlier half's rate (an even rate gives 1; a settling
curve's rate decays)."""

Verdict = Literal["steady", "leak", "short"]


class ProcessMemory(BaseModel):
    """One process's memory over the soak: its samples' summary and the verdict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int
    role: str
    """'rank N' or 'agent of rank N'."""
    samples: int
    samples_judged: int | None = None
    """Samples taken after its rank's first step (the window judged); None in soaks from before it was recorded."""
    first_rss_bytes: int
    last_rss_bytes: int
    growth_bytes: int | None
    """The fitted line's rise over the window from the rank's first step; None when too short to judge."""
    noise_bytes: int | None
    tolerance_bytes: int | None
    verdict: Verdict

    def describe(self) -> str:
        """One line: who, how much it grew, against what tolerance."""
        if self.growth_bytes is None or self.tolerance_bytes is None or self.noise_bytes is None:
            return (f"{self.role} (pid {self.pid}): {self.samples} samples, {self.samples_judged} after its rank's "
                    f"first step: not enough samples to judge")
        mib = 2**20
        return (f"{self.role} (pid {self.pid}): {self.verdict}, grew {self.growth_bytes / mib:+.1f} MiB "
                f"(tolerance {self.tolerance_bytes / mib:.1f} MiB, noise {self.noise_bytes / mib:.2f} MiB)")


def _percentile(values: list[int] | list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


def _slope(values: list[int]) -> float:
    """The least-squares line's rise per sample."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(values)
    return sum((k - mean_x) * (y - mean_y) for k, y in enumerate(values)) / sum((k - mean_x) ** 2 for k in range(n))


class Sample(NamedTuple):
    """One RSS reading of a process and when it was taken."""

    time_unix_s: float
    rss_bytes: int


def judge(pid: int, role: str, samples: list[Sample], first_step_unix_s: float | None) -> ProcessMemory:
    """The verdict on one process's samples (in sampling order), judged from the first one taken after
    `first_step_unix_s` (when its rank recorded its first step; None: it recorded none, nothing is judged)."""
    rss = [s.rss_bytes for s in samples]
    steady = [] if first_step_unix_s is None else [s.rss_bytes for s in samples if s.time_unix_s >= first_step_unix_s]
    base = {"pid": pid, "role": role, "samples": len(rss), "samples_judged": len(steady),
            "first_rss_bytes": rss[0] if rss else 0, "last_rss_bytes": rss[-1] if rss else 0}  # fmt: skip
    if len(steady) < MIN_SAMPLES:
        return ProcessMemory(**base, growth_bytes=None, noise_bytes=None, tolerance_bytes=None, verdict="short")
    early, late = steady[: len(steady) // 2], steady[len(steady) // 2 :]
    n = len(steady)
    slope = _slope(steady)
    mean_x, mean_y = (n - 1) / 2, statistics.fmean(steady)
    residuals = [y - (mean_y + slope * (k - mean_x)) for k, y in enumerate(steady)]
    growth = slope * (n - 1)
    noise = _percentile(residuals, 0.9) - _percentile(residuals, 0.1)
    tolerance = max(LEAK_NOISE_FACTOR * noise, LEAK_FLOOR_FRACTION * statistics.median(steady))
    moved = _percentile(late, 0.1) > _percentile(early, 0.9)
    late_slope = _slope(late)
    sustained = late_slope * (n - 1) > tolerance and late_slope >= SUSTAINED_FRACTION * _slope(early)
    verdict: Verdict = "leak" if growth > tolerance and moved and sustained else "steady"
    return ProcessMemory(**base, growth_bytes=int(growth), noise_bytes=int(noise), tolerance_bytes=int(tolerance),
                         verdict=verdict)  # fmt: skip


def first_step_after(step_times_unix_s: list[float], started_unix_s: float) -> float | None:
    """When a rank recorded its first step after `started_unix_s` (a process's start; None: no step since)."""
    return min((t for t in step_times_unix_s if t >= started_unix_s), default=None)


def rank_step_times(out: RunOutput) -> dict[int, list[float]]:
    """rank -> when each of its step records was written (every attempt's), from the job's metrics."""
    return {rank: [r.time_unix_s for r in out.metric_records(rank) if r.time_unix_s is not None]
            for rank in out.metric_ranks()}  # fmt: skip


class JobProcess(NamedTuple):
    """A process of the job: its role in words and the rank it runs (or started, for a torchrun agent)."""

    role: str
    rank: int


@dataclass
class _Series:
    process: JobProcess
    started_unix_s: float
    samples: list[Sample] = field(default_factory=list)


class MemorySampler:
    """Samples the RSS of the job's processes every `every_s` in a thread: `processes()` names them (pid -> role and
    rank, re-read at every sample, so restarted ranks join); a process is keyed by pid and start time (pids are
    reused)."""

    def __init__(self, processes: Callable[[], dict[int, JobProcess]], every_s: float) -> None:
        self._processes, self._every_s = processes, every_s
        self._series: dict[tuple[int, float], _Series] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-memory", daemon=True)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.sample()

    def sample(self) -> None:
        """One sample of every process named now (those gone or unreadable are passed over)."""
        try:
            named = self._processes()
        except (OSError, ValueError):  # the job's records being rewritten: the next sample reads them
            return
        for pid, job_process in named.items():
            try:
                process = psutil.Process(pid)
                key = (pid, process.create_time())
                rss = process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            if rss == 0:  # a process on its way out has handed its memory back: no sample of its own use
                continue
            series = self._series.setdefault(key, _Series(job_process, started_unix_s=key[1]))
            series.samples.append(Sample(time.time(), rss))

    def verdicts(self, step_times_unix_s: dict[int, list[float]]) -> list[ProcessMemory]:
        """Every sampled process's verdict, in the order they were first seen, each judged from its rank's first
        step after the process started (`step_times_unix_s`: rank -> when its steps were recorded)."""
        return [
            judge(pid, s.process.role, s.samples,
                  first_step_after(step_times_unix_s.get(s.process.rank, []), s.started_unix_s))
            for (pid, _), s in list(self._series.items())
        ]  # fmt: skip


def job_processes(ranks: list[dict[str, object]]) -> dict[int, JobProcess]:
    """The processes of a job's ranks visible on this machine (the local launcher's, and the SSH launcher's on
    namespace hosts, which share this machine's process table): each rank and its torchrun agent."""
    named: dict[int, JobProcess] = {}
    for record in ranks:
        pid, rank = record.get("pid"), record.get("rank")
        if not isinstance(pid, int) or not isinstance(rank, int) or not psutil.pid_exists(pid):
            continue
        named[pid] = JobProcess(f"rank {rank}", rank)
        try:
            parent = psutil.Process(pid).parent()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if parent is not None and parent.pid > 1:  # the torchrun agent that started the rank
            named.setdefault(parent.pid, JobProcess(f"agent of rank {rank}", rank))
    return named
