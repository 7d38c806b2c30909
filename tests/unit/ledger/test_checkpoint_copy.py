"""The ledger keeps an accepted run's checkpoint by copy_step: the copy is committed, sound and pinned, and the
entry's reference records the same COMMIT.json digest as the source's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tasks.ledger.registry import Ledger
from tasks.run_id import new_run_id
from tasks.spec import DeploymentSpec
from tests.unit.checkpoints import manager_at, no_key_and_quiet_dcp, saved_steps  # noqa: F401 - autouse fixture
from training.checkpoint import COMMIT, commit_digest, step_dir_name
from training.storage import StorageConfig


def test_an_accepted_runs_checkpoint_is_copied_into_the_ledger_with_its_commit_digest(
    ledger: Ledger, make_spec: Callable[..., DeploymentSpec], tmp_path: Path
) -> None:
    deployment = make_spec(name="deployment").training_config()  # its checkpoint folder holds nothing
    accepted = make_spec(name="accepted").training_config()
    saved_steps(Path(accepted.checkpoint.url), 4, 8)
    entry_id = new_run_id()

    ref = ledger.keep_checkpoint(entry_id, deployment, accepted)

    assert ref is not None and ref.url == ledger.checkpoint_url(entry_id) and ref.step == 8
    source = Path(accepted.checkpoint.url) / step_dir_name(8)
    assert ref.commit_sha256 == commit_digest(str(source), StorageConfig())
    kept = manager_at(Path(ref.url))
    assert kept.steps_on_storage() == [8] and kept.sound(8) is not None
    assert kept.pinned_steps() == {8}
    assert (Path(ref.url) / step_dir_name(8) / COMMIT).read_bytes() == (source / COMMIT).read_bytes()
