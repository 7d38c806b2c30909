"""The fp8 loss-parity gate: a spec with precision.dtype fp8 is accepted only when its loss follows a bf16 run's.

Float8 training (training/float8.py) trades matmul precision for speed; what the literature and torchao report
is loss curves that match bf16 (torchao's rowwise recipe: Llama 3 pretraining on H100/H200 within a few tenths of
a percent of bf16's loss; Micikevicius et al. 2022, "FP8 Formats for Deep Learning": within run-to-run noise).
The gate runs the same job in bf16 (same seed, data order and LR schedule; stopped after the acceptance
reference's steps to stay short) and compares the two loss curves step by step: the mean loss over the last
quarter of the common steps (at least MIN_WINDOW_STEPS) must agree within MAX_REL_LOSS_GAP (or MAX_ABS_LOSS_GAP
nats, near zero loss), and no step may be
non-finite in the fp8 run where bf16's is finite. A short run's curve is noisy, but both runs see the same
batches, so what differs is the arithmetic. The verdict is merged into the correctness dimension.

Only a GPU of compute capability 8.9+ runs fp8 (the spec refuses it elsewhere), so the gate runs there only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tasks.acceptance.config import AcceptanceConfig
from tasks.acceptance.workspace import Job, RunOutcome, variant
from tasks.launch.cluster import ClusterConfig
from tasks.launch.environment import JobEnvironment
from tasks.progress import report
from training.config import TrainConfig
from validation.acceptance import DimensionResult

MAX_REL_LOSS_GAP = 0.02
"""|mean fp8 loss - mean bf16 loss| / mean bf16 loss over the compared window: 2%, a margin over the few tenths of
a percent reported at scale, for short acceptance runs on small models where a step's loss moves more."""
MAX_ABS_LOSS_GAP = 0.01
"""Nats: a gap this small passes whatever the ratio (a run that has nearly memorised its data, loss near 0, would
otherwise be judged on the ratio of two tiny numbers)."""
MIN_WINDOW_STEPS = 5
MIN_COMMON_STEPS = 4
"""Fewer common steps than this compare nothing: the gate is not measured rather than passed."""


@dataclass(frozen=True)
class Fp8Parity:
    """The gate's verdict: passed (None: nothing to compare), the figures, and what to say."""

    passed: bool | None
    measured: dict[str, Any]
    threshold: dict[str, Any]
    message: str
    look_first: str = ""


def judge_fp8_parity(
    fp8: dict[int, float], bf16: dict[int, float], max_rel_gap: float = MAX_REL_LOSS_GAP
) -> Fp8Parity:
    """Compare the fp8 run's loss per step with the bf16 run's (step -> loss, rank 0's records)."""
    threshold = {"max_rel_loss_gap": max_rel_gap, "max_abs_loss_gap": MAX_ABS_LOSS_GAP}
    common = sorted(set(fp8) & set(bf16))
    if len(common) < MIN_COMMON_STEPS:
        return Fp8Parity(None, {"common_steps": len(common)}, threshold,
                         f"fp8 parity not measured: {len(common)} step(s) in common with the bf16 run "
                         f"(< {MIN_COMMON_STEPS})", "the bf16 parity run's log")  # fmt: skip
    diverged = [s for s in common if not math.isfinite(fp8[s]) and math.isfinite(bf16[s])]
    if diverged:
        return Fp8Parity(False, {"common_steps": len(common), "first_nonfinite_step": diverged[0]}, threshold,
                         f"fp8 loss is not finite at step {diverged[0]} where bf16's is {bf16[diverged[0]]:.4g}: "
                         "float8 diverged; train in bf16 (precision.dtype: bf16)",
                         "the fp8 run's metrics around that step")  # fmt: skip
    window = common[-max(MIN_WINDOW_STEPS, len(common) // 4) :]
    fp8_mean = sum(fp8[s] for s in window) / len(window)
    bf16_mean = sum(bf16[s] for s in window) / len(window)
    gap = abs(fp8_mean - bf16_mean) / abs(bf16_mean) if bf16_mean else math.inf
    largest = max(abs(fp8[s] - bf16[s]) / abs(bf16[s]) if bf16[s] else math.inf for s in common)
    measured = {
        "common_steps": len(common),
        "window_steps": [window[0], window[-1]],
        "fp8_loss": round(fp8_mean, 6),
        "bf16_loss": round(bf16_mean, 6),
        "rel_loss_gap": round(gap, 6),
        "abs_loss_gap": round(abs(fp8_mean - bf16_mean), 6),
        "max_step_rel_gap": round(largest, 6),
    }
    where = f"steps {window[0]}-{window[-1]}"
    if gap <= max_rel_gap or abs(fp8_mean - bf16_mean) <= MAX_ABS_LOSS_GAP:
        return Fp8Parity(True, measured, threshold,
                         f"fp8 loss {fp8_mean:.4f} vs bf16 {bf16_mean:.4f} over {where}: {gap:.2%} apart "
                         f"(<= {max_rel_gap:.0%})")  # fmt: skip
    return Fp8Parity(False, measured, threshold,
                     f"fp8 loss {fp8_mean:.4f} vs bf16 {bf16_mean:.4f} over {where}: {gap:.2%} apart (> "
                     f"{max_rel_gap:.0%}, and more than {MAX_ABS_LOSS_GAP} nats): float8 does not match bf16 on "
                     "this model; train in bf16 (precision.dtype: bf16)",
                     "the two loss curves (fp8 run and fp8-parity-bf16)")  # fmt: skip


def with_fp8_parity(correctness: DimensionResult, parity: Fp8Parity) -> DimensionResult:
    """The correctness dimension with the fp8 gate merged in (measured/threshold["fp8_parity"], message, verdict)."""
    measured = correctness.measured if isinstance(correctness.measured, dict) else {"agreement": correctness.measured}
    threshold = (
        correctness.threshold if isinstance(correctness.threshold, dict) else {"agreement": correctness.threshold}
    )
    return replace(
        correctness,
        passed=False if parity.passed is False else correctness.passed,
        measured={**measured, "fp8_parity": parity.measured},
        threshold={**threshold, "fp8_parity": parity.threshold},
        message="; ".join(m for m in (correctness.message, parity.message) if m),
        look_first=correctness.look_first or (parity.look_first if parity.passed is False else ""),
    )


def bf16_twin(train: TrainConfig, root: Path, stop_after_steps: int) -> TrainConfig:
    """The fp8 run's bf16 twin: the same spec (steps, seed, layout, compile) in bf16, stopped after
    `stop_after_steps`, without checkpoints, under root/fp8-parity-bf16."""
    return variant(
        train,
        root,
        "fp8-parity-bf16",
        precision={"dtype": "bf16"},
        run={"stop_after_steps": min(stop_after_steps, train.run.steps)},
        checkpoint={"save_every_steps": None, "save_at_end": False},
    )


def losses(outcome: RunOutcome) -> dict[int, float]:
    """Rank 0's loss per step."""
    return {step: record.loss for step, record in outcome.metrics(0).items()}


def run_fp8_parity(
    cluster: ClusterConfig,
    dist_train: TrainConfig,
    acceptance: AcceptanceConfig,
    root: Path,
    fp8_run: RunOutcome,
    environment: JobEnvironment | None = None,
    image: str | None = None,
) -> Fp8Parity:
    """Run the bf16 twin of the fp8 acceptance run and judge the two loss curves."""
    twin = bf16_twin(dist_train, root, acceptance.reference_steps)
    phase = f"fp8 parity: bf16 run ({cluster.world_size} ranks)"
    report("acceptance", phase, 0, twin.run.stop_after_steps or twin.run.steps)
    bf16 = Job(cluster, twin, "accept-fp8-parity", environment, image, phase=phase).wait(
        acceptance.job_timeout_s, acceptance.thresholds.stall_timeout_s
    )
    if not bf16.ok:
        return Fp8Parity(None, {}, {"max_rel_loss_gap": MAX_REL_LOSS_GAP, "max_abs_loss_gap": MAX_ABS_LOSS_GAP},
                         f"fp8 parity not measured: the bf16 run did not finish ({bf16.status.state.value})",
                         f"the bf16 parity run's log under {bf16.output_dir}")  # fmt: skip
    return judge_fp8_parity(losses(fp8_run), losses(bf16))
