"""The health gate's verdict over recorded probes: what excludes a node, and what a busy machine must not."""

from __future__ import annotations

import pytest

from training.health_gate import HealthGateConfig, NodeProbe, StorageProbe, judge

CONFIG = HealthGateConfig()


def probe(name: str, wall: float = 90.0, cpu: float = 90.0, **fields: object) -> NodeProbe:
    """A node's probe: `wall` and `cpu` are the matmul's GFLOP/s in wall and CPU time."""
    values = {"compute_noise": 0.05, "throttled_periods": 0, "storage": [StorageProbe(path="/scratch", ok=True)]}
    return NodeProbe(name=name, started_unix_s=0.0, probe_s=1.0, compute_gflops=wall, compute_cpu_gflops=cpu,
                     **(values | fields))  # fmt: skip


def excluded(probes: list[NodeProbe], config: HealthGateConfig = CONFIG, **kwargs: object) -> dict[str, list[str]]:
    names = kwargs.pop("expected", None) or [p.name for p in probes]
    record = judge(probes, config, names, started_unix_s=0.0, **kwargs)
    return {v.name: v.reasons for v in record.nodes if not v.healthy}


def test_peers_that_waited_for_a_cpu_on_a_busy_machine_are_all_kept() -> None:
    """Measured on this machine under load: wall rates 14 to 52 GFLOP/s, CPU-time rates 84 to 99, no throttling."""
    probes = [probe("a", 14.0, 92.0), probe("b", 52.0, 99.0), probe("c", 31.0, 95.0), probe("d", 18.0, 84.0)]
    assert excluded(probes) == {}


def test_a_node_whose_quota_grants_it_a_tenth_of_a_cpu_is_excluded() -> None:
    probes = [probe("a", 16.0), probe("b", 8.0, throttled_periods=11, cpu_limit=0.1), probe("c", 16.5)]
    found = excluded(probes)
    assert list(found) == ["b"]
    assert "quota grants it 0.10 CPU" in found["b"][0] and "throttled it 11 times" in found["b"][0]


def test_a_quota_above_half_a_cpu_is_not_a_slow_node() -> None:
    assert excluded([probe("a"), probe("b", 60.0, throttled_periods=3, cpu_limit=0.8), probe("c")]) == {}


def test_a_node_slower_on_the_wall_clock_with_unreadable_throttling_is_excluded_against_its_peers() -> None:
    probes = [probe("a", 40.0), probe("b", 8.0, throttled_periods=None), probe("c", 42.0)]
    assert "throttling unreadable" in excluded(probes)["b"][0]


def test_a_slow_processor_is_excluded_by_its_rate_per_cpu_second() -> None:
    probes = [probe("a", 30.0, 90.0), probe("b", 10.0, 20.0), probe("c", 31.0, 92.0)]
    assert "a slow processor" in excluded(probes)["b"][0]


@pytest.mark.parametrize("noise", [0.05, 0.6])
def test_the_band_widens_with_the_measured_noise(noise: float) -> None:
    probes = [probe("a", cpu=90.0, compute_noise=noise), probe("b", cpu=35.0, compute_noise=noise), probe("c")]
    assert ("b" in excluded(probes)) is (noise == 0.05)  # 90/35 = 2.6: outside 2.0, inside 1 + 4 * 0.6


def test_a_full_disk_and_a_node_that_never_reported_are_excluded_with_their_reasons() -> None:
    full = [StorageProbe(path="/scratch", ok=False, error="OSError: No space left on device")]
    found = excluded([probe("a"), probe("b", storage=full)], expected=["a", "b", "c"],
                     missing_reasons={"c": "its probe failed (exit 255): Connection refused"})  # fmt: skip
    assert found == {"b": ["storage /scratch: OSError: No space left on device"],
                     "c": ["its probe failed (exit 255): Connection refused"]}  # fmt: skip


def test_a_lone_node_is_judged_against_the_baseline_only() -> None:
    assert excluded([probe("a", cpu=20.0)]) == {}  # no peers, no baseline: no compute verdict
    assert "below the reference 90.00" in excluded([probe("a", cpu=20.0)], baseline_gflops=90.0)["a"][0]
    assert excluded([probe("a", cpu=80.0)], baseline_gflops=90.0) == {}


def test_bandwidth_is_judged_against_a_floor_and_only_where_asked_against_the_peers() -> None:
    ring = [probe("a", bandwidth_mb_s=4000.0, peer="b"), probe("b", bandwidth_mb_s=460.0, peer="c"),
            probe("c", bandwidth_mb_s=2300.0, peer="a")]  # fmt: skip
    assert excluded(ring) == {}  # a busy machine's loopback: 9x between healthy pairs
    assert list(excluded(ring, HealthGateConfig(max_bandwidth_slowdown=4.0))) == ["b"]
    assert list(excluded(ring, HealthGateConfig(min_bandwidth_mb_s=1000.0))) == ["b"]
