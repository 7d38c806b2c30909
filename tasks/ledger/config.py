"""The `acceptance.regression` section of the spec: the ledger's regression gate (tasks/ledger/gate.py)."""

from __future__ import annotations

from pydantic import Field

from training.config import StrictModel


class RegressionConfig(StrictModel):
    """The regression gate: an acceptance run against the current baseline (the newest accepted, not rolled back,
    ledger entry of the same spec and cluster). A limit of None leaves that figure unjudged (still shown)."""

    enabled: bool = Field(default=True, description="Compare with the current baseline at all.")
    tokens_per_s_drop_max: float | None = Field(
        default=0.10,
        ge=0,
        le=1,
        description="Largest relative drop of tokens/s below the baseline's (0.10 = 10%); on CPU runs of tokens per "
        "CPU-second, which a busy host does not lower (wall-time tokens/s is then shown, not judged).",
    )
    step_time_rise_max: float | None = Field(
        default=0.15,
        ge=0,
        le=100,
        description="Largest relative rise of the median step time over the baseline's (on CPU runs: of the step's "
        "CPU time).",
    )
    comm_share_rise_max: float | None = Field(
        default=None, ge=0, le=1, description="Largest rise of the communication share (absolute, 0.1 = 10 points)."
    )
    checkpoint_save_rise_max: float | None = Field(
        default=1.0, ge=0, le=100, description="Largest relative rise of the median checkpoint save time."
    )
    busbw_drop_max: float | None = Field(
        default=0.2, ge=0, le=1, description="Largest relative drop of the all-reduce bus bandwidth (when measured)."
    )
    loss_max_rel_worse: float | None = Field(
        default=None,
        ge=0,
        le=10,
        description="Loss curve at the same seed (the quality gate's comparison: final validation loss and the "
        "tail's mean training loss); None = thresholds.quality_max_rel_worse.",
    )
    noise_floor_s: float = Field(
        default=0.2,
        ge=0,
        le=3600,
        description="tokens/s and step time of a baseline whose median step took less than this, and the bus "
        "bandwidth of a baseline whose timed probe all-reduces took less than this in all (raise run.comm_probe_mb "
        "to judge it), are shown but not judged: a few milliseconds of scheduler noise on a shared host are a large "
        "share of such intervals.",
    )
    throughput_min_interval_s: float = Field(
        default=1.0,
        ge=0,
        le=86400,
        description="tokens/s and step time (wall or CPU) are judged only when the steady-state steps they are "
        "measured over took at least this long in all, in the baseline and in the run (timed_s, cpu_timed_s; as "
        "the bus bandwidth is by its timed all-reduces); a shorter interval is shown but not judged.",
    )
    noise_multiple: float = Field(
        default=2.0,
        ge=0,
        le=100,
        description="The limit of a timing figure widens to this many times the baseline's own spread: the "
        "figure's range over the baseline's last noise_runs runs (ledger entries of the same spec, cluster and "
        "curve identity), relative to their median (absolute for the communication share).",
    )
    noise_runs: int = Field(
        default=5, ge=2, le=1000, description="The baseline's runs its spread is taken over (2 or more are needed)."
    )
    save_noise_floor_s: float = Field(
        default=1.0,
        ge=0,
        le=3600,
        description="The checkpoint save time of a baseline whose median save took less than this is shown but "
        "not judged (a small save is dominated by fsync and the page cache).",
    )
