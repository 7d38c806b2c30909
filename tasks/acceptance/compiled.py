"""run.compile under acceptance: whether the correctness dimension's agreement is also a compiled-vs-eager check.

run.compile defaults to on for GPU jobs with a data-parallel layout (training.config.resolve_compile). The
correctness dimension compares the distributed run (the correctness plan's fp32 run, or the main run) with the
independent reference (training/reference.py), which never compiles: on such a job its agreement is the loss of
the compiled blocks against eager PyTorch's, within the dimension's own tolerance. The note says so in the report.
"""

from __future__ import annotations

from dataclasses import replace

from tasks.acceptance.workspace import RunOutcome
from training.config import TrainConfig, resolve_compile
from training.run_output import RunOutputFormatError
from validation.acceptance import DimensionResult


def compiled_on(train: TrainConfig, run: RunOutcome) -> bool:
    """Whether `run`'s blocks were compiled: run.compile resolved for the device its ranks recorded."""
    try:
        ranks = run.run.ranks()
    except RunOutputFormatError:  # the stability dimension reports an unreadable run; this is only a note
        return False
    devices = {str(r.get("device", "")).split(":")[0] for r in ranks.ranks} if ranks is not None else set()
    device_type = "cuda" if "cuda" in devices else "cpu"
    return resolve_compile(train.run, train.parallel, device_type)


def with_compile_note(correctness: DimensionResult, compiled: bool) -> DimensionResult:
    """The correctness dimension saying that it compared compiled blocks with the eager reference (unchanged when
    the blocks ran eager)."""
    if not compiled:
        return correctness
    note = "compiled blocks (run.compile) vs the eager reference"
    return replace(
        correctness,
        evidence={**correctness.evidence, "compiled_vs_eager": True},
        message="; ".join(m for m in (correctness.message, note) if m),
    )
