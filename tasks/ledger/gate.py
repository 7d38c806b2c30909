"""The regression gate: an acceptance run's figures against the current baseline (the ledger's newest entry of the
same spec and cluster that is not rolled back), each with both values, the change and the spec's limit."""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Any

from tasks.ledger.config import RegressionConfig
from tasks.ledger.registry import GoldenFigures, Ledger, LedgerEntry, LedgerError
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


# figure, label, format, worse direction (+1: higher is worse), absolute change?, limit field, noise rule
_FIGURES: tuple[tuple[str, str, str, int, bool, str, str | None], ...] = (
    ("tokens_per_s", "tokens/s", "{:.0f}", -1, False, "tokens_per_s_drop_max", "wall"),
    ("tokens_per_cpu_s", "tokens per CPU-second", "{:.0f}", -1, False, "tokens_per_s_drop_max", "cpu"),
    ("step_time_s", "step time", "{:.4g} s", +1, False, "step_time_rise_max", "wall"),
    ("step_cpu_s", "step CPU time", "{:.4g} s", +1, False, "step_time_rise_max", "cpu"),
    ("comm_share", "communication share", "{:.3f}", +1, True, "comm_share_rise_max", None),
    ("checkpoint_save_s", "checkpoint save time", "{:.3g} s", +1, False, "checkpoint_save_rise_max", "save"),
    ("busbw_gbps", "bus bandwidth", "{:.3g} GB/s", -1, False, "busbw_drop_max", "busbw"),
    ("serving_p99_ms", "serving P99", "{:.1f} ms", +1, False, "", None),
)  # fmt: skip


def _too_noisy(rule: str | None, base: GoldenFigures, run: GoldenFigures, config: RegressionConfig) -> str | None:
    """Why a figure under `rule` is not judged (its measurement is within the noise), or None."""
    if rule == "wall" and base.tokens_per_cpu_s is not None and run.tokens_per_cpu_s is not None:
        return "judged by CPU time (a busy host stretches wall time): see tokens_per_cpu_s and step_cpu_s"
    if rule == "wall" and base.step_time_s is not None and base.step_time_s < config.noise_floor_s:
        return f"the baseline's median step ({base.step_time_s:.3g} s) is below noise_floor_s {config.noise_floor_s}"
    if rule in ("wall", "cpu"):
        field = "timed_s" if rule == "wall" else "cpu_timed_s"
        for side, figures in (("baseline", base), ("run", run)):
            interval = getattr(figures, field)
            if interval is not None and interval < config.throughput_min_interval_s:
                return (
                    f"the {side}'s steps were timed over {interval:.3g} s ({field}), below "
                    f"throughput_min_interval_s {config.throughput_min_interval_s}"
                )
    if rule == "save" and base.checkpoint_save_s is not None and base.checkpoint_save_s < config.save_noise_floor_s:
        return f"the baseline's median save is below save_noise_floor_s {config.save_noise_floor_s}"
    if rule == "busbw" and base.busbw_timed_s is not None and base.busbw_timed_s < config.noise_floor_s:
        return f"the probe's all-reduces were timed over {base.busbw_timed_s:.3g} s, below noise_floor_s"
    return None


@dataclass(frozen=True)
class Spread:
    """A figure's spread over the baseline's runs: max - min, relative to the median unless absolute."""

    value: float
    runs: int


def spread_of(name: str, absolute: bool, history: list[GoldenFigures]) -> Spread | None:
    """The spread of figure `name` over `history` (None: fewer than 2 runs measured it)."""
    values = [v for v in (getattr(h, name) for h in history) if v is not None]
    if len(values) < 2:
        return None
    width = max(values) - min(values)
    mid = median(values)
    return Spread(width if absolute else (width / mid if mid else math.inf), len(values))


def baseline_runs(ledger: Ledger, baseline: LedgerEntry, config: RegressionConfig) -> list[GoldenFigures]:
    """The figures of the baseline's last `config.noise_runs` runs: the ledger's entries of its spec, cluster and
    curve identity up to and including it (not rolled back), or just its own when the ledger lacks it."""
    lineage = [e for e in ledger.lineage(baseline.spec_name, baseline.cluster_key) if e.curve_key == baseline.curve_key]
    ids = [e.entry_id for e in lineage]
    if baseline.entry_id not in ids:
        return [baseline.figures]
    return [e.figures for e in lineage[: ids.index(baseline.entry_id) + 1]][-config.noise_runs :]


def compare(
    baseline: LedgerEntry,
    run: GoldenFigures,
    same_curve: bool,
    config: RegressionConfig,
    thresholds: AcceptanceThresholds,
    history: list[GoldenFigures] | None = None,
) -> list[FigureDiff]:
    """Each figure of `run` against the baseline entry's (the table `tdeploy baseline` shows, the gate judges).

    A timing figure is judged with the larger of its limit and noise_multiple x its spread over `history` (the
    baseline's runs, `baseline_runs`), and not at all where its measurement is within the noise (`_too_noisy`).
    """
    base = baseline.figures
    where = f"entry {baseline.entry_id}"
    diffs = []
    for name, label, fmt, worse, absolute, limit_field, rule in _FIGURES:
        b, r = getattr(base, name), getattr(run, name)
        limit = getattr(config, limit_field) if limit_field else None
        if b is None or r is None:
            diffs.append(FigureDiff(name, b, r, None, limit, "not measured"))
            continue
        change = (r - b) if absolute else (r / b - 1 if b else math.inf)
        bad = worse * change
        noisy = _too_noisy(rule, base, run, config)
        if limit is None or noisy:
            diffs.append(FigureDiff(name, b, r, change, limit, "not judged", f"{label}: not judged: {noisy}"
                                    if noisy else ""))  # fmt: skip
            continue
        spread = spread_of(name, absolute, history or [])
        allowed = max(limit, config.noise_multiple * spread.value) if spread is not None else limit
        if bad <= allowed:
            diffs.append(FigureDiff(name, b, r, change, allowed, "pass"))
            continue
        side = ("above" if change > 0 else "below") if not absolute else ("up" if change > 0 else "down")
        amount = f"{abs(change):.3f}" if absolute else f"{abs(change):.0%}"
        pct = (lambda v: f"{v:.3f}") if absolute else (lambda v: f"{v:.0%}")
        allowed_text = pct(allowed)
        if spread is not None:
            allowed_text += (
                f": the larger of the limit {pct(limit)} and {config.noise_multiple:g} x the baseline's spread "
                f"{pct(spread.value)} over its last {spread.runs} runs"
            )
        text = (
            f"{label} {fmt.format(r)} is {amount} {side} the baseline's {fmt.format(b)} ({where}; allowed "
            f"{allowed_text})"
            if not absolute
            else f"{label} {fmt.format(r)} is {amount} {side} from the baseline's {fmt.format(b)} ({where}; "
            f"allowed {allowed_text})"
        )
        diffs.append(FigureDiff(name, b, r, change, allowed, "FAIL", text))
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
        return DimensionResult(
            name="regression", passed=True, measured={}, threshold={}, evidence=evidence,
            message="off (acceptance.regression.enabled=false)",
        )  # fmt: skip
    if current is None:
        return DimensionResult(
            name="regression", passed=True, measured={}, threshold={}, evidence=evidence,
            message="no baseline; this run becomes it when accepted",
        )  # fmt: skip
    evidence |= {"baseline_entry": current.entry_id, "baseline_created_at": current.created_at}
    if run is None:
        why = "the distributed run wrote no result"
        return DimensionResult.not_measured("regression", why, "the stability dimension")
    try:
        history = baseline_runs(ledger, current, config)
    except LedgerError as err:  # the baseline itself was read: judge with the spec's limits alone, and say why
        history, evidence["baseline_runs_unread"] = [], str(err)
    diffs = compare(current, run, curve_key == current.curve_key, config, thresholds, history)
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
    return DimensionResult(
        name="regression", passed=not failures, measured=measured, threshold=threshold, evidence=evidence,
        message="; ".join(failures), look_first=look,
    )  # fmt: skip
