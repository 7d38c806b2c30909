"""A start-up measurement of the job's process group: all-reduce bus bandwidth and each host pair's bandwidth.

The figures follow nccl-tests (NVIDIA/nccl-tests, doc/PERFORMANCE.md): for a message of S bytes taking t
seconds, the algorithm bandwidth is algbw = S / t, and an all-reduce's bus bandwidth on n ranks is
busbw = algbw * 2(n-1)/n, the share of the data each rank's link carries, so that it can be compared with the
hardware's link speed whatever n is. As nccl-tests reports, t is the mean time of one timed iteration after a
few warm-up iterations, taken as the maximum over the ranks.

Between hosts, one leader rank per host (its local rank 0) ping-pongs the largest message with each other
host's leader, one pair at a time (every rank steps through the pairs in the same order; the others wait at a
barrier): a pair's bandwidth is S / (round trip / 2), so a slow link or NIC shows up by host names.

Every rank calls `comm_probe` (it is collective); rank 0's record carries the figures.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

HOST_ENV_VAR = "TDEPLOY_COMM_PROBE_HOST"
"""Tests only: the host name this rank reports to the probe, `{node}` replaced by torchrun's GROUP_RANK (so that
agents on one machine can stand for several hosts)."""
WARMUP_ITERS = 2
TIMED_ITERS = 5
MB = 1 << 20


def bus_bandwidth_factor(world: int) -> float:
    """nccl-tests' all-reduce bus bandwidth factor 2(n-1)/n."""
    return 2 * (world - 1) / world


def algbw_gbps(nbytes: int, time_s: float) -> float:
    """Algorithm bandwidth S / t in GB/s (10^9 bytes per second, as nccl-tests prints)."""
    return nbytes / time_s / 1e9


def busbw_gbps(nbytes: int, time_s: float, world: int) -> float:
    """All-reduce bus bandwidth algbw * 2(n-1)/n in GB/s."""
    return algbw_gbps(nbytes, time_s) * bus_bandwidth_factor(world)


@dataclass
class SizeResult:
    """One message size's all-reduce figures."""

    bytes: int
    time_s: float
    algbw_gbps: float
    busbw_gbps: float


@dataclass
class PairResult:
    """One host pair's ping-pong bandwidth between the two hosts' leader ranks."""

    hosts: tuple[str, str]
    ranks: tuple[int, int]
    bytes: int
    bandwidth_gbps: float


@dataclass
class CommProbe:
    """The probe's figures: all-reduce per size, the largest size's busbw, each host pair, the slowest pair."""

    world_size: int
    backend: str
    sizes: list[SizeResult]
    busbw_gbps: float
    pairs: list[PairResult] = field(default_factory=list)
    slowest_pair: PairResult | None = None
    elapsed_s: float = 0.0
    timed_iters: int = TIMED_ITERS
    """All-reduces timed per size: a size's time_s x timed_iters is the interval its bandwidth was measured over."""

    def to_record(self) -> dict[str, Any]:
        """The JSON-able form written into ranks.json."""
        return asdict(self)


def host_leaders(hosts: list[str], local_ranks: list[int]) -> dict[str, int]:
    """Each host's leader: its rank with local rank 0 (the lowest rank on the host if none has it)."""
    leaders: dict[str, int] = {}
    for rank, (host, local) in enumerate(zip(hosts, local_ranks, strict=True)):
        if local == 0 and host not in leaders:
            leaders[host] = rank
    for rank, host in enumerate(hosts):
        leaders.setdefault(host, rank)
    return leaders


def host_pairs(leaders: dict[str, int]) -> list[tuple[str, str]]:
    """Every pair of hosts once, in the same order on every rank (by host name)."""
    return list(itertools.combinations(sorted(leaders), 2))


def slowest(pairs: list[PairResult]) -> PairResult | None:
    """The pair of the lowest bandwidth (None without pairs)."""
    return min(pairs, key=lambda p: p.bandwidth_gbps, default=None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _all_reduce_time(buf: torch.Tensor, device: torch.device, warmup: int, iters: int) -> float:
    """Mean seconds of one all-reduce of `buf`, the maximum over ranks."""
    for _ in range(warmup):
        dist.all_reduce(buf)
    _sync(device)
    started = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    _sync(device)
    mine = torch.tensor([(time.perf_counter() - started) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return float(mine.item())


def _ping_pong_time(buf: torch.Tensor, peer: int, first: bool, device: torch.device, iters: int) -> float:
    """Mean seconds of one round trip of `buf` between this rank and `peer` (`first` sends first)."""
    started = 0.0
    for i in range(iters + 1):  # the first round trip warms the connection up
        if i == 1:
            _sync(device)
            started = time.perf_counter()
        if first:
            dist.send(buf, peer)
            dist.recv(buf, peer)
        else:
            dist.recv(buf, peer)
            dist.send(buf, peer)
    _sync(device)
    return (time.perf_counter() - started) / iters


def probe_host(host: str) -> str:
    """The host name the probe groups this rank by: `host`, or the test override of HOST_ENV_VAR."""
    override = os.environ.get(HOST_ENV_VAR)
    return override.replace("{node}", os.environ.get("GROUP_RANK", "0")) if override else host


def comm_probe(
    sizes_mb: list[float],
    device: torch.device,
    host: str,
    local_rank: int,
    warmup: int = WARMUP_ITERS,
    iters: int = TIMED_ITERS,
) -> CommProbe:
    """All-reduce bandwidth per message size and ping-pong bandwidth per host pair on the default process group.

    Collective: every rank calls it with the same sizes.
    """
    started = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    sizes = []
    for mb in sizes_mb:
        buf = torch.zeros(max(1, int(mb * MB) // 4), dtype=torch.float32, device=device)
        nbytes = buf.numel() * buf.element_size()
        t = _all_reduce_time(buf, device, warmup, iters)
        sizes.append(SizeResult(nbytes, t, algbw_gbps(nbytes, t), busbw_gbps(nbytes, t, world)))
    placed: list[Any] = [None] * world
    dist.all_gather_object(placed, (probe_host(host), local_rank))
    hosts, local_ranks = [p[0] for p in placed], [p[1] for p in placed]
    leaders = host_leaders(hosts, local_ranks)
    order = host_pairs(leaders)
    largest = torch.zeros(max(1, int(max(sizes_mb) * MB) // 4), dtype=torch.float32, device=device)
    nbytes = largest.numel() * largest.element_size()
    round_trips = torch.zeros(len(order), dtype=torch.float64, device=device)
    for i, (a, b) in enumerate(order):
        if rank in (leaders[a], leaders[b]):
            peer = leaders[b] if rank == leaders[a] else leaders[a]
            t = _ping_pong_time(largest, peer, rank == leaders[a], device, iters)
            if rank == leaders[a]:
                round_trips[i] = t
        dist.barrier()
    if order:
        dist.all_reduce(round_trips)  # each pair's time is filled in by its first leader only
    pairs = [
        PairResult((a, b), (leaders[a], leaders[b]), nbytes, nbytes / (float(t) / 2) / 1e9)
        for (a, b), t in zip(order, round_trips.tolist(), strict=True)
    ]
    return CommProbe(
        world_size=world,
        backend=str(dist.get_backend()),
        sizes=sizes,
        busbw_gbps=max(sizes, key=lambda s: s.bytes).busbw_gbps,
        pairs=pairs,
        slowest_pair=slowest(pairs),
        elapsed_s=time.perf_counter() - started,
        timed_iters=iters,
    )


def probe_record(
    sizes_mb: list[float] | None, device: torch.device, host: str, local_rank: int
) -> dict[str, Any] | None:
    """The per-rank ranks.json entry: None when the probe is off; rank 0 the whole record, others its headline."""
    if sizes_mb is None:
        return None
    probe = comm_probe(sizes_mb, device, host, local_rank)
    if dist.get_rank() == 0:
        return probe.to_record()
    return {"busbw_gbps": probe.busbw_gbps, "elapsed_s": probe.elapsed_s}
