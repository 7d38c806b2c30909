"""The regression gate: an acceptance run's figures against the current baseline (the ledger's newest entry of the
same spec and cluster that is not rolled back), each with both values, the change and the spec's limit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tasks.acceptance.config import RegressionConfig
from tasks.ledger.registry import GoldenFigures, Ledger, LedgerEntry
from validation.acceptance import AcceptanceThresholds, DimensionResult
from validation.quality import check_quality


def regression_thresholds(config: RegressionConfig, thresholds: AcceptanceThresholds) -> AcceptanceThresholds:
    """The quality thresholds with the regression gate's loss tolerance."""
    if config.loss_max_rel_worse is None:
        return thresholds
    return thresholds.model_copy(update={"quality_max_rel_worse": config.loss_max_rel_worse})


@dataclass(frozen=True)
class FigureDiff:
    """One figure of a run against the baseline: both values, the change, the limit and the verdict."""

    figure: str
    baseline: float | None
    run: float | None
    change: float | None
    allowed: float | None
    verdict: str
    """pass, FAIL, not judged (no limit, or below the noise floor) or not measured (either side lacks it)."""
    message: str = ""


# figure, label, format, worse direction (+1: higher is worse), absolute change?, limit field, noise-floor figure
_FIGURES: tuple[tuple[str, str, str, int, bool, str, str | None], ...] = (
    ("tokens_per_s", "tokens/s", "{:.0f}", -1, False, "tokens_per_s_drop_max", "step_time_s"),
    ("step_time_s", "step time", "{:.4g} s", +1, False, "step_time_rise_max", "step_time_s"),
    ("comm_share", "communication share", "{:.3f}", +1, True, "comm_share_rise_max", None),
    ("checkpoint_save_s", "checkpoint save time", "{:.3g} s", +1, False, "checkpoint_save_rise_max",
     "checkpoint_save_s"),
    ("busbw_gbps", "bus bandwidth", "{:.3g} GB/s", -1, False, "busbw_drop_max", "busbw_timed_s"),
    ("serving_p99_ms", "serving P99", "{:.1f} ms", +1, False, "", None),
)  # fmt: skip


def compare(
    baseline: LedgerEntry,
    run: GoldenFigures,
    same_curve: bool,
    config: RegressionConfig,
    thresholds: AcceptanceThresholds,
) -> list[FigureDiff]:
    """Each figure of `run` against the baseline entry's (the table `tdeploy baseline` shows, the gate judges)."""
    base = baseline.figures
    where = f"entry {baseline.entry_id}"
    diffs = []
    for name, label, fmt, worse, absolute, limit_field, floor_figure in _FIGURES:
        b, r = getattr(base, name), getattr(run, name)
        limit = getattr(config, limit_field) if limit_field else None
        if b is None or r is None:
            diffs.append(FigureDiff(name, b, r, None, limit, "not measured"))
            continue
        change = (r - b) if absolute else (r / b - 1 if b else math.inf)
        bad = worse * change
        floor = getattr(base, floor_figure) if floor_figure else None
        least = config.save_noise_floor_s if floor_figure == "checkpoint_save_s" else config.noise_floor_s
        if limit is None or (floor is not None and floor < least):
            diffs.append(FigureDiff(name, b, r, change, limit, "not judged"))
            continue
        if bad <= limit:
            diffs.append(FigureDiff(name, b, r, change, limit, "pass"))
            continue
        side = ("above" if change > 0 else "below") if not absolute else ("up" if change > 0 else "down")
        amount = f"{abs(change):.3f}" if absolute else f"{abs(change):.0%}"
        allowed = f"{limit:.3f}" if absolute else f"{limit:.0%}"
        text = (
            f"{label} {fmt.format(r)} is {amount} {side} the baseline's {fmt.format(b)} ({where}; allowed {allowed})"
            if not absolute
            else f"{label} {fmt.format(r)} is {amount} {side} from the baseline's {fmt.format(b)} ({where}; "
            f"allowed {allowed})"
        )
        diffs.append(FigureDiff(name, b, r, change, limit, "FAIL", text))
    if not same_curve:
        why = "not judged: another curve identity (model, optimizer, batch, data, seed or steps changed)"
        diffs.append(FigureDiff("loss_curve", base.val_loss, run.val_loss, None, None, "not judged", why))
        return diffs
    limits = regression_thresholds(config, thresholds)
    quality = check_quality(run.curve(), base.curve(), limits)
    rel = quality.measured.get("rel_worse")
    message = f"loss curve at the same seed: {quality.message} ({where})" if quality.passed is False else ""
    verdict = {True: "pass", False: "FAIL", None: "not measured"}[quality.passed]
    diffs.append(FigureDiff("loss_curve", base.val_loss, run.val_loss, rel, limits.quality_max_rel_worse, verdict,
                            message))  # fmt: skip
    return diffs


def check_regression(
    ledger: Ledger,
    current: LedgerEntry | None,
    run: GoldenFigures | None,
    curve_key: str | None,
    config: RegressionConfig,
    thresholds: AcceptanceThresholds,
) -> DimensionResult:
    """The regression dimension: the run against the current baseline (see `compare`)."""
    evidence: dict[str, Any] = {"ledger": ledger.url, "curve_key": curve_key}
    if not config.enabled:
        return DimensionResult("regression", True, {}, {}, evidence, "off (acceptance.regression.enabled=false)")
    if current is None:
        return DimensionResult("regression", True, {}, {}, evidence, "no baseline; this run becomes it when accepted")
    evidence |= {"baseline_entry": current.entry_id, "baseline_created_at": current.created_at}
    if run is None:
        why = "the distributed run wrote no result"
        return DimensionResult.not_measured("regression", why, "the stability dimension")
    diffs = compare(current, run, curve_key == current.curve_key, config, thresholds)
    measured = {d.figure: {"baseline": d.baseline, "run": d.run, "change": d.change, "verdict": d.verdict}
                for d in diffs}  # fmt: skip
    threshold = {d.figure: d.allowed for d in diffs if d.allowed is not None}
    failures = [d.message for d in diffs if d.verdict == "FAIL"]
    look = (
        f"what changed since entry {current.entry_id} (image {current.image_ref or '-'}, code "
        f"{current.code_version}): `tdeploy history` lists the entries, `tdeploy rollback` restores it"
        if failures
        else ""
    )
    return DimensionResult("regression", not failures, measured, threshold, evidence, "; ".join(failures), look)
