"""Replica groups (fault_tolerance.mode=replica_groups) as the Slurm and Kubernetes launchers render them: one group
per node under a torchft lighthouse, each group its own torchrun (--standalone) with its restarts."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from tasks.errors import UserError
from tasks.launch.kubernetes import (
    CONFIG_DIR,
    LIGHTHOUSE_PORT,
    check_round_trip,
    render_manifests,
    validate_pytorchjob,
)
from tasks.launch.slurm import REPLICA_TASK, SlurmLauncher
from tasks.spec import SpecError
from training.config import FaultToleranceConfig, TrainConfig
from training.replica import HOST_ENV, LIGHTHOUSE_ENV, REPLICA_GROUP_ENV

REPLICAS = {"mode": "replica_groups", "replica_groups": 2}


def _slurm_spec(make_spec, **cluster: object):
    return make_spec({"cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 2, "max_restarts": 2, **cluster},
                      "fault_tolerance": REPLICAS})  # fmt: skip


def test_slurm_runs_one_replica_group_per_node_and_names_the_fix_otherwise(make_spec) -> None:
    assert _slurm_spec(make_spec).training_config().fault_tolerance.replica_groups == 2
    with pytest.raises(SpecError) as caught:
        make_spec({"cluster": {"scheduler": "slurm", "nodes": 1, "procs_per_node": 2, "max_restarts": 1},
                   "fault_tolerance": REPLICAS})  # fmt: skip
    assert any(
        p.startswith("fault_tolerance.replica_groups=2: must equal cluster.nodes=1 on the slurm launcher")
        and "set fault_tolerance.replica_groups to 1, or cluster.nodes to 2" in p
        for p in caught.value.problems
    ), caught.value.problems


def test_the_sbatch_script_starts_the_lighthouse_then_each_nodes_group_then_the_outcome(make_spec) -> None:
    spec = _slurm_spec(make_spec)
    script = SlurmLauncher().render(spec.cluster, "/r/run.json", "ft", "/r", None, train=spec.training_config())
    lines = script.splitlines()
    port = spec.cluster.slurm.rdzv_port
    start = next(i for i, line in enumerate(lines) if "torchft_lighthouse" in line)
    assert f'"--bind=$lighthouse_host:{port}"' in lines[start] and lines[start].endswith("&")
    assert lines[start + 1] == "lighthouse=$!"
    assert f'export TORCHFT_LIGHTHOUSE="http://$lighthouse_host:{port}"' in lines
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert srun > start
    words = shlex.split(lines[srun].removesuffix(" || rc=$?"))
    assert words[words.index("-c") + 1] == REPLICA_TASK and "--kill-on-bad-exit=0" in words
    torchrun = words[words.index("training.preemption") + 1 :]
    assert torchrun[:4] == ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=2"]
    assert torchrun[-2:] == ["-m", "training.train"]  # the task adds its group's --config
    assert lines[srun + 2] == 'kill "$lighthouse" 2>/dev/null || true'
    assert "-m tasks.launch.replica_step --config /r/run.json --workdir /r/replicas" in lines[srun + 3]
    assert "--rdzv-endpoint" not in script  # each group's torchrun has its own rendezvous


def test_each_nodes_task_runs_its_own_group_config_and_records_its_exit(tmp_path: Path) -> None:
    recorder = tmp_path / "torchrun"
    recorder.write_text(
        '#!/bin/sh\nprintf "%s\\n" "$@" > "$RECORD"\n'
        'echo "$TDEPLOY_REPLICA_GROUP $TDEPLOY_REPLICA_HOST $PET_LOCAL_ADDR $PET_LOG_DIR" >> "$RECORD"\nexit 3\n'
    )
    recorder.chmod(0o755)
    workdir = tmp_path / "it's $(x)"
    workdir.mkdir()
    env = {"SLURM_NODEID": "1", "SLURMD_NODENAME": "node-2", "RECORD": str(tmp_path / "record"),
           "PATH": "/bin:/usr/bin"}  # fmt: skip
    done = subprocess.run(["sh", "-c", REPLICA_TASK, "t", "/logs", str(workdir), str(recorder), "--standalone"],
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert (workdir / "exit-1.txt").read_text().strip() == "3"
    recorded = (tmp_path / "record").read_text().splitlines()
    assert recorded[:3] == ["--standalone", "--config", f"{workdir}/run-replica-1.json"]
    assert recorded[3] == "1 node-2 node-2 /logs/node-2"


def test_a_hostile_output_folder_stays_one_word_in_the_replica_groups_script(make_spec, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    spec = _slurm_spec(make_spec)
    out = f"/shared/o'ut $(touch {marker})"
    script = SlurmLauncher().render(spec.cluster, f"{out}/run.json", "ft", out, None, train=spec.training_config())
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    assert f"replicas={shlex.quote(out + '/replicas')}" in script.splitlines()
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    words = shlex.split(srun.removesuffix(" || rc=$?"))
    assert words[words.index("tdeploy-replica") + 1 :][:2] == [f"{out}/logs", f"{out}/replicas"]
    assert not marker.exists()


def _kubernetes(make_spec, nodes: int = 2):
    """A Kubernetes spec and its training config with replica groups (the spec refuses the mode on Kubernetes
    until its launcher submits them: the rendering is checked on its own)."""
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": nodes, "procs_per_node": 2, "max_restarts": 2,
                                  "kubernetes": {"namespace": "train", "api": "pytorchjob"}}})  # fmt: skip
    train = spec.training_config()
    return spec.cluster, train.model_copy(update={"fault_tolerance": FaultToleranceConfig(**REPLICAS)})


def test_kubernetes_renders_a_lighthouse_service_and_one_standalone_pytorchjob_per_group(make_spec) -> None:
    cluster, train = _kubernetes(make_spec)
    config_map, deployment, service, *jobs = render_manifests(cluster, train, "ft", "registry/img:1")
    client = ApiClient()
    for obj, model in ((deployment, "V1Deployment"), (service, "V1Service")):
        check_round_trip(client, obj, model, obj["kind"], "a rendering bug")
    for job in jobs:
        validate_pytorchjob(job)
    lighthouse = deployment["spec"]["template"]["spec"]["containers"][0]
    assert lighthouse["image"] == "registry/img:1" and lighthouse["command"][0] == "torchft_lighthouse"
    assert f"--bind=0.0.0.0:{LIGHTHOUSE_PORT}" in lighthouse["command"]
    assert service["metadata"]["name"] == "ft-lighthouse" and service["spec"]["selector"] == (
        deployment["spec"]["template"]["metadata"]["labels"]
    )
    assert [job["metadata"]["name"] for job in jobs] == ["ft-replica-0", "ft-replica-1"]
    for group, job in enumerate(jobs):
        assert list(job["spec"]["pytorchReplicaSpecs"]) == ["Master"]
        container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
        command = container["command"]
        assert command[3:7] == ["--standalone", "--nnodes=1", "--nproc-per-node=2", "--max-restarts=2"]
        assert command[-2:] == ["--config", f"{CONFIG_DIR}/run-replica-{group}.json"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
        assert env[REPLICA_GROUP_ENV] == str(group)
        assert env[LIGHTHOUSE_ENV] == f"http://ft-lighthouse.train.svc:{LIGHTHOUSE_PORT}"
        assert env[HOST_ENV] == env["PET_LOCAL_ADDR"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        group_train = TrainConfig.model_validate_json(config_map["data"][f"run-replica-{group}.json"])
        assert group_train.run.output_url.endswith(f"/replica-{group}")
        assert group_train.checkpoint.url.endswith(f"/replica-{group}")


def test_kubernetes_refuses_replica_groups_that_are_not_one_per_pod(make_spec) -> None:
    cluster, train = _kubernetes(make_spec, nodes=1)
    with pytest.raises(UserError, match="fault_tolerance.replica_groups=2 with cluster.nodes=1"):
        render_manifests(cluster, train, "ft", "registry/img:1")


@pytest.mark.parametrize(
    ("container", "starts", "host"),
    [
        ("pyxis", ["srun", "--overlap", "--nodes=1", "--ntasks=1", "--relative=0", "--container-image=reg/img:1"],
         "$head_node"),
        ("apptainer", ["apptainer", "exec", "--nv"], "$SLURMD_NODENAME"),
    ],
)  # fmt: skip
def test_in_a_container_the_lighthouse_and_the_outcome_run_from_the_image(make_spec, container, starts, host) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                                  "slurm": {"container": container}}, "fault_tolerance": REPLICAS})  # fmt: skip
    script = SlurmLauncher().render(spec.cluster, "/r/run.json", "ft", "/r", "reg/img:1", train=spec.training_config())
    lines = script.splitlines()
    lighthouse = shlex.split(next(line for line in lines if "torchft_lighthouse" in line).split(" > ")[0])
    assert lighthouse[: len(starts)] == starts and "torchft_lighthouse" in lighthouse
    assert f"lighthouse_host={host}" in lines
    outcome = shlex.split(next(line for line in lines if "tasks.launch.replica_step" in line))
    assert outcome[: len(starts)] == starts
