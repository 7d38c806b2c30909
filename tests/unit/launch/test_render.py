"""Rendered sbatch scripts and Kubernetes manifests, and the bad inputs refused before submitting."""

from __future__ import annotations

import copy
import json

import pytest

from tasks.errors import UserError
from tasks.launch.base import JobState, parse_root_cause
from tasks.launch.kubernetes import render_manifests, validate_pytorchjob
from tasks.launch.network import ALLOWED_ENV_VAR
from tasks.launch.slurm import SlurmLauncher, slurm_state
from tasks.spec import SpecError

GPU_CLUSTER = {
    "scheduler": "slurm",
    "nodes": 4,
    "procs_per_node": 8,
    "accelerator": "h100-sxm",
    "env": {"NCCL_IB_HCA": "mlx5", "NCCL_DEBUG": "WARN"},
    "slurm": {
        "partition": "gpu",
        "account": "ml",
        "qos": "high",
        "time_limit": "2-00:00:00",
        "cpus_per_node": 96,
        "mem_per_node_mb": 512000,
        "container": "pyxis",
    },
    "kubernetes": {"api": "pytorchjob", "namespace": "train", "cpu_per_node": 96, "memory_per_node_gb": 500},
}


def test_sbatch_script_carries_resources_rendezvous_restarts_env_and_image(make_spec) -> None:
    spec = make_spec({"cluster": {**GPU_CLUSTER, "max_restarts": 3}, "parallel": {"data_parallel": 32}})
    script = SlurmLauncher().render(
        spec.cluster, "/shared/run/run.json", "llm", "/shared/run", "registry/img@sha256:ab"
    )
    for directive in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=96",
        "#SBATCH --mem=512000M",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=ml",
        "#SBATCH --qos=high",
        "#SBATCH --job-name=llm",
    ):
        assert directive in script.splitlines(), directive
    assert "export NCCL_IB_HCA=mlx5" in script and "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in script
    assert 'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in script
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--container-image=registry/img@sha256:ab" in srun
    assert f"--rdzv-endpoint=$head_node:{spec.cluster.slurm.rdzv_port}" in srun and "--rdzv-id=$SLURM_JOB_ID" in srun
    assert "--nnodes=4" in srun and "--nproc-per-node=8" in srun and "--max-restarts=3" in srun
    assert srun.endswith("-m training.train --config /shared/run/run.json")


def test_bare_metal_cpu_script_uses_this_python_and_no_gpus(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    script = SlurmLauncher().render(spec.cluster, "/r/run.json", "tiny", "/r", None)
    assert "--gpus-per-node" not in script and "--container-image" not in script
    import sys

    assert f"{sys.executable} -m torch.distributed.run" in script


def test_slurm_states_map_to_five() -> None:
    assert slurm_state("PENDING") is JobState.PENDING
    assert slurm_state("RUNNING") is JobState.RUNNING
    assert slurm_state("COMPLETED") is JobState.SUCCEEDED
    assert slurm_state("CANCELLED by 0") is JobState.CANCELLED
    assert slurm_state("TIMEOUT") is JobState.FAILED and slurm_state("OUT_OF_MEMORY") is JobState.FAILED


def test_a_malformed_time_limit_is_refused_by_the_spec(make_spec) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"cluster": {"scheduler": "slurm", "slurm": {"time_limit": "2 hours"}}})
    assert any(
        p.startswith("cluster.slurm.time_limit=2 hours: '2 hours' is not a Slurm time; use MM, MM:SS, HH:MM:SS")
        for p in caught.value.problems
    )


def test_pytorchjob_manifest_validates_and_matches_the_spec(make_spec) -> None:
    spec = make_spec({"cluster": {**GPU_CLUSTER, "scheduler": "kubernetes"}, "parallel": {"data_parallel": 32}})
    config_map, job = render_manifests(spec.cluster, spec.training_config(), "llm", "registry/img@sha256:ab")
    validate_pytorchjob(job)
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 3
    assert job["spec"]["nprocPerNode"] == "8"
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry/img@sha256:ab"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "96", "memory": "512000Mi"}
    assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in container["env"]
    assert '"steps": 20' in config_map["data"]["run.json"]


def test_pods_take_the_checkpoint_key_from_a_kubernetes_secret_and_the_config_map_never_holds_it(
    make_spec, monkeypatch
) -> None:
    monkeypatch.setenv("TDEPLOY_CHECKPOINT_KEY", "operator-key-0123456789")
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}}})
    config_map, job = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    validate_pytorchjob(job)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    key = next(e for e in container["env"] if e["name"] == "TDEPLOY_CHECKPOINT_KEY")
    assert key == {
        "name": "TDEPLOY_CHECKPOINT_KEY",
        "valueFrom": {"secretKeyRef": {"name": "tdeploy-checkpoint-key", "key": "key", "optional": True}},
    }
    assert "operator-key" not in json.dumps([config_map, job])


def test_pytorchjob_validation_catches_unknown_fields_and_missing_required_ones(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}}})
    _, job = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    typo = copy.deepcopy(job)
    typo["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["imagee"] = "x"
    with pytest.raises(UserError, match=r"fields the schema does not know: .*containers\[0\]\.imagee"):
        validate_pytorchjob(typo)
    missing = copy.deepcopy(job)
    del missing["spec"]["runPolicy"]
    with pytest.raises(UserError, match="run_policy"):
        validate_pytorchjob(missing)


TORCHRUN_SUMMARY = """
[rank5]: RuntimeError: boom on rank 5
============================================================
training.train FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-29_19:00:00
  host      : node-7
  rank      : 5 (local_rank: 1)
  exitcode  : 1 (pid: 1234)
  error_file: <N/A>
  traceback : Traceback (most recent call last):
    File "x.py", line 1, in <module>
  RuntimeError: boom on rank 5
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_19:00:00
  host      : node-7
  rank      : 4 (local_rank: 0)
  exitcode  : 1 (pid: 1233)
  error_file: <N/A>
  traceback : Traceback (most recent call last):
  RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234
============================================================
"""


def test_root_cause_is_the_rank_that_failed_not_the_one_that_saw_its_peer_die() -> None:
    report = parse_root_cause(TORCHRUN_SUMMARY)
    assert report is not None and (report.rank, report.local_rank, report.host, report.exitcode) == (5, 1, "node-7", 1)
    assert report.error == "RuntimeError: boom on rank 5"
    killed = parse_root_cause(TORCHRUN_SUMMARY.replace("exitcode  : 1 (pid: 1234)", "exitcode  : -9 (pid: 1234)"))
    assert killed is not None and killed.rank == 5 and killed.error.startswith("killed by signal 9")
    assert parse_root_cause("no summary here") is None


def test_missing_slurm_tools_are_named_before_anything_is_written(make_spec, tmp_path) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm"}})
    with pytest.raises(UserError, match=r"`sbatch` is not on PATH"):
        SlurmLauncher({"PATH": str(tmp_path)}).submit(spec.cluster, spec.training_config(), "x")


def test_more_gpus_per_node_than_the_accelerator_has_is_refused(make_spec) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"cluster": {"scheduler": "slurm", "accelerator": "h100-sxm", "procs_per_node": 16}})
    assert (
        "cluster.procs_per_node=16: a h100-sxm node holds at most 8 devices; use procs_per_node <= 8 and more nodes"
        in caught.value.problems[0]
    )


def test_pytorchjob_env_values_are_literal_and_the_command_is_a_list_of_words(
    make_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALLOWED_ENV_VAR, "NOTE")  # no library's variable: the operator allows it
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"},
                                  "env": {"NOTE": "$(HOME) and $$ and `id`"}}})
    _, job = render_manifests(spec.cluster, spec.training_config(), "tiny", "img:1")
    validate_pytorchjob(job)
    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    assert {"name": "NOTE", "value": "$$(HOME) and $$$$ and `id`"} in container["env"], "kubelet turns $$ into $"
    assert all(isinstance(word, str) for word in container["command"]) and "args" not in container


BAD_KUBERNETES = [
    ({"namespace": "Train;x"}, "cluster.kubernetes.namespace=Train;x: 'Train;x' is not a Kubernetes namespace"),
    ({"namespace": "train\n"}, "is not a Kubernetes namespace"),
    ({"service_account": "a b"}, "cluster.kubernetes.service_account=a b: 'a b' is not a service account name"),
    ({"gpu_resource": "nvidia.com/gpu\n"}, "is not a Kubernetes resource name such as nvidia.com/gpu"),
    ({"cpu_per_node": float("inf")}, "cluster.kubernetes.cpu_per_node=Infinity: must be a finite number"),
    ({"cpu_per_node": 1e30}, "cluster.kubernetes.cpu_per_node=1e+30: must be <= 65536"),
    ({"memory_per_node_gb": float("nan")}, "cluster.kubernetes.memory_per_node_gb=NaN: must be a finite number"),
    ({"memory_per_node_gb": 1e30}, "cluster.kubernetes.memory_per_node_gb=1e+30: must be <= 1000000"),
]


@pytest.mark.parametrize(("kubernetes", "expected"), BAD_KUBERNETES, ids=[e for _, e in BAD_KUBERNETES])
def test_bad_kubernetes_settings_are_refused_by_the_spec(make_spec, kubernetes, expected) -> None:
    with pytest.raises(SpecError) as caught:
        make_spec({"cluster": {"scheduler": "kubernetes", "kubernetes": kubernetes}})
    assert any(expected in problem for problem in caught.value.problems), caught.value.problems


def test_a_peer_echo_in_an_error_file_is_seen_past_the_python_frames_torch_appends(tmp_path) -> None:
    # a collective's C++ error carries the Python frames it was called from ("At:"); its message comes first
    echo = tmp_path / "error0.json"
    message = (
        "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
        "[127.0.0.1]:31642.\n\nAt:\n  /venv/torch/ddp_comm_hooks/default_hooks.py(31): <lambda>\n\n\nAt:\n"
        "  /work/training/metrics.py(71): finished\n"
    )
    echo.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1"}}}))
    crash = tmp_path / "error1.json"
    crash.write_text(json.dumps({"message": {"message": "RuntimeError: boom on rank 5", "extraInfo": {}}}))
    summary = (
        TORCHRUN_SUMMARY.replace("rank      : 4 (local_rank: 0)\n  exitcode  : 1 (pid: 1233)\n  error_file: <N/A>",
                                 f"rank      : 4 (local_rank: 0)\n  exitcode  : 1 (pid: 1233)\n  error_file: {echo}")
        .replace("rank      : 5 (local_rank: 1)\n  exitcode  : 1 (pid: 1234)\n  error_file: <N/A>",
                 f"rank      : 5 (local_rank: 1)\n  exitcode  : 1 (pid: 1234)\n  error_file: {crash}")
    )  # fmt: skip
    assert str(echo) in summary and str(crash) in summary
    report = parse_root_cause(summary)
    assert report is not None and report.rank == 5 and report.error == "RuntimeError: boom on rank 5"
