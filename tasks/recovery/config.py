"""The spec's `recovery:` section: how often the launch step requeues a failed job, and when a node is quarantined."""

from __future__ import annotations

from pydantic import Field

from training.config import StrictModel

DAY_S = 24 * 3600


class RecoveryConfig(StrictModel):
    """The restart policy's limits (tasks/recovery/policy.py) and the node quarantine's (recovery/quarantine.py)."""

    requeues: int = Field(
        default=1,
        ge=0,
        le=100,
        description="Times the launch step submits a job again after an infrastructure failure (lost rank or node, "
        "hang, storage, network) that torchrun's own restarts (cluster.max_restarts) did not recover, each time "
        "without the failing hosts; a workload error (NaN loss, bad data, a bug) is never requeued. 0 = never.",
    )
    quarantine_after_failures: int = Field(
        default=2,
        ge=1,
        le=100,
        description="A host that fails this many times within quarantine_window_s is quarantined: left out of every "
        "later job of the deployment until an operator clears it (`tdeploy nodes clear HOST --spec SPEC`).",
    )
    quarantine_window_s: float = Field(
        default=DAY_S,
        gt=0,
        le=365 * DAY_S,
        allow_inf_nan=False,
        description="The window in which a host's failures count towards its quarantine, in seconds (default a day).",
    )
