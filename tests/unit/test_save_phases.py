"""The save protocol's phase points (where the kill_during_save drill stops a save) and the wholeness check."""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from tests.unit.checkpoints import (
    manager_at,
    no_key_and_quiet_dcp,  # noqa: F401 - autouse fixture
    saved_steps,
    tiny_model,
)
from tests.faults.bugs import TestFaults
from tests.faults.payload import patch_checkpoints
from training import drill_points
from training.checkpoint import COMMIT, DCP_METADATA, CheckpointCommitError, TRAIN_STATE, rng_file, step_dir_name
from training.drill_points import SAVE_PHASES, DrillPoints, PausedRank, paused_ranks

SHARD = "__0_0.distcp"


def _phases_seen(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    background: bool = False,
    seen: dict[str, list[str]] | None = None,
    **injected: object,
) -> dict[str, list[str]]:
    """Save one checkpoint in a drill's job (`background`: with save_async) with the test bugs `injected`
    (tests/faults/payload.py); its folder's files at each phase point (writing_dcp: once written), also into `seen`
    when given (kept when the save raises)."""
    elsewhere = {"phase": "after_commit", "step": 99, "marker_dir": str(tmp_path / "markers")}
    points = DrillPoints(pause_in_save=elsewhere)
    patch_checkpoints(TestFaults.model_validate(injected), monkeypatch.setattr)
    manager = manager_at(tmp_path / "ckpt")
    seen = {} if seen is None else seen

    def record(phase: str, step: int, shard_written: bool | None = None) -> None:
        if shard_written is not False:
            seen[phase] = manager.files(step)

    monkeypatch.setattr(drill_points, "active", lambda: points)
    monkeypatch.setattr(drill_points, "at_save_phase", record)
    if background:
        manager.save_async(3, *tiny_model(), {"step": 3})
        assert manager.wait() is not None
    else:
        manager.save(3, *tiny_model(), {"step": 3})
    return seen


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "background"])
def test_each_save_phase_point_sees_exactly_the_files_its_name_says(
    tmp_path: Path, monkeypatch, background: bool
) -> None:
    seen = _phases_seen(tmp_path, monkeypatch, background)
    assert list(seen) == list(SAVE_PHASES)
    dcp_files = [DCP_METADATA, SHARD]
    extras = [rng_file(0), TRAIN_STATE]
    assert seen["writing_dcp"] == [SHARD]  # this rank's data, no metadata yet
    assert seen["after_dcp"] == dcp_files
    assert seen["after_extras"] == sorted(dcp_files + extras)
    assert seen["after_commit"] == sorted([COMMIT, *dcp_files, *extras])


def test_the_commit_before_extras_mutation_commits_right_after_the_dcp_files_and_the_writer_withdraws_it(
    tmp_path: Path, monkeypatch
) -> None:
    seen: dict[str, list[str]] = {}
    with pytest.raises(CheckpointCommitError) as caught:
        _phases_seen(tmp_path, monkeypatch, seen=seen, commit_before_extras=True)
    assert seen["after_dcp"] == [DCP_METADATA, COMMIT, SHARD]  # committed listing only the DCP files
    for extra in (rng_file(0), TRAIN_STATE):  # the writer's own check after the commit names what it left out
        assert f"{extra} was written but {COMMIT} does not list it" in str(caught.value)
    assert not (tmp_path / "ckpt" / step_dir_name(3) / COMMIT).exists()


def _stop_at_sleep(monkeypatch: pytest.MonkeyPatch) -> type[Exception]:
    class Stopped(Exception):
        pass

    def sleep(seconds: float) -> None:
        raise Stopped

    monkeypatch.setattr(drill_points.time, "sleep", sleep)
    return Stopped


def test_a_rank_asked_to_pause_at_a_phase_leaves_its_marker_and_stops(tmp_path: Path, monkeypatch) -> None:
    markers = tmp_path / "markers"
    points = DrillPoints(pause_in_save={"phase": "after_extras", "step": 4, "marker_dir": str(markers)})
    monkeypatch.setattr(drill_points, "active", lambda: points)
    stopped = _stop_at_sleep(monkeypatch)

    drill_points.at_save_phase("after_dcp", 4)  # another phase
    drill_points.at_save_phase("after_extras", 2)  # another save
    assert paused_ranks(str(markers)) == []
    with pytest.raises(stopped):
        drill_points.at_save_phase("after_extras", 4)
    (marker,) = paused_ranks(str(markers))
    assert isinstance(marker, PausedRank) and (marker.rank, marker.phase, marker.step) == (0, "after_extras", 4)


def test_while_dcp_is_written_rank_0_stops_once_its_files_are_written(tmp_path: Path, monkeypatch) -> None:
    markers = tmp_path / "markers"
    points = DrillPoints(pause_in_save={"phase": "writing_dcp", "step": 4, "marker_dir": str(markers)})
    monkeypatch.setattr(drill_points, "active", lambda: points)
    stopped = _stop_at_sleep(monkeypatch)

    drill_points.at_save_phase("writing_dcp", 4, shard_written=False)  # rank 0 writes its files first
    assert paused_ranks(str(markers)) == []
    with pytest.raises(stopped):
        drill_points.at_save_phase("writing_dcp", 4, shard_written=True)


# ---- wholeness ------------------------------------------------------------------------------------


def _rewrite_commit(folder: Path, drop: str) -> None:
    """COMMIT.json as if the save had not listed `drop`."""
    commit = json.loads((folder / COMMIT).read_text())
    del commit["files"][drop]
    (folder / COMMIT).write_text(json.dumps(commit))


@pytest.fixture
def saved(tmp_path: Path):  # noqa: ANN201
    """A manager and the folder of its committed checkpoint of step 2."""
    manager = saved_steps(tmp_path / "ckpt", 2)
    return manager, tmp_path / "ckpt" / step_dir_name(2)


def test_a_checkpoint_as_saved_is_whole(saved) -> None:
    manager, _ = saved
    assert manager.wholeness(2) == []


def test_a_missing_listed_file_is_named(saved) -> None:
    manager, folder = saved
    (folder / SHARD).unlink()
    assert manager.wholeness(2) == [f"{SHARD} is missing (COMMIT.json lists it)"]


def test_a_listed_file_of_the_wrong_size_is_named(saved) -> None:
    manager, folder = saved
    with open(folder / TRAIN_STATE, "ab") as handle:
        handle.write(b" ")
    (problem,) = manager.wholeness(2)
    assert problem.startswith(f"{TRAIN_STATE} has ") and "COMMIT.json says" in problem


def test_a_changed_listed_file_fails_its_checksum(saved) -> None:
    manager, folder = saved
    data = bytearray((folder / SHARD).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / SHARD).write_bytes(bytes(data))
    assert manager.wholeness(2) == [f"{SHARD} fails its sha256 check"]


def test_an_rng_file_the_commit_never_listed_is_missing_for_the_loader(saved) -> None:
    manager, folder = saved
    (folder / rng_file(0)).unlink()
    _rewrite_commit(folder, rng_file(0))
    assert manager.wholeness(2) == [f"{rng_file(0)} is missing (the loader needs it)"]


def test_a_needed_file_present_but_not_listed_is_unverified(saved) -> None:
    manager, folder = saved
    _rewrite_commit(folder, TRAIN_STATE)
    assert manager.wholeness(2) == [f"{TRAIN_STATE} is not listed in COMMIT.json, so nothing verifies it"]


def test_a_missing_dcp_metadata_is_named(saved) -> None:
    manager, folder = saved
    (folder / DCP_METADATA).unlink()
    _rewrite_commit(folder, DCP_METADATA)
    assert manager.wholeness(2) == [f"{DCP_METADATA} is missing (the loader needs it)"]


def test_a_shard_shorter_than_the_metadata_reads_is_named_even_when_the_commit_agrees(saved) -> None:
    manager, folder = saved
    short = (folder / SHARD).read_bytes()[:100]
    (folder / SHARD).write_bytes(short)
    commit = json.loads((folder / COMMIT).read_text())
    commit["files"][SHARD] = {"sha256": hashlib.sha256(short).hexdigest(), "bytes": len(short)}
    (folder / COMMIT).write_text(json.dumps(commit))
    (problem,) = manager.wholeness(2)
    assert problem.startswith(f"{SHARD} has 100 bytes, {DCP_METADATA} reads up to byte ")


def test_an_uncommitted_checkpoint_is_not_whole(saved) -> None:
    manager, folder = saved
    (folder / COMMIT).unlink()
    assert manager.wholeness(2) == [f"{COMMIT} is missing"]


def test_the_loader_skips_a_committed_checkpoint_that_does_not_list_what_it_needs(saved, tmp_path: Path) -> None:
    manager, folder = saved
    saved_steps(tmp_path / "ckpt", 4)  # step 4 is the newest, step 2 the sound one before it
    newest = tmp_path / "ckpt" / step_dir_name(4)
    (newest / rng_file(0)).unlink()
    _rewrite_commit(newest, rng_file(0))  # committed before its RNG file was written
    skipped: list = []
    step, _ = manager.latest_sound(skipped)
    assert step == 2
    assert skipped[0].reason == "corrupt" and rng_file(0) in skipped[0].detail and "loader needs" in skipped[0].detail


def test_a_held_rank_leaves_its_marker_and_goes_on_once_the_drill_releases_it(tmp_path: Path, monkeypatch) -> None:
    markers = tmp_path / "hold"
    points = DrillPoints(hold_after_step={"step": 6, "marker_dir": str(markers), "timeout_s": 60})
    monkeypatch.setattr(drill_points, "active", lambda: points)
    assert [drill_points.holds_after(s) for s in (5, 6, 7)] == [False, True, False]
    released = threading.Timer(0.3, lambda: (markers / drill_points.RELEASE_FILE).touch())
    released.start()
    drill_points.hold(6)
    assert (markers / drill_points.RELEASE_FILE).exists(), "the rank went on before the release"
    (marker,) = paused_ranks(str(markers), drill_points.HOLD_MARKER_PREFIX)
    assert (marker.rank, marker.phase, marker.step) == (0, "held", 6)
    assert paused_ranks(str(markers)) == [], "hold markers are not save-pause markers"


def test_a_held_rank_goes_on_by_itself_after_the_timeout(tmp_path: Path, monkeypatch) -> None:
    points = DrillPoints(hold_after_step={"step": 2, "marker_dir": str(tmp_path), "timeout_s": 0.2})
    monkeypatch.setattr(drill_points, "active", lambda: points)
    drill_points.hold(2)  # returns: a drill that died never leaves the job held for good
    assert not (tmp_path / drill_points.RELEASE_FILE).exists()
