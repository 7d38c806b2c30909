"""The vision-language model under the real trainer (torchrun, gloo, 2 processes): DDP, FSDP and tensor parallelism
each match the independent single-process reference (training/reference.py) step by step, and an FSDP run whose
rank is killed (the rank_kill drill's hold and strike, training/drill_points.py) goes on from its last checkpoint
bit-identically with the uninterrupted run.

The captions have different lengths, so a micro-batch's caption loss averages a different number of tokens than
its neighbour's: every layout keeps micro_batch 2 (and the global batch at 8 samples), the reference averages the
same groups, and one reference run serves them all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tasks.launch.torchrun import free_port
from tests.integration.vlm_setup import MODEL, PATCHES, VISION, caption_dataset
from tests.processes import run_group, start_group, stop_group
from training.config import ReferenceConfig, TrainConfig
from training.drill_points import ENV_VAR as DRILL_ENV
from training.drill_points import HOLD_MARKER_PREFIX, RELEASE_FILE, DrillPoints, StepHold, paused_ranks
from training.run_output import RunOutput
from validation.acceptance import check_correctness

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[3]
STEPS = 5
TOLERANCE = 1e-4  # the LM layouts' bound (tests/integration/parallel/test_model_parallel_training.py)
CAPTION_LEN = 8
# Two encoder heads, so that tensor parallelism has one per rank (the serving tests' single head of 32 would not
# split); the language model keeps head_dim 32.
VLM = {**MODEL, "vision": {**VISION, "n_heads": 2}}

# name: parallel section; micro_batch 2 and global batch 8 in each.
LAYOUTS: dict[str, dict[str, Any]] = {
    "ddp": {"sharding": "ddp", "micro_batch": 2, "grad_accum_steps": 2},
    "fsdp": {"sharding": "fsdp", "micro_batch": 2, "grad_accum_steps": 2},
    "tp2": {"tensor_parallel": 2, "micro_batch": 2, "grad_accum_steps": 4},
}
KILL_AFTER_STEP, SAVE_EVERY_STEPS = 3, 2


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    return caption_dataset(tmp_path_factory.mktemp("vlm-data"))


def _config(root: Path, dataset: str, parallel: dict[str, Any], **checkpoint: Any) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": VLM,
        "parallel": parallel,
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 1},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / "checkpoints"), "save_every_steps": None, "save_at_end": False,
                       "memory_every_steps": 0, **checkpoint},
        "run": {"steps": STEPS, "seed": 5, "output_url": str(root / "output"), "threads_per_rank": 1,
                "log_every_steps": 1, "eval_every_steps": STEPS},
        "watchdog": {"enabled": False},
    })  # fmt: skip


def _command(cfg: TrainConfig, procs: int) -> list[str]:
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", "--master_addr=127.0.0.1",
            f"--master_port={free_port()}", "-m", "training.train", "--config", str(out / "run.json")]  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TDEPLOY_CHECKPOINT_KEY", None)  # unsigned test checkpoints
    return env


def _train(cfg: TrainConfig, procs: int) -> RunOutput:
    """torchrun with `procs` processes on `cfg` to the end; its run output."""
    done = run_group(_command(cfg, procs), timeout=300, env=_env(), cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return RunOutput(cfg.run.output_url)


@pytest.fixture(scope="module")
def reference(dataset: str, tmp_path_factory: pytest.TempPathFactory) -> RunOutput:
    """The independent reference of a 2-rank job with micro_batch 2 and a global batch of 8 image-caption pairs."""
    cfg = _config(tmp_path_factory.mktemp("reference"), dataset, LAYOUTS["ddp"])
    return _train(cfg.model_copy(update={"reference": ReferenceConfig(world_size=2)}), 1)


@pytest.fixture(scope="module")
def runs() -> dict[str, RunOutput]:
    """The layouts' runs, kept for the rank-kill test (the FSDP run is its uninterrupted twin)."""
    return {}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_vlm_layout_matches_the_single_process_reference(
    layout: str, reference: RunOutput, runs: dict[str, RunOutput], dataset: str, tmp_path: Path
) -> None:
    out = runs[layout] = _train(_config(tmp_path, dataset, LAYOUTS[layout]), 2)
    got, ref = out.metrics(0), reference.metrics()
    assert sorted(got) == sorted(ref) == list(range(1, STEPS + 1))
    assert ref[STEPS].loss < ref[1].loss  # it learns: the comparison is not of constants
    result = check_correctness(got, ref, TOLERANCE)
    assert result.passed, (result.message, result.measured, result.evidence)
    worst = max(abs(got[s].loss - ref[s].loss) / ref[s].loss for s in ref)
    assert worst < TOLERANCE, worst
    params = check_correctness(got, ref, params=out.params(), reference_params=reference.params()[0])
    assert params.passed and params.evidence["parameters"] == "compared", (params.message, params.evidence)
    # tokens: the global batch's image tokens and all but the last caption token, in the reference as in the run
    assert {r.tokens for r in got.values()} == {8 * (PATCHES + CAPTION_LEN - 1)}
    assert reference.result().tokens_seen == STEPS * 8 * (PATCHES + CAPTION_LEN - 1)
    # the evaluation averages the same caption tokens as the reference's
    val, ref_val = out.result().val_loss, reference.result().val_loss
    assert val is not None and ref_val is not None and abs(val - ref_val) / ref_val < TOLERANCE, (val, ref_val)
    pieces = {p.name: p for p in out.params()[0].pieces}
    if layout == "tp2":  # the encoder's and the language model's projections are split, the projector is not
        assert pieces["vision.blocks.0.attn.wq.weight"].shape == [16, 32]
        assert pieces["lm.blocks.0.attn.wq.weight"].shape == [32, 64]
        assert pieces["projector.linear_1.weight"].shape == pieces["projector.linear_1.weight"].full_shape
    if layout == "fsdp":  # the encoder's and the language model's blocks are FSDP units sharded over the two ranks
        for name in ("vision.blocks.1.mlp.w1.weight", "lm.blocks.1.mlp.w1.weight"):
            assert pieces[name].shape[0] * 2 == pieces[name].full_shape[0], name


def _strike(markers: Path, rank: int, timeout_s: float = 240.0) -> None:
    """The rank_kill drill's strike: once every rank holds (their checkpoints committed), SIGKILL `rank`, then
    release the survivors, which find their peer gone."""
    deadline = time.monotonic() + timeout_s
    while len(held := paused_ranks(str(markers), HOLD_MARKER_PREFIX)) < 2:
        assert time.monotonic() < deadline, "the ranks never held"
        time.sleep(0.2)
    os.kill(next(r.pid for r in held if r.rank == rank), signal.SIGKILL)
    (markers / RELEASE_FILE).touch()


def test_an_fsdp_vlm_rank_killed_and_resumed_continues_bit_identically(
    runs: dict[str, RunOutput], dataset: str, tmp_path: Path
) -> None:
    if "fsdp" not in runs:  # the uninterrupted job (the parity test's, when it ran first)
        runs["fsdp"] = _train(_config(tmp_path / "whole", dataset, LAYOUTS["fsdp"]), 2)
    whole = runs["fsdp"].metrics(0)
    cfg = _config(tmp_path / "killed", dataset, LAYOUTS["fsdp"], save_every_steps=SAVE_EVERY_STEPS)
    markers = tmp_path / "markers"
    points = DrillPoints(hold_after_step=StepHold(step=KILL_AFTER_STEP, marker_dir=str(markers)))
    env = _env() | {DRILL_ENV: points.model_dump_json()}
    job = start_group(_command(cfg, 2), env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                      text=True)  # fmt: skip
    try:
        _strike(markers, 1)
        _, stderr = job.communicate(timeout=120)  # torchrun ends the job: a rank died
    finally:
        stop_group(job, grace_s=0.5)
    assert job.returncode != 0, stderr[-2000:]
    resumed = _train(cfg, 2)  # a relaunch (without the drill point) resumes from the last committed checkpoint
    assert resumed.result().resumed_from_step == SAVE_EVERY_STEPS
    again = resumed.metrics(0)
    later = range(SAVE_EVERY_STEPS + 1, STEPS + 1)  # step 3 ran before the kill and again after the resume
    assert [(again[s].loss, again[s].grad_norm) for s in later] == [(whole[s].loss, whole[s].grad_norm) for s in later]
