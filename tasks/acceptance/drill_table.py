"""Every drill by name and the loop that runs the chosen ones: the checkpoint-restore drills
(tasks/acceptance/drills.py) and the recovery ladder's (tasks/acceptance/ladder/), each held to drills.rto_max_s."""

from __future__ import annotations

from collections.abc import Callable

from tasks.acceptance import drills
from tasks.acceptance.config import DRILLS
from tasks.acceptance.drills import DrillContext, stopped_drill
from tasks.acceptance.ladder import bad_node_recurrence, hang, memory_restore, replica_loss, spare_takeover
from tasks.acceptance.ladder import workload_error
from tasks.acceptance.record import DrillResult
from tasks.progress import report

# Looked up on the modules at each call, so that a test can replace one drill.
TABLE: dict[str, Callable[[DrillContext], DrillResult]] = {
    "rank_kill": lambda c: drills.drill_rank_kill(c)[0],
    "kill_during_save": lambda c: drills.drill_kill_during_save(c),
    "corrupt_checkpoint": lambda c: drills.drill_corrupt_checkpoint(c),
    "reshard": lambda c: drills.drill_reshard(c),
    "storage_outage": lambda c: drills.drill_storage_outage(c),
    "node_loss": lambda c: drills.drill_node_loss(c),
    "preemption": lambda c: drills.drill_preemption(c),
    "replica_loss": lambda c: replica_loss.drill_replica_loss(c),
    "spare_takeover": lambda c: spare_takeover.drill_spare_takeover(c),
    "memory_restore": lambda c: memory_restore.drill_memory_restore(c),
    "hang": lambda c: hang.drill_hang(c),
    "workload_error": lambda c: workload_error.drill_workload_error(c),
    "bad_node_recurrence": lambda c: bad_node_recurrence.drill_bad_node_recurrence(c),
}
assert set(TABLE) == set(DRILLS), "every drill name has its function"


def held_to_rto(result: DrillResult, rto_max_s: float | None) -> DrillResult:
    """`result`, failed when it passed but recovered slower than `rto_max_s` (drills.rto_max_s)."""
    if result.passed and rto_max_s is not None and result.recovery_s is not None and result.recovery_s > rto_max_s:
        result.passed = False
        result.message = (
            f"recovery took {result.recovery_s:.1f} s > drills.rto_max_s={rto_max_s:g} s; the rung recovered, "
            "too slowly: see its detection_s and the job log, or raise drills.rto_max_s where this cluster is slower"
        )
    return result


def run_drills(ctx: DrillContext, only: list[str] | None = None,
               on_result: Callable[[DrillResult], None] | None = None) -> list[DrillResult]:  # fmt: skip
    """Run the chosen drills (all by default) and return their results."""
    chosen = only if only is not None else (ctx.drills.only if ctx.drills.only is not None else list(DRILLS))
    names = [name for name in DRILLS if name in chosen]
    results = []
    for k, name in enumerate(names):
        report(ctx.progress_step, f"drill {name}", k, len(names))
        try:
            result = TABLE[name](ctx)
        except Exception as err:  # noqa: BLE001 - a drill's failure is that drill's finding; the others still run
            result = stopped_drill(name, err)
        results.append(held_to_rto(result, ctx.drills.rto_max_s))
        if on_result:
            on_result(result)
    if names:
        report(ctx.progress_step, "drills done", len(names), len(names))
    return results
