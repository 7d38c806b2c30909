"""Rollback: resubmit an earlier ledger entry's image, resumed from its accepted checkpoint.

The entry's checkpoint is copied (COMMIT.json last, its digest checked against the entry's) into a fresh
checkpoint folder beside the deployment's, `<checkpoint.url>-rollback-<id>`, so that the resumed job's newest
checkpoint is the accepted one (the deployment's own folder holds the newer, rolled-back version's) and the
entry's pinned copy is never written to. The job writes its output to `<run.output_url>-rollback-<id>`. Once the
job is submitted, the entries after the restored one are marked rolled back: the restored entry is the current
baseline again.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tasks.acceptance.workspace import RUN_ID, new_run_id
from tasks.cluster import ClusterConfig
from tasks.errors import UserError
from tasks.launch.base import TERMINAL, JobState
from tasks.launch.submit import JobFailed, submit
from tasks.ledger.registry import Ledger, LedgerEntry, cluster_key_of, copy_checkpoint
from training.checkpoint import COMMIT, CheckpointManager, step_dir_name
from training.config import CheckpointConfig, TrainConfig
from training.storage import ControlFileError, filesystem, join, read_control_file

log = logging.getLogger(__name__)


class RollbackError(UserError):
    """A rollback that cannot be done as asked (nothing to go back to, an entry of another spec, ...)."""


@dataclass(frozen=True)
class RollbackPlan:
    """What a rollback restores: the target entry, the entries it supersedes, and the job to resubmit."""

    rollback_id: str
    target: LedgerEntry
    superseded: list[LedgerEntry]
    train: TrainConfig
    """The spec's training config resumed from the copy of the target's checkpoint."""
    image: str | None

    def describe(self) -> str:
        """One line for logs and the CLI."""
        gone = ", ".join(e.entry_id for e in self.superseded)
        step = self.target.checkpoint.step if self.target.checkpoint else "-"
        return (
            f"rollback to entry {self.target.entry_id} (image {self.image or '-'}, code "
            f"{self.target.code_version}, step {step}); rolled back: {gone}"
        )


def plan_rollback(
    ledger: Ledger, spec_name: str, cluster: ClusterConfig, train: TrainConfig, to: str | None = None
) -> RollbackPlan:
    """The rollback of the spec's deployment on `cluster` to entry `to` (None: the one before the current)."""
    lineage = ledger.lineage(spec_name, cluster_key_of(cluster))
    if to is None:
        if len(lineage) < 2:
            raise RollbackError(
                f"nothing to roll back to: the ledger {ledger.url} has {len(lineage)} entry(ies) of spec "
                f"{spec_name!r} on this cluster that are not rolled back",
                "`tdeploy history SPEC` lists them; roll back needs an earlier accepted entry",
            )
        target = lineage[-2]
    else:
        if not RUN_ID.match(to):
            raise RollbackError(f"--to {to!r}: not a ledger entry id", "use an id `tdeploy history SPEC` lists")
        target = ledger.entry(to)
        if target.entry_id not in {e.entry_id for e in lineage}:
            raise RollbackError(
                f"entry {to} is rolled back already, or of another spec or cluster than {spec_name!r}",
                "use an id `tdeploy history SPEC` lists as not rolled back",
            )
    superseded = [e for e in lineage if e.entry_id > target.entry_id]
    if not superseded:
        raise RollbackError(f"entry {target.entry_id} is the current baseline already", "nothing to roll back")
    if target.checkpoint is None:
        raise RollbackError(f"entry {target.entry_id} kept no checkpoint", "roll back to another entry (--to)")
    if target.train.get("model") != train.model.model_dump(mode="json"):
        raise RollbackError(
            f"the spec's model section differs from entry {target.entry_id}'s, so its checkpoint cannot be resumed",
            "restore the entry's model section in the spec (its file lists it under train.model)",
        )
    rollback_id = new_run_id()
    data = train.model_dump(mode="json")
    data["checkpoint"] |= {"url": f"{train.checkpoint.url.rstrip('/')}-rollback-{rollback_id}", "resume": True}
    data["run"] |= {"output_url": f"{train.run.output_url.rstrip('/')}-rollback-{rollback_id}"}
    return RollbackPlan(rollback_id, target, superseded, TrainConfig.model_validate(data), target.image_ref)


def restore_checkpoint(plan: RollbackPlan) -> str:
    """Copy the target's checkpoint into the plan's fresh checkpoint folder; its step folder's URL. Refuses a
    checkpoint whose COMMIT.json is not the one the entry recorded."""
    ref = plan.target.checkpoint
    assert ref is not None  # plan_rollback refuses entries without one
    source = CheckpointManager(CheckpointConfig(url=ref.url), plan.train.storage)
    commit_path = join(source.root, step_dir_name(ref.step), COMMIT)
    try:
        commit = read_control_file(source.fs, commit_path)
    except ControlFileError as err:
        raise RollbackError(
            f"entry {plan.target.entry_id}'s checkpoint: {err}", "roll back to another entry (--to)"
        ) from err
    except FileNotFoundError as err:
        raise RollbackError(
            f"entry {plan.target.entry_id}'s checkpoint {source.step_url(ref.step)} is gone",
            "roll back to another entry (--to); the ledger pins its checkpoints, so check what removed it",
        ) from err
    if hashlib.sha256(commit).hexdigest() != ref.commit_sha256:
        raise RollbackError(
            f"{source.step_url(ref.step)}/{COMMIT} is not the checkpoint entry {plan.target.entry_id} accepted "
            "(its digest differs)",
            "roll back to another entry (--to); that checkpoint was replaced after it was accepted",
        )
    dest = plan.train.checkpoint.url
    fs, root = filesystem(dest, plan.train.storage)
    if fs.exists(root):
        raise RollbackError(f"{dest} exists already", "plan the rollback again (a new rollback id)")
    return copy_checkpoint(source, ref.step, dest, plan.train.storage)


def finish_rollback(ledger: Ledger, plan: RollbackPlan) -> list[str]:
    """Mark the superseded entries rolled back (the target is the current baseline again); those marked."""
    return ledger.mark_rolled_back(
        [e.entry_id for e in plan.superseded], plan.target.entry_id, f"rollback {plan.rollback_id}"
    )


@dataclass(frozen=True)
class RollbackOutcome:
    """A rollback that was carried out: its plan, the resumed job and its state, the entries marked."""

    plan: RollbackPlan
    job: str
    state: str
    output_dir: str
    checkpoint_dir: str
    marked: list[str]


def roll_back(
    ledger: Ledger,
    spec_name: str,
    cluster: ClusterConfig,
    train: TrainConfig,
    to: str | None = None,
    until: Literal["submitted", "running", "finished"] = "running",
    timeout_s: float | None = None,
    on_line: Callable[[str], None] | None = None,
) -> RollbackOutcome:
    """Plan, restore the checkpoint, resubmit the target's image resumed from it, wait `until`, then mark the
    superseded entries rolled back (the CLI and the rollback flow's task both call this)."""
    plan = plan_rollback(ledger, spec_name, cluster, train, to)
    restored = restore_checkpoint(plan)
    log.info("%s; checkpoint %s", plan.describe(), restored)
    launcher, handle = submit(cluster, plan.train, spec_name or "rollback", plan.image, supervised=until == "finished")
    states = {"submitted": frozenset(JobState), "running": frozenset({JobState.RUNNING}), "finished": TERMINAL}
    status = launcher.wait(handle, states[until], timeout_s, on_line=on_line)
    if status.state in (JobState.FAILED, JobState.CANCELLED):
        raise JobFailed(handle, status)  # nothing marked: the current baseline stays the current one
    marked = finish_rollback(ledger, plan)
    return RollbackOutcome(plan, handle.ref, status.state.value, handle.output_dir, restored, marked)
