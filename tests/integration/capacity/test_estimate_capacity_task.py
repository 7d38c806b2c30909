"""The Prefect task `estimate_capacity` on a temporary Prefect backend: plan.json, artifacts, and a hard stop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tasks.capacity.record import read_plan
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge

pytestmark = pytest.mark.integration


def _spec(tmp_path: Path, overrides: dict | None = None):  # noqa: ANN202 - DeploymentSpec
    paths = {
        "data": {"dataset_url": str(tmp_path / "d")},
        "checkpoint": {"url": str(tmp_path / "c")},
        "run": {"output_url": str(tmp_path / "o")},
        "capacity": {"output_url": str(tmp_path / "plan")},
    }
    return parse_spec(deep_merge(deep_merge(TINY_SPEC, paths), overrides or {}))


def test_estimate_capacity_writes_the_plan_and_publishes_artifacts(prefect_harness, tmp_path: Path) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.capacity.step import CapacityInputs, CapacityResult
    from tasks.capacity.task import estimate_capacity

    spec = _spec(tmp_path)

    @flow
    def plan_only() -> CapacityResult:
        return estimate_capacity(CapacityInputs.of(spec))

    result = plan_only()
    assert result.fits and result.plan_url.endswith("plan.json")
    assert read_plan(result.plan_url).requested.peak_bytes > 0

    async def artifacts() -> list:
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["capacity-plan", "capacity-memory"]))
            )

    found = asyncio.run(artifacts())
    assert {a.key for a in found} == {"capacity-plan", "capacity-memory"}
    plan_md = next(a for a in found if a.key == "capacity-plan").data
    assert "# Capacity plan: tiny" in plan_md and "| total |" in plan_md


def test_estimate_capacity_stops_the_flow_when_the_layout_does_not_fit(prefect_harness, tmp_path: Path) -> None:
    from prefect import flow

    from tasks.capacity.plan import CapacityError
    from tasks.capacity.step import CapacityInputs, CapacityResult
    from tasks.capacity.task import estimate_capacity

    spec = _spec(tmp_path, {"capacity": {"accelerators": {"cpu": {"memory_gib": 0.0001}}}})

    @flow
    def plan_only() -> CapacityResult:
        return estimate_capacity(CapacityInputs.of(spec))

    with pytest.raises(CapacityError, match=r"does not fit: needs .* GiB > 0\.00 GiB usable"):
        plan_only()
    assert not read_plan(str(tmp_path / "plan" / "plan.json")).fits
