"""The workload_error drill: a NaN loss (a workload error) is stopped, not retried, even with restarts left.

The loss of the step after the first checkpoint becomes NaN on every rank (training.drill_points.NanLossPoint). The
job runs through the launch step (tasks/launch/step.py `run`, the pipeline's own path) with torchrun restarts
(cluster.max_restarts >= 1) and a launch-step requeue left. It passes when the trainer recorded the failure as a
workload error (failure.json: class workload, cause nan_loss, at that step), the restart policy decided stop
(decisions.jsonl: one decision, no requeue), and no step was trained after the failure: no restarted worker and no
requeued job trained a step (the metrics end at that step, each step once). Everything is read from the records the
trainer and the launch step wrote for this purpose, never from logs.
"""

from __future__ import annotations

from typing import Any

from tasks.acceptance.drills import DrillContext
from tasks.acceptance.record import DrillResult
from tasks.launch.step import JobInputs, run
from tasks.launch.submit import JobFailed
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.record import read_decisions
from training.failure import read_failure
from training.run_output import RunOutput

NAME = "workload_error"


def steps_after_failure(output_dir: str, failed_step: int) -> int:
    """Steps trained after the failure: any step past it, and any step trained twice (a retry from a checkpoint),
    over every rank's metrics."""
    run_output = RunOutput(output_dir)
    retried = 0
    for rank in run_output.metric_ranks():
        steps = [r.step for r in run_output.metric_records(rank)]
        retried = max(retried, sum(s > failed_step for s in steps) + len(steps) - len(set(steps)))
    return retried


def drill_workload_error(ctx: DrillContext) -> DrillResult:
    """Make the loss NaN one step past the first checkpoint; judge that it is stopped and not retried."""
    name = "drill-workload-error"
    nan_step = ctx.acceptance.save_every_steps + 1
    cluster = ctx.cluster.model_copy(update={"max_restarts": max(1, ctx.cluster.max_restarts)})
    train = ctx.train(name)
    inputs = JobInputs(
        cluster=cluster, train=train, name=name, image=ctx.image, timeout_s=ctx.acceptance.job_timeout_s,
        recovery=RecoveryConfig(requeues=1), node_memory_url=str(ctx.root / name / "nodes"),
    )  # fmt: skip
    environment = ctx.environment.with_drill_points(nan_loss={"step": nan_step})
    try:
        run(inputs, environment=environment)
        stopped: JobFailed | None = None
    except JobFailed as err:
        stopped = err
    out = train.run.output_url
    failure = read_failure(out, train.storage)
    decisions = read_decisions(out, train.storage)
    retried = steps_after_failure(out, nan_step)
    decision = decisions[-1] if decisions else None
    evidence: dict[str, Any] = {
        "output_dir": out, "nan_step": nan_step, "max_restarts": cluster.max_restarts, "requeues": 1,
        "failure": None if failure is None else failure.model_dump(by_alias=True),
        "decisions": [d.model_dump(by_alias=True) for d in decisions], "steps_after_failure": retried,
    }  # fmt: skip
    problems = []
    if stopped is None:
        problems.append("the job finished: the NaN loss did not stop it")
    if failure is None or (failure.failure_class, failure.cause, failure.step) != ("workload", "nan_loss", nan_step):
        problems.append(f"failure.json is {failure.describe() if failure else 'missing'}, not a workload error "
                        f"(nan_loss) at step {nan_step}")  # fmt: skip
    if decision is None or (decision.failure_class, decision.action) != ("workload", "stop") or len(decisions) != 1:
        problems.append(f"the restart policy decided {[d.describe() for d in decisions] or 'nothing'}, not one stop "
                        "of a workload error")  # fmt: skip
    if retried:
        problems.append(f"{retried} step(s) trained after the failure: it was retried")
    detection = None
    if failure is not None and decision is not None:
        detection = max(0.0, decision.time_unix_s - failure.time_unix_s)  # from the NaN to the policy's stop
    return DrillResult(
        NAME, passed=not problems, detection_s=detection, recovery_s=None, steps_lost=retried,
        state_matched=None, message="; ".join(problems), evidence=evidence,
    )  # fmt: skip
