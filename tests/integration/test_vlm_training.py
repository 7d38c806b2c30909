"""The vision-language model under the real trainer (torchrun, gloo, 2 processes, DDP): it trains on image captions
(the loss falls, the evaluation records the caption loss), and a run stopped and resumed from its checkpoint goes
on bit-identically."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from tasks.launch.torchrun import free_port
from tests.integration.vlm_setup import MODEL, caption_dataset
from tests.processes import run_group
from training.config import TrainConfig
from training.run_output import RunOutput

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 6


def _config(root: Path, dataset: str, **run: Any) -> TrainConfig:
    return TrainConfig.model_validate({
        "model": MODEL,
        "parallel": {"sharding": "ddp", "micro_batch": 2, "grad_accum_steps": 1},
        "optim": {"lr_peak": 3e-3, "lr_min": 3e-4, "warmup_steps": 1},
        "data": {"dataset_url": dataset},
        "checkpoint": {"url": str(root / "checkpoints"), "save_every_steps": None, "save_at_end": True,
                       "memory_every_steps": 0},
        "run": {"steps": STEPS, "seed": 5, "output_url": str(root / "output"), "threads_per_rank": 1,
                "log_every_steps": 1, "eval_every_steps": STEPS, **run},
        "watchdog": {"enabled": False},
    })  # fmt: skip


def _train(cfg: TrainConfig) -> RunOutput:
    out = Path(cfg.run.output_url)
    out.mkdir(parents=True, exist_ok=True)
    cfg.to_json_file(out / "run.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "training.train", "--config", str(out / "run.json")]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TDEPLOY_CHECKPOINT_KEY", None)
    done = run_group(cmd, timeout=300, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    return RunOutput(out)


def test_a_vlm_trains_on_captions_and_a_stopped_run_resumes_bit_identically(tmp_path: Path) -> None:
    dataset = caption_dataset(tmp_path)
    whole = _train(_config(tmp_path / "whole", dataset)).metrics(0)
    losses = [whole[s].loss for s in range(1, STEPS + 1)]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert whole[STEPS].tokens == 2 * 2 * (16 + 8 - 1)  # global batch x (image tokens + caption tokens - 1)
    result = RunOutput(tmp_path / "whole" / "output").result()
    assert result is not None and result.val_loss is not None and math.isfinite(result.val_loss)

    cfg = _config(tmp_path / "split", dataset)
    _train(cfg.model_copy(update={"run": cfg.run.model_copy(update={"stop_after_steps": 3})}))
    resumed = _train(cfg)
    assert resumed.result().resumed_from_step == 3
    again = resumed.metrics(0)
    assert [again[s].loss for s in range(4, STEPS + 1)] == [whole[s].loss for s in range(4, STEPS + 1)]
    assert [again[s].grad_norm for s in range(4, STEPS + 1)] == [whole[s].grad_norm for s in range(4, STEPS + 1)]
