"""The run-output reader reads back everything the trainer's writer writes, and refuses a newer format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.run_output import (
    FORMAT_VERSION,
    RANKS,
    CheckpointEvent,
    Ranks,
    ResumeRecord,
    RunOutput,
    RunOutputFormatError,
    RunOutputWriter,
    RunResult,
    SkippedCheckpoint,
    StepRecord,
)
from training.storage import StorageConfig

RESULT = RunResult(
    steps=4, resumed_from_step=2, world_size=2, first_loss=5.5, final_loss=4.25, val_loss=4.5, val_ppl=90.0,
    skipped_steps=0, tokens_seen=1024, n_params=1000,
)  # fmt: skip
RESUME = ResumeRecord(
    storage_url="/ckpt", loaded_step=2, loaded_url="/ckpt/step-00000002", saved_world_size=2, world_size=1,
    resharded=True, skipped=[SkippedCheckpoint(3, "/ckpt/step-00000003", "corrupt", "model.distcp fails its sha256")],
)  # fmt: skip


def _written(folder: Path) -> None:
    out = RunOutputWriter(str(folder), StorageConfig())
    out.write_ranks(Ranks(2, [{"rank": 0, "host": "a", "resumed_from_step": 2}, {"rank": 1, "host": "a"}]))
    for rank in (0, 1):
        for attempt, step in enumerate((1, 2, 2, 3)):  # step 2 ran again after a resume
            out.append_metrics(StepRecord(rank=rank, step=step, loss=step + rank, lr=float(attempt)))  # lr: attempt
            out.append_samples(rank, {"step": step, "epoch": 0, "indices": [step, rank]})
    out.append_eval({"step": 3, "val_loss": 4.5, "val_ppl": 90.0})
    out.append_checkpoint(CheckpointEvent(2, 1000.0, 0.5))
    out.append_checkpoint(CheckpointEvent(3, error="connection refused"))
    out.write_resume(RESUME)
    out.write_result(RESULT)
    out.close()


def test_the_reader_returns_every_record_kind_the_writer_wrote(tmp_path: Path) -> None:
    _written(tmp_path)
    run = RunOutput(tmp_path)

    ranks = run.ranks()
    assert ranks is not None and ranks.format_version == FORMAT_VERSION and ranks.world_size == 2
    assert [r["rank"] for r in ranks.ranks] == [0, 1] and ranks.ranks[0]["resumed_from_step"] == 2
    assert json.loads((tmp_path / RANKS).read_text())["format_version"] == FORMAT_VERSION
    assert run.metric_ranks() == [0, 1] and run.sample_ranks() == [0, 1]
    assert [r.step for r in run.metric_records(1)] == [1, 2, 2, 3]
    assert sorted(run.metrics(1)) == [1, 2, 3] and run.metrics(1)[1].rank == 1
    assert run.metrics(0)[2].lr == 2  # the later attempt of a repeated step wins
    assert sorted(run.all_metrics()) == [0, 1] and run.last_step() == 3 and run.last_step(1) == 3
    assert run.samples(1)[3]["indices"] == [3, 1] and sorted(run.all_samples()[0]) == [1, 2, 3]
    assert run.evals() == [{"step": 3, "val_loss": 4.5, "val_ppl": 90.0}]
    assert run.checkpoints() == [CheckpointEvent(2, 1000.0, 0.5), CheckpointEvent(3, error="connection refused")]
    assert run.resume() == RESUME and run.resume().skipped_step(3).reason == "corrupt"
    assert run.result() == RESULT


def test_an_output_folder_not_yet_written_reads_as_empty(tmp_path: Path) -> None:
    run = RunOutput(tmp_path / "nothing-yet")
    assert run.ranks() is None and run.result() is None and run.resume() is None and run.ranks_written_at() is None
    assert run.metrics() == {} and run.last_step() == 0 and run.evals() == [] and run.checkpoints() == []


def test_a_newer_format_version_is_refused_with_what_to_do(tmp_path: Path) -> None:
    _written(tmp_path)
    data = json.loads((tmp_path / RANKS).read_text())
    (tmp_path / RANKS).write_text(json.dumps(data | {"format_version": FORMAT_VERSION + 1}))

    with pytest.raises(RunOutputFormatError, match=f"format_version={FORMAT_VERSION + 1}, this reader knows") as err:
        RunOutput(tmp_path).ranks()
    assert "upgrade" in err.value.fix and err.value.path == tmp_path / RANKS


@pytest.mark.parametrize("pid", [-1, 0, 1, "123", True, 4.5])
def test_a_rank_record_whose_pid_is_no_single_process_is_refused(tmp_path: Path, pid: object) -> None:
    _written(tmp_path)
    data = json.loads((tmp_path / RANKS).read_text())
    data["ranks"][0]["pid"] = pid  # drills and cancels would signal it: -1 is every process the user may signal
    (tmp_path / RANKS).write_text(json.dumps(data))

    with pytest.raises(RunOutputFormatError, match=r"pid=.* is not a process id \(an integer above 1\)") as err:
        RunOutput(tmp_path).ranks()
    assert err.value.path == tmp_path / RANKS
