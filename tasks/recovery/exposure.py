"""The deployment's observed failure rate: node-hours its jobs ran and the failures they met, and the job's mean time
between failures that the checkpoint interval is chosen from (training/checkpoint/interval.py).

Where: `<ledger>/exposure/` (tasks/paths.py `DeploymentPaths.exposure_url`), one small JSON file per finished job
(the job step, tasks/launch/step.py, records it), named by a run id and never rewritten, as the node memory's are
(tasks/recovery/quarantine.py). A job's failures are its trainer's restarts (recovery.jsonl: every start after
the first, live recoveries included, preemptions left out) and the requeues the restart policy decided; its
node-hours are its wall time from submission to its end times its nodes. Acceptance drills inject failures and
are not recorded: the rate is the deployment's own.

The job's MTBF is the observed per-node figure, node-hours / failures, divided by the job's nodes; before a failure
was observed the spec's `cluster.mttf_hours / nodes`; neither: unknown.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.run_id import RUN_ID, new_run_id
from training.storage import ControlFileError, StorageConfig, filesystem, join, read_control_file, write_bytes_atomic

log = logging.getLogger(__name__)

RateSource = Literal["ledger", "mttf_hours", "checkpoint.mtbf_s", "unknown"]


class JobExposure(BaseModel):
    """One file of the exposure folder: a finished job's node-hours and the failures it met."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    job: str = Field(max_length=500, description="The job's reference (scheduler:id).")
    nodes: int = Field(ge=1, description="Nodes the job ran on.")
    wall_s: float = Field(ge=0, description="Seconds from its submission to its end.")
    failures: int = Field(ge=0, description="Trainer restarts and requeues after a failure.")
    ended_unix_s: float = Field(ge=0, description="When it ended.")

    @property
    def node_hours(self) -> float:
        """Node-hours of allocation."""
        return self.nodes * self.wall_s / 3600


def record_exposure(url: str, exposure: JobExposure, storage: StorageConfig | None = None) -> None:
    """Add a finished job's exposure to the folder at `url`."""
    fs, root = filesystem(url, storage)
    fs.makedirs(root, exist_ok=True)
    write_bytes_atomic(fs, join(root, f"{new_run_id()}.json"), exposure.model_dump_json(indent=2).encode())


def read_exposures(url: str, storage: StorageConfig | None = None) -> list[JobExposure]:
    """Every readable exposure of the folder, oldest first; a file that is not one is skipped with a warning."""
    fs, root = filesystem(url, storage)
    if not fs.exists(root):
        return []
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    found = []
    for name in names:
        if not name.endswith(".json") or not RUN_ID.match(name.removesuffix(".json")):
            continue
        path = join(root, name)
        try:
            found.append(JobExposure.model_validate(json.loads(read_control_file(fs, path))))
        except (ControlFileError, OSError, ValueError, ValidationError) as err:
            log.warning("exposure file %s skipped (%s); move it out of %s", path, type(err).__name__, url)
    return sorted(found, key=lambda e: e.ended_unix_s)


@dataclass(frozen=True)
class FailureRate:
    """The job's mean time between failures and where it came from (mtbf_s None: unknown)."""

    mtbf_s: float | None
    source: RateSource
    detail: str

    def describe(self) -> str:
        """One line: the MTBF and its source, or what to set."""
        if self.mtbf_s is None:
            return f"MTBF unknown: {self.detail}"
        return f"MTBF {self.mtbf_s / 3600:.3g} h ({self.source}: {self.detail})"


def failure_rate(exposures: list[JobExposure], nodes: int, mttf_hours: float | None) -> FailureRate:
    """The MTBF of a job of `nodes` nodes: observed in `exposures` when they met a failure, else from the spec's
    `cluster.mttf_hours`, else unknown."""
    node_hours = sum(e.node_hours for e in exposures)
    failures = sum(e.failures for e in exposures)
    if failures > 0 and node_hours > 0:
        per_node_h = node_hours / failures
        return FailureRate(per_node_h * 3600 / nodes, "ledger",
                           f"{failures} failure(s) in {node_hours:.3g} node-hours of {len(exposures)} job(s), "
                           f"{per_node_h:.3g} h per node / {nodes} node(s)")  # fmt: skip
    seen = f"; the ledger saw no failure in {node_hours:.3g} node-hours" if exposures else ""
    if mttf_hours is not None:
        return FailureRate(mttf_hours * 3600 / nodes, "mttf_hours",
                           f"cluster.mttf_hours={mttf_hours:g} / {nodes} node(s){seen}")  # fmt: skip
    return FailureRate(None, "unknown", f"no failure observed in the ledger{seen or ' (no job recorded)'}; "
                       "set cluster.mttf_hours (a node's mean time to failure) to choose the interval")  # fmt: skip
