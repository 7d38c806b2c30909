"""The communication probe in a real 2-agent x 2-process local job: figures in ranks.json, judged by connectivity."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.launch.local import run_local
from training.comm_probe import HOST_ENV_VAR
from training.run_output import RunOutput
from validation.acceptance import AcceptanceThresholds, check_connectivity

pytestmark = pytest.mark.integration


def test_a_two_node_job_records_bus_bandwidth_and_its_host_pair_and_connectivity_judges_them(
    make_spec, monkeypatch
) -> None:
    # Both agents run on this machine: the test-only override (inherited by the job) names each after its node rank.
    monkeypatch.setenv(HOST_ENV_VAR, "node{node}")
    cluster = {"nodes": 2, "procs_per_node": 2}
    spec = make_spec({"cluster": cluster, "run": {"steps": 2, "comm_probe_mb": [0.25, 1]}})
    job = run_local(spec.cluster, spec.training_config())
    ranks = RunOutput(job.output_dir).ranks()
    assert ranks is not None and ranks.world_size == 4
    by_rank = {r["rank"]: r["comm_probe"] for r in ranks.ranks}
    probe = by_rank[0]
    assert probe["world_size"] == 4 and probe["backend"] == "gloo"
    assert [s["bytes"] for s in probe["sizes"]] == [1 << 18, 1 << 20]
    assert probe["busbw_gbps"] == pytest.approx(probe["sizes"][-1]["algbw_gbps"] * 1.5)
    (pair,) = probe["pairs"]
    assert pair["hosts"] == ["node0", "node1"] and pair["ranks"] == [0, 2] and pair["bandwidth_gbps"] > 0
    assert all(set(by_rank[r]) == {"busbw_gbps", "elapsed_s"} for r in (1, 2, 3))  # the others keep it small

    # Connectivity itself fails this job (two agents on one host name give local ranks 0, 0, 1, 1), so only the
    # bandwidth findings are looked at.
    out, busbw = Path(job.output_dir), probe["busbw_gbps"]
    report_only = check_connectivity(out, 4, AcceptanceThresholds())
    assert report_only.measured["comm_probe"]["slowest_pair"] == ["node0", "node1"]
    assert "bandwidth" not in report_only.message
    above = check_connectivity(out, 4, AcceptanceThresholds(bus_bandwidth_gbps_min=busbw / 2))
    assert "bandwidth" not in above.message
    below = check_connectivity(out, 4, AcceptanceThresholds(bus_bandwidth_gbps_min=busbw * 2))
    assert below.passed is False
    assert f"bus_bandwidth_gbps_min={busbw * 2:g}" in below.message and "node0<->node1" in below.message


def test_without_comm_probe_mb_the_ranks_record_no_probe(make_spec) -> None:
    spec = make_spec({"run": {"steps": 2}})
    job = run_local(spec.cluster, spec.training_config())
    ranks = RunOutput(job.output_dir).ranks()
    assert ranks is not None and [r["comm_probe"] for r in ranks.ranks] == [None, None]
