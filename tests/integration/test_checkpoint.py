"""Checkpoints under real torchrun: kill and resume bit for bit, partial and corrupt ones skipped,
resharding 2 -> 1, pruning, and an S3-compatible store."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from tasks.launch.base import JobState
from tasks.launch.local import LocalJob, run_local, start_local
from tasks.spec import parse_spec
from tests.conftest import TINY_SPEC, deep_merge, metrics_by_step
from tests.faults.job import injected
from training.checkpoint import KEY_ENV, CheckpointManager
from training.model import Transformer
from training.run_output import RunOutput
from training.storage import StorageConfig, filesystem
from training.train import build_optimizer

pytestmark = pytest.mark.integration

STEPS_30 = {"run": {"steps": 30}, "checkpoint": {"save_every_steps": 10}}


def _wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _paused_job(spec, pause_after_step: int, committed_step: int) -> LocalJob:  # noqa: ANN001
    """Start a job that hangs after `pause_after_step`, and wait until it got there and its (background) save of
    `committed_step` is committed."""
    job = start_local(
        spec.cluster, spec.training_config(), environment=injected(pause_after_step=pause_after_step)
    )
    run = RunOutput(spec.run.output_url)
    _wait_for(lambda: pause_after_step in run.metrics(1), "the pause")
    commit = Path(spec.checkpoint.url) / f"step-{committed_step:08d}" / "COMMIT.json"
    _wait_for(commit.exists, f"the commit of step {committed_step}")
    return job


def _kill_rank(output_dir: Path, rank: int) -> None:
    ranks = RunOutput(output_dir).ranks().ranks
    os.kill(next(r["pid"] for r in ranks if r["rank"] == rank), signal.SIGKILL)


def _assert_identical_after(reference: dict, resumed: dict, first: int, last: int) -> None:
    for step in range(first, last + 1):
        assert resumed[step].loss == reference[step].loss, f"step {step} differs"
        assert resumed[step].grad_norm == reference[step].grad_norm, f"step {step} differs"


@pytest.fixture(scope="module")
def uninterrupted_30(tiny_dataset: str, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    """Per-step metrics of the uninterrupted 30-step job that the kill-and-resume tests must reproduce (run once:
    the same job for each of them, deterministic on CPU)."""
    root = tmp_path_factory.mktemp("uninterrupted-30")
    paths = {
        "data": {"dataset_url": tiny_dataset},
        "checkpoint": {"url": str(root / "checkpoints")},
        "run": {"output_url": str(root / "output")},
    }
    spec = parse_spec(deep_merge(deep_merge(TINY_SPEC, paths), STEPS_30), "tiny:uninterrupted-30")
    run_local(spec.cluster, spec.training_config())
    return metrics_by_step(spec.run.output_url)


def test_killed_rank_relaunch_resumes_bit_identical(make_spec, uninterrupted_30: dict[int, dict]) -> None:
    spec = make_spec(STEPS_30, name="killed")
    job = _paused_job(spec, 25, committed_step=20)
    _kill_rank(job.output_dir, 1)
    assert job.wait(timeout_s=120).state is JobState.FAILED
    assert "exitcode  : -9" in job.log_tail(200)

    run_local(spec.cluster, spec.training_config())  # the relaunch
    assert RunOutput(job.output_dir).ranks().ranks[0]["resumed_from_step"] == 20
    _assert_identical_after(uninterrupted_30, metrics_by_step(spec.run.output_url), 21, 30)


def test_torchrun_restarts_a_killed_rank_and_the_job_recovers_by_itself(
    make_spec, uninterrupted_30: dict[int, dict]
) -> None:
    spec = make_spec({**STEPS_30, "cluster": {"max_restarts": 1}}, name="elastic")
    job = _paused_job(spec, 25, committed_step=20)
    _kill_rank(job.output_dir, 1)
    assert job.wait(timeout_s=180).state is JobState.SUCCEEDED
    ranks = RunOutput(job.output_dir).ranks().ranks
    assert {r["restart_count"] for r in ranks} == {1} and ranks[0]["resumed_from_step"] == 20
    _assert_identical_after(uninterrupted_30, metrics_by_step(spec.run.output_url), 21, 30)


def test_checkpoint_killed_mid_save_is_never_loaded(make_spec) -> None:
    spec = make_spec(STEPS_30)
    job = start_local(spec.cluster, spec.training_config(), environment=injected(kill_during_save_step=20))
    assert job.wait(timeout_s=120).state is JobState.FAILED
    partial = Path(spec.checkpoint.url) / "step-00000020"
    assert partial.exists() and not (partial / "COMMIT.json").exists()

    again = run_local(spec.cluster, spec.training_config())
    log = again.log_tail(400)
    assert f"skipping partial checkpoint {partial}: no COMMIT.json" in log
    assert RunOutput(again.output_dir).ranks().ranks[0]["resumed_from_step"] == 10
    assert (partial / "COMMIT.json").exists()  # saved properly this time


def test_corrupt_checkpoint_is_detected_and_the_previous_one_used(make_spec) -> None:
    spec = make_spec({"run": {"steps": 20}, "checkpoint": {"save_every_steps": 10}})
    run_local(spec.cluster, spec.training_config())
    newest = Path(spec.checkpoint.url) / "step-00000020"
    shard = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))

    longer = make_spec({"run": {"steps": 25}, "checkpoint": {"save_every_steps": 10}})
    again = run_local(longer.cluster, longer.training_config())
    assert f"skipping corrupt checkpoint {newest}: {shard.name} fails its sha256 check" in again.log_tail(400)
    assert RunOutput(again.output_dir).ranks().ranks[0]["resumed_from_step"] == 10


def test_a_bug_on_one_rank_inside_a_save_stops_every_rank_even_when_lost_saves_are_tolerated(make_spec) -> None:
    spec = make_spec({**STEPS_30, "checkpoint": {"save_every_steps": 10, "continue_on_save_failure": True}})
    job = start_local(spec.cluster, spec.training_config(), environment=injected(save_bug_rank=1))
    assert job.wait(timeout_s=120).state is JobState.FAILED
    log = job.log_tail(400)
    assert "TypeError: test fault: a bug inside the checkpoint save of step 10 on rank 1" in log
    assert "checkpoint of step 10 lost" not in log and "retrying" not in log
    assert not (Path(spec.checkpoint.url) / "step-00000010" / "COMMIT.json").exists()


def test_a_signed_two_rank_checkpoint_resumes_with_its_key_and_is_refused_without_it(
    make_spec, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, "a-test-key-of-32-characters-000")  # the operator's secret, in its environment
    spec = make_spec({"run": {"steps": 10}, "checkpoint": {"save_every_steps": 10}})
    run_local(spec.cluster, spec.training_config())
    assert "hmac_sha256" in json.loads((Path(spec.checkpoint.url) / "step-00000010" / "COMMIT.json").read_text())

    longer = make_spec({"run": {"steps": 12}, "checkpoint": {"save_every_steps": 10}})
    job = run_local(longer.cluster, longer.training_config())
    assert RunOutput(job.output_dir).ranks().ranks[0]["resumed_from_step"] == 10

    monkeypatch.delenv(KEY_ENV)
    unkeyed = start_local(longer.cluster, longer.training_config())
    assert unkeyed.wait(timeout_s=120).state is JobState.FAILED
    assert f"is signed (hmac_sha256) but {KEY_ENV} is not set" in unkeyed.log_tail(400)


def test_only_the_last_k_checkpoints_are_kept(make_spec) -> None:
    spec = make_spec({"run": {"steps": 40}, "checkpoint": {"save_every_steps": 10, "keep_last": 2}})
    run_local(spec.cluster, spec.training_config())
    kept = sorted(p.name for p in Path(spec.checkpoint.url).iterdir() if p.name.startswith("step-"))
    assert kept == ["step-00000030", "step-00000040"]


def test_two_rank_checkpoint_resumes_on_one_rank_with_model_and_optimizer_state(make_spec) -> None:
    """Resharding 2 -> 1: with the global batch kept (micro-batch doubled), the loss continues
    where the two-rank run would have gone; fresh optimizer moments would derail it at once.
    A constant LR keeps the schedule independent of run.steps (10 for the first leg, 14 after)."""
    constant = {"optim": {"schedule": "constant"}}
    plan = {**constant, "run": {"steps": 14}, "checkpoint": {"save_every_steps": 10}}
    reference = make_spec(plan, name="reference")
    run_local(reference.cluster, reference.training_config())

    two = make_spec({**constant, "run": {"steps": 10}, "checkpoint": {"save_every_steps": 10}}, name="resharded")
    run_local(two.cluster, two.training_config())
    one = make_spec({**plan, "cluster": {"procs_per_node": 1}, "parallel": {"micro_batch": 8}}, name="resharded")
    job = run_local(one.cluster, one.training_config())
    assert "was saved by 2 ranks and is loaded by 1: model and optimizer resharded" in job.log_tail(400)
    ref, got = metrics_by_step(reference.run.output_url), metrics_by_step(one.run.output_url)
    for step in range(11, 15):
        assert got[step].loss == pytest.approx(ref[step].loss, rel=1e-5), step

    # and the state itself: a lone process loads the newest checkpoint (step 14, after the 2 -> 1 resume)
    cfg = one.training_config()
    model = Transformer(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    manager = CheckpointManager(cfg.checkpoint.model_copy(update={"keep_last": 5}), cfg.storage)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    restored = manager.load_latest(model, optimizer)
    assert restored is not None and restored.step == 14
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    states = list(optimizer.state.values())
    assert len(states) == len(list(model.parameters()))
    assert all(float(s["step"]) == restored.step for s in states)
    assert all(s["exp_avg_sq"].abs().sum() > 0 for s in states)


def test_checkpoints_and_dataset_on_s3(make_spec, s3_endpoint: str, s3_bucket: str, tiny_dataset: str) -> None:
    storage = StorageConfig(s3_endpoint_url=s3_endpoint)
    fs, _ = filesystem(f"s3://{s3_bucket}", storage)
    fs.put(tiny_dataset, f"{s3_bucket}/data", recursive=True)
    remote = {
        "storage": {"s3_endpoint_url": s3_endpoint},
        "data": {"dataset_url": f"s3://{s3_bucket}/data"},
        "checkpoint": {"url": f"s3://{s3_bucket}/ckpt", "save_every_steps": 5},
    }
    spec = make_spec({**remote, "run": {"steps": 10}})
    run_local(spec.cluster, spec.training_config())
    commit = json.loads(fs.cat_file(f"{s3_bucket}/ckpt/step-00000010/COMMIT.json"))
    assert commit["world_size"] == 2 and any(name.endswith(".distcp") for name in commit["files"])

    longer = make_spec({**remote, "run": {"steps": 14}})
    job = run_local(longer.cluster, longer.training_config())
    assert RunOutput(job.output_dir).ranks().ranks[0]["resumed_from_step"] == 10
    assert sorted(n for p in fs.ls(f"{s3_bucket}/ckpt") if (n := p.rsplit("/", 1)[-1]).startswith("step-")) == [
        "step-00000005",
        "step-00000010",
        "step-00000014",
    ]
