"""Hot spares (cluster.spares): what the spec refuses, and what each launcher starts or renders for them."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tasks.launch import registry
from tasks.launch.base import JobHandle, JobState
from tasks.launch.cluster import ClusterConfig
from tasks.launch.kubernetes import render_manifests, validate_pytorchjob
from tasks.launch.local import LocalLauncher
from tasks.launch.slurm import SlurmLauncher
from tasks.launch.spares import SPARE_WAIT_ENV, spare_wait_value, wait_until_needed
from tasks.launch.ssh import SshLauncher
from tasks.launch.torchrun import torchrun_args
from tasks.spec import SpecError, parse_spec
from tests.conftest import REPO, TINY_SPEC, deep_merge
from training.run_output import RESULT, Ranks, RunOutputWriter
from training.storage import StorageConfig

HOSTS = [{"name": f"node-{i}", "address": f"10.0.0.{i + 2}"} for i in range(3)]
PATHS = {"data": {"dataset_url": "/data/ds"}, "checkpoint": {"url": "/shared/ck"}, "run": {"output_url": "/shared/o"}}


def _spec(cluster: dict, **sections: dict):  # noqa: ANN202 - a DeploymentSpec
    raw = deep_merge(deep_merge(TINY_SPEC, PATHS), {"cluster": {"procs_per_node": 1, **cluster}, **sections})
    return parse_spec(raw, "tiny")


def _problems(cluster: dict, **sections: dict) -> list[str]:
    with pytest.raises(SpecError) as caught:
        _spec(cluster, **sections)
    return caught.value.problems


def test_spares_without_restarts_are_refused_naming_max_restarts_and_the_fix() -> None:
    problems = _problems({"nodes": 2, "spares": 1})
    assert any(p.startswith("cluster.max_restarts=0: spares=1") and "set max_restarts >= 1" in p for p in problems)


class PlainLauncher(LocalLauncher):
    """The local launcher without hot spares: a scheduler that cannot keep them."""

    scheduler = "plain"
    capabilities = replace(LocalLauncher.capabilities, has_hot_spares=False)


def test_a_scheduler_that_keeps_no_spares_refuses_them_and_names_those_that_do() -> None:
    registry.register(PlainLauncher)
    try:
        with pytest.raises(ValueError, match=r"spares\n.*scheduler=plain keeps no hot spares; use .*local"):
            ClusterConfig(scheduler="plain", nodes=2, procs_per_node=1, max_restarts=1, spares=1)
    finally:
        registry.unregister("plain")


def test_an_ssh_inventory_must_list_the_nodes_and_the_spares() -> None:
    problems = _problems({"scheduler": "ssh", "nodes": 2, "spares": 2, "max_restarts": 1}, nodes={"hosts": HOSTS})
    assert any(p.startswith("cluster.spares=2: cluster.scheduler=ssh has 3 host(s)") and "list 4" in p
               for p in problems), problems  # fmt: skip


def test_ssh_starts_agents_on_the_spare_hosts_after_the_nodes_and_records_them() -> None:
    spec = _spec({"scheduler": "ssh", "nodes": 2, "spares": 1, "max_restarts": 1}, nodes={"hosts": HOSTS})
    assert [h.name for h in SshLauncher.hosts(spec.cluster) or []] == ["node-0", "node-1", "node-2"]
    details = SshLauncher()._details(spec.cluster)
    assert details["hosts"] == ["node-0", "node-1", "node-2"] and details["spare_hosts"] == ["node-2"]
    launcher = SshLauncher()
    args = torchrun_args(spec.cluster, "10.0.0.2:29500", "job", "/shared/o/run.json", None,
                         launcher._store_host(spec.cluster, 2))  # fmt: skip
    spare = {SPARE_WAIT_ENV: spare_wait_value(Path("/shared/o"), 1.0, [Path("/shared/o/exit-0.txt")])}
    argv, _ = launcher._agent_command(spec.cluster, 2, args, None, Path("/shared/o"), spare)
    assert argv[-2] == "10.0.0.4"  # the spare host, reached over SSH
    remote = shlex.split(argv[-1])
    waits = [w for w in remote if w.startswith(f"{SPARE_WAIT_ENV}=")]
    assert waits == [f"{SPARE_WAIT_ENV}=" + '{"output": "/shared/o", "since": 1.0, "exits": ["/shared/o/exit-0.txt"]}']
    conf = next(w for w in remote if w.startswith("--rdzv-conf="))
    assert conf == "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,is_host=0"
    assert "--nnodes=2" in remote  # the job stays `nodes` nodes: the spare stands by


def test_local_agent_zero_hosts_the_store_and_the_others_never_do_with_spares() -> None:
    cluster = ClusterConfig(nodes=2, procs_per_node=1, max_restarts=1, spares=1)
    hosts = [LocalLauncher._store_host(cluster, node) for node in range(3)]
    assert hosts == [True, False, False]
    assert LocalLauncher._store_host(ClusterConfig(nodes=2, procs_per_node=1), 1) is None  # torchrun decides
    args = torchrun_args(cluster, "127.0.0.1:1", "job", "run.json", None, True)
    assert "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3,is_host=1" in args


def test_without_spares_the_torchrun_arguments_are_unchanged() -> None:
    cluster = ClusterConfig(nodes=2, procs_per_node=1)
    assert not [a for a in torchrun_args(cluster, "127.0.0.1:1", "job", "run.json") if a.startswith("--rdzv-conf")]


def test_slurm_allocates_the_spares_and_keeps_the_job_when_a_node_fails(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                                  "spares": 1}})  # fmt: skip
    lines = SlurmLauncher().render(spec.cluster, "/shared/run/run.json", "llm", "/shared/run", None).splitlines()
    assert "#SBATCH --nodes=3" in lines and "#SBATCH --no-kill" in lines
    srun = next(line for line in lines if line.startswith("srun "))
    assert "--kill-on-bad-exit=0" in srun and "--nnodes=2" in srun
    assert " -m training.preemption " in srun  # a spare left standing at the end exits 0, not 1
    assert "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3" in srun
    plain = make_spec({"cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1}})
    plain_lines = SlurmLauncher().render(plain.cluster, "/shared/run/run.json", "llm", "/shared/run", None)
    assert "#SBATCH --nodes=2" in plain_lines.splitlines() and "--kill-on-bad-exit=1" in plain_lines
    assert " -m torch.distributed.run " in plain_lines and "--no-kill" not in plain_lines


@pytest.mark.parametrize(("result_written", "exit_code"), [(True, 0), (False, 9)])
def test_with_spares_a_failed_slurm_step_ends_the_job_only_when_the_trainer_wrote_no_result(
    make_spec, tmp_path: Path, result_written: bool, exit_code: int
) -> None:
    spec = make_spec({"cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1, "max_restarts": 1,
                                  "spares": 1}})  # fmt: skip
    script = SlurmLauncher().render(spec.cluster, f"{tmp_path}/run.json", "llm", str(tmp_path), None)
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun.endswith(" || finished_with_spares")
    header = script[script.index("result=") : script.index("\n}\n") + 3]  # the function, its file and start time
    written = f"touch {shlex.quote(str(tmp_path / RESULT))}; " if result_written else ""
    # a node lost (its task killed: 137 in the step) after the job finished on the spare, or before anything did
    proc = subprocess.run(["bash", "-c", f"{header}{written}(exit 9) || finished_with_spares"], capture_output=True)
    assert proc.returncode == exit_code, proc
    plain = make_spec({"cluster": {"scheduler": "slurm", "nodes": 2, "procs_per_node": 1}})
    assert "finished_with_spares" not in SlurmLauncher().render(plain.cluster, "/s/run.json", "llm", "/s", None)


def test_kubernetes_renders_spare_worker_pods_in_an_elastic_job_of_exactly_the_nodes(make_spec) -> None:
    spec = make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, "procs_per_node": 1, "max_restarts": 2,
                                  "spares": 1, "kubernetes": {"api": "pytorchjob"}}})  # fmt: skip
    _, job = render_manifests(spec.cluster, spec.training_config(), "llm", "registry/img@sha256:ab")
    validate_pytorchjob(job)
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 2, "maxReplicas": 2,
                                            "maxRestarts": 2}  # fmt: skip
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert list(replicas) == ["Worker"] and replicas["Worker"]["replicas"] == 3
    command = replicas["Worker"]["template"]["spec"]["containers"][0]["command"]
    assert [w for w in command if w.startswith("--rdzv-conf=")] == [
        "--rdzv-conf=keep_alive_interval=1,keep_alive_max_attempt=3"
    ]


def test_a_spare_stands_by_once_the_ranks_met_and_stands_down_when_the_job_ended_first(tmp_path: Path) -> None:
    exits = [tmp_path / "exit-0.txt", tmp_path / "exit-1.txt"]
    for path in exits:
        path.write_text("1")
    assert wait_until_needed(spare_wait_value(tmp_path, 0.0, exits), poll_s=0.01) is False  # ended, no ranks
    RunOutputWriter(str(tmp_path), StorageConfig()).write_ranks(Ranks(world_size=1, ranks=[{"rank": 0}]))
    assert wait_until_needed(spare_wait_value(tmp_path, 0.0, exits), poll_s=0.01) is True


def test_an_ssh_relaunch_without_the_lost_host_keeps_the_spares_there_are_hosts_for() -> None:
    spec = _spec({"scheduler": "ssh", "nodes": 2, "spares": 1, "max_restarts": 1}, nodes={"hosts": HOSTS})
    relaunch = SshLauncher.relaunch_cluster(spec.cluster, "node-1")
    assert relaunch.spares == 0 and [h.name for h in SshLauncher.hosts(relaunch) or []] == ["node-0", "node-2"]


def _ended_job(out: Path, codes: list[int], spare_nodes: list[int]) -> JobHandle:
    """A local job whose agents (the last ones spares) have exited with `codes`."""
    out.mkdir(parents=True, exist_ok=True)
    for node, code in enumerate(codes):
        (out / f"exit-{node}.txt").write_text(f"{code}\n")
    (out / "train.log").write_text("")
    gone = {"pid": 2**22 + 1, "start_time": "1"}
    return JobHandle("local", "job-1", "job", str(out), str(out / "train.log"), time.time() - 10,
                     details={"agents": [gone] * len(codes), "spare_nodes": spare_nodes})  # fmt: skip


def test_a_local_job_whose_spare_took_a_lost_nodes_place_succeeded_once_it_wrote_its_result(tmp_path: Path) -> None:
    handle = _ended_job(tmp_path / "out", [0, 137, 0], spare_nodes=[2])
    assert LocalLauncher().status(handle).state is JobState.FAILED  # no result: the job did not finish
    (tmp_path / "out" / RESULT).write_text("{}")
    status = LocalLauncher().status(handle)
    assert status.state is JobState.SUCCEEDED and status.exit_code == 0
    assert status.reason == "finished on 2 of 3 agents (hot spares); not finishing: node 1 (host unknown, exit 137)"
    unused = _ended_job(tmp_path / "unused", [0, 0, 1], spare_nodes=[2])  # the spare stood by to the end
    (tmp_path / "unused" / RESULT).write_text("{}")
    assert LocalLauncher().status(unused).state is JobState.SUCCEEDED
    plain = _ended_job(tmp_path / "plain", [0, 137], spare_nodes=[])
    (tmp_path / "plain" / RESULT).write_text("{}")
    assert LocalLauncher().status(plain).state is JobState.FAILED  # without spares a lost node fails the job


def test_a_standby_agent_sees_its_children_start_and_end() -> None:
    probe = (
        "import subprocess, sys\n"
        "from tasks.launch.spares import _has_children\n"
        "seen = [_has_children()]\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "seen.append(_has_children())\n"
        "child.kill(); child.wait()\n"
        "seen.append(_has_children())\n"
        "print(seen)\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.stdout.strip() == "[False, True, False]", out.stderr
