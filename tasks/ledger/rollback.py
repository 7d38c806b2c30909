"""Rollback: resubmit an earlier ledger entry's image, resumed from its accepted checkpoint.

The entry's checkpoint is copied by `training.checkpoint.copy_step` (COMMIT.json last, its digest checked against
the entry's, every file against its record) into a fresh checkpoint folder beside the deployment's,
`<checkpoint.url>-rollback-<id>`, so that the resumed job's newest checkpoint is the accepted one (the deployment's
own folder holds the newer, rolled-back version's) and the entry's pinned copy is never written to. The job writes its output to `<run.output_url>-rollback-<id>`. Once the
job is submitted, the entries after the restored one are marked rolled back: the restored entry is the current
baseline again.

An entry is data on shared storage: with the signing key set the ledger refuses unsigned and tampered ones, and
even a signed entry may only name what the deployment's spec allows: its checkpoint is the spec's own
`checkpoint.url` or the ledger's copy for that entry (`<ledger>/checkpoints/<entry-id>`), and its image comes from
the spec's `image.registry_url` + `image.repository` (the local store's `localhost/<repository>` when no registry is
set). The image runs by digest where the entry recorded one, and the plan names it before anything is copied.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from tasks.errors import UserError
from tasks.image.config import IMAGE_REF, ImageConfig
from tasks.launch.base import TERMINAL, JobState
from tasks.launch.cluster import ClusterConfig
from tasks.launch.submit import JobFailed, submit
from tasks.ledger.registry import Ledger, LedgerEntry, cluster_key_of
from tasks.run_id import RUN_ID, new_run_id
from training.checkpoint import (
    COMMIT,
    KEY_ENV,
    CheckpointCopyError,
    CheckpointFormatError,
    CheckpointManager,
    commit_digest,
    copy_step,
)
from training.config import CheckpointConfig, TrainConfig
from training.storage import StorageConfig, filesystem
from training.untrusted import escape_untrusted

log = logging.getLogger(__name__)


class RollbackError(UserError):
    """A rollback that cannot be done as asked (nothing to go back to, an entry of another spec, ...)."""


_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
UNAUTHENTICATED = (
    f"{KEY_ENV} is not set, so the ledger's entries are not authenticated: anyone who can write to the ledger "
    "folder can add the entry a rollback restores (its checkpoint and image are still held to the spec's); set "
    f"{KEY_ENV} (or the Prefect Secret block tdeploy-checkpoint-key, which the flows read) to sign and check them"
)


def _folder(url: str, storage: StorageConfig) -> tuple[str, str]:
    """A folder URL as (protocol, normalised path without a trailing slash), to compare two URLs by."""
    fs, path = filesystem(url, storage)
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol, posixpath.normpath("/" + path.strip("/"))


def image_repository(image: ImageConfig) -> str:
    """Where the spec's images live: `registry_url/repository`, or the local store's `localhost/repository`."""
    return f"{image.registry_url or 'localhost'}/{image.repository}"


def _image_name(ref: str) -> str:
    """`ref` without its digest and tag ([host[:port]/]path)."""
    name = ref.split("@", 1)[0]
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def _confined(ledger: Ledger, target: LedgerEntry, train: TrainConfig, image: ImageConfig) -> str | None:
    """The image reference the rollback runs (by digest where the entry recorded one; None: the nodes' own
    environment); RollbackError naming the field when the entry's checkpoint or image is not one the spec allows."""
    entry, ref = target.entry_id, target.checkpoint
    assert ref is not None  # plan_rollback refuses entries without one
    allowed = {train.checkpoint.url, ledger.checkpoint_url(entry)}
    if _folder(ref.url, train.storage) not in {_folder(url, train.storage) for url in allowed}:
        raise RollbackError(
            f"entry {entry}: checkpoint.url={escape_untrusted(ref.url)} is neither the deployment's checkpoint "
            f"folder (checkpoint.url={train.checkpoint.url!r}) nor the ledger's copy of that entry "
            f"({ledger.checkpoint_url(entry)!r}); a rollback restores only those",
            f"roll back to another entry (--to); move {entry}.json out of the ledger's entries/ unless the "
            "spec's checkpoint.url was changed since (then restore it to resume from that entry)",
        )
    if target.image_ref is None:
        return None
    repository, digest = image_repository(image), target.image_digest
    if not IMAGE_REF.fullmatch(target.image_ref) or _image_name(target.image_ref) != repository:
        raise RollbackError(
            f"entry {entry}: image_ref={escape_untrusted(target.image_ref)} is not an image of the spec's "
            f"repository (image.registry_url + image.repository = {repository!r}); a rollback runs only those",
            f"roll back to another entry (--to); move {entry}.json out of the ledger's entries/ unless the spec's "
            "image.registry_url or image.repository was changed since (then restore them to run that image)",
        )
    if digest is not None and not _DIGEST.fullmatch(digest):
        raise RollbackError(
            f"entry {entry}: image_digest={escape_untrusted(digest)} is not a sha256:<64 hex> digest",
            "roll back to another entry (--to)",
        )
    pinned = target.image_ref.partition("@")[2] or None
    if pinned is not None and digest is not None and pinned != digest:
        raise RollbackError(
            f"entry {entry}: image_ref={target.image_ref!r} names digest {pinned}, but image_digest={digest!r}",
            "roll back to another entry (--to); the entry is not as it was recorded",
        )
    digest = pinned or digest
    return f"{_image_name(target.image_ref)}@{digest}" if digest else target.image_ref


@dataclass(frozen=True)
class RollbackPlan:
    """What a rollback restores: the target entry, the entries it supersedes, and the job to resubmit."""

    rollback_id: str
    target: LedgerEntry
    superseded: list[LedgerEntry]
    train: TrainConfig
    """The spec's training config resumed from the copy of the target's checkpoint."""
    image: str | None
    """The image the job runs: by digest where the entry recorded one (None: the nodes' own environment)."""
    authenticated: bool
    """Whether the ledger's entries were checked against the signing key."""

    def describe(self) -> str:
        """What the rollback runs, for logs and the CLI, before it runs it."""
        gone = ", ".join(e.entry_id for e in self.superseded)
        ref = self.target.checkpoint
        if self.image is None:
            image = "the nodes' own environment"
        elif "@" in self.image:
            image = f"image {self.image} (digest {self.image.rpartition('@')[2]})"
        else:
            image = f"image {self.image} (no digest recorded: the tag is resolved when the job starts)"
        trust = "" if self.authenticated else f"; entry NOT authenticated ({KEY_ENV} unset)"
        return (
            f"rollback to entry {self.target.entry_id}: {image}, code {self.target.code_version}, checkpoint "
            f"{ref.url if ref else '-'} step {ref.step if ref else '-'}; rolled back: {gone}{trust}"
        )


def plan_rollback(
    ledger: Ledger,
    spec_name: str,
    cluster: ClusterConfig,
    train: TrainConfig,
    image: ImageConfig,
    to: str | None = None,
) -> RollbackPlan:
    """The rollback of the spec's deployment on `cluster` to entry `to` (None: the one before the current); its
    checkpoint and image held to what the spec's `train.checkpoint` and `image` allow."""
    if ledger.key is None:
        log.warning("%s", UNAUTHENTICATED)
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
    run_image = _confined(ledger, target, train, image)
    rollback_id = new_run_id()
    data = train.model_dump(mode="json")
    data["checkpoint"] |= {"url": f"{train.checkpoint.url.rstrip('/')}-rollback-{rollback_id}", "resume": True}
    data["run"] |= {"output_url": f"{train.run.output_url.rstrip('/')}-rollback-{rollback_id}"}
    plan_train = TrainConfig.model_validate(data)
    return RollbackPlan(rollback_id, target, superseded, plan_train, run_image, ledger.key is not None)


def restore_checkpoint(plan: RollbackPlan) -> str:
    """Copy the target's checkpoint into the plan's fresh checkpoint folder; its step folder's URL. Refuses a
    checkpoint whose COMMIT.json is not the one the entry recorded, or whose files do not match it."""
    ref = plan.target.checkpoint
    assert ref is not None  # plan_rollback refuses entries without one
    source = CheckpointManager(CheckpointConfig(url=ref.url), plan.train.storage)
    step_dir = source.step_url(ref.step)
    try:
        digest = commit_digest(step_dir, plan.train.storage)
    except CheckpointFormatError as err:
        raise RollbackError(
            f"entry {plan.target.entry_id}'s checkpoint: {err.path}: {err.problem}", "roll back to another entry (--to)"
        ) from err
    except FileNotFoundError as err:
        raise RollbackError(
            f"entry {plan.target.entry_id}'s checkpoint {step_dir} is gone",
            "roll back to another entry (--to); the ledger pins its checkpoints, so check what removed it",
        ) from err
    if digest != ref.commit_sha256:
        raise RollbackError(
            f"{step_dir}/{COMMIT} is not the checkpoint entry {plan.target.entry_id} accepted (its digest differs)",
            "roll back to another entry (--to); that checkpoint was replaced after it was accepted",
        )
    dest = plan.train.checkpoint.url
    fs, root = filesystem(dest, plan.train.storage)
    if fs.exists(root):
        raise RollbackError(f"{dest} exists already", "plan the rollback again (a new rollback id)")
    try:
        return copy_step(step_dir, dest, plan.train.storage, expect_commit_sha256=ref.commit_sha256)
    except CheckpointCopyError as err:
        raise RollbackError(
            f"entry {plan.target.entry_id}'s checkpoint: {err.path} {err.problem}", "roll back to another entry (--to)"
        ) from err


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
    image: ImageConfig,
    to: str | None = None,
    until: Literal["submitted", "running", "finished"] = "running",
    timeout_s: float | None = None,
    on_line: Callable[[str], None] | None = None,
    on_plan: Callable[[str], None] | None = None,
) -> RollbackOutcome:
    """Plan, show the plan (`on_plan`, and the log), restore the checkpoint, resubmit the target's image resumed
    from it, wait `until`, then mark the superseded entries rolled back (the CLI and the rollback flow's task both
    call this)."""
    plan = plan_rollback(ledger, spec_name, cluster, train, image, to)
    log.info("%s", plan.describe())
    if on_plan is not None:
        on_plan(plan.describe())
    restored = restore_checkpoint(plan)
    log.info("rollback %s: checkpoint restored into %s", plan.rollback_id, restored)
    launcher, handle = submit(cluster, plan.train, spec_name or "rollback", plan.image, supervised=until == "finished")
    states = {"submitted": frozenset(JobState), "running": frozenset({JobState.RUNNING}), "finished": TERMINAL}
    status = launcher.wait(handle, states[until], timeout_s, on_line=on_line)
    if status.state in (JobState.FAILED, JobState.CANCELLED):
        raise JobFailed(handle, status)  # nothing marked: the current baseline stays the current one
    marked = finish_rollback(ledger, plan)
    return RollbackOutcome(plan, handle.ref, status.state.value, handle.output_dir, restored, marked)
