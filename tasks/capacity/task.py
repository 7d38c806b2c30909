"""Prefect task `estimate_capacity`: thin wrapper over `plan_capacity`."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.capacity.config import CapacityConfig
from tasks.capacity.memory import GIB
from tasks.capacity.plan import make_plan, write_plan
from tasks.capacity.report import markdown_report, memory_rows
from tasks.cluster import ClusterConfig
from tasks.deployment import CapacityResult
from tasks.serve.config import ServeConfig
from training.config import ModelConfig, ParallelConfig, PrecisionConfig, RunConfig
from training.storage import StorageConfig


@task(name="estimate_capacity")
def estimate_capacity(
    name: str,
    capacity: CapacityConfig,
    cluster: ClusterConfig,
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: PrecisionConfig,
    run: RunConfig,
    serve: ServeConfig | None = None,
    ledger: str | None = None,
    storage: StorageConfig | None = None,
) -> CapacityResult:
    """Estimate memory, time and traffic (calibrated from the `ledger`'s accepted runs where it has some);
    write plan.json; stop (CapacityError) if the layout does not fit."""
    logger = get_run_logger()
    plan = make_plan(name, capacity, cluster, model, parallel, precision, run, serve, ledger, storage)
    url = write_plan(plan)
    ev = plan.requested
    logger.info(
        "%s: %s needs %.2f GiB of %.2f GiB usable; step %.4g s; %.3g days for %.3g tokens; plan %s",
        name, ev.layout.describe(), ev.memory.total / GIB, ev.usable_bytes / GIB, ev.step_seconds,
        plan.steps * ev.step_seconds / 86400, plan.train_tokens, url,
    )  # fmt: skip
    create_table_artifact(
        key="capacity-memory",
        table=[{"component": c, "GiB per GPU": v} for c, v in memory_rows(ev)],
        description=f"peak memory per GPU of {ev.layout.describe()}",
    )
    create_markdown_artifact(
        key="capacity-plan", markdown=markdown_report(plan), description=f"capacity plan of {name}"
    )
    if not plan.fits and capacity.enforce:
        raise plan.error()
    return CapacityResult.of(plan, url)
