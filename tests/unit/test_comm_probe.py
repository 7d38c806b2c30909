"""The start-up communication probe: nccl-tests' bus bandwidth, host pairs, the config switch, the judgement."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from pydantic import ValidationError

from training.comm_probe import (
    HOST_ENV_VAR,
    algbw_gbps,
    bus_bandwidth_factor,
    busbw_gbps,
    comm_probe,
    host_leaders,
    host_pairs,
)
from training.config import RunConfig
from training.run_output import Ranks, RunOutputWriter
from training.storage import StorageConfig
from validation.acceptance import AcceptanceThresholds, check_connectivity


@pytest.mark.parametrize(("world", "factor"), [(2, 1.0), (4, 1.5), (8, 1.75)])
def test_bus_bandwidth_is_algbw_times_two_n_minus_one_over_n_as_nccl_tests_defines_it(
    world: int, factor: float
) -> None:
    nbytes, time_s = 32 << 20, 0.01
    assert bus_bandwidth_factor(world) == pytest.approx(factor)
    assert algbw_gbps(nbytes, time_s) == pytest.approx(nbytes / time_s / 1e9)
    assert busbw_gbps(nbytes, time_s, world) == pytest.approx(nbytes / time_s / 1e9 * 2 * (world - 1) / world)


def test_each_host_is_led_by_its_local_rank_zero_and_pairs_come_in_one_order() -> None:
    hosts = ["b", "b", "a", "a", "c", "c"]
    leaders = host_leaders(hosts, [1, 0, 0, 1, 0, 1])
    assert leaders == {"b": 1, "a": 2, "c": 4}
    assert host_pairs(leaders) == [("a", "b"), ("a", "c"), ("b", "c")]
    assert host_pairs(host_leaders(["x", "x"], [0, 1])) == []


def test_comm_probe_mb_is_off_by_default_and_refuses_empty_non_positive_or_huge_sizes(tmp_path: Path) -> None:
    base: dict[str, Any] = {"steps": 1, "output_url": str(tmp_path)}
    assert RunConfig(**base).comm_probe_mb is None
    assert RunConfig(**base, comm_probe_mb=[1, 8, 32]).comm_probe_mb == [1.0, 8.0, 32.0]
    for bad in ([], [0], [-1.0], [4096], [1.0] * 9):
        with pytest.raises(ValidationError, match="comm_probe_mb"):
            RunConfig(**base, comm_probe_mb=bad)


def _probe_worker(rank: int, world: int, port: int, queue: Any) -> None:
    os.environ[HOST_ENV_VAR] = f"host{rank // 2}"  # ranks 0,1 on host0 and 2,3 on host1
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        probe = comm_probe([0.0625, 0.25], torch.device("cpu"), "same-machine", rank % 2, warmup=1, iters=2)
        queue.put((rank, probe.to_record()))
    finally:
        dist.destroy_process_group()


def test_comm_probe_measures_each_size_and_the_pair_between_two_hosts_on_every_rank() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.start_processes(_probe_worker, args=(4, port, queue), nprocs=4, start_method="spawn")
    records = dict(queue.get(timeout=30) for _ in range(4))
    probe = records[0]
    assert probe["world_size"] == 4 and probe["backend"] == "gloo"
    assert [s["bytes"] for s in probe["sizes"]] == [1 << 16, 1 << 18]
    for s in probe["sizes"]:
        assert s["time_s"] > 0 and s["busbw_gbps"] == pytest.approx(s["algbw_gbps"] * 1.5)
    assert probe["busbw_gbps"] == probe["sizes"][-1]["busbw_gbps"] and probe["timed_iters"] == 2
    (pair,) = probe["pairs"]
    assert pair["hosts"] == ("host0", "host1") and pair["ranks"] == (0, 2) and pair["bandwidth_gbps"] > 0
    assert probe["slowest_pair"] == pair
    assert all(r["pairs"] == probe["pairs"] for r in records.values())  # the pair's figure reaches every rank


def _probe(pairs: dict[tuple[str, str], float], busbw: float = 2.0) -> dict[str, Any]:
    sizes = [{"bytes": 1 << 20, "time_s": 0.001, "algbw_gbps": busbw, "busbw_gbps": busbw}]
    rows = [{"hosts": list(h), "ranks": [0, 1], "bytes": 1 << 20, "bandwidth_gbps": bw} for h, bw in pairs.items()]
    slowest = min(rows, key=lambda p: p["bandwidth_gbps"], default=None)
    return {"world_size": 4, "backend": "gloo", "sizes": sizes, "busbw_gbps": busbw, "pairs": rows,
            "slowest_pair": slowest, "elapsed_s": 0.1, "timed_iters": 5}  # fmt: skip


def _write_ranks(out: Path, probe: dict[str, Any] | None, hosts: int = 4) -> Path:
    ranks = []
    for rank in range(hosts):
        ranks.append({"rank": rank, "local_rank": 0, "host": f"h{rank}", "backend": "gloo",
                      "collective": {"all_reduce_sum": 1.0, "all_reduce_expected": 1.0, "broadcast_ok": True},
                      "mesh": None, "comm_probe": probe if rank == 0 else {"busbw_gbps": 2.0}})  # fmt: skip
    RunOutputWriter(str(out), StorageConfig()).write_ranks(Ranks(hosts, ranks))
    return out


PAIRS = {("h0", "h1"): 10.0, ("h0", "h2"): 10.0, ("h0", "h3"): 9.0, ("h1", "h2"): 10.0, ("h1", "h3"): 2.5,
         ("h2", "h3"): 11.0}  # fmt: skip


def test_connectivity_reports_bus_bandwidth_and_host_pairs_when_thresholds_are_unset(tmp_path: Path) -> None:
    result = check_connectivity(_write_ranks(tmp_path, _probe(PAIRS, busbw=0.01)), 4, AcceptanceThresholds())
    assert result.passed, result.message
    measured = result.measured["comm_probe"]
    assert measured["busbw_gbps"] == 0.01 and measured["pairs"]["h1<->h3"] == 2.5
    assert measured["busbw_timed_s"] == pytest.approx(0.001 * 5)  # the largest size's time x the timed all-reduces
    assert measured["slowest_pair"] == ["h1", "h3"]
    assert measured["slowest_pair_ratio_to_median"] == pytest.approx(2.5 / 10.0)


def test_connectivity_passes_with_bandwidth_above_both_thresholds(tmp_path: Path) -> None:
    limits = AcceptanceThresholds(bus_bandwidth_gbps_min=1.0, host_pair_bandwidth_ratio_min=0.2)
    result = check_connectivity(_write_ranks(tmp_path, _probe(PAIRS)), 4, limits)
    assert result.passed, result.message
    assert result.threshold["bus_bandwidth_gbps_min"] == 1.0


def test_connectivity_fails_below_bus_bandwidth_min_naming_value_threshold_and_slowest_pair(tmp_path: Path) -> None:
    limits = AcceptanceThresholds(bus_bandwidth_gbps_min=5.0)
    result = check_connectivity(_write_ranks(tmp_path, _probe(PAIRS, busbw=0.8)), 4, limits)
    assert result.passed is False
    assert "all-reduce bus bandwidth 0.8 GB/s" in result.message and "bus_bandwidth_gbps_min=5" in result.message
    assert "slowest host pair h1<->h3 at 2.5 GB/s" in result.message
    assert "interconnect" in result.look_first


def test_connectivity_fails_a_host_pair_far_below_the_median_pair(tmp_path: Path) -> None:
    limits = AcceptanceThresholds(host_pair_bandwidth_ratio_min=0.5)
    result = check_connectivity(_write_ranks(tmp_path, _probe(PAIRS)), 4, limits)
    assert result.passed is False
    assert "slowest host pair h1<->h3 at 2.5 GB/s is 0.25 x the median pair" in result.message
    assert "host_pair_bandwidth_ratio_min=0.5" in result.message


def test_connectivity_with_a_bandwidth_threshold_fails_when_the_probe_did_not_run(tmp_path: Path) -> None:
    limits = AcceptanceThresholds(bus_bandwidth_gbps_min=1.0)
    result = check_connectivity(_write_ranks(tmp_path, None), 4, limits)
    assert result.passed is False and "set run.comm_probe_mb" in result.message
    assert check_connectivity(tmp_path, 4).passed  # no threshold, no probe: nothing to judge
