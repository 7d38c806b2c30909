"""The tp_shard_seed test fault: tensor-parallel rank 1 redraws its shards, every other rank keeps them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests.faults.bugs import TestFaults
from tests.faults.payload import reseed_tp_shards, tp_shard_seed_offset


@pytest.fixture
def one_rank_tp_mesh(tmp_path: Path) -> Iterator[object]:
    """A one-process gloo group (a file store, no port) and a 1-D "tp" mesh over it."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def _mlp(mesh: object) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    return parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})


@pytest.mark.timeout(60)
def test_tp_rank_one_redraws_its_shards_and_rank_zero_keeps_them(one_rank_tp_mesh: object) -> None:
    faults = TestFaults(tp_shard_seed=True, seed_offset=5)
    assert tp_shard_seed_offset(faults, 0) == 0 and tp_shard_seed_offset(faults, 1) == 5
    kept, redrawn = _mlp(one_rank_tp_mesh), _mlp(one_rank_tp_mesh)
    before = {n: p.full_tensor().clone() for n, p in kept.named_parameters()}
    assert reseed_tp_shards(kept, tp_coordinate=0, seed=7, faults=faults) == 0
    assert reseed_tp_shards(redrawn, tp_coordinate=1, seed=7, faults=faults) == 3  # both weights, the bias of 0
    for name, param in kept.named_parameters():
        assert torch.equal(param.full_tensor(), before[name]), name
    changed = {n for n, p in redrawn.named_parameters() if not torch.equal(p.full_tensor(), before[n])}
    assert changed == {"0.weight", "0.bias", "1.weight"}  # the row-wise bias is replicated, not a shard
    spread = redrawn.get_parameter("0.weight").to_local().std() / before["0.weight"].std()
    assert 0.5 < spread < 2  # a different draw of the same init, not a blow-up


def test_without_the_fault_no_rank_is_offset() -> None:
    assert tp_shard_seed_offset(TestFaults(), 1) == 0
