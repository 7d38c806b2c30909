"""The counter's conversion of one collective's buffers into the bytes a rank sends (the planner's convention)."""

from __future__ import annotations

import pytest
import torch

from tasks.capacity.traffic import DIMS, PLANNER_KEYS, ring_bytes
from training.config import ParallelConfig
from training.layout import MESH_GROUPS

MB = torch.empty(262144)  # 1 MiB of fp32


@pytest.mark.parametrize(
    ("op", "args", "n", "sent"),
    [
        ("allreduce_", ([MB],), 4, 2 * 3 / 4 * 2**20),
        ("all_reduce", (MB, "sum", "g"), 2, 2**20),
        ("_allgather_base_", (MB, MB[:65536]), 4, 3 / 4 * 2**20),
        ("all_gather_into_tensor", (MB[:65536], 4, "g"), 4, 3 / 4 * 2**20),
        ("_reduce_scatter_base_", (MB[:65536], MB), 4, 3 / 4 * 2**20),
        ("reduce_scatter_tensor", (MB, "sum", 4, "g"), 4, 3 / 4 * 2**20),
        ("send", ([MB], None, 1, 0), 2, 2**20),
        ("recv_", ([MB], None, 1, 0), 2, 0),
    ],
)
def test_each_collective_counts_what_one_rank_sends_under_the_ring_algorithm(
    op: str, args: tuple, n: int, sent: float
) -> None:
    assert ring_bytes(op, args, n, 0)[0] == pytest.approx(sent)


def test_an_uneven_all_to_all_counts_only_the_rows_that_leave_the_rank() -> None:
    rows = torch.empty(10, 8)  # 32 bytes a row
    assert ring_bytes("alltoall_base_", (rows, rows, None, [], [7, 3], False), 2, 0)[0] == 3 * 32
    assert ring_bytes("all_to_all_single", (rows, [5, 5], [7, 3], "g"), 2, 1)[0] == 7 * 32
    assert ring_bytes("alltoall_base_", (rows, rows, None, [], [], False), 2, 0)[0] == 5 * 32


def test_traffic_is_booked_to_every_mesh_sub_group_context_parallel_included_each_with_its_planners_key() -> None:
    assert DIMS == tuple(MESH_GROUPS) and "cp" in DIMS
    assert set(PLANNER_KEYS) == set(DIMS)
    assert set(PLANNER_KEYS.values()) <= set(ParallelConfig.model_fields)
