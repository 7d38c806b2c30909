"""Rung 5: each launcher leaves hosts out of a requeued job its own way (Slurm --exclude, Kubernetes node affinity,
the SSH inventory less the host; a local job has no other host), and refuses names that are not host names."""

from __future__ import annotations

import pytest

from tasks.errors import UserError
from tasks.launch.kubernetes import KubernetesLauncher, render_manifests, validate_pytorchjob
from tasks.launch.local import LocalLauncher
from tasks.launch.slurm import SlurmLauncher
from tasks.launch.ssh import SshLauncher
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge

PATHS = {"data": {"dataset_url": "/data/ds"}, "checkpoint": {"url": "/shared/ck"}, "run": {"output_url": "/shared/o"}}
HOSTS = [{"name": f"node-{n}", "address": f"10.0.0.{n + 1}"} for n in (1, 2, 3, 4)]
HOSTILE = ["node-1,node-9", "node[1-3]", "/etc/hosts", "node-1 --uid=0", "-x", "node-1\n#SBATCH --uid=0", "", "$(id)"]


def _cluster(cluster: dict):  # noqa: ANN202 - the spec's ClusterConfig
    return parse_spec(deep_merge(deep_merge(TINY_SPEC, PATHS), {"cluster": cluster}), "tiny").cluster


def test_slurm_requeue_excludes_the_hosts_in_the_sbatch_script_beside_the_specs_own_exclude() -> None:
    cluster = _cluster({"scheduler": "slurm", "nodes": 2, "procs_per_node": 1,
                        "slurm": {"extra_args": ["--exclusive", "--exclude=gpu[05-06]"]}})  # fmt: skip
    requeued = SlurmLauncher.excluding(cluster, ["node-3", "node-2"])
    script = SlurmLauncher().render(requeued, "/shared/o/run.json", "llm", "/shared/o", None).splitlines()
    assert "#SBATCH --exclude=gpu[05-06],node-2,node-3" in script
    assert "#SBATCH --exclusive" in script and sum(line.startswith("#SBATCH --exclude") for line in script) == 1
    assert cluster.slurm.extra_args == ["--exclusive", "--exclude=gpu[05-06]"]  # the spec's own cluster unchanged
    plain = SlurmLauncher.excluding(_cluster({"scheduler": "slurm", "nodes": 1, "procs_per_node": 1}), ["node-1"])
    assert plain.slurm.extra_args == ["--exclude=node-1"]


def test_kubernetes_requeue_renders_a_node_affinity_away_from_the_hosts_that_the_schema_accepts() -> None:
    cluster = _cluster({"scheduler": "kubernetes", "kubernetes": {"api": "pytorchjob"}, "nodes": 2,
                        "procs_per_node": 1})
    requeued = KubernetesLauncher.excluding(cluster, ["gpu-node-7", "gpu-node-3"])
    train = parse_spec(deep_merge(TINY_SPEC, PATHS), "tiny").training_config()
    _, job = render_manifests(requeued, train, "llm", "registry/img@sha256:ab")
    validate_pytorchjob(job)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        affinity = replica["template"]["spec"]["affinity"]["nodeAffinity"]
        terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        away = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["gpu-node-3", "gpu-node-7"]}
        assert terms == [{"matchExpressions": [away]}]
    _, untouched = render_manifests(cluster, train, "llm", "registry/img@sha256:ab")
    assert "affinity" not in untouched["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    with pytest.raises(UserError, match="Kubernetes node name"):
        KubernetesLauncher.excluding(cluster, ["Node_7"])  # a host name, but not a Kubernetes node name


def test_ssh_requeue_runs_on_the_inventory_less_the_host_and_refuses_when_too_few_are_left() -> None:
    cluster = _cluster({"scheduler": "ssh", "nodes": 2, "procs_per_node": 1, "ssh": {"hosts": HOSTS}})
    requeued = SshLauncher.excluding(cluster, ["node-2"])
    assert [h.name for h in SshLauncher.hosts(requeued)] == ["node-1", "node-3"]
    assert [h.name for h in requeued.ssh.hosts] == ["node-1", "node-3", "node-4"]
    with pytest.raises(UserError, match="without node-1, node-2, node-3 1 are left"):
        SshLauncher.excluding(cluster, ["node-1", "node-2", "node-3"])


def test_a_local_job_has_no_host_to_leave_out() -> None:
    cluster = _cluster({"scheduler": "local", "nodes": 2, "procs_per_node": 1})
    assert LocalLauncher.excluding(cluster, ["vm"]) is cluster


@pytest.mark.parametrize("launcher", [SlurmLauncher, KubernetesLauncher, SshLauncher, LocalLauncher])
@pytest.mark.parametrize("host", HOSTILE)
def test_a_hostile_host_name_is_refused_at_the_boundary(launcher, host: str) -> None:
    scheduler = {SlurmLauncher: "slurm", KubernetesLauncher: "kubernetes", SshLauncher: "ssh", LocalLauncher: "local"}
    cluster = _cluster({"scheduler": scheduler[launcher], "nodes": 1, "procs_per_node": 1, "ssh": {"hosts": HOSTS}}
                       if launcher is SshLauncher else {"scheduler": scheduler[launcher], "nodes": 1,
                                                        "procs_per_node": 1})  # fmt: skip
    with pytest.raises(UserError, match="cannot be excluded: it is not a host name"):
        launcher.excluding(cluster, ["node-1", host])
