"""The plan's in-memory checkpoint tier: what its copies need on a node and whether memory_every_steps=auto turns it
on for the spec's cluster and model."""

from __future__ import annotations

import pytest

from tasks.capacity.report import markdown_report
from tasks.capacity.units import GIB
from tests.unit.capacity.test_model_states import P_7_5B, _plan

# master-weights under FSDP on one node of 8: 2 bytes of 16-bit weights and 12 of optimizer state (fp32 master and
# two moments) per parameter, each rank holding an eighth; the node keeps own + peer copy x 2 steps of its 8 ranks.
PER_RANK = 14 * P_7_5B / 8
PER_NODE = 2 * 2 * 8 * PER_RANK


def test_the_plan_shows_the_tiers_bytes_per_node_and_that_the_trainer_decides_without_host_memory_gib() -> None:
    plan = _plan({"mixed_precision": "master-weights"}, parallel={"sharding": "fsdp"})
    tier = plan.to_json()["requested"]["memory_tier"]
    assert tier["per_rank_bytes"] == pytest.approx(PER_RANK)
    assert tier["per_node_bytes"] == pytest.approx(PER_NODE)
    assert tier["fits"] is None and tier["allowed_bytes"] is None
    assert "host memory a node has at start" in tier["summary"]
    assert tier["summary"] in markdown_report(plan)


@pytest.mark.parametrize(("host_gib", "fits"), [(2 * PER_NODE / GIB + 1, True), (2 * PER_NODE / GIB - 1, False)])
def test_the_tier_fits_half_of_the_nodes_host_memory_or_is_planned_off_with_the_fix(
    host_gib: float, fits: bool
) -> None:
    plan = _plan({"mixed_precision": "master-weights", "host_memory_gib": host_gib}, parallel={"sharding": "fsdp"})
    tier = plan.memory_tier()
    assert tier.fits is fits and tier.allowed_bytes == pytest.approx(host_gib * GIB / 2)
    if not fits:
        assert "OFF under memory_every_steps=auto" in tier.describe()
        assert "checkpoint.memory_budget_mib" in tier.describe()


def test_offloaded_states_leave_less_host_memory_for_the_tier() -> None:
    capacity = {"mixed_precision": "master-weights", "host_memory_gib": 2 * PER_NODE / GIB + 1}
    on_device = _plan(capacity, parallel={"sharding": "fsdp"}).memory_tier()
    offloaded = _plan(capacity | {"offload": "optimizer"}, parallel={"sharding": "fsdp"}).memory_tier()
    assert offloaded.per_rank_bytes == pytest.approx(on_device.per_rank_bytes)  # the same state, elsewhere
    assert on_device.fits and not offloaded.fits
