"""The training payload under real torchrun with gloo: learning, data coverage, parallelism, precision."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tasks.launch.base import JobState
from tasks.launch.local import TrainingFailed, run_local, start_local
from tests.conftest import metrics_by_step, run_lone_process
from tests.faults.job import injected
from tests.processes import run_group
from training.dataset import DatasetWriter, TokenDataset, TokenizerInfo
from training.lease import LEASE_FILE, Lease
from training.run_output import RunOutput
from training.sampler import GlobalBatchSampler

pytestmark = pytest.mark.integration


def _small_dataset(url: str) -> None:
    """About 170 samples of 32 tokens: an epoch is a handful of steps."""
    rng = np.random.default_rng(0)
    with DatasetWriter(url, 257, TokenizerInfo(kind="bytes"), eos_id=256, shard_tokens=2000) as writer:
        for i in range(120):
            doc = rng.integers(97, 123, size=int(rng.integers(20, 70)))
            writer.add_document("val" if i % 10 == 0 else "train", doc)


def test_two_process_run_learns(make_spec) -> None:
    # gloo on the loopback interface: the rendezvous is on 127.0.0.1, so the network section stays harmless
    network = {"interface": "lo", "collective_timeout_s": 900, "rdzv_timeout_s": 120, "nccl": {"debug": "WARN"}}
    spec = make_spec({"run": {"steps": 40}, "checkpoint": {"save_every_steps": 20}, "cluster": {"network": network}})
    job = run_local(spec.cluster, spec.training_config())
    out = job.output_dir

    ranks = RunOutput(out).ranks()
    assert ranks.world_size == 2 and sorted(r["rank"] for r in ranks.ranks) == [0, 1]
    assert {r["backend"] for r in ranks.ranks} == {"gloo"}
    # a CPU job's workers are forked from their agent with the payload imported (training/worker_start.py)
    assert {r["worker_start"] for r in ranks.ranks} == {"fork"}, ranks.ranks
    for rank in ranks.ranks:  # each rank records the network it ran with, from the spec's cluster.network
        ran_with = rank["network"]
        assert ran_with["collective_timeout_s"] == 900.0, ran_with
        assert ran_with["collective_timeout_from"] == "cluster.network.collective_timeout_s"
        assert {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "NCCL_DEBUG": "WARN"}.items() <= ran_with[
            "env"
        ].items(), ran_with

    metrics = metrics_by_step(out)
    assert sorted(metrics) == list(range(1, 41))
    first, last = (
        np.mean([metrics[s].loss for s in range(1, 4)]),
        np.mean([metrics[s].loss for s in range(38, 41)]),
    )
    assert last < first - 1.0, (first, last)
    assert all(m.comm_s is not None and m.data_wait_s >= 0 for m in metrics.values())
    result = RunOutput(out).result()
    assert math.isfinite(result.val_loss) and result.val_loss < first
    assert (Path(spec.checkpoint.url) / "step-00000040" / "COMMIT.json").exists()


def test_ranks_get_disjoint_samples_that_cover_every_epoch(make_spec, tmp_path: Path) -> None:
    _small_dataset(str(tmp_path / "small"))
    spec = make_spec({"data": {"dataset_url": str(tmp_path / "small")}, "run": {"steps": 50}})
    cfg = spec.training_config()
    out = run_local(spec.cluster, cfg).output_dir

    # per epoch: pairwise disjoint ranks, and together exactly the epoch's samples
    records = [list(RunOutput(out).samples(r).values()) for r in range(2)]
    n = len(TokenDataset(cfg.data.dataset_url, "train", cfg.model.seq_len))
    sampler = GlobalBatchSampler(n, cfg.parallel.micro_batch, 1, 2, 0, cfg.run.seed)
    steps_per_epoch = n // sampler.global_batch
    assert 50 >= 2 * steps_per_epoch, "the run must cover two whole epochs for this test to mean something"
    for epoch in (0, 1):
        per_rank = [[i for rec in recs if rec["epoch"] == epoch for i in rec["indices"]] for recs in records]
        assert len(set(per_rank[0])) == len(per_rank[0])  # no sample twice on one rank
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == sorted(sampler.epoch_samples(epoch).tolist())


def test_ddp_matches_one_process_with_double_micro_batch(make_spec) -> None:
    """World 2 x micro-batch b vs world 1 x 2b on the same samples: equal within 1e-5 relative.

    fp32 all-reduce and batch-mean summation orders differ, so bit equality is not expected
    (about 1e-7 relative is typical); 1e-5 leaves room for 8 steps of compounding.
    """
    steps = {"run": {"steps": 8}, "checkpoint": {"save_every_steps": None, "save_at_end": False}}
    ddp = make_spec(steps, name="ddp")
    single = make_spec({**steps, "cluster": {"procs_per_node": 1}, "parallel": {"micro_batch": 8}}, name="single")
    run_local(ddp.cluster, ddp.training_config())
    run_local(single.cluster, single.training_config())
    a, b = metrics_by_step(ddp.run.output_url), metrics_by_step(single.run.output_url)
    for step in range(1, 9):
        assert a[step].loss == pytest.approx(b[step].loss, rel=1e-5), step


@pytest.mark.parametrize("sharding", ["fsdp", "hsdp"])
def test_sharded_data_parallel_matches_ddp(make_spec, sharding: str) -> None:
    """FSDP2 full shard, and hybrid shard on a (2 nodes x 1) mesh acted out by two torchrun agents."""
    common = {"run": {"steps": 6}, "checkpoint": {"save_every_steps": 3}}
    ddp = make_spec(common, name="ddp")
    cluster = {"nodes": 2, "procs_per_node": 1} if sharding == "hsdp" else {}
    sharded = make_spec({**common, "parallel": {"sharding": sharding}, "cluster": cluster}, name=sharding)
    run_local(ddp.cluster, ddp.training_config())
    run_local(sharded.cluster, sharded.training_config())
    a, b = metrics_by_step(ddp.run.output_url), metrics_by_step(sharded.run.output_url)
    for step in range(1, 7):
        assert b[step].loss == pytest.approx(a[step].loss, rel=1e-5), step
    assert (Path(sharded.checkpoint.url) / "step-00000006" / "COMMIT.json").exists()


def test_ddp_gradient_compression_and_accumulation_train(make_spec) -> None:
    spec = make_spec(
        {"run": {"steps": 12}, "parallel": {"ddp_grad_compression": "bf16", "grad_accum_steps": 2, "micro_batch": 2}}
    )
    run_local(spec.cluster, spec.training_config())
    metrics = metrics_by_step(spec.run.output_url)
    assert metrics[12].loss < metrics[1].loss


def test_moe_model_trains_under_ddp(make_spec) -> None:
    spec = make_spec({"run": {"steps": 10}, "model": {"moe": {"n_experts": 4, "top_k": 2}}})
    run_local(spec.cluster, spec.training_config())
    metrics = metrics_by_step(spec.run.output_url)
    assert metrics[10].loss < metrics[1].loss
    assert all(m.aux_loss is not None and m.aux_loss >= 0.9 * 2 for m in metrics.values())


def test_fp16_loss_scaling_skips_overflows_halves_and_grows_the_scale(make_spec) -> None:
    """An absurd initial scale overflows fp16 gradients: steps are skipped and the scale halves
    until it fits; after `growth_interval` clean steps it doubles again."""
    spec = make_spec(
        {
            "cluster": {"procs_per_node": 1},
            "precision": {"dtype": "fp16", "fp16_init_scale": 2.0**40, "fp16_growth_interval_steps": 3},
            "run": {"steps": 40},
            "checkpoint": {"save_every_steps": None, "save_at_end": False},
        }
    )
    result = run_lone_process(spec)
    metrics = metrics_by_step(spec.run.output_url)
    scales = [metrics[s].loss_scale for s in range(1, 41)]
    skipped = [metrics[s].skipped for s in range(1, 41)]
    assert skipped[0] and scales[0] == 2.0**39
    halvings = sum(b == a / 2 for a, b in zip(scales, scales[1:], strict=False))
    growths = sum(b == a * 2 for a, b in zip(scales, scales[1:], strict=False))
    assert halvings >= 10 and growths >= 1, scales
    assert result["skipped_steps"] == sum(skipped) and not all(skipped)
    assert metrics[40].loss < metrics[1].loss


def test_bf16_autocast_trains(make_spec) -> None:
    spec = make_spec(
        {
            "cluster": {"procs_per_node": 1},
            "precision": {"dtype": "bf16"},
            "run": {"steps": 6},
            "checkpoint": {"save_every_steps": None, "save_at_end": False},
        }
    )
    result = run_lone_process(spec)
    assert math.isfinite(result["final_loss"]) and result["final_loss"] < result["first_loss"]


def test_dataset_with_a_larger_vocabulary_than_the_model_is_refused(make_spec) -> None:
    spec = make_spec({"cluster": {"procs_per_node": 1}, "model": {"vocab_size": 200}})
    with pytest.raises(TrainingFailed) as caught:
        run_local(spec.cluster, spec.training_config())
    assert "dataset vocab_size=257 exceeds model.vocab_size=200; set model.vocab_size >= 257" in caught.value.log_tail


def _train_lone(spec) -> subprocess.CompletedProcess:  # noqa: ANN001 - DeploymentSpec
    """The trainer as one plain process; returns the finished process with its output."""
    cfg = spec.training_config()
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    command = [sys.executable, "-m", "training.train", "--config", str(out / "run.json")]
    return run_group(command, timeout=300)


def test_training_writes_nothing_into_an_output_folder_that_another_live_job_holds(make_spec) -> None:
    spec = make_spec({"cluster": {"procs_per_node": 1}, "run": {"steps": 3}})
    out = Path(spec.run.output_url)
    with Lease(str(out), label="run.output_url", job_id="the-other-job"):
        proc = _train_lone(spec)
    assert proc.returncode != 0
    assert f"run.output_url={out}: held by pid {os.getpid()} on host" in proc.stderr
    assert "(job the-other-job)" in proc.stderr and "wait for it, cancel that job, or use another" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [".LEASE.lock", "run.json"]  # no ranks.json, metrics, ...
    assert not Path(spec.checkpoint.url).exists()


def test_a_lease_left_by_a_killed_job_is_taken_over_with_a_warning(make_spec) -> None:
    spec = make_spec({"cluster": {"procs_per_node": 1}, "run": {"steps": 3}})
    killed = subprocess.Popen(
        [sys.executable, "-c", "import os, signal, sys; from training.lease import Lease; "
         "Lease(sys.argv[1], job_id='killed-job').acquire(); os.kill(os.getpid(), signal.SIGKILL)",
         spec.checkpoint.url],
    )  # fmt: skip
    assert killed.wait(timeout=60) == -9 and (Path(spec.checkpoint.url) / LEASE_FILE).exists()
    proc = _train_lone(spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint.url={spec.checkpoint.url}: took over a stale lease held by pid {killed.pid}" in proc.stderr
    assert "(job killed-job)" in proc.stderr and "is gone" in proc.stderr
    assert not (Path(spec.checkpoint.url) / LEASE_FILE).exists()  # released at the end


def test_a_second_job_on_a_checkpoint_folder_in_use_stops_on_every_rank_naming_the_holder(make_spec) -> None:
    first = make_spec({"cluster": {"procs_per_node": 1}, "run": {"steps": 50}}, name="first")
    job = start_local(first.cluster, first.training_config(), environment=injected(pause_after_step=2))
    try:
        deadline = time.monotonic() + 120
        while job.status().state is not JobState.RUNNING:
            assert time.monotonic() < deadline, job.log_tail()
            time.sleep(0.2)
        holder = RunOutput(job.output_dir).ranks().ranks[0]["pid"]
        second = make_spec({"checkpoint": {"url": first.checkpoint.url}}, name="second")
        with pytest.raises(TrainingFailed) as caught:
            run_local(second.cluster, second.training_config())
        failure = caught.value.status.failure
        assert failure is not None and caught.value.status.state is JobState.FAILED
        assert f"checkpoint.url={first.checkpoint.url}: held by pid {holder} on host" in failure.error
        log_text = caught.value.log_path.read_text()
        # rank 0 was refused the lease, rank 1 stopped with its reason: neither waits for the other
        assert "LeaseHeld: checkpoint.url=" in log_text and "LeaseRefused: checkpoint.url=" in log_text, log_text
        assert RunOutput(second.run.output_url).ranks() is None
        assert job.status().state is JobState.RUNNING  # the holder was left alone
    finally:
        job.cancel()
