"""Schedulers live in their launchers: one registry line adds one, and callers ask capabilities, not names.

The stub scheduler below is all a new scheduler needs: a settings model, a launcher class and one `register`
call. Nothing outside this module knows it, yet it passes spec validation, the job step's submission and the
acceptance workspace's rank kill. The second half pins each real launcher's capabilities to what the callers'
branches on `cluster.scheduler` said before they moved into the launchers.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pydantic import Field

from tasks.acceptance.workspace import Job
from tasks.errors import UserError
from tasks.hosts import NodeHost
from tasks.launch import registry
from tasks.launch.base import Capabilities, JobHandle, JobState, JobStatus, Launcher, read_log
from tasks.launch.cluster import ClusterConfig
from tasks.launch.config import SshLaunchConfig
from tasks.launch.environment import JobEnvironment
from tasks.launch.kubernetes import KubernetesLauncher
from tasks.launch.local import LocalLauncher
from tasks.launch.slurm import SlurmLauncher
from tasks.launch.ssh import SshLauncher
from tasks.launch.step import JobInputs, run
from tasks.nodes.config import NodesConfig
from tasks.nodes.inventory import default_hosts, rendezvous_port
from tasks.spec import DeploymentSpec, SpecError, parse_spec
from tests import processes
from tests.conftest import TINY_SPEC, deep_merge
from training.config import StrictModel, TrainConfig
from training.run_output import Ranks, RunOutputWriter
from training.storage import local_path

# ---- a whole new scheduler, in this module only ---------------------------------------------------------------


class StubSettings(StrictModel):
    """cluster.settings of the stub scheduler."""

    queue: str = Field(pattern=r"^[a-z]+$", description="The stub's queue: lowercase letters.")


class StubLauncher(Launcher):
    """Runs each job as one sleeping process on this machine that records itself as rank 0."""

    scheduler = "stub"
    capabilities = Capabilities(
        runs_image=False,
        runs_on_this_machine_only=False,
        needs_shared_output=False,
        delivers_signals=False,
        can_lose_node=False,
        replaces_lost_host=False,
    )
    jobs: ClassVar[dict[str, subprocess.Popen[bytes]]] = {}

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        self.env = dict(env or {})

    @classmethod
    def cluster_problems(cls, cluster: ClusterConfig) -> list[tuple[tuple[str, ...], Any, str]]:
        if cluster.nodes != 1:
            return [(("nodes",), cluster.nodes, "the stub runs one node; set cluster.nodes: 1")]
        return []

    def submit(
        self,
        cluster: ClusterConfig,
        train: TrainConfig,
        name: str,
        image: str | None = None,
        *,
        environment: JobEnvironment | None = None,
        supervised: bool = True,
    ) -> JobHandle:
        queue = StubSettings.model_validate(cluster.settings).queue
        out = Path(local_path(train.run.output_url))
        out.mkdir(parents=True, exist_ok=True)
        log = out / "stub.log"
        sleeper = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(120)"]
        with log.open("wb") as sink:
            proc = processes.start_group(sleeper, stdout=sink, stderr=subprocess.STDOUT)
        rank_0 = {"rank": 0, "host": socket.gethostname(), "pid": proc.pid}
        RunOutputWriter(str(out), train.storage).write_ranks(Ranks(world_size=1, ranks=[rank_0]))
        handle = JobHandle(self.scheduler, str(proc.pid), name, str(out), str(log), details={"queue": queue})
        self.jobs[handle.job_id] = proc
        return handle

    def status(self, handle: JobHandle) -> JobStatus:
        code = self.jobs[handle.job_id].poll()
        if code is None:
            return JobStatus(JobState.RUNNING, "sleeping")
        return JobStatus(JobState.SUCCEEDED if code == 0 else JobState.FAILED, f"exit {code}", exit_code=code)

    def logs(self, handle: JobHandle, offset: int = 0) -> tuple[list[str], int]:
        return read_log(handle.log_path, offset)

    def cancel(self, handle: JobHandle) -> None:
        processes.stop_group(self.jobs[handle.job_id])

    def kill_rank(self, handle: JobHandle, rank: Mapping[str, Any], sig: int) -> None:
        os.kill(rank["pid"], sig)


STUB_CLUSTER = {"scheduler": "stub", "nodes": 1, "procs_per_node": 1, "settings": {"queue": "fast"}}


@pytest.fixture
def stub_registered() -> Iterator[None]:
    registry.register(StubLauncher, StubSettings)
    yield
    registry.unregister("stub")
    for proc in StubLauncher.jobs.values():
        processes.stop_group(proc)
    StubLauncher.jobs.clear()


def _stub_spec(tmp_path: Path, cluster: dict[str, Any] | None = None) -> DeploymentSpec:
    paths = {"run": {"output_url": "s3://bucket/stub-output"}, "checkpoint": {"url": str(tmp_path / "ckpt")}}
    return parse_spec(deep_merge(deep_merge(TINY_SPEC, paths), {"cluster": cluster or STUB_CLUSTER}))


def test_an_unregistered_scheduler_is_refused_with_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        _stub_spec(tmp_path)
    assert any(
        p.startswith("cluster.scheduler=stub: must be one of 'local', 'ssh', 'slurm' or 'kubernetes'")
        for p in caught.value.problems
    ), caught.value.problems


def test_a_registered_stub_scheduler_passes_validation_with_its_own_settings_and_checks(
    tmp_path: Path, stub_registered: None
) -> None:
    spec = _stub_spec(tmp_path)  # an object-store output is fine: the stub needs no shared folder
    assert spec.cluster.scheduler == "stub" and StubSettings.model_validate(spec.cluster.settings).queue == "fast"

    with pytest.raises(SpecError) as caught:
        _stub_spec(tmp_path, {**STUB_CLUSTER, "settings": {"queue": "Fast!"}})
    assert any(p.startswith("cluster.settings.queue=Fast!:") for p in caught.value.problems), caught.value.problems

    with pytest.raises(SpecError) as caught:
        _stub_spec(tmp_path, {**STUB_CLUSTER, "nodes": 2})
    assert "cluster.nodes=2: the stub runs one node; set cluster.nodes: 1" in caught.value.problems


def test_settings_are_refused_for_a_scheduler_that_registered_no_model(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(deep_merge(TINY_SPEC, {"cluster": {"settings": {"queue": "fast"}}}))
    assert any(
        p.startswith("cluster.settings={...}: scheduler=local takes no settings; remove it")
        for p in caught.value.problems
    ), caught.value.problems


def test_a_registered_stub_scheduler_is_submitted_by_the_job_step_and_its_rank_killed_by_acceptance(
    tmp_path: Path, stub_registered: None
) -> None:
    spec = _stub_spec(tmp_path)
    train = spec.training_config(dataset_url=str(tmp_path / "dataset"))
    train = train.model_copy(update={"run": train.run.model_copy(update={"output_url": str(tmp_path / "out")})})

    submitted = run(JobInputs(cluster=spec.cluster, train=train, name="stub-job", wait_until="submitted"))
    assert submitted.job.startswith("stub:") and submitted.handle["details"] == {"queue": "fast"}
    StubLauncher().cancel(JobHandle.from_json(submitted.handle))

    job = Job(spec.cluster, train, "stub-rank-kill", None, None)
    job.wait_until(lambda: "started" in Path(job.handle.log_path).read_text(), "the stub's start", 60)
    killed = job.kill_rank(0, signal.SIGKILL)
    assert killed["pid"] == int(job.handle.job_id)
    assert job.launcher.wait(job.handle, timeout_s=60).exit_code == -signal.SIGKILL


# ---- the real launchers answer what the callers' branches said --------------------------------------------------

OLD_BRANCHES = {
    # scheduler: (image step may skip: scheduler in (local, ssh); tdeploy train: == local;
    #             output_url a folder: in (local, ssh, slurm); preemption drill: delivers_signals() of local/ssh;
    #             node-loss drill: in (local, ssh), and slurm since its kill_node; lost host must be gone: == ssh)
    "local": (True, True, True, True, True, False),
    "ssh": (True, False, True, True, True, True),
    "slurm": (False, False, True, False, True, False),
    "kubernetes": (False, False, False, False, False, False),
}


@pytest.mark.parametrize("scheduler", list(OLD_BRANCHES))
def test_each_launcher_has_the_capabilities_the_old_branches_gave_its_scheduler(scheduler: str) -> None:
    skip_image, this_machine, folder_output, signals, lose_node, replace_host = OLD_BRANCHES[scheduler]
    assert registry.capabilities(scheduler) == Capabilities(
        runs_image=not skip_image,
        runs_on_this_machine_only=this_machine,
        needs_shared_output=folder_output,
        delivers_signals=signals,
        can_lose_node=lose_node,
        replaces_lost_host=replace_host,
        has_hot_spares=True,  # cluster.spares: every built-in scheduler keeps them (tasks/launch/spares.py)
        live_recovery=scheduler in ("local", "ssh", "slurm"),  # replica_supervisor.py; SSH, Slurm: one per node
        replica_group_per_node=scheduler in ("ssh", "slurm"),
    )


def test_the_registry_is_the_one_dispatcher_of_every_built_in_scheduler() -> None:
    kinds = {"local": LocalLauncher, "ssh": SshLauncher, "slurm": SlurmLauncher, "kubernetes": KubernetesLauncher}
    assert registry.names() == list(kinds)
    assert {name: registry.launcher_class(name) for name in kinds} == kinds
    with pytest.raises(UserError, match=r"cluster\.scheduler=pbs: unknown; use local, ssh, slurm or kubernetes"):
        registry.launcher_for("pbs")


def test_node_checks_ask_the_launcher_for_hosts_and_rendezvous_port() -> None:
    nodes = NodesConfig()
    local = ClusterConfig(procs_per_node=1, rdzv_port=29111)
    slurm = ClusterConfig(scheduler="slurm", procs_per_node=1, rdzv_port=29111, slurm={"rdzv_port": 29222})
    assert default_hosts(nodes, local) == [NodeHost(name="localhost", connection="local")]
    with pytest.raises(UserError, match="cluster.scheduler=slurm runs on other machines"):
        default_hosts(nodes, slurm)
    assert rendezvous_port(nodes, local, 1) == 29111 and rendezvous_port(nodes, slurm, 2) == 29222


def test_an_ssh_relaunch_after_a_lost_host_takes_a_spare_and_the_others_keep_theirs() -> None:
    hosts = [{"name": f"node-{i}"} for i in range(3)]
    ssh = ClusterConfig(scheduler="ssh", nodes=2, procs_per_node=1, ssh=SshLaunchConfig(hosts=hosts))
    relaunch = SshLauncher.relaunch_cluster(ssh, "node-0")
    assert [h.name for h in SshLauncher.hosts(relaunch) or []] == ["node-1", "node-2"]
    assert SshLauncher.relaunch_cluster(relaunch, "node-1") is relaunch  # no spare left: the same hosts
    local = ClusterConfig(nodes=2, procs_per_node=1)
    assert LocalLauncher.relaunch_cluster(local, "localhost") is local


def test_slurm_kills_a_rank_on_this_host_without_srun(tmp_path: Path) -> None:
    proc = processes.start_group([sys.executable, "-c", "import time; time.sleep(120)"])
    handle = JobHandle("slurm", "1", "t", str(tmp_path), str(tmp_path / "log"))
    launcher = SlurmLauncher({"PATH": str(tmp_path)})  # no srun on this PATH: the kill must not need it
    launcher.kill_rank(handle, {"rank": 0, "host": socket.gethostname(), "pid": proc.pid}, signal.SIGKILL)
    assert proc.wait(timeout=60) == -signal.SIGKILL
    with pytest.raises(UserError, match="`srun` is not on PATH"):
        launcher.kill_rank(handle, {"rank": 1, "host": "elsewhere", "pid": 1}, signal.SIGKILL)
