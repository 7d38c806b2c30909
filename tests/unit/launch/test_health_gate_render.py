"""The health gate inside a Slurm allocation (steps of the batch script, run with bash against stand-in Slurm tools
and the real verdict) and a Kubernetes pod's (an init container, schema-checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tasks.launch.base import JobHandle, JobState, JobStatus
from tasks.launch.kubernetes import render_manifests, validate_pytorchjob
from tasks.launch.local import LocalLauncher
from tasks.launch.requeue import evidence_of
from tasks.launch.slurm import SlurmLauncher
from tasks.recovery.config import RecoveryConfig
from tasks.recovery.policy import decide
from training.health_gate import GATE_NODE_ENV, HEALTH_GATE_EXIT_CODE, NodeProbe, StorageProbe, read_health_gate

# Stands for srun: the gate's probe step writes the probes recorded in $RECORDS (as each node's probe would), the
# verdict step runs for real, the trainer's step records its options.
SRUN = """#!/bin/bash
case " $* " in
  *" probe "*)
    while [ $# -gt 0 ]; do [ "$1" = --gate-dir ] && gate_dir=$2; shift; done
    mkdir -p "$gate_dir" && cp "$RECORDS"/probe-*.json "$gate_dir"/ ;;
  *" judge "*)
    while [ "${1#--}" != "$1" ]; do shift; done
    exec "$@" ;;
  *) echo "$@" > "$RECORDS/trainer" ;;
esac
"""
SCONTROL = """#!/bin/sh
[ "$1 $2" = "show hostnames" ] && echo "$SLURM_JOB_NODELIST" | tr , '\\n'
"""


def _probe(name: str, disk_full: bool = False) -> NodeProbe:
    error = "OSError: No space left on device" if disk_full else ""
    storage = StorageProbe(path="/scratch", ok=not disk_full, error=error)
    return NodeProbe(name=name, started_unix_s=0.0, probe_s=1.0, compute_gflops=30.0, compute_cpu_gflops=90.0,
                     compute_noise=0.05, throttled_periods=0, storage=[storage])  # fmt: skip


def _run_script(
    tmp_path: Path, make_spec, cluster: dict, probes: list[NodeProbe], env_extra: dict[str, str] | None = None
) -> tuple[int, str, Path]:
    bin_dir, records, out = tmp_path / "bin", tmp_path / "records", tmp_path / "out"
    for folder in (bin_dir, records, out):
        folder.mkdir(exist_ok=True)
    for name, text in {"srun": SRUN, "scontrol": SCONTROL}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    for probe in probes:
        (records / f"probe-{probe.name}.json").write_text(probe.model_dump_json())
    slurm = {"scheduler": "slurm", "preemption": {"enabled": False}, "slurm": {"python": sys.executable}}
    spec = make_spec({"cluster": {**slurm, **cluster}})
    script = tmp_path / "job.sbatch"
    script.write_text(SlurmLauncher().render(spec.cluster, f"{out}/run.json", "tiny", str(out), None))
    nodelist = ",".join(p.name for p in probes)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "RECORDS": str(records), "SLURM_JOB_ID": "7",
           "SLURM_JOB_NODELIST": nodelist, "PYTHONPATH": str(Path(__file__).resolve().parents[3]),
           **(env_extra or {})}  # fmt: skip
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout + proc.stderr, records


def test_a_slurm_job_runs_its_trainer_without_the_node_the_gate_excluded_where_min_nodes_allows(
    tmp_path: Path, make_spec
) -> None:
    probes = [_probe("node-1"), _probe("node-2", disk_full=True), _probe("node-3")]
    code, output, records = _run_script(tmp_path, make_spec, {"nodes": 3, "min_nodes": 2, "max_restarts": 1}, probes)
    assert code == 0, output
    assert "health gate excluded node-2; the job runs on the other 2 node(s)" in output
    trainer = (records / "trainer").read_text()
    assert trainer.startswith("--ntasks-per-node=1 --kill-on-bad-exit=1 --exclude=node-2 --nodes=2 ")
    record = read_health_gate(tmp_path / "out")
    assert record is not None and record.excluded == ["node-2"]


def test_a_slurm_job_that_cannot_start_without_an_excluded_node_exits_with_the_gates_code(
    tmp_path: Path, make_spec
) -> None:
    probes = [_probe("node-1"), _probe("node-2", disk_full=True)]
    code, output, records = _run_script(tmp_path, make_spec, {"nodes": 2}, probes)
    assert code == HEALTH_GATE_EXIT_CODE, output
    assert "health gate excluded node-2: 1 node(s) left, 2 needed" in output
    assert not (records / "trainer").exists()


def test_a_clean_slurm_allocation_starts_its_trainer_with_every_node(tmp_path: Path, make_spec) -> None:
    code, output, records = _run_script(tmp_path, make_spec, {"nodes": 2}, [_probe("node-1"), _probe("node-2")])
    assert code == 0, output
    assert "--exclude" not in (records / "trainer").read_text()


def test_a_requeued_slurm_job_probes_in_a_folder_of_its_own(tmp_path: Path, make_spec) -> None:
    # A requeued job keeps its id: with the first run's folder, its barrier files let a probe start before its
    # peer listened (a ring probe refused, a healthy node excluded). Each run of the script gets its own folder.
    probes = [_probe("node-1"), _probe("node-2")]
    for restart in (None, "1"):
        extra = {} if restart is None else {"SLURM_RESTART_COUNT": restart}
        code, output, _ = _run_script(tmp_path, make_spec, {"nodes": 2}, probes, extra)
        assert code == 0, output
    folders = sorted(p.name for p in (tmp_path / "out" / "health_gate").iterdir())
    assert folders == ["slurm-7-0", "slurm-7-1"], folders


def test_the_gate_is_left_out_of_the_script_when_off(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "health_gate": {"level": "off"}}})
    assert "health_gate" not in SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None)


@pytest.mark.parametrize("memory_tier", [False, True])
def test_every_kubernetes_pod_runs_the_gate_as_an_init_container_that_the_schema_accepts(
    make_spec, memory_tier: bool
) -> None:
    checkpoint = {"memory_every_steps": 2} if memory_tier else {}
    cluster = {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}, "nodes": 2,
               "health_gate": {"storage_paths": ["/scratch"]}}
    spec = make_spec({"cluster": cluster, "checkpoint": checkpoint})
    _, job = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    validate_pytorchjob(job)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        pod = replica["template"]["spec"]
        (init,) = pod["initContainers"]
        trainer = pod["containers"][0]
        assert init["image"] == trainer["image"] and init["volumeMounts"] == trainer["volumeMounts"]
        assert init["command"][:7] == ["python", "-m", "training.health_gate", "probe", "--name",
                                       f"$({GATE_NODE_ENV})", "--alone"]  # fmt: skip
        storage = [init["command"][i + 1] for i, word in enumerate(init["command"]) if word == "--storage"]
        assert storage == (["/dev/shm/tdeploy-memory"] if memory_tier else []) + ["/scratch"]
        assert init["env"] == [{"name": GATE_NODE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    off = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"},
                                 "health_gate": {"level": "off"}}}, name="off")
    _, job = render_manifests(off.cluster, off.training_config(), "tiny", "img:1")
    assert all("initContainers" not in r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values())


def test_a_slurm_job_the_gate_stopped_is_requeued_without_the_excluded_node(tmp_path: Path, make_spec) -> None:
    """The script's exit 78 and the health_gate.json it left: the restart policy's `health_gate` rule."""
    probes = [_probe("node-1"), _probe("node-2", disk_full=True)]
    code, _, _ = _run_script(tmp_path, make_spec, {"nodes": 2}, probes)
    spec = make_spec({"cluster": {"scheduler": "slurm"}, "run": {"output_url": str(tmp_path / "out")}})
    train = spec.training_config()
    handle = JobHandle(scheduler="slurm", job_id="7", name="tiny", output_dir=str(tmp_path / "out"),
                       log_path=str(tmp_path / "out" / "slurm-7.out"), submitted_unix_s=0.0)  # fmt: skip
    status = JobStatus(JobState.FAILED, "FAILED", "NonZeroExitCode", exit_code=code)
    decision = decide(evidence_of(LocalLauncher(), handle, status, train, None, 0), RecoveryConfig())
    assert (decision.cause, decision.action) == ("health_gate", "requeue_excluding")
    assert decision.excluded_hosts == ["node-2"]
