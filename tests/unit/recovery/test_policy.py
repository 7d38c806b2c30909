"""The restart policy's decisions as a table over recorded failures (what failed jobs left: torchrun's root cause,
the launcher's reason, the trainer's failure.json, the watchdog's hang records, how far training got)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.recovery.config import RecoveryConfig
from tasks.recovery.policy import FailureEvidence, decide, remember
from tasks.recovery.quarantine import NodeMemory
from tasks.recovery.record import DECISIONS_FILE, DecisionFileError, append_decision, read_decisions
from training.failure import WorkloadFailure
from training.watchdog import HANG_EXIT_CODE

JOB = "ssh:drill-20261206-1"


def _workload(cause: str, error: str) -> WorkloadFailure:
    return WorkloadFailure(cause=cause, step=5, error=error, fix="the trainer's fix", rank=0, host="node-1",
                           run_id="drill-20261206-1", time_unix_s=1.0)  # fmt: skip


# Recorded failures: (name, evidence, class, cause, action, blamed hosts)
RECORDED = [
    ("nan loss", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0); node 1 (node-2): exit 1", 1, "node-1",
        "training.failure.NonFiniteLoss: step 5: the training loss is nan (not skipped by a loss scaler)", 1, "node-1",
        workload=_workload("nan_loss", "NonFiniteLoss: step 5: the training loss is nan"), step_now=5),
     "workload", "nan_loss", "stop", []),
    ("bad data (failure.json)", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1", "DatasetError: /data/train: shard 2 ...", 1,
        "node-1", workload=_workload("bad_data", "DatasetError: /data/train: shard 2 sha256 mismatch")),
     "workload", "bad_data", "stop", []),
    ("bad starting model (failure.json)", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1", "InitCheckError: model.init_from=...", 1,
        "node-1", workload=_workload("bad_model", "InitCheckError: model.init_from=/m: the job's logits deviate")),
     "workload", "bad_model", "stop", []),
    ("bad data (root cause only)", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1",
        "training.dataset.DatasetError: /data/train: manifest.json names 4 shards, 3 exist; prepare it again", 1,
        "node-1"),
     "workload", "bad_data", "stop", []),
    ("a bug's traceback", FailureEvidence(
        JOB, "torchrun exited with 1 on node-2 (node 1)", 1, "node-2",
        "TypeError: unsupported operand type(s) for +: 'int' and 'NoneType'", 1, "node-2"),
     "workload", "bug", "stop", []),
    ("a lost rank (-9)", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0); node 1 (node-2): exit 1", 1, "node-1",
        "killed by signal 9", -9, "node-2", step_now=7),
     "infrastructure", "lost_rank", "requeue_excluding", ["node-2"]),
    ("a rank that aborted (-6)", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1",
        "killed by signal 6;   /work/main/training/metrics.py(71): finished", -6, "node-2", step_now=7),
     "infrastructure", "rank_crash", "requeue", []),
    ("a lost node", FailureEvidence(
        JOB, "torchrun exited with 137 on node-3 (node 2); node 0 (node-1): exit 1", 137, "node-3",
        "torch.distributed.elastic.rendezvous.api.RendezvousClosedError", 1, "node-1", step_now=7),
     "infrastructure", "lost_node", "requeue_excluding", ["node-3"]),
    ("a node that no longer answers", FailureEvidence(
        JOB, "torchrun exited with 255 on node-2 (node 1)", 255, "node-2", "", None, None,
        unreachable_hosts=("node-2",), step_now=3),
     "infrastructure", "lost_node", "requeue_excluding", ["node-2"]),
    ("a hang (watchdog exit)", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1", "no traceback", HANG_EXIT_CODE, "node-1",
        hangs=("hang on rank 0 (attempt 0): step at step 6 ran 31.0s > 30.0s (step_timeout_s); rank 3 did not "
               "arrive",), hung_hosts=("node-2",), step_now=6),
     "infrastructure", "hang", "requeue_excluding", ["node-2"]),
    ("a storage error", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1",
        "training.checkpoint.errors.CheckpointSaveError: checkpoint save to /ck/step-4 failed: [Errno 28] No space "
        "left on device", 1, "node-1", step_now=4),
     "infrastructure", "storage", "requeue", []),
    ("a rendezvous timeout", FailureEvidence(
        JOB, "torchrun exited with 1 on node-2 (node 1)", 1, "node-2",
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError", 1, "node-2", step_now=None),
     "infrastructure", "rendezvous_timeout", "requeue", []),
    ("a broken peer connection", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[10.0.0.3]:29500", 1, "node-1", step_now=9),
     "infrastructure", "network", "requeue_excluding", ["node-1"]),
    ("no progress since the last restart", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1", "killed by signal 9", -9, "node-2",
        step_before=4, step_now=4, requeues_done=1),
     "infrastructure", "lost_rank", "stop", ["node-2"]),
    ("the requeues used up", FailureEvidence(
        JOB, "torchrun exited with 1 on node-1 (node 0)", 1, "node-1", "killed by signal 9", -9, "node-2",
        step_before=4, step_now=8, requeues_done=3),
     "infrastructure", "lost_rank", "stop", ["node-2"]),
    ("the health gate inside the allocation excluded a node", FailureEvidence(
        JOB, "NodeFail", 78, None, "", None, None, gate_excluded=("node-3",)),
     "infrastructure", "health_gate", "requeue_excluding", ["node-3"]),
    ("the gate's exit code without its record", FailureEvidence(JOB, "NonZeroExitCode", 78),
     "infrastructure", "health_gate", "requeue", []),
]  # fmt: skip


def _case(name: str) -> FailureEvidence:
    return next(case[1] for case in RECORDED if case[0] == name)


@pytest.mark.parametrize(("evidence", "failure_class", "cause", "action", "blamed"),
                         [case[1:] for case in RECORDED], ids=[case[0] for case in RECORDED])  # fmt: skip
def test_the_policy_decides_each_recorded_failure(evidence, failure_class, cause, action, blamed) -> None:
    decision = decide(evidence, RecoveryConfig(requeues=3))
    assert (decision.failure_class, decision.cause, decision.action) == (failure_class, cause, action)
    assert decision.blamed_hosts == blamed
    assert decision.excluded_hosts == (blamed if action == "requeue_excluding" else [])
    assert decision.evidence and decision.fix and decision.why
    assert (decision.requeue == evidence.requeues_done + 1) if action != "stop" else decision.requeue == 0


def test_a_workload_error_is_stopped_even_with_requeues_left_and_says_why() -> None:
    decision = decide(_case("nan loss"), RecoveryConfig(requeues=10))
    assert decision.action == "stop" and "not retried" in decision.why
    assert "failure.json" in decision.evidence[0]


def test_no_progress_names_the_steps_before_and_after_the_restart() -> None:
    decision = decide(_case("no progress since the last restart"), RecoveryConfig(requeues=3))
    assert "no progress since the last restart" in decision.why and "step 4" in decision.why


def test_a_host_that_fails_twice_is_quarantined_and_excluded_from_the_requeue(tmp_path: Path) -> None:
    memory = NodeMemory(str(tmp_path / "nodes"), RecoveryConfig(quarantine_after_failures=2))
    lost_node = _case("a lost node")
    first = remember(decide(lost_node, RecoveryConfig(requeues=3)), memory)
    assert first.quarantined_hosts == [] and first.excluded_hosts == ["node-3"]
    # a later job of the deployment: the same host fails again, this time by a killed rank on it
    again = FailureEvidence(JOB, "torchrun exited with 1", 1, "node-1", "killed by signal 9", -9, "node-3", step_now=2)
    second = remember(decide(again, RecoveryConfig(requeues=3)), memory)
    assert second.quarantined_hosts == ["node-3"] and second.excluded_hosts == ["node-3"]
    # a third failure elsewhere: the requeue leaves out the host that failed and the quarantined one
    other = FailureEvidence(JOB, "torchrun exited with 1", 1, "node-1", "killed by signal 9", -9, "node-2", step_now=5)
    third = remember(decide(other, RecoveryConfig(requeues=3)), memory)
    assert third.action == "requeue_excluding" and third.excluded_hosts == ["node-2", "node-3"]
    # a storage error blames no host, yet its requeue still runs without the quarantined one
    storage = remember(decide(_case("a storage error"), RecoveryConfig(requeues=3)), memory)
    assert storage.action == "requeue_excluding" and storage.excluded_hosts == ["node-3"]


def test_decisions_round_trip_through_decisions_jsonl_and_a_bad_line_is_named(tmp_path: Path) -> None:
    out = str(tmp_path / "output")
    made = [decide(case[1], RecoveryConfig(requeues=3)) for case in RECORDED[:5]]
    for decision in made:
        append_decision(out, decision)
    assert read_decisions(out) == made
    with open(tmp_path / "output" / DECISIONS_FILE, "a") as handle:
        handle.write('{"class": "cosmic"}\n')
    with pytest.raises(DecisionFileError, match="line 6"):
        read_decisions(out)


def test_the_launch_tasks_artifact_shows_each_decision_with_its_evidence_and_fix() -> None:
    from tasks.launch.task import decisions_markdown

    stop = decide(_case("nan loss"), RecoveryConfig(requeues=3))
    requeue = decide(_case("a lost node"), RecoveryConfig(requeues=3))
    page = decisions_markdown([requeue, stop])
    rows = [line for line in page.splitlines() if line.startswith(f"| {JOB} ")]
    assert "## Restart policy" in page and len(rows) == 2
    assert "| infrastructure | lost_node | requeue_excluding (node-3) |" in rows[0] and "ended with 137" in rows[0]
    assert "| workload | nan_loss | stop |" in rows[1] and "failure.json" in rows[1]
    assert "lower optim.lr_peak" in rows[1]
    assert decisions_markdown([]) == ""
