"""Job records by reference: two clusters of one scheduler number their jobs independently, so a record never
overwrites another cluster's job of the same number, and a reference that names two jobs is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.base import JobHandle, find_job, record_job, registry_dir


@pytest.fixture(autouse=True)
def own_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TDEPLOY_HOME", str(tmp_path / "home"))


def _job(tmp_path: Path, cluster: str, job_id: str = "12") -> JobHandle:
    out = tmp_path / cluster / "output"
    out.mkdir(parents=True)
    handle = JobHandle(scheduler="slurm", job_id=job_id, name="train", output_dir=str(out), log_path=str(out / "log"))
    record_job(handle)
    return handle


def test_the_same_job_number_on_two_clusters_keeps_both_records_and_the_reference_is_refused_as_ambiguous(
    tmp_path: Path,
) -> None:
    first, second = _job(tmp_path, "cluster-a"), _job(tmp_path, "cluster-b")
    assert len(list(registry_dir().glob("slurm-12@*.json"))) == 2  # the second did not overwrite the first
    with pytest.raises(UserError, match="job 'slurm:12' is ambiguous: 2 jobs") as err:
        find_job("slurm:12")
    assert first.output_dir in str(err.value) and second.output_dir in str(err.value)
    assert "output folder instead of the reference" in err.value.fix
    assert find_job(first.output_dir).output_dir == first.output_dir  # the folder is unambiguous
    assert find_job(second.output_dir).output_dir == second.output_dir


def test_a_reference_recorded_once_is_found_and_recording_it_again_does_not_make_it_ambiguous(tmp_path: Path) -> None:
    handle = _job(tmp_path, "cluster-a", "7")
    record_job(handle)  # a launcher records a job again when its details change
    assert find_job("slurm:7").output_dir == handle.output_dir


def test_a_record_written_under_the_reference_alone_is_still_found(tmp_path: Path) -> None:
    out = tmp_path / "old"
    registry_dir().mkdir(parents=True)
    old = {"scheduler": "slurm", "job_id": "3", "name": "train", "output_dir": str(out), "log_path": str(out / "log")}
    (registry_dir() / "slurm-3.json").write_text(json.dumps(old))
    assert find_job("slurm:3").output_dir == str(out)


@pytest.mark.parametrize("ref", ["slurm:../../etc/passwd", "slurm:..", "slurm:a/b", "slurm:*"])
def test_a_reference_that_is_no_job_id_is_unknown_and_reads_nothing_outside_the_registry(ref: str) -> None:
    with pytest.raises(UserError, match="is unknown"):
        find_job(ref)
