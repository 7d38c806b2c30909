"""The trainer's verdict on its own failure (training/failure.py): which errors are the workload's, failure.json's
writer and reader, the restarted worker's check, and the diagnosis naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.diagnose import diagnose_run
from training.checkpoint import CheckpointFormatError
from training.dataset import DatasetError
from training.hf_load import HFLoadError, InitCheckError
from training.failure import (
    FAILURE_FILE,
    FailureFileError,
    NonFiniteLoss,
    classify,
    failure_of_this_job,
    read_failure,
    write_failure,
)


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (NonFiniteLoss(5, float("nan")), "nan_loss"),
        (DatasetError("/data", "shard 2 sha256 mismatch", "prepare the dataset again"), "bad_data"),
        (InitCheckError("/models/llama", 0.53, 5.1e-3, "check the spec's model fields"), "bad_model"),
        (HFLoadError("model.init_from tensor", "lm_head.weight", "missing", "use the right folder"), "bad_model"),
        (TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"), "bug"),
        (KeyError("scheduler"), "bug"),
        (AssertionError("layout"), "bug"),
        (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer"), None),
        (OSError(28, "No space left on device"), None),
        (ConnectionResetError(104, "Connection reset by peer"), None),
        (MemoryError(), None),
        (CheckpointFormatError("/ck/step-4/COMMIT.json", "not JSON"), None),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v),
)
def test_only_errors_a_retry_cannot_fix_are_the_workloads(error: BaseException, cause: str | None) -> None:
    found = classify(error, step=3, rank=1)
    assert (found.cause if found else None) == cause
    if found is not None:
        assert found.failure_class == "workload" and found.rank == 1 and found.fix
        assert found.step == (5 if cause == "nan_loss" else 3)


def test_failure_json_round_trips_and_a_restarted_worker_of_the_same_job_finds_it(tmp_path: Path, monkeypatch) -> None:
    out = str(tmp_path / "out")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-1")
    failure = classify(NonFiniteLoss(7, float("inf")), step=7, rank=0)
    assert failure is not None and failure.run_id == "job-1"
    write_failure(out, failure)
    assert '"class": "workload"' in (tmp_path / "out" / FAILURE_FILE).read_text()
    assert read_failure(out) == failure
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert failure_of_this_job(out) == failure
    # The other nodes' workers are restarted as a membership change, which torchrun does not count: they stop too
    # (they trained on before, and waited in the process group's start-up for the ranks that had stopped).
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert failure_of_this_job(out) == failure
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-2")  # a later job in the same folder is not stopped by it
    assert failure_of_this_job(out) is None


def test_a_failure_json_that_is_not_the_trainers_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / FAILURE_FILE).write_text('{"class": "workload", "cause": "cosmic rays"}')
    with pytest.raises(FailureFileError, match="failure.json: not a workload failure record"):
        read_failure(str(tmp_path))


def test_the_diagnosis_names_the_workload_error_first_with_the_trainers_fix(tmp_path: Path) -> None:
    failure = classify(NonFiniteLoss(5, float("nan")), step=5, rank=0)
    write_failure(str(tmp_path), failure)
    first = diagnose_run(tmp_path).findings[0]
    assert first.cause == "workload error (nan_loss): not retried" and first.fix == failure.fix
    assert "at step 5" in first.evidence[0]
