"""KubernetesLauncher through the real `kubernetes` client against a fake API server (tests/.../fake_kube.py).

No kube-apiserver runs on the CI machine; the fake keeps what the launcher creates and answers reads as the
Trainer, JobSet and Training Operator controllers would leave them (the tests set their status and add pods).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.errors import UserError
from tasks.launch.base import JobState
from tasks.launch.kubernetes import KubernetesLauncher, render_manifests
from tasks.launch.trainjob import COMPLETION_INDEX_LABEL, JOBSET_NAME_LABEL
from tests.integration.launch.fake_kube import FakeKube
from training.preemption import PREEMPTED_EXIT_CODE


@pytest.fixture
def kube(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeKube]:
    with FakeKube() as fake:
        monkeypatch.setenv("KUBECONFIG", str(fake.kubeconfig(tmp_path / "kubeconfig")))
        yield fake


def _spec(make_spec, api: str, **kubernetes):
    return make_spec({"cluster": {"scheduler": "kubernetes", "nodes": 2, "procs_per_node": 1,
                                  "kubernetes": {"api": api, "namespace": "train", **kubernetes}}})  # fmt: skip


def _terminated(code: int, container: str) -> dict:
    return {"containerStatuses": [{"name": container, "ready": False, "restartCount": 0, "image": "img",
                                   "imageID": "", "state": {"terminated": {"exitCode": code}}}]}  # fmt: skip


def test_a_trainjob_is_created_watched_read_and_deleted_through_the_api(make_spec, kube: FakeKube) -> None:
    spec = _spec(make_spec, "trainjob", render_runtime=True)
    launcher = KubernetesLauncher()
    handle = launcher.submit(spec.cluster, spec.training_config(), "llm", "reg/img:1")
    rendered = render_manifests(spec.cluster, spec.training_config(), "llm", "reg/img:1")
    job = kube.objects[("trainjobs", "train", "llm")]
    assert job["spec"] == rendered[-1]["spec"]
    assert kube.objects[("configmaps", "train", "llm-config")]["data"] == rendered[0]["data"]
    assert ("clustertrainingruntimes", "", "torch-distributed") in kube.objects
    assert launcher.status(handle).state is JobState.PENDING

    job["status"] = {"jobsStatus": [{"name": "node", "active": 2, "ready": 2}]}
    assert launcher.status(handle).state is JobState.RUNNING
    labels = {JOBSET_NAME_LABEL: "llm", COMPLETION_INDEX_LABEL: "0"}
    kube.add_pod("train", "llm-node-0-0-abcde", labels, "node")
    kube.add_pod("train", "llm-node-0-1-fghij", {**labels, COMPLETION_INDEX_LABEL: "1"}, "node")
    kube.logs[("train", "llm-node-0-0-abcde")] = "step 1\nstep 2\nstep 3\n"
    kube.logs[("train", "llm-node-0-1-fghij")] = "node 1\n"
    assert launcher.logs(handle, 1) == (["step 2", "step 3"], 3)
    assert launcher.queue_seconds(handle) is None  # the fake's pods never started

    job["status"]["conditions"] = [{"type": "Complete", "status": "True", "reason": "JobsCompleted", "message": "",
                                    "lastTransitionTime": "2026-01-01T00:00:00Z"}]  # fmt: skip
    assert launcher.status(handle).state is JobState.SUCCEEDED
    launcher.cancel(handle)
    assert ("trainjobs", "train", "llm") not in kube.objects

    # a second job keeps the runtime that now exists (409 from the API), and is created all the same
    again = launcher.submit(spec.cluster, spec.training_config(), "llm2", "reg/img:1")
    assert ("trainjobs", "train", "llm2") in kube.objects and again.details["api"] == "trainjob"


def test_a_failed_trainjob_whose_trainer_exited_75_is_preempted_and_one_that_exited_1_failed(
    make_spec, kube: FakeKube
) -> None:
    spec = _spec(make_spec, "trainjob")
    launcher = KubernetesLauncher()
    handle = launcher.submit(spec.cluster, spec.training_config(), "llm", "reg/img:1")
    assert ("clustertrainingruntimes", "", "torch-distributed") not in kube.objects  # render_runtime off
    failed = {"type": "Failed", "status": "True", "reason": "JobSetFailed", "message": "jobset failed",
              "lastTransitionTime": "2026-01-01T00:00:00Z"}  # fmt: skip
    kube.objects[("trainjobs", "train", "llm")]["status"] = {"conditions": [failed]}
    kube.add_pod("train", "llm-node-0-0-a", {JOBSET_NAME_LABEL: "llm"}, "node", **_terminated(1, "node"))
    status = launcher.status(handle)
    assert (status.state, status.reason) == (JobState.FAILED, "jobset failed")
    kube.add_pod("train", "llm-node-0-1-b", {JOBSET_NAME_LABEL: "llm"}, "node",
                 **_terminated(PREEMPTED_EXIT_CODE, "node"))  # fmt: skip
    status = launcher.status(handle)
    assert status.state is JobState.PREEMPTED and "llm-node-0-1-b" in status.reason
    assert "llm-node-0-0-a: exit 1" in status.reason


def test_a_pytorchjob_is_created_watched_read_and_deleted_through_the_api(make_spec, kube: FakeKube) -> None:
    spec = _spec(make_spec, "pytorchjob")
    launcher = KubernetesLauncher()
    handle = launcher.submit(spec.cluster, spec.training_config(), "llm", "reg/img:1")
    job = kube.objects[("pytorchjobs", "train", "llm")]
    assert job["kind"] == "PyTorchJob" and set(job["spec"]["pytorchReplicaSpecs"]) == {"Master", "Worker"}
    assert launcher.status(handle).state is JobState.PENDING
    job["status"] = {"conditions": [{"type": "Running", "reason": "PyTorchJobRunning"}]}
    assert launcher.status(handle).state is JobState.RUNNING
    kube.add_pod("train", "llm-master-0", {"training.kubeflow.org/job-name": "llm"}, "pytorch")
    kube.logs[("train", "llm-master-0")] = "a\nb\n"
    assert launcher.logs(handle) == (["a", "b"], 2)
    job["status"]["conditions"].append({"type": "Failed", "reason": "PyTorchJobFailed"})
    kube.objects[("pods", "train", "llm-master-0")]["status"] = _terminated(PREEMPTED_EXIT_CODE, "pytorch")
    assert launcher.status(handle).state is JobState.PREEMPTED
    launcher.cancel(handle)
    assert ("pytorchjobs", "train", "llm") not in kube.objects


@pytest.mark.parametrize("api", ["trainjob", "pytorchjob"])
def test_a_rank_kill_signals_the_ranks_process_through_an_exec_in_its_pod(
    make_spec, kube: FakeKube, api: str
) -> None:
    spec = _spec(make_spec, api)
    launcher = KubernetesLauncher()
    handle = launcher.submit(spec.cluster, spec.training_config(), "llm", "reg/img:1")
    label = JOBSET_NAME_LABEL if api == "trainjob" else "training.kubeflow.org/job-name"
    trainer = "node" if api == "trainjob" else "pytorch"
    kube.add_pod("train", "llm-node-0-1-xyz", {label: "llm"}, trainer, hostname="llm-node-0-1")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # the "rank" runs here
    try:
        launcher.kill_rank(handle, {"rank": 1, "host": "llm-node-0-1", "pid": rank.pid}, signal.SIGKILL)
        assert rank.wait(timeout=30) == -signal.SIGKILL
    finally:
        if rank.poll() is None:
            rank.kill()
            rank.wait()
    assert kube.execs[-1] == {"namespace": "train", "pod": "llm-node-0-1-xyz", "container": trainer,
                              "argv": ["kill", f"-{int(signal.SIGKILL)}", str(rank.pid)]}  # fmt: skip
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it (a reaped pid may be reused)
    with pytest.raises(UserError, match=rf"kill -9 {gone} in pod llm-node-0-1-xyz exited 1"):
        launcher.kill_rank(handle, {"rank": 1, "host": "llm-node-0-1", "pid": gone}, signal.SIGKILL)
    with pytest.raises(UserError, match="no pod of .* is host 'elsewhere'"):
        launcher.kill_rank(handle, {"rank": 0, "host": "elsewhere", "pid": 1}, signal.SIGKILL)
