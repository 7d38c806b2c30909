"""Prefect tasks `rollback_deployment` (the rollback flow's own step; `tdeploy rollback` calls the same function)
and `record_serving_figures` (the pipeline's serving step adds its P99 to the accepted entry)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from tasks.errors import retry_on_transient
from tasks.image.config import ImageConfig
from tasks.launch.cluster import ClusterConfig
from tasks.ledger.registry import Ledger, LedgerError, ServingRecord
from tasks.ledger.rollback import RollbackOutcome, roll_back
from tasks.paths import ledger_url
from tasks.serve.step import ServingResult
from training.config import TrainConfig

if TYPE_CHECKING:
    from tasks.acceptance.config import AcceptanceConfig


@task(name="rollback_deployment")
def rollback_deployment(
    name: str,
    cluster: ClusterConfig,
    train: TrainConfig,
    acceptance: AcceptanceConfig,
    image: ImageConfig,
    to: str | None = None,
    wait_until: Literal["submitted", "running", "finished"] = "running",
    timeout_s: float | None = None,
) -> RollbackOutcome:
    """Resubmit ledger entry `to`'s image (None: the entry before the current baseline), resumed from its
    accepted checkpoint; mark the entries after it rolled back; publish what was restored. Never retried: a
    second attempt would submit a second job."""
    logger = get_run_logger()
    ledger = Ledger(ledger_url(acceptance, train.run.output_url), train.storage)
    outcome = roll_back(ledger, name, cluster, train, image, to, wait_until, timeout_s,
                        lambda line: logger.info("%s", line), lambda line: logger.info("%s", line))  # fmt: skip
    plan = outcome.plan
    logger.info("%s: job %s %s", plan.describe(), outcome.job, outcome.state)
    create_markdown_artifact(
        key="rollback",
        markdown=f"# Rollback of `{name}`\n\n- restored entry: `{plan.target.entry_id}` (image "
        f"`{plan.image or '-'}`, code `{plan.target.code_version}`)\n- resumed from: `{outcome.checkpoint_dir}`\n"
        f"- job: `{outcome.job}` ({outcome.state}), output `{outcome.output_dir}`\n"
        f"- rolled back: {', '.join(f'`{e}`' for e in outcome.marked) or '-'}\n",
        description=f"rollback to {plan.target.entry_id}",
    )
    return outcome


@task(name="record_serving_figures", retries=2, retry_delay_seconds=5, retry_condition_fn=retry_on_transient)
def record_serving_figures(
    acceptance: AcceptanceConfig, train: TrainConfig, entry_id: str, served: ServingResult
) -> bool:
    """Add the serving check's P99 (and tokens/s) of the accepted checkpoint to ledger entry `entry_id`; False
    when that entry has its serving figures already (the first serving check of an entry is its golden one), or
    when they cannot be recorded (another step was served, an unreadable ledger: a warning; the serving check
    itself passed and stands)."""
    logger = get_run_logger()
    ledger = Ledger(ledger_url(acceptance, train.run.output_url), train.storage)
    record = ServingRecord(
        entry_id=entry_id,
        recorded_at=datetime.now(UTC).isoformat(timespec="seconds"),
        step=served.step,
        p99_e2e_ms=served.p99_e2e_ms,
        p99_ttft_ms=served.p99_ttft_ms,
        output_tokens_per_s=served.output_tokens_per_s,
    )
    try:
        recorded = ledger.record_serving(record)
    except LedgerError as err:
        logger.warning("serving figures not recorded in the ledger: %s", err)
        return False
    logger.info(
        "ledger entry %s: serving P99 %.1f ms %s", entry_id, served.p99_e2e_ms, "recorded" if recorded else "kept"
    )
    return recorded
