"""The Prefect task `submit_job` through a real (temporary) Prefect server."""

from __future__ import annotations

import asyncio

import pytest

from tasks.launch.environment import JobEnvironment
from tests.faults.job import injected

pytestmark = pytest.mark.integration


def test_submit_job_task_waits_for_the_job_and_a_failed_job_is_not_retried(prefect_harness, make_spec) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from tasks.launch.step import JobInputs, JobResult
    from tasks.launch.submit import JobFailed
    from tasks.launch.task import submit_job

    good = make_spec({"run": {"steps": 4}}, name="good")
    bad = make_spec({"run": {"steps": 4}}, name="bad")

    @flow
    def run_job(spec, environment: JobEnvironment | None = None) -> JobResult:  # noqa: ANN001
        return submit_job(JobInputs.of(spec, spec.training_config()), environment=environment)

    result = run_job(good)
    assert result.state == "succeeded" and result.job.startswith("local:")

    state = run_job(bad, injected(crash_at_step=2, crash_rank=0), return_state=True)
    assert state.is_failed()
    with pytest.raises(JobFailed, match=r"rank 0 \(local rank 0\) .* injected crash on rank 0 after step 2"):
        state.result()

    async def task_runs() -> list:
        async with get_client() as client:
            return await client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
            )

    (run,) = [r for r in asyncio.run(task_runs()) if r.name.startswith("submit_job")]
    assert run.run_count == 1 and run.state.is_failed()  # a failed training is never resubmitted
