"""The drills copy the reference run's checkpoints by the commit protocol (training.checkpoint.copy_step): only
committed steps, only the files their COMMIT.json lists, each checked against its record; a reference checkpoint
that is not what its commit says stops the copy naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.acceptance.drills import copy_checkpoints
from tasks.acceptance.workspace import variant
from tests.unit.checkpoints import no_key_and_quiet_dcp, saved_steps  # noqa: F401 - autouse fixture
from training.checkpoint import COMMIT, CheckpointCopyError, commit_digest, step_dir_name
from training.config import TrainConfig
from training.storage import StorageConfig


def _reference(tmp_path: Path, make_spec) -> tuple[TrainConfig, TrainConfig]:
    """A reference run's config with committed steps 2, 4 and 6 and a partial step 8; a drill job's config."""
    train = make_spec().training_config()
    source, target = variant(train, tmp_path, "drill-reference"), variant(train, tmp_path, "drill-corrupt")
    saved_steps(Path(source.checkpoint.url), 2, 4, 6)
    (Path(source.checkpoint.url) / step_dir_name(8)).mkdir()  # a save cut short: no COMMIT.json
    return source, target


def test_the_drills_copy_committed_steps_up_to_a_step_with_their_commit_digests_and_nothing_unlisted(
    tmp_path: Path, make_spec
) -> None:
    source, target = _reference(tmp_path, make_spec)
    src, dst = Path(source.checkpoint.url), Path(target.checkpoint.url)
    (src / step_dir_name(4) / "stray.txt").write_text("not in COMMIT.json")

    assert copy_checkpoints(source, target, up_to=4) == [2, 4]

    assert sorted(p.name for p in dst.iterdir()) == [step_dir_name(2), step_dir_name(4)]
    assert not (dst / step_dir_name(4) / "stray.txt").exists()
    for step in (2, 4):
        copied, original = str(dst / step_dir_name(step)), str(src / step_dir_name(step))
        assert commit_digest(copied, StorageConfig()) == commit_digest(original, StorageConfig())


def test_a_corrupt_reference_checkpoint_stops_the_drills_copy_naming_the_file(tmp_path: Path, make_spec) -> None:
    source, target = _reference(tmp_path, make_spec)
    shard = sorted((Path(source.checkpoint.url) / step_dir_name(6)).glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    with pytest.raises(CheckpointCopyError) as caught:
        copy_checkpoints(source, target)

    assert caught.value.path == str(shard) and "fails its sha256 check" in str(caught.value)
    assert not (Path(target.checkpoint.url) / step_dir_name(6) / COMMIT).exists()
