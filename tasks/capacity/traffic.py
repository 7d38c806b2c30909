"""Measured communication: the bytes each mesh dimension's collectives move per step in the real trainer.

training/comm_counter.py counts (and the trainer's measurement step times) every collective per mesh dimension
as ring-equivalent bytes, the convention of the planner's model (tasks/capacity/comm.py); here it runs for chosen
steps of a whole run, to set the measured bytes beside the planner's.

`python -m tasks.capacity.traffic --config run.json --out DIR` runs under torchrun: the real Trainer, with the
counter on for the steps of `--measure-steps` and every step timed; each rank writes DIR/rank<r>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from training.comm_counter import DIMS, PLANNER_KEYS, TrafficCounter, group_labels, ring_bytes
from training.network import listen_port

__all__ = ["DIMS", "PLANNER_KEYS", "RankTraffic", "Traffic", "measure", "ring_bytes"]


@dataclass
class RankTraffic:
    """One rank's measurement: bytes per dimension per step (mean over the measured steps) and step times."""

    rank: int
    coords: dict[str, int]
    sent_per_step: dict[str, float]
    buffer_per_step: dict[str, float]
    calls_per_step: dict[str, float]
    ops_per_step: dict[str, float]
    step_seconds: list[float]
    tokens_per_step: int
    param_bytes: int


def _param_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank holds (local shards of DTensors)."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def worker(config: str, out: str, measure: tuple[int, int]) -> None:
    """Under torchrun: the real Trainer, counting collectives on the steps in [measure[0], measure[1])."""
    from training.config import TrainConfig
    from training.train import DistEnv, Trainer, init_distributed

    cfg = TrainConfig.from_json_file(config)
    init_distributed(DistEnv.from_environ())
    trainer = Trainer(cfg)
    counter = TrafficCounter(labels=group_labels(trainer.meshes))
    times: list[float] = []
    step_of_run = trainer.train_step

    def counted_step() -> dict[str, Any]:
        index = len(times)
        started = time.perf_counter()
        if measure[0] <= index < measure[1]:
            with counter:
                record = step_of_run()
        else:
            record = step_of_run()
        times.append(time.perf_counter() - started)
        return record

    trainer.train_step = counted_step  # type: ignore[method-assign]
    trainer.fit()
    steps = measure[1] - measure[0]
    par = cfg.parallel
    dp = trainer.meshes.dims.dp if trainer.meshes is not None else dist.get_world_size()
    result = RankTraffic(
        rank=dist.get_rank(),
        coords=dict(trainer.meshes.coords) if trainer.meshes is not None else {"dp": dist.get_rank()},
        sent_per_step={k: v / steps for k, v in counter.sent.items()},
        buffer_per_step={k: v / steps for k, v in counter.buffers.items()},
        calls_per_step={k: v / steps for k, v in counter.calls.items()},
        ops_per_step={k: v / steps for k, v in counter.ops.items()},
        step_seconds=times,
        tokens_per_step=par.micro_batch * par.grad_accum_steps * dp * cfg.model.seq_len,
        param_bytes=_param_bytes(trainer.model),
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"rank{result.rank}.json").write_text(json.dumps(asdict(result)))
    del trainer
    dist.destroy_process_group()


@dataclass
class Traffic:
    """A layout's measurement over all ranks."""

    ranks: list[RankTraffic]

    def sent(self, dim: str, how: str = "max") -> float:
        """Bytes per step one rank sends on `dim`: the busiest rank's (max) or the mean over ranks."""
        values = [r.sent_per_step.get(dim, 0.0) for r in self.ranks]
        return max(values) if how == "max" else statistics.fmean(values)

    def tokens_per_s(self, skip: int) -> float:
        """Global tokens per second: the median over steps (after `skip`) of the slowest rank's step time."""
        steps = len(self.ranks[0].step_seconds)
        slowest = [max(r.step_seconds[i] for r in self.ranks) for i in range(skip, steps)]
        return self.ranks[0].tokens_per_step / statistics.median(slowest)


def measure(config_path: Path, nprocs: int, out: Path, measure_steps: tuple[int, int], timeout_s: float) -> Traffic:
    """Run the trainer of `config_path` on `nprocs` local gloo processes with the counter; the ranks' results."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1",
        f"--master-port={listen_port()}", "-m", "tasks.capacity.traffic", "--config", str(config_path),
        "--out", str(out), "--measure-steps", f"{measure_steps[0]}:{measure_steps[1]}",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    if proc.returncode:
        raise RuntimeError(f"traffic run failed ({proc.returncode}):\n{output.decode(errors='replace')[-4000:]}")
    ranks = [RankTraffic(**json.loads((out / f"rank{r}.json").read_text())) for r in range(nprocs)]
    return Traffic(ranks)


def main() -> None:
    """torchrun entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description="count the trainer's collectives per mesh dimension")
    parser.add_argument("--config", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--measure-steps", default="1:3", help="first:end (0-based, end excluded)")
    args = parser.parse_args()
    first, end = (int(v) for v in args.measure_steps.split(":"))
    worker(args.config, args.out, (first, end))


if __name__ == "__main__":
    main()
