"""The acceptance table as the Prefect UI gets it: each cell a short text with units, no JSON cut at the edge."""

from __future__ import annotations

import asyncio
import json

import pytest

from tasks.acceptance.record import AcceptanceReport, DrillResult
from validation.acceptance import DimensionResult, PerformanceFigures

pytestmark = pytest.mark.integration


def test_the_published_acceptance_table_has_figures_with_units_and_thresholds_beside_them(prefect_harness) -> None:
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.acceptance.step import ARTIFACT
    from tasks.acceptance.task import publish

    performance = DimensionResult(
        name="performance",
        passed=False,
        figures=PerformanceFigures(scaling_efficiency=0.55, tokens_per_s=8123.4, comm_share=0.31),
        measured={"comm_share_per_rank": {str(r): 0.3 + r / 100 for r in range(8)}, "resources": {"cpu": {"a": 1}}},
        threshold={"scaling_efficiency_min": 0.7, "comm_share_max": 0.5},
        look_first="the interconnect",
    )
    report = AcceptanceReport(dimensions=[performance], drills=[DrillResult("rank_kill", True, recovery_s=4.25)])

    @flow
    def publish_only() -> None:
        publish(report, {})

    publish_only()

    async def artifacts() -> list:
        async with get_client() as client:
            return await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT])))

    table = asyncio.run(artifacts())[-1].data
    rows = json.loads(table) if isinstance(table, str) else table
    row, drill = rows
    assert row["measured"].startswith("scaling_efficiency=55%; tokens_per_s=8,123 tokens/s; comm_share=31%")
    assert "comm_share_per_rank=8 values, max 37%" in row["measured"] and "{" not in row["measured"]
    assert row["threshold"] == "scaling_efficiency ≥ 70%; comm_share ≤ 50%" and row["verdict"] == "FAIL"
    assert drill["measured"] == "recovery_s=4.25 s"
