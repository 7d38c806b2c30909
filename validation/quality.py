"""The quality gate: is the run's training good, not only in agreement with its reference?

Agreement with the single-process reference says the distributed run computes the same mathematics; it
cannot say the training is good (a bug shared by both, a wrong schedule, bad data all agree with
themselves). The gate compares the run with a golden run of the same spec and seed (the baseline,
recorded by the first accepted run: tasks/acceptance/baselines.py):

- with a baseline, the final validation loss and the mean training loss over the last 10% of the steps
  may each be worse than the baseline's by at most `quality_max_rel_worse` (relative);
- before a baseline exists, an absolute sanity rule: the final validation loss must be at most
  (1 - `quality_min_loss_drop_fraction`) x the first step's training loss (about ln(vocab) at init);
- a run that started from a Hugging Face checkpoint (model.init_from) is fine-tuning a model that is already
  trained: a fixed drop from its first loss means nothing there. Its bar is the starting model's own validation
  loss, which the trainer measures before the first step (the eval record of step 0): the final validation loss
  must not be above it (rule `init_from` before a baseline exists; with a baseline, on top of the baseline rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from training.run_output import RunOutput
from validation.acceptance import AcceptanceThresholds, DimensionResult

TAIL_FRACTION = 0.1
"""Share of the last steps whose mean training loss is compared with the baseline's."""
LOOK_FIRST = (
    "what changed since the baseline run: the learning rate actually applied (metrics 'lr'), the optimizer "
    "and schedule, the data (tokens, tokenizer) and the model code"
)


@dataclass(frozen=True)
class LossCurve:
    """A run's training-loss curve (step -> loss), its final validation loss and its first step's loss."""

    losses: dict[int, float]
    val_loss: float
    first_loss: float
    start_val_loss: float | None = None
    """The starting model's validation loss (model.init_from: the trainer's step-0 evaluation); None otherwise."""


@dataclass
class QualityResult:
    """The gate's verdict (passed None: not measured), both runs' figures, the thresholds and why."""

    passed: bool | None
    measured: dict[str, Any]
    threshold: dict[str, Any]
    message: str = ""
    look_first: str = ""
    evidence: dict[str, Any] = field(default_factory=dict)


def loss_curve(output_dir: str | Path) -> LossCurve | None:
    """The curve of a finished run (rank 0's metrics, later attempts winning; result.json); None if unfinished."""
    run = RunOutput(output_dir)
    result = run.result()
    losses = {step: float(m.loss) for step, m in run.metrics().items()}
    if result is None or not losses:
        return None
    start = next((float(e["val_loss"]) for e in run.evals() if e.get("step") == 0), None)
    return LossCurve(losses, float(result.val_loss), losses[min(losses)], start)


def tail_steps(steps: list[int]) -> list[int]:
    """The last TAIL_FRACTION of `steps` (at least one), ascending."""
    ordered = sorted(steps)
    return ordered[-max(1, math.ceil(TAIL_FRACTION * len(ordered))) :]


def _mean(curve: dict[int, float], steps: list[int]) -> float:
    return sum(curve[s] for s in steps) / len(steps)


def _rel_worse(value: float, baseline: float) -> float:
    return (value - baseline) / abs(baseline) if baseline else math.inf


def check_quality(run: LossCurve, baseline: LossCurve | None, limits: AcceptanceThresholds) -> QualityResult:
    """The baseline rule when a baseline exists, else the sanity rule; both figures in `measured`."""
    drop = 1 - run.val_loss / run.first_loss if run.first_loss else math.nan
    if baseline is None and run.start_val_loss is not None:
        return _from_start(run, drop)
    if baseline is None:
        return _sanity(run, drop, limits.quality_min_loss_drop_fraction)
    rule: Literal["baseline"] = "baseline"
    max_rel = limits.quality_max_rel_worse
    steps = tail_steps(sorted(set(run.losses) & set(baseline.losses)))
    rel_val = _rel_worse(run.val_loss, baseline.val_loss)
    tail = _mean(run.losses, steps) if steps else math.nan
    base_tail = _mean(baseline.losses, steps) if steps else math.nan
    rel_tail = _rel_worse(tail, base_tail) if steps else math.nan
    measured = {
        "rule": rule,
        "val_loss": run.val_loss,
        "baseline_val_loss": baseline.val_loss,
        "rel_worse": rel_val,
        "tail_loss": tail,
        "baseline_tail_loss": base_tail,
        "tail_rel_worse": rel_tail,
        "tail_steps": [steps[0], steps[-1]] if steps else None,
        "first_loss": run.first_loss,
        "loss_drop_fraction": drop,
    }
    problems = []
    if run.start_val_loss is not None:
        measured["start_val_loss"] = run.start_val_loss
        if not run.val_loss <= run.start_val_loss:
            problems.append(_worse_than_start(run))
    if not steps:
        problems.append("the run and its baseline have no step in common")
    if not rel_val <= max_rel:
        problems.append(
            f"final validation loss {run.val_loss:.4f} is {rel_val:+.1%} against the baseline's "
            f"{baseline.val_loss:.4f} (allowed {max_rel:+.1%})"
        )
    if steps and not rel_tail <= max_rel:
        problems.append(
            f"mean training loss over steps {steps[0]}-{steps[-1]} {tail:.4f} is {rel_tail:+.1%} against the "
            f"baseline's {base_tail:.4f} (allowed {max_rel:+.1%})"
        )
    return QualityResult(
        not problems,
        measured,
        {"rule": rule, "max_rel_worse": max_rel},
        "; ".join(f"quality: {p}" for p in problems),
        LOOK_FIRST if problems else "",
    )


def _worse_than_start(run: LossCurve) -> str:
    return (
        f"final validation loss {run.val_loss:.4f} is above the starting model's {run.start_val_loss:.4f} "
        "(model.init_from, measured before the first step): the fine-tuning made the model worse on held-out data"
    )


def _from_start(run: LossCurve, drop: float) -> QualityResult:
    """Fine-tuning without a baseline: the final validation loss against the starting model's."""
    assert run.start_val_loss is not None
    passed = run.val_loss <= run.start_val_loss  # False for a NaN loss
    measured = {
        "rule": "init_from",
        "val_loss": run.val_loss,
        "start_val_loss": run.start_val_loss,
        "baseline_val_loss": None,
        "rel_worse": _rel_worse(run.val_loss, run.start_val_loss),
        "first_loss": run.first_loss,
        "loss_drop_fraction": drop,
    }
    message = "" if passed else f"quality (fine-tuning, no baseline yet): {_worse_than_start(run)}"
    look = "" if passed else "the learning rate (a fine-tune wants a smaller one than pre-training), then the data"
    return QualityResult(passed, measured, {"rule": "init_from", "max_val_loss": run.start_val_loss}, message, look)


def _sanity(run: LossCurve, drop: float, min_drop: float) -> QualityResult:
    limit = (1 - min_drop) * run.first_loss
    passed = run.val_loss <= limit  # False for a NaN loss
    measured = {
        "rule": "sanity",
        "val_loss": run.val_loss,
        "baseline_val_loss": None,
        "rel_worse": None,
        "first_loss": run.first_loss,
        "loss_drop_fraction": drop,
    }
    message = (
        ""
        if passed
        else f"quality (no baseline yet): final validation loss {run.val_loss:.4f} fell by {drop:.1%} from the "
        f"first step's training loss {run.first_loss:.4f}; it must fall by at least {min_drop:.0%} "
        f"(to <= {limit:.4f})"
    )
    look = "" if passed else "the learning rate and schedule (metrics 'lr'), then the data (tokens, tokenizer)"
    return QualityResult(passed, measured, {"rule": "sanity", "min_loss_drop_fraction": min_drop}, message, look)


def not_measured(reason: str) -> QualityResult:
    """The gate could not run (the run never finished): no verdict of its own."""
    return QualityResult(None, {"rule": None}, {}, f"quality not measured: {reason}")


def with_quality(correctness: DimensionResult, quality: QualityResult) -> DimensionResult:
    """The correctness dimension with the gate merged in (measured/threshold["quality"], message, verdict)."""
    measured = correctness.measured if isinstance(correctness.measured, dict) else {"agreement": correctness.measured}
    threshold = (
        correctness.threshold if isinstance(correctness.threshold, dict) else {"agreement": correctness.threshold}
    )
    message = "; ".join(m for m in (correctness.message, quality.message) if m)
    return replace(
        correctness,
        passed=correctness.passed and quality.passed is not False,
        measured={**measured, "quality": quality.measured},
        threshold={**threshold, "quality": quality.threshold},
        evidence={**correctness.evidence, **({"quality": quality.evidence} if quality.evidence else {})},
        message=message,
        look_first=correctness.look_first or quality.look_first,
    )
