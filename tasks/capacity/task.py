"""Prefect task `estimate_capacity`: the capacity step's `run`, publishing the plan."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.capacity.memory import GIB
from tasks.capacity.plan import CapacityPlan
from tasks.capacity.report import markdown_report, memory_rows
from tasks.capacity.step import ARTIFACT, MEMORY_ARTIFACT, CapacityInputs, CapacityResult, run


def publish(plan: CapacityPlan, url: str) -> None:
    """Log the requested layout's figures; publish its memory table and the plan's report."""
    ev = plan.requested
    get_run_logger().info(
        "%s: %s needs %.2f GiB of %.2f GiB usable; step %.4g s; %.3g days for %.3g tokens; plan %s",
        plan.name, ev.layout.describe(), ev.memory.total / GIB, ev.usable_bytes / GIB, ev.step_seconds,
        plan.steps * ev.step_seconds / 86400, plan.train_tokens, url,
    )  # fmt: skip
    create_table_artifact(
        key=MEMORY_ARTIFACT,
        table=[{"component": c, "GiB per GPU": v} for c, v in memory_rows(ev)],
        description=f"peak memory per GPU of {ev.layout.describe()}",
    )
    create_markdown_artifact(key=ARTIFACT, markdown=markdown_report(plan), description=f"capacity plan of {plan.name}")


@task(name="estimate_capacity")
def estimate_capacity(inputs: CapacityInputs) -> CapacityResult:
    """Estimate memory, time and traffic (calibrated from the ledger's accepted runs where it has some); write
    plan.json; stop (CapacityError) if the layout does not fit."""
    return run(inputs, publish)
