"""The soak on real local jobs (two local nodes of one rank, the tiny model, gloo): a short soak with a failure every
40 s on average passes with every failure recovered by its expected rung, and a planted leak fails it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.soak.config import FAILURE_KINDS, SoakConfig
from tasks.soak.report import read_report
from tasks.soak.step import SoakFailed, SoakInputs, run
from training.recovery_record import recovery_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]


def _two_nodes(make_spec, tmp_path: Path):  # noqa: ANN202 - a DeploymentSpec
    return make_spec({"cluster": {"nodes": 2, "procs_per_node": 1},
                      "checkpoint": {"memory_dir": str(tmp_path / "shm")}})  # fmt: skip


def test_a_short_soak_recovers_every_injected_failure_by_its_expected_rung(
    make_spec, tmp_path: Path, record_property
) -> None:
    spec = _two_nodes(make_spec, tmp_path)
    # Seed 440 over 145 s, a failure every 40 s on average: a rank kill, a hang, a node loss, a slow node, an outage
    # (at 5, 15, 17, 49 and 83 s; one that comes due while the previous one recovers waits for it). The restarts come
    # first, so the ranks the last one starts live long enough for their memory to be judged past their start-up
    # growth (a restart late in a short soak leaves its ranks a window that start-up growth can fill).
    soak = SoakConfig(hours=145 / 3600, failure_every_min=40 / 60, seed=440, slow_for_s=6, outage_s=6, hang_timeout_s=8)
    result = run(SoakInputs.of(spec, spec.training_config(), soak, work_url=str(tmp_path / "work")))
    record_property("soak", result.summary())
    assert result.passed, result.problems
    assert len(result.failures) >= 3 and all(f.recovered for f in result.failures), result.failures
    assert {f.kind for f in result.failures} == set(FAILURE_KINDS), result.failures  # the schedule met every kind
    restarts = [f for f in result.failures if f.kind in ("rank_kill", "hang", "node_loss")]
    # restored from host memory (or from a storage save newer than the last copy), no step lost beyond the memory
    # interval (every step): the kill may land before the step's copy is taken
    assert all(f.rung in ("memory", "storage") and f.steps_lost <= 1 for f in restarts), restarts
    # each restart left its own recovery event, read back from the job's records
    events = [e for e in recovery_events(result.output_dir) if e.rung in ("memory", "storage")]
    assert len(events) == len(restarts)
    assert sum(result.recoveries_per_rung.values()) == len(result.failures)
    assert result.goodput is not None and 0 < result.goodput.productive_s < result.goodput.allocation_s
    assert result.goodput.badput_s["recovery"] > 0  # the restarts' time is badput
    assert result.processes and not result.leaks
    written = read_report(Path(result.files["json"]).parent)  # soak.json, read back by its typed reader
    assert written.failures == result.failures and written.processes == result.processes and written.passed


def test_a_planted_memory_leak_fails_the_soak(make_spec, tmp_path: Path) -> None:
    spec = _two_nodes(make_spec, tmp_path)
    # No failure within the half minute (the mean interval is far longer): only the ranks' leak can fail it.
    soak = SoakConfig(hours=0.5 / 60, failure_every_min=600, leak_mb_per_step=0.5, sample_every_s=0.5)
    failed = None
    try:
        run(SoakInputs.of(spec, spec.training_config(), soak, work_url=str(tmp_path / "work")))
    except SoakFailed as err:
        failed = err
    report = read_report(next((tmp_path / "work" / "soak").iterdir()))
    leaking = {p.role for p in report.leaks}
    assert leaking == {"rank 0", "rank 1"}, [p.describe() for p in report.processes]
    assert {p.verdict for p in report.processes if p.role.startswith("agent")} == {"steady"}
    assert not report.failures and not report.passed
    assert failed is not None and "memory leak: rank" in str(failed)
