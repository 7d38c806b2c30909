"""The trainer's verdict on its own failure: `<output>/failure.json` for a workload error, and its typed reader.

A failure is the workload's when running it again cannot help: the loss became NaN or infinite (and the fp16
loss scaler did not skip the step), the dataset is bad (`DatasetError`), or our own code raised a programming
error (a bug). The rank that meets it writes failure.json (class "workload", cause, step, error, fix) before it
exits; the launch step's restart policy (tasks/recovery/policy.py) reads it and stops instead of requeueing.
Lost ranks, signals, hangs, storage and network errors are the infrastructure's: nothing is written here for
them.

torchrun restarts its workers whatever their exit code. A restarted worker that finds a workload failure.json of
its own job (the same TORCHELASTIC_RUN_ID, whatever the restart count) exits at once with WORKLOAD_EXIT_CODE,
before it joins the process group or trains a step: the failure is not retried.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from training.storage import ControlFileError, StorageConfig, filesystem, join, read_control_file, write_bytes_atomic

log = logging.getLogger(__name__)

FAILURE_FILE = "failure.json"
WORKLOAD_EXIT_CODE = 76
"""The exit code of a restarted worker that refused to retry its job's workload failure (75 is a preemption)."""

WorkloadCause = Literal["nan_loss", "bad_data", "bad_model", "bug"]

# Programming errors: raised by code that is wrong, whatever the machine. RuntimeError is left out on purpose:
# torch raises it for lost peers and device faults as well as for shape mismatches.
_BUG_TYPES: tuple[type[BaseException], ...] = (
    TypeError, ValueError, AttributeError, KeyError, IndexError, NameError, AssertionError, ZeroDivisionError,
    NotImplementedError, ImportError, RecursionError,
)  # fmt: skip


def _infrastructure_types() -> tuple[type[BaseException], ...]:
    """Errors that say the infrastructure (the machine, its storage) failed although their type is one of the
    above. The checkpoint and dataset modules load torch: imported when a failure is classified (in the trainer,
    which has them loaded), so that readers of failure.json (the diagnosis, the launch step) stay light."""
    from training.checkpoint.errors import CheckpointFormatError  # noqa: PLC0415 - torch, for the trainer only

    return OSError, MemoryError, ControlFileError, CheckpointFormatError


class FailureFileError(ValueError):
    """failure.json is not what the trainer writes."""

    def __init__(self, path: str, problem: str) -> None:
        super().__init__(
            f"{path}: {problem}; only the trainer writes it: remove the file if it was edited by hand"
        )
        self.path, self.problem = path, problem


class NonFiniteLoss(RuntimeError):
    """The training loss of `step` is NaN or infinite and no loss scaler skipped it (run.stop_on_nonfinite_loss)."""

    def __init__(self, step: int, loss: float) -> None:
        super().__init__(f"step {step}: the training loss is {loss} (not skipped by a loss scaler)")
        self.step, self.loss = step, loss


class WorkloadFailure(BaseModel):
    """failure.json: a failure that running the job again cannot fix, and what to do instead."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    failure_class: Literal["workload"] = Field(default="workload", alias="class", description="Always workload.")
    cause: WorkloadCause = Field(description="nan_loss, bad_data, bad_model or bug.")
    step: int | None = Field(description="The step being trained when it failed (None: before the first step).")
    error: str = Field(description="The exception, one line: its type and message.")
    fix: str = Field(description="What to change before running the job again.")
    rank: int = Field(ge=0, description="The rank that wrote it.")
    host: str = Field(description="Where that rank ran.")
    run_id: str | None = Field(default=None, description="TORCHELASTIC_RUN_ID of the job (None outside torchrun).")
    time_unix_s: float = Field(description="When it was written.")

    def describe(self) -> str:
        """One line for people."""
        where = "before the first step" if self.step is None else f"at step {self.step}"
        return f"workload error ({self.cause}) {where} on rank {self.rank} ({self.host}): {self.error}; {self.fix}"


_FIXES: dict[WorkloadCause, str] = {
    "nan_loss": "lower optim.lr_peak or raise optim.warmup_steps, set optim.grad_clip_norm, or use bf16 instead of "
    "fp16; check the data of that step; then run again (it resumes from the last checkpoint before the NaN)",
    "bad_data": "fix the dataset as the error says (prepare it again, or point data.dataset_url at a good one), "
    "then run again",
    "bad_model": "the starting model (model.init_from) or the distillation teacher (distill) cannot be loaded, does "
    "not fit or does not compute what transformers does: fix the spec or the checkpoint as the error says, then run "
    "again",
    "bug": "a programming error in the job's code: fix it (the traceback is in the job's log), then run again",
}


def _dataset_error() -> tuple[type[BaseException], ...]:
    from training.dataset import DatasetError  # noqa: PLC0415 - numpy and torch, for the trainer only
    from training.image_dataset import ImageDatasetError  # noqa: PLC0415 - the same

    return DatasetError, ImageDatasetError


def _model_errors() -> tuple[type[BaseException], ...]:
    from training.distill import TeacherError  # noqa: PLC0415 - torch, for the trainer only
    from training.hf_load import HFLoadError, InitCheckError  # noqa: PLC0415 - torch, for the trainer only

    return HFLoadError, InitCheckError, TeacherError


def classify(err: BaseException, step: int | None, rank: int) -> WorkloadFailure | None:
    """The workload failure `err` is (None: the infrastructure's, or unknown: the restart policy recovers)."""
    cause: WorkloadCause
    fix = None
    if isinstance(err, NonFiniteLoss):
        cause, step = "nan_loss", err.step
    elif isinstance(err, _dataset_error()):
        cause, fix = "bad_data", f"{err.fix}; then run again"
    elif isinstance(err, _model_errors()):
        cause, fix = "bad_model", f"{err.fix}; then run again"
    elif isinstance(err, _BUG_TYPES) and not isinstance(err, _infrastructure_types()):
        cause = "bug"
    else:
        return None
    message = str(err).strip().splitlines()
    return WorkloadFailure(
        cause=cause, step=step, error=f"{type(err).__name__}: {message[0] if message else ''}"[:500],
        fix=fix or _FIXES[cause], rank=rank, host=socket.gethostname(), run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
        time_unix_s=time.time(),
    )  # fmt: skip


def write_failure(output_url: str, failure: WorkloadFailure, storage: StorageConfig | None = None) -> None:
    """Write failure.json into the run's output (atomically: readers see all of it or none)."""
    fs, root = filesystem(output_url, storage)
    write_bytes_atomic(fs, join(root, FAILURE_FILE), failure.model_dump_json(by_alias=True, indent=2).encode())


def read_failure(output_url: str, storage: StorageConfig | None = None) -> WorkloadFailure | None:
    """failure.json of the run (None when there is none); FailureFileError when it is not what the trainer writes."""
    fs, root = filesystem(output_url, storage)
    path = join(root, FAILURE_FILE)
    try:
        raw = read_control_file(fs, path)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise FailureFileError(path, f"cannot be read ({err})") from err
    try:
        return WorkloadFailure.model_validate(json.loads(raw))
    except (ValueError, ValidationError) as err:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise FailureFileError(path, f"not a workload failure record ({type(err).__name__})") from err


def failure_of_this_job(output_url: str, storage: StorageConfig | None = None) -> WorkloadFailure | None:
    """The workload failure an earlier attempt of this very job (same TORCHELASTIC_RUN_ID) recorded, else None:
    a restarted worker then stops instead of retrying it. A failure.json of another job is not this one's.

    The run id alone decides, not TORCHELASTIC_RESTART_COUNT: when one node's worker fails, torchrun restarts the
    workers of the other nodes as a membership change, which it does not count, so their restarted workers still
    read 0. Had they trained, they would wait in the process group's start-up for the ranks that stopped here."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    try:
        failure = read_failure(output_url, storage)
    except FailureFileError as err:
        log.warning("ignored: %s", err)
        return None
    return failure if failure is not None and failure.run_id == run_id else None


def failure_since(
    output_url: str, since_unix_s: float, storage: StorageConfig | None = None
) -> WorkloadFailure | None:
    """The workload failure recorded in the run's output at or after `since_unix_s` (a job's submission), else None."""
    failure = read_failure(output_url, storage)
    return failure if failure is not None and failure.time_unix_s >= since_unix_s else None
