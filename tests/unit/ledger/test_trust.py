"""The ledger as an attacker who can write to its folder sees it: entries signed with the checkpoint key, unsigned
and tampered ones refused, a signed entry's checkpoint and image held to the spec's, malformed files skipped, and
the image digest shown before a rollback runs it (no jobs: the plan and the checkpoint copy)."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from flows.cli import app
from tasks.ledger.registry import CheckpointRef, Ledger, LedgerEntry, LedgerError, RollbackMark, cluster_key_of
from tasks.ledger.rollback import UNAUTHENTICATED, RollbackError, finish_rollback, plan_rollback, restore_checkpoint
from tasks.spec import DeploymentSpec
from tests.conftest import TINY_SPEC, deep_merge
from tests.unit.ledger.conftest import CLUSTER
from training.checkpoint import COMMIT, KEY_ENV, SIGNATURE_FIELD, step_dir_name

KEY = "ledger-test-key-0123456789abcdef"
DIGEST = "sha256:" + "b" * 64
IMAGE = {"registry_url": "registry.local", "repository": "tdeploy"}  # the conftest entries' image is in it


@pytest.fixture
def keyed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ledger:
    """An empty ledger read and written with the signing key set."""
    monkeypatch.setenv(KEY_ENV, KEY)
    return Ledger(str(tmp_path / "ledger"))


@pytest.fixture
def spec(make_spec: Callable[..., DeploymentSpec]) -> DeploymentSpec:
    """The tiny spec (the conftest entries' spec name and cluster), its image in registry.local/tdeploy."""
    return make_spec({"image": IMAGE})


def _checkpoint(url: str, step: int = 20) -> CheckpointRef:
    """A committed step folder at `url` (a weights file and COMMIT.json) and the reference an entry keeps."""
    folder = Path(url) / step_dir_name(step)
    folder.mkdir(parents=True)
    weights = b"\x00" * 64
    (folder / "weights.bin").write_bytes(weights)
    files = {"weights.bin": {"sha256": hashlib.sha256(weights).hexdigest(), "bytes": len(weights)}}
    commit = json.dumps({"step": step, "world_size": 1, "files": files}).encode()
    (folder / COMMIT).write_bytes(commit)
    return CheckpointRef(url=url, step=step, commit_sha256=hashlib.sha256(commit).hexdigest())


def _rollbackable(make_entry: Callable[..., LedgerEntry], spec: DeploymentSpec, **overrides: object) -> LedgerEntry:
    """An entry of the spec whose checkpoint a rollback could resume (its model section is the spec's)."""
    model = spec.training_config().model.model_dump(mode="json")
    return make_entry(train={"model": model}, **overrides)


def _write_by_hand(ledger: Ledger, entry: LedgerEntry) -> Path:
    """`entry` put into the ledger's entries/ as an attacker would: well-formed JSON, no signature."""
    path = Path(ledger.root) / "entries" / f"{entry.entry_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(entry.model_dump_json(indent=2))
    return path


def _spec_file(tmp_path: Path, spec: DeploymentSpec, ledger: Ledger) -> str:
    overrides = {
        "data": {"dataset_url": spec.data.dataset_url},
        "checkpoint": {"url": spec.checkpoint.url},
        "run": {"output_url": spec.run.output_url},
        "image": IMAGE,
        "acceptance": {"ledger_url": ledger.url},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(deep_merge(TINY_SPEC, overrides)))
    return str(path)


def test_with_a_key_a_hand_written_entry_is_skipped_by_history_and_refused_by_rollback(
    keyed: Ledger, make_entry, spec: DeploymentSpec, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train = spec.training_config()
    old = _rollbackable(make_entry, spec, checkpoint=_checkpoint(train.checkpoint.url))
    current = _rollbackable(make_entry, spec)
    keyed.append(old)
    keyed.append(current)
    forged = _rollbackable(
        make_entry,
        spec,
        image_ref="evil.example/miner@sha256:" + "e" * 64,
        checkpoint=_checkpoint(str(tmp_path / "other-tenant" / "checkpoints")),
    )
    path = _write_by_hand(keyed, forged)
    with caplog.at_level(logging.WARNING, logger="tasks.ledger.registry"):
        result = CliRunner().invoke(app, ["history", _spec_file(tmp_path, spec, keyed)], terminal_width=300)
    assert result.exit_code == 0, result.output
    assert [line.split()[0] for line in result.output.splitlines()] == [old.entry_id, current.entry_id]
    assert f"ledger file {path}: not signed ({SIGNATURE_FIELD} is missing) while {KEY_ENV} is set" in caplog.text
    # the default target is the entry before the newest authentic one, never the forged newest
    assert plan_rollback(keyed, spec.name, spec.cluster, train, spec.image).target == old
    with pytest.raises(LedgerError, match="not signed") as caught:
        plan_rollback(keyed, spec.name, spec.cluster, train, spec.image, to=forged.entry_id)
    assert str(path) in caught.value.message and str(path) in (caught.value.fix or "")


def test_with_a_key_a_tampered_signed_entry_is_refused(
    keyed: Ledger, make_entry, spec: DeploymentSpec, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    train = spec.training_config()
    entry = _rollbackable(make_entry, spec, checkpoint=_checkpoint(train.checkpoint.url))
    keyed.append(entry)
    keyed.append(_rollbackable(make_entry, spec))
    path = Path(keyed.root) / "entries" / f"{entry.entry_id}.json"
    written = json.loads(path.read_text())
    assert isinstance(written[SIGNATURE_FIELD], str)  # signed on write
    written["image_ref"] = "registry.local/tdeploy@sha256:" + "e" * 64  # same repository, another image
    path.write_text(json.dumps(written))
    with caplog.at_level(logging.WARNING, logger="tasks.ledger.registry"):
        assert entry.entry_id not in [e.entry_id for e in keyed.entries()]
    assert f"ledger file {path}: its signature ({SIGNATURE_FIELD}) does not match {KEY_ENV}" in caplog.text
    with pytest.raises(LedgerError, match="does not match"):
        plan_rollback(keyed, spec.name, spec.cluster, train, spec.image, to=entry.entry_id)


def test_with_a_key_a_hand_written_rollback_mark_does_not_move_the_baseline(
    keyed: Ledger, make_entry, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = make_entry(), make_entry()
    keyed.append(first)
    keyed.append(second)
    path = Path(keyed.root) / "rollbacks" / f"{second.entry_id}.json"
    path.parent.mkdir(parents=True)
    mark = RollbackMark(entry_id=second.entry_id, rolled_back_at="2026-01-02T03:04:05+00:00",
                        restored_entry=first.entry_id)  # fmt: skip
    path.write_text(mark.model_dump_json())
    with caplog.at_level(logging.WARNING, logger="tasks.ledger.registry"):
        assert keyed.current("tiny", cluster_key_of(CLUSTER)) == second
    assert f"ledger file {path}: not signed" in caplog.text


@pytest.mark.parametrize(
    "where",
    [
        lambda spec, tmp: str(tmp / "other-tenant" / "checkpoints"),
        lambda spec, tmp: f"{spec.checkpoint.url}/../../other-tenant/checkpoints",
        lambda spec, tmp: f"{spec.checkpoint.url}-old",
    ],
    ids=["another folder", "dot-dot out of the spec's", "a sibling with the spec's name as prefix"],
)
def test_rollback_refuses_a_signed_entry_whose_checkpoint_is_not_the_specs_or_the_ledgers_copy(
    keyed: Ledger, make_entry, spec: DeploymentSpec, tmp_path: Path, where
) -> None:
    url = where(spec, tmp_path)
    target = _rollbackable(make_entry, spec, checkpoint=_checkpoint(url))
    keyed.append(target)
    keyed.append(_rollbackable(make_entry, spec))
    with pytest.raises(RollbackError) as caught:
        plan_rollback(keyed, spec.name, spec.cluster, spec.training_config(), spec.image, to=target.entry_id)
    message = caught.value.message
    assert f"entry {target.entry_id}: checkpoint.url={url} is neither" in message
    assert f"checkpoint.url={spec.checkpoint.url!r}" in message and keyed.checkpoint_url(target.entry_id) in message


@pytest.mark.parametrize(
    "image_ref",
    [
        "evil.example/tdeploy@sha256:" + "e" * 64,
        "registry.local/other@sha256:" + "e" * 64,
        "registry.local.evil.example/tdeploy:v1",
        "registry.local/tdeploy-evil:v1",
        "registry.local/tdeploy/sub:v1",
        "registry.local/tdeploy:v1\n",
    ],
)
def test_rollback_refuses_a_signed_entry_whose_image_is_not_from_the_specs_registry_and_repository(
    keyed: Ledger, make_entry, spec: DeploymentSpec, image_ref: str
) -> None:
    train = spec.training_config()
    target = _rollbackable(make_entry, spec, image_ref=image_ref, checkpoint=_checkpoint(train.checkpoint.url))
    keyed.append(target)
    keyed.append(_rollbackable(make_entry, spec))
    with pytest.raises(RollbackError) as caught:
        plan_rollback(keyed, spec.name, spec.cluster, train, spec.image, to=target.entry_id)
    message = caught.value.message
    assert f"entry {target.entry_id}: image_ref=" in message
    assert "(image.registry_url + image.repository = 'registry.local/tdeploy')" in message
    assert "\n" not in message  # an untrusted value is shown escaped


def test_history_skips_a_malformed_entry_with_a_warning_naming_it(
    ledger: Ledger, make_entry, spec: DeploymentSpec, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = make_entry()
    ledger.append(good)
    path = Path(ledger.root) / "entries" / f"{make_entry().entry_id}.json"
    path.write_text('{"entry_id": ')
    with caplog.at_level(logging.WARNING, logger="tasks.ledger.registry"):
        result = CliRunner().invoke(app, ["history", _spec_file(tmp_path, spec, ledger)], terminal_width=300)
    assert result.exit_code == 0, result.output
    assert result.output.startswith(good.entry_id) and "[current baseline]" in result.output
    assert f"ledger file {path}: not a valid LedgerEntry (not JSON" in caplog.text


def test_a_signed_entry_rolls_back_from_the_ledgers_copy_showing_the_image_digest_first(
    keyed: Ledger, make_entry, spec: DeploymentSpec
) -> None:
    old_id = make_entry().entry_id
    old = _rollbackable(
        make_entry,
        spec,
        entry_id=old_id,
        image_ref="registry.local/tdeploy:v1",  # a tag, with the digest it had when accepted
        image_digest=DIGEST,
        checkpoint=_checkpoint(keyed.checkpoint_url(old_id)),
    )
    current = _rollbackable(make_entry, spec, image_ref="registry.local/tdeploy:v2", image_digest=None)
    keyed.append(old)
    keyed.append(current)
    plan = plan_rollback(keyed, spec.name, spec.cluster, spec.training_config(), spec.image)
    assert plan.target == old and plan.authenticated
    assert plan.image == f"registry.local/tdeploy@{DIGEST}"  # run by digest: a moved tag cannot swap it
    assert f"image registry.local/tdeploy@{DIGEST} (digest {DIGEST})" in plan.describe()
    restored = restore_checkpoint(plan)
    kept = Path(keyed.checkpoint_url(old_id)) / step_dir_name(20) / COMMIT
    assert (Path(restored) / COMMIT).read_bytes() == kept.read_bytes()
    assert finish_rollback(keyed, plan) == [current.entry_id]
    mark = json.loads((Path(keyed.root) / "rollbacks" / f"{current.entry_id}.json").read_text())
    assert isinstance(mark[SIGNATURE_FIELD], str)  # marks are signed too
    assert keyed.current(spec.name, cluster_key_of(spec.cluster)) == old


def test_without_a_key_rollback_says_the_entries_are_not_authenticated(
    ledger: Ledger, make_entry, spec: DeploymentSpec, caplog: pytest.LogCaptureFixture
) -> None:
    assert ledger.key is None
    train = spec.training_config()
    old = _rollbackable(make_entry, spec, checkpoint=_checkpoint(train.checkpoint.url))
    ledger.append(old)
    ledger.append(_rollbackable(make_entry, spec))
    with caplog.at_level(logging.WARNING, logger="tasks.ledger.rollback"):
        plan = plan_rollback(ledger, spec.name, spec.cluster, train, spec.image)
    assert plan.target == old and not plan.authenticated
    assert UNAUTHENTICATED in caplog.text
    assert f"entry NOT authenticated ({KEY_ENV} unset)" in plan.describe()
