"""Measured communication: the bytes each mesh dimension's collectives move per step in the real trainer.

A TorchDispatchMode (the mechanism of torch's CommDebugMode, which counts calls but not bytes or groups) sees every
c10d and functional collective the step issues: DTensor's (tensor and sequence parallel, loss_parallel), FSDP2's
all-gathers and reduce-scatters, the expert all-to-alls and the pipeline's sends. Each call is booked to the mesh
dimension of its process group and converted to the bytes one rank sends under the ring algorithms, the
convention of the planner's model (tasks/capacity/comm.py): an all-reduce of B bytes sends 2(n-1)/n B, an
all-gather (n-1)/n of its output, a reduce-scatter (n-1)/n of its input, an all-to-all what leaves the rank, a
send its tensor. gloo's own algorithms may move other amounts; what is checked is which buffers the step
communicates and how often, against what the planner assumes.

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
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

DIMS = ("dp", "tp", "pp", "ep")
PLANNER_KEYS = {"dp": "data_parallel", "tp": "tensor_parallel", "pp": "pipeline_parallel", "ep": "expert_parallel"}
_MESH_DIM_LABELS = {
    "pp": "pp", "dp_replicate": "dp", "dp_shard": "dp", "dp_mod_ep": "dp", "dp": "dp", "cp": "cp", "tp": "tp",
    "ep": "ep",
}  # fmt: skip
_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd"}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_of(args: tuple[Any, ...]) -> dist.ProcessGroup | None:
    """The process group of a c10d op (a boxed ScriptObject) or a functional one (its group name)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except RuntimeError:  # a ReduceOp, not a group
                continue
    names = [a for a in args if isinstance(a, str)]
    return _resolve_process_group(names[-1]) if names else None


def ring_bytes(op: str, args: tuple[Any, ...], group_size: int, group_rank: int) -> tuple[float, float]:
    """(bytes this rank sends under the ring algorithms, bytes of the buffer it passed) of one collective."""
    n = group_size
    share = (n - 1) / n if n > 1 else 0.0
    if op in ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_coalesced"):
        buf = _nbytes(args[0])
        return 2 * share * buf, buf
    if op in ("_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "allgather_coalesced_"):
        buf = _nbytes(args[0])  # the gathered output
        return share * buf, buf
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced"):
        buf = _nbytes(args[0]) * n
        return share * buf, buf
    if op in ("_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_"):
        buf = _nbytes(args[1])  # the input that is reduced
        return share * buf, buf
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"):
        buf = _nbytes(args[0])
        return share * buf, buf
    if op in ("alltoall_base_", "all_to_all_single"):
        # c10d: (output, input, group, output_splits, input_splits); functional: (input, output_splits, input_splits)
        inp, splits = (args[1], args[4]) if op == "alltoall_base_" else (args[0], args[2])
        buf = _nbytes(inp)
        if not splits:
            return share * buf, buf
        row = buf / max(1, sum(splits))
        return row * (sum(splits) - splits[group_rank]), buf
    if op == "alltoall_":
        buf = _nbytes(args[1])
        return share * buf, buf
    if op in ("send", "broadcast_", "broadcast"):
        buf = _nbytes(args[0])
        return float(buf), buf
    return 0.0, 0.0  # recv, barrier, wait_tensor, ...: nothing sent


def _label(dims: tuple[str, ...], op: str) -> str:
    """The dimension a collective serves when its group serves several (a mesh dimension spanning the same ranks
    as another reuses its group, e.g. ep and dp on two processes): all-to-alls are expert dispatch."""
    if len(dims) == 1:
        return dims[0]
    if "ep" in dims and op in ("alltoall_base_", "alltoall_", "all_to_all_single"):
        return "ep"
    return next(d for d in ("dp", "tp", "pp", "cp", *dims) if d in dims)


@dataclass
class TrafficCounter(TorchDispatchMode):
    """Bytes sent per mesh dimension (see the module docstring) while active; `labels` maps group names."""

    labels: dict[str, tuple[str, ...]] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    buffers: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    ops: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) in _NAMESPACES:
            op = func._overloadpacket.__name__  # noqa: SLF001 - the op's name
            group = _group_of(tuple(args))
            if group is not None and op not in ("wait_tensor", "_wrap_tensor_autograd", "recv_", "recv"):
                label = _label(self.labels.get(group.group_name, ("other",)), op)
                rank = group.rank()
                sent, buf = ring_bytes(op, tuple(args), group.size(), rank)
                self.sent[label] += sent
                self.buffers[label] += buf
                self.calls[label] += 1
                self.ops[f"{label}:{op}"] += 1
        return out

    def reset(self) -> None:
        """Forget what was counted."""
        for table in (self.sent, self.buffers, self.calls, self.ops):
            table.clear()


def group_labels(meshes: Any) -> dict[str, tuple[str, ...]]:
    """Group name -> the dimensions (dp, tp, pp, ep, cp) it serves, for every dimension of the trainer's meshes
    (None: pure data parallel, where every group is the data-parallel one)."""
    if meshes is None:
        return {dist.group.WORLD.group_name: ("dp",)}
    labels: dict[str, set[str]] = defaultdict(set)
    for mesh in (meshes.world, meshes.experts):
        if mesh is None:
            continue
        for name in mesh.mesh_dim_names:
            if mesh.size(mesh.mesh_dim_names.index(name)) > 1:
                labels[mesh.get_group(name).group_name].add(_MESH_DIM_LABELS[name])
    if meshes.dims.dp > 1:
        labels[meshes.dp_flat.get_group().group_name].add("dp")
    return {name: tuple(sorted(dims)) for name, dims in labels.items()}


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(config_path: Path, nprocs: int, out: Path, measure_steps: tuple[int, int], timeout_s: float) -> Traffic:
    """Run the trainer of `config_path` on `nprocs` local gloo processes with the counter; the ranks' results."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}", "--master-addr=127.0.0.1",
        f"--master-port={_free_port()}", "-m", "tasks.capacity.traffic", "--config", str(config_path),
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
