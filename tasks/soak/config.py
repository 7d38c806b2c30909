"""The soak's settings: how long, how often a failure, which failures, and the job's recovery tiers."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, field_validator

from training.config import StrictModel

FailureKind = Literal["rank_kill", "node_loss", "hang", "storage_outage", "slow_node"]
FAILURE_KINDS: tuple[FailureKind, ...] = get_args(FailureKind)


class SoakConfig(StrictModel):
    """One soak: a job trained for `hours` while failures arrive at random (seeded) every `failure_every_min` on
    average, each one recovered by the ladder's expected rung."""

    hours: float = Field(gt=0, le=168, description="How long the soak trains, in hours (0.05 = 3 minutes).")
    failure_every_min: float = Field(
        gt=0, le=24 * 60, description="Mean time between injected failures in minutes (exponential inter-arrival)."
    )
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Seed of the failure schedule (times, kinds).")
    kinds: tuple[FailureKind, ...] = Field(
        default=FAILURE_KINDS,
        min_length=1,
        description="The failures drawn from; those the cluster's launcher cannot inject are left out and named "
        "in the report (node_loss needs 2+ nodes on a launcher that can lose one, hang and slow_node 2+ ranks, "
        "storage_outage the local launcher, whose jobs reach the soak's own S3 endpoint).",
    )
    memory_every_steps: int | None = Field(
        default=1,
        ge=1,
        description="The job's in-memory copies (rung memory) every N steps; None = recovery from storage only "
        "(today's path: the benchmark's baseline).",
    )
    save_every_steps: int = Field(default=20, ge=1, description="The job's storage checkpoints every N steps.")
    hang_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=3600,
        description="The job's step timeout floor (watchdog.step_timeout_floor_s) during the soak: how long a hung "
        "rank goes unnoticed.",
    )
    slow_for_s: float = Field(
        default=10.0, gt=0, le=3600, description="How long a slow node lasts (its rank runs half of the time)."
    )
    outage_s: float = Field(default=10.0, gt=0, le=3600, description="How long a storage outage lasts.")
    recovery_timeout_s: float = Field(
        default=300.0, gt=0, le=86400, description="Longest wait for one failure's recovery before it counts as lost."
    )
    sample_every_s: float = Field(
        default=1.0, gt=0, le=600, description="Interval of the per-process memory (RSS) samples."
    )
    leak_mb_per_step: float | None = Field(
        default=None,
        gt=0,
        description="Tests only: the job's ranks keep this much more memory every step (a planted leak the soak "
        "must catch; training.drill_points.LeakPoint). None = off.",
    )

    @field_validator("kinds")
    @classmethod
    def _distinct(cls, kinds: tuple[FailureKind, ...]) -> tuple[FailureKind, ...]:
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"kinds={list(kinds)} names a failure twice; list each once")
        return kinds

    @property
    def duration_s(self) -> float:
        """The soak's length in seconds."""
        return self.hours * 3600.0

    @property
    def mean_interval_s(self) -> float:
        """The mean time between failures in seconds."""
        return self.failure_every_min * 60.0
