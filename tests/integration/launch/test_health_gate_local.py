"""The health gate on the local launcher: this machine's single-node probes before the job, in the launch step."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.launch.health_gate import GateBaseline, HealthGateFailed, read_baseline, run_health_gate
from tasks.launch.local import LocalLauncher
from tasks.launch.step import JobInputs, run
from training.health_gate import read_health_gate

pytestmark = pytest.mark.integration


def test_the_local_launcher_probes_this_machine_once_and_records_it(make_spec) -> None:
    spec = make_spec({"cluster": {"nodes": 2, "procs_per_node": 1}})
    train = spec.training_config()
    outcome = run_health_gate(LocalLauncher(), spec.cluster, train)
    assert outcome.cluster == spec.cluster
    record = read_health_gate(train.run.output_url)
    assert record is not None and record.passed and [v.name for v in record.nodes] == ["localhost"]
    (probe,) = record.probes
    assert probe.compute_cpu_gflops and [s.ok for s in probe.storage] == [True] and probe.peer is None


def test_a_local_job_whose_machine_fails_the_gate_is_not_started(make_spec, tmp_path: Path) -> None:
    """The launch step runs the gate before it submits: a storage folder that cannot be written stops the job."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the memory tier's folder should be")
    spec = make_spec({"cluster": {"nodes": 1, "procs_per_node": 1, "health_gate": {"storage_paths": [str(blocker)]}}})
    train = spec.training_config()
    with pytest.raises(HealthGateFailed) as caught:
        run(JobInputs(cluster=spec.cluster, train=train, name="gated"))
    assert "this machine failed the gate" in str(caught.value) and f"storage {blocker}: " in str(caught.value)
    assert not (Path(train.run.output_url) / "job.json").exists()  # no job was submitted
    record = read_health_gate(train.run.output_url)
    assert record is not None and record.excluded == ["localhost"]


def test_the_ledgers_baseline_grows_with_each_healthy_gate_and_judges_a_lone_node(make_spec, tmp_path: Path) -> None:
    spec = make_spec({"cluster": {"nodes": 1, "procs_per_node": 1}})
    train = spec.training_config()
    baseline = str(tmp_path / "ledger" / "health_gate_baseline.json")
    run_health_gate(LocalLauncher(), spec.cluster, train, baseline_url=baseline)
    measured = read_baseline(baseline)
    assert measured is not None and measured > 0  # this machine's rate per CPU-second, from the first gate
    # A ledger whose nodes were 10x faster per CPU-second: this machine is a slow processor against it.
    Path(baseline).write_text(GateBaseline(rates_gflops=[measured * 10] * 3).model_dump_json())
    with pytest.raises(HealthGateFailed, match="a slow processor"):
        run_health_gate(LocalLauncher(), spec.cluster, train, baseline_url=baseline)
    assert GateBaseline.model_validate_json(Path(baseline).read_text()).rates_gflops == [measured * 10] * 3
