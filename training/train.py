"""The training job: `torchrun ... -m training.train --config run.json`.

Rank 0 logs a line every `run.log_every_steps`; every rank records each step's
metrics and sample indices in the run output (training/run_output.py, which
describes the files): the ranks at start-up, what the resume loaded, each
evaluation and save, and the result at the end.

Before anything is written, rank 0 takes the leases of `run.output_url` and
`checkpoint.url` (training/lease.py): a second job on the same roots stops at
once with who holds them. Under torchrun every worker dies with its agent.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import logging
import math
import os
import random
import signal
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record

from training import drill_points, failure, hf_load, preemption, process, replica, spares, worker_start
from training.checkpoint import CheckpointManager, CheckpointSaveError, SavedCheckpoint
from training.checkpoint.memory import MemoryTier
from training.checkpoint.memory_auto import record_decision
from training.checkpoint.save_auto import SaveSchedule
from training.comm_probe import probe_record
from training.config import OptimConfig, TrainConfig, resolve_compile
from training.distill import load_teacher
from training.distill_report import distillation_record, gathered_student
from training.grad_clip import clip_grad_norm
from training.holdings import held_layers, param_record
from training.lease import Lease
from training.mesh import Meshes, ParallelDims
from training.metrics import CommTimer, peak_memory_bytes
from training.model import blocks_of
from training.network import collective_timeout, network_record
from training.parallel import comm_timed, gradient_sync, parallelize
from training.recovery_record import RecoveryEvent, Refusal, append_event
from training.reference import run_reference
from training.run_output import (
    AttemptRecord,
    CheckpointEvent,
    EpochEnd,
    Ranks,
    RunOutputWriter,
    RunResult,
    StepRecord,
)
from training.sampler import GlobalBatchSampler, SamplerState
from training.telemetry import Telemetry
from training.watchdog import Watchdog, enable_flight_recorder
from training.tensor_parallel import loss_context
from training.workload import LossInputs, workload_of

log = logging.getLogger("training.train")  # not __main__ under `python -m`

_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job (from torchrun's environment)."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    host: str

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Read RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (a lone process when unset)."""
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            host=socket.gethostname(),
        )


def init_distributed(env: DistEnv) -> tuple[torch.device, str]:
    """Start the process group: NCCL on GPUs, gloo on CPU; its timeout from cluster.network.collective_timeout_s."""
    if torch.cuda.is_available():
        device, backend = torch.device("cuda", env.local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        timeout = collective_timeout()
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, device_id=device if backend == "nccl" else None, timeout=timeout)
        else:  # a lone process outside torchrun (benchmarks, notebooks)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return device, backend


class LeaseRefused(RuntimeError):
    """Rank 0 could not lease the run's roots; the other ranks stop with its reason."""


@contextlib.contextmanager
def exclusive_roots(cfg: TrainConfig) -> Iterator[list[Lease]]:
    """Rank 0 holds the leases of run.output_url and checkpoint.url for the run; every rank stops if it could not.

    Collective: rank 0 broadcasts its outcome, so no rank waits in a collective for a rank 0 that gave up.
    """
    leases: list[Lease] = []
    failure: Exception | None = None
    if dist.get_rank() == 0:
        roots = {cfg.run.output_url: "run.output_url"}
        roots.setdefault(cfg.checkpoint.url, "checkpoint.url")
        job_id = os.environ.get("TORCHELASTIC_RUN_ID")  # a restarted attempt of this job takes its leases back
        try:
            for url, label in roots.items():
                leases.append(Lease(url, cfg.storage, label=label, job_id=job_id).acquire())
        except Exception as err:  # noqa: BLE001 - re-raised below, after the other ranks were told
            failure = err
    outcome = [None if failure is None else str(failure)]
    dist.broadcast_object_list(outcome, src=0)
    try:
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise LeaseRefused(outcome[0])
        yield leases
    finally:
        for lease in reversed(leases):
            lease.release()


def lr_lambda(cfg: OptimConfig, total_steps: int):  # noqa: ANN201 - returns a float function of the step
    """Multiplier of lr_peak at a step: linear warmup, then cosine/linear decay to lr_min, or constant."""
    floor = cfg.lr_min / cfg.lr_peak

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return floor + (1 - floor) * shape

    return factor


def build_optimizer(model: nn.Module, cfg: OptimConfig, device_type: str = "cpu") -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, with the kernels of cfg.implementation (auto: fused on GPUs)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    implementation = cfg.implementation
    if implementation == "auto":
        implementation = "fused" if device_type == "cuda" else "default"
    if implementation == "fused" and device_type != "cuda":
        raise ValueError(f"optim.implementation=fused needs GPUs, this process runs on {device_type}; use auto")
    kernels = {
        "fused": {"fused": True},
        "foreach": {"foreach": True},
        "for-loop": {"foreach": False},
        "default": {},
    }[implementation]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr_peak,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        **kernels,
    )


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _to_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a DTensor (the loss under loss_parallel is a replicated DTensor)."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def _to_float(value: torch.Tensor | float) -> float:
    if isinstance(value, torch.Tensor):
        value = value.full_tensor() if hasattr(value, "full_tensor") else value
        return float(value.item())
    return float(value)


def _compute_events(device: torch.device) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
    """On a GPU, two timing events with the first recorded now (the start of a step's compute); None on CPU."""
    if device.type != "cuda":
        return None
    events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
    events[0].record()
    return events


@dataclass
class PendingRecord:
    """A step's metrics record whose device figures (`device`: field -> 0-d tensor) are not read yet; `work` is the
    loss all-reduce in flight (None: done), whose sum is divided by `divide` (gloo has no average)."""

    record: dict[str, Any]
    device: dict[str, torch.Tensor]
    work: Any
    divide: int = 1
    compute_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    """CUDA events at the start and the end of the step's compute (GPUs): read as compute_device_s."""


class Trainer:
    """Builds everything from a TrainConfig, resumes if it can, trains, evaluates, checkpoints."""

    def __init__(self, cfg: TrainConfig, leases: list[Lease] | None = None, watchdog: Watchdog | None = None) -> None:
        self.cfg = cfg
        self.leases = leases or []  # checked every step: a job whose lease was taken over stops writing
        # Phases and heartbeats (training/watchdog.py); main() starts the real one, in-process use tracks only.
        self.watchdog = watchdog or Watchdog(cfg.watchdog.model_copy(update={"enabled": False}))
        self.env = DistEnv.from_environ()
        self.device, self.backend = init_distributed(self.env)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # Host-side agreement (preemption flags) beside NCCL, so that it never waits for the device.
        self.host_group = None if self.backend == "gloo" else dist.new_group(backend="gloo")
        torch.set_num_threads(cfg.run.threads_per_rank or max(1, (os.cpu_count() or 1) // self.env.local_world_size))

        par, model_cfg = cfg.parallel, cfg.model
        # What is trained (model.kind): the model, its datasets, its loss and metrics (training/workload.py).
        self.workload = workload_of(cfg)
        self.train_data, self.val_data = self.workload.open_datasets()
        # Model-parallel layouts run on a named device mesh (training/mesh.py); samples go per data-parallel
        # rank, so the tensor and pipeline peers of one data-parallel rank are fed the same ones.
        self.meshes: Meshes | None = None
        self.pipeline: Any = None
        self.dp_rank, self.dp_size = self.rank, self.world
        if par.model_parallel:
            self.meshes = ParallelDims.from_config(par, self.world, self.env.local_world_size).build(self.device.type)
            self.dp_rank, self.dp_size = self.meshes.coords["dp"], self.meshes.dims.dp
        ft = cfg.fault_tolerance
        self.replica_index = replica.group_index(ft.replica_groups) if ft.mode == "replica_groups" else None
        if self.replica_index is not None:  # replica groups train disjoint shards of the global batch
            self.dp_rank, self.dp_size = self.replica_index * self.world + self.rank, ft.replica_groups * self.world
        seed = cfg.run.seed
        self.blend = self.workload.blend(self.train_data, seed)  # None unless the dataset mixes weighted sources
        self.sampler = GlobalBatchSampler(
            self.blend.epoch_size if self.blend else len(self.train_data),
            par.micro_batch, par.grad_accum_steps, self.dp_size,
            self.dp_rank, seed, drop_last=cfg.data.drop_last,
        )  # fmt: skip

        # On CPU the peak resident set is the only memory figure: what the runtime held before the model was built
        # is recorded so that acceptance can compare the training's own share with the capacity plan.
        self.runtime_mem_bytes = peak_memory_bytes(self.device) if self.device.type == "cpu" else None
        seed_everything(seed)  # identical initial weights on every rank
        model = self.workload.build_model(par.activation_recompute).to(self.device)
        self.n_params = model.num_params()
        if cfg.precision.dtype == "fp8":  # the blocks' Linear layers in float8 before compile and the layouts
            from training.float8 import convert_blocks, require_float8_device  # noqa: PLC0415 - torchao, fp8 only

            require_float8_device(self.device)
            convert_blocks(blocks_of(model))
        # run.compile (None: on for GPUs with a data-parallel layout): per block and in place, as torchtitan does;
        # FSDP2 then wraps the compiled blocks
        if resolve_compile(cfg.run, par, self.device.type):
            for block in blocks_of(model):
                block.compile()
        if model_cfg.moe is not None:
            from training.experts import set_capacity_factor  # noqa: PLC0415 - MoE models only

            set_capacity_factor(model, par.expert_capacity_factor)
        self.comm_timer = CommTimer()
        if self.meshes is None:
            self.model = parallelize(model, par, self.device, self.env.local_world_size, self.comm_timer)
            self.comm_measured = comm_timed(par, self.world, self.env.local_world_size)
        else:
            self.model = self._model_parallel(model)
            # FSDP2's reduce-scatter is timed; a replicate-only data dimension synchronises by an all-reduce the
            # timer does not see, so its comm_s is not measured rather than zero.
            self.comm_measured = self.meshes.dims.dp_shard > 1
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device.type)
        # distill: a frozen teacher, whole on every rank (collective load; training/distill.py).
        self.teacher = load_teacher(cfg.distill, model_cfg, cfg.storage, self.device) if cfg.distill else None
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg.optim, cfg.run.steps))
        self.autocast_dtype = _AUTOCAST[cfg.precision.dtype]
        self.scaler = torch.amp.GradScaler(
            self.device.type,
            init_scale=cfg.precision.fp16_init_scale,
            growth_interval=cfg.precision.fp16_growth_interval_steps,
            enabled=cfg.precision.dtype == "fp16",
        )
        card = self.workload.card(self.train_data)
        self.checkpoints = CheckpointManager(
            cfg.checkpoint, cfg.storage, layout=self._layout(), card=card.model_dump(mode="json")
        )
        self.out = RunOutputWriter(cfg.run.output_url, cfg.storage)
        self.telemetry = Telemetry.for_rank(
            cfg.run, rank=self.rank, local_rank=self.env.local_rank, local_world_size=self.env.local_world_size,
            host=self.env.host, device=self.device,
        )  # fmt: skip

        self.step, self.tokens_seen, self.skipped_steps = 0, 0, 0
        self.resumed_from: int | None = None
        self.saved_step: int | None = None  # the step of the last checkpoint this run committed
        self.save_schedule = SaveSchedule(cfg.checkpoint.save_every_steps, cfg.checkpoint.mtbf_s)
        self.preempt_signal: str | None = None  # set when the ranks agreed that one of them was signalled
        self._pending: list[PendingRecord] = []  # steps whose device figures the host has not read yet
        self.preempted: preemption.PreemptionRecord | None = None
        # Per-rank streams from here on (dropout, sampling, ...). Tensor-parallel peers hold the same activations
        # outside the sharded matmuls, so they must draw the same dropout masks: one stream per (dp, pp) place.
        stream = self.rank if self.meshes is None else self.dp_rank * self.meshes.dims.pp + self.meshes.coords["pp"]
        seed_everything(cfg.run.seed + 1 + stream)
        # In-memory copies of every rank's state (checkpoint.memory_every_steps): the rung a restart takes before
        # storage. Replicated (DDP) copies serve any rank; sharded ones only the same world and layout.
        self.memory: MemoryTier | None = None
        self._copy_held_s: float | None = None  # the last in-memory copy's stall, for the next step's record
        if cfg.checkpoint.memory_tier_on:
            node = int(os.environ.get("GROUP_RANK", self.rank // self.env.local_world_size))
            replicated = self.meshes is None and par.sharding == "ddp"
            record = functools.partial(record_decision, cfg.run.output_url, cfg.storage) if self.rank == 0 else None
            self.memory = MemoryTier(
                cfg.checkpoint, self._layout(), replicated, self.env.local_world_size, node, record
            )
        self.watchdog.beat("model_built")
        self.replica: replica.ReplicaGroup | None = None
        if self.replica_index is not None:
            self.replica = replica.ReplicaGroup(
                ft, self.replica_index, self.device, self._replica_state, self._load_replica_state, self._restore,
                cfg.run.output_url, cfg.storage,
            )  # fmt: skip
        # A restarted replica group reads no storage: it pulls the state from a healthy group at its first step.
        if cfg.checkpoint.resume and (self.replica is None or not replica.restarted()):
            self._resume()
        # A fresh start from a Hugging Face checkpoint: its weights, checked against transformers' logits.
        self.started_from_hf = (
            cfg.model.init_from is not None and self.resumed_from is None
            and (self.replica is None or not replica.restarted())
        )  # fmt: skip
        self.init_deviation: float | None = None
        if self.started_from_hf:
            self.init_deviation = hf_load.initialise(
                self.model, self.pipeline, self.meshes, model_cfg, par.pipeline_chunks, cfg.init_check_url,
                self.device, cfg.storage,
            )  # fmt: skip
        # A fresh start of the encoder from a Hugging Face vision tower (training/hf_vision_load.py).
        vision_url = cfg.model.vision.init_from if cfg.model.vision is not None else None
        self.started_from_hf_vision = (
            vision_url is not None and self.resumed_from is None and (self.replica is None or not replica.restarted())
        )
        if self.started_from_hf_vision:
            from training.hf_vision_load import load_vision_into  # noqa: PLC0415 - only with model.vision.init_from

            loaded = load_vision_into(self.model, model_cfg, cfg.storage)
            log.info("model.vision.init_from=%s: %d encoder tensors loaded", vision_url, loaded)
        if self.replica is not None:
            self.replica.set_step(self.step)
        self.save_schedule.last_saved = self.step  # auto's first save counts from the resumed step
        self.watchdog.beat("ranks")
        self._write_ranks()
        if self.rank == 0:  # goodput's start-up share: from the process's start to here (validation/goodput.py)
            now = time.time()
            self.out.append_attempt(AttemptRecord(
                int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), process.started_unix_s() or now, now, self.world
            ))  # fmt: skip

    def _layout(self) -> str:
        """The model-parallel layout as checkpoints record it ("" for pure data parallelism)."""
        if self.meshes is None:
            return ""
        d = self.meshes.dims
        return f"pp{d.pp} dp{d.dp_replicate}x{d.dp_shard} cp{d.cp} tp{d.tp} ep{d.ep}"

    def _model_parallel(self, model: nn.Module) -> nn.Module:
        """Tensor/expert parallel and FSDP2 on the mesh; with pipeline stages, this rank's chunks of the model."""
        assert self.meshes is not None
        par = self.cfg.parallel

        from training.parallel import apply_model_parallel  # noqa: PLC0415 - model-parallel layouts only

        def wrap(chunk: nn.Module) -> nn.Module:
            return apply_model_parallel(chunk, par, self.meshes, self.comm_timer)  # type: ignore[arg-type]

        if par.pipeline_parallel > 1:
            from training.pipeline import build_pipeline  # noqa: PLC0415 - pipeline layouts only

            self.pipeline = build_pipeline(model, self.cfg, self.meshes, self.device, wrap)
            return self.pipeline.model
        return wrap(model)

    # ---- state ------------------------------------------------------------------------------

    def _train_state(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "epoch": self.sampler.state.epoch,
            "sample_offset": self.sampler.state.offset,
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "global_batch": self.sampler.global_batch,
            "world_size": self.world,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
        }

    def _resume(self, refused_above: Sequence[Refusal] = (), why_not_above: str = "") -> None:
        """Restore by the rungs of the recovery ladder the trainer walks itself: the host-memory copies, then
        storage; rank 0 records which one restored what, and what it refused (recovery.jsonl), with what a rung
        above refused (`refused_above`, `why_not_above`: live recovery)."""
        started = time.perf_counter()
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        outcome = None
        if self.memory is not None:
            outcome = self.memory.restore(self.model, self.optimizer, self._newest_on_storage)
        refused = [*refused_above, *([] if outcome is None else outcome.refused)]
        if outcome is not None and outcome.restored is not None:
            found = outcome.restored
            event = RecoveryEvent("memory", found.step, self.world, attempt, found.source, refused,
                                  reason=why_not_above)  # fmt: skip
            self._apply_train_state(found.train_state)
            if self.rank == 0:
                log.info("restored step %d from host memory: %s", found.step, "; ".join(found.source.values()))
        else:
            memory_why = "" if outcome is None else f"memory copies not used: {outcome.reason}"
            why = "; ".join(r for r in (why_not_above, memory_why) if r)
            restored = self.checkpoints.load_latest(self.model, self.optimizer, self.out)
            if restored is None:
                event = RecoveryEvent("fresh", None, self.world, attempt, {}, refused, reason=why)
            else:
                event = RecoveryEvent("storage", restored.step, self.world, attempt, {"every rank": restored.path},
                                      refused, reason=why)  # fmt: skip
                self._apply_train_state(restored.train_state)
                if self.rank == 0:
                    log.info("resumed from %s at step %d (saved by %d ranks)", restored.path, self.step,
                             restored.saved_world_size)  # fmt: skip
        if self.rank == 0:
            event = dataclasses.replace(event, restore_s=round(time.perf_counter() - started, 4))
            append_event(self.cfg.run.output_url, event, self.cfg.storage)

    def _restore(self, refused: list[Refusal], why: str) -> int:
        """The trainer's own rungs (memory, storage) when no replica group could be pulled from, or its state was
        refused (`refused`, `why`); the step."""
        if self.cfg.checkpoint.resume:
            self._resume(refused, why)
        elif refused and self.rank == 0:  # nothing to restore from: the group goes on from its own state
            append_event(self.cfg.run.output_url, RecoveryEvent(
                "fresh", None, self.world, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), {}, refused,
                reason=f"{why}; checkpoint.resume is off"), self.cfg.storage)  # fmt: skip
        return self.step

    def _replica_state(self) -> dict[str, Any]:
        """What a healing replica group pulls from this one (training/replica.py)."""
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(), "train": self._train_state()}

    def _load_replica_state(self, state: dict[str, Any]) -> None:
        """Take the state a healthy replica group sent."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optim"])
        self._apply_train_state(state["train"])

    def _apply_train_state(self, state: dict[str, Any]) -> None:
        """Step, sampler position, LR schedule and loss scale of a restored checkpoint or memory copy."""
        self.step, self.tokens_seen, self.skipped_steps = state["step"], state["tokens_seen"], state["skipped_steps"]
        self.sampler.state = SamplerState(state["epoch"], state["sample_offset"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.resumed_from = self.step

    def _newest_on_storage(self) -> int | None:
        """The newest step with a COMMIT.json on storage (a listing, no data read; collective); None when there
        is none or the storage cannot be listed (the memory rung goes on without it)."""
        newest = None
        if self.rank == 0:
            try:
                newest = self.checkpoints.newest_committed_step()
            except Exception as err:  # noqa: BLE001 - an unreachable storage does not stop a memory restore
                log.warning("could not list the checkpoints on %s (%s): memory copies are compared with none",
                            self.cfg.checkpoint.url, err)  # fmt: skip
        box = [newest]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _collective_check(self) -> dict[str, Any]:
        """All-reduce of known values and a broadcast from rank 0 on the real process group."""
        total = torch.tensor([float(self.rank + 1)], device=self.device)
        dist.all_reduce(total)
        expected = self.world * (self.world + 1) / 2
        payload = (
            torch.arange(8, dtype=torch.float32, device=self.device) * 7
            if self.rank == 0
            else torch.zeros(8, device=self.device)
        )
        dist.broadcast(payload, src=0)
        return {
            "all_reduce_sum": total.item(),
            "all_reduce_expected": expected,
            "broadcast_ok": bool(torch.equal(payload.cpu(), torch.arange(8, dtype=torch.float32) * 7)),
        }

    def _mesh_record(self) -> dict[str, Any] | None:
        """Model-parallel layouts: this rank's mesh coordinates and an all-reduce of rank+1 on each of its
        sub-groups (tensor, context, pipeline, data, expert) against the sum those ranks should give."""
        if self.meshes is None:
            return None
        m = self.meshes
        dims = m.dims
        sizes = {"pp": dims.pp, "dp": dims.dp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard,
                 "cp": dims.cp, "tp": dims.tp, "ep": dims.ep}  # fmt: skip
        groups: dict[str, Any] = {}
        for name, mesh in (("tp", m.tp), ("cp", m.cp), ("pp", m.pp), ("dp", m.dp_flat), ("ep", m.ep)):
            if mesh is None or mesh.size() == 1:
                continue
            ranks = mesh.mesh.flatten().tolist()
            total = torch.tensor([float(self.rank + 1)], device=self.device)
            dist.all_reduce(total, group=mesh.get_group())
            groups[name] = {"ranks": ranks, "all_reduce_sum": total.item(),
                            "all_reduce_expected": float(sum(r + 1 for r in ranks))}  # fmt: skip
        # What this rank runs, beside what the spec defines: acceptance checks that every layer runs on exactly
        # one pipeline stage and every expert on exactly one expert-parallel rank.
        moe = self.cfg.model.moe
        defined = {"n_layers": self.cfg.model.n_layers, "n_experts": moe.n_experts if moe is not None else 0}
        held = held_layers(self.pipeline.model if self.pipeline is not None else self.model)
        return {"dims": sizes, "coords": {k: m.coords[k] for k in sizes}, "groups": groups, **held, **defined}

    def _write_ranks(self) -> None:
        me = {
            "rank": self.rank,
            "local_rank": self.env.local_rank,
            "world_size": self.world,
            "local_world_size": self.env.local_world_size,
            "host": self.env.host,
            "pid": os.getpid(),
            "device": str(self.device),
            "backend": self.backend,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
            "worker_start": worker_start.how_started(),  # fork: forked from its agent (training/worker_start.py)
            "resumed_from_step": self.resumed_from,
            "collective": self._collective_check(),
            "mesh": self._mesh_record(),
            "network": network_record(self.backend),
            "comm_probe": probe_record(self.cfg.run.comm_probe_mb, self.device, self.env.host, self.env.local_rank),
            # model.init_from's load check: the largest deviation from transformers' logits (None: not checked)
            "init_check_deviation": self.init_deviation,
            **spares.agent_record(),
        }
        everyone: list[Any] = [None] * self.world
        dist.all_gather_object(everyone, me)
        if self.rank == 0:
            previous = spares.previous_ranks(self.cfg.run.output_url, self.cfg.storage)  # before it is replaced
            spares.record_takeover(self.cfg.run.output_url, self.cfg.storage, previous, everyone, self.resumed_from)
            self.out.write_ranks(Ranks(self.world, everyone))
            self.out.sync()

    # ---- loop -------------------------------------------------------------------------------

    def _loss(self, batch: Any, distilled: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The loss of a batch (the workload's), the MoE aux loss and, `distilled` (training steps of a distill
        run), the KL to the teacher: the loss is then the distillation objective; evaluation keeps the plain
        cross-entropy."""
        return self.workload.loss(self.model, batch, self._loss_inputs, distilled)

    @functools.cached_property
    def _loss_inputs(self) -> LossInputs:
        return LossInputs(self.device, self.autocast_dtype, self.meshes is not None, self.teacher)

    @property
    def _tensor_parallel(self) -> bool:
        return self.meshes is not None and self.meshes.dims.tp > 1

    def _pipeline_step(self, micro_batches: list[np.ndarray]) -> tuple[torch.Tensor, float, float]:
        """One pipelined optimizer step (the schedule folds the accumulation into its microbatches): the data-
        parallel rank's mean loss on every stage, and the seconds (wall, then process CPU) spent reading samples."""
        fetch, fetch_cpu = time.perf_counter(), time.process_time()
        tokens = self.train_data.batch(np.concatenate(micro_batches))
        data_s, data_cpu_s = time.perf_counter() - fetch, time.process_time() - fetch_cpu
        loss = self.pipeline.train_step(tokens)
        return self._from_last_stage(loss), data_s, data_cpu_s

    def _from_last_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss on every stage of the pipeline (the others contribute zero to the sum)."""
        value = torch.zeros((), device=self.device) if loss is None else loss.detach().float().reshape(())
        if self.meshes is not None and self.meshes.dims.pp > 1:
            dist.all_reduce(value, group=self.meshes.pp.get_group())
        return value

    def train_step(self) -> PendingRecord:
        """One optimizer step (its record is written by the next `flush_metrics`); on model-parallel layouts the
        second step of each launch is also the measurement step: its collectives are counted and timed per mesh
        dimension (training/comm_counter.py) and recorded as comm_bytes and comm_s_per_dim. Waiting for each
        collective where it is issued serialises that one step's communication, so only one step per launch is
        measured."""
        self._steps_run = getattr(self, "_steps_run", 0) + 1
        if self.meshes is None or self._steps_run != 2:
            pending = self._train_step()
            while pending is None:  # the replica groups did not commit this step: it is trained again
                pending = self._train_step()
            return pending
        from training.comm_counter import TrafficCounter, group_labels  # noqa: PLC0415 - model-parallel only

        counter = TrafficCounter(labels=group_labels(self.meshes), timed=True)
        with counter:
            pending = self._train_step(counted=counter)
        return pending

    def _train_step(self, counted: Any = None) -> PendingRecord | None:
        """One optimizer step over grad_accum_steps micro-batches; its metrics record, whose device figures are
        read with the next `flush_metrics` (None: the replica groups did not commit it, nothing changed)."""
        cfg = self.cfg
        started, cpu_started = time.perf_counter(), time.process_time()
        compute_events = _compute_events(self.device)
        data_s = data_cpu_s = 0.0
        if not self.model.training:  # evaluate() leaves it in eval mode; train() walks every module
            self.model.train()
        if self.replica is not None:
            last = min(cfg.run.steps, cfg.run.stop_after_steps or cfg.run.steps)
            self.replica.begin_step(last=self.step + 1 == last)  # a group behind the others heals here
        position = self.sampler.state
        epoch, draws = self.sampler.next_step()
        micro_batches = [self.blend.samples(epoch, d) for d in draws] if self.blend else draws
        loss_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        kl_sum = torch.zeros((), device=self.device)
        accum = len(micro_batches)
        coef = cfg.model.moe.aux_loss_coef if cfg.model.moe else 0.0
        if self.pipeline is not None:
            loss_mean, data_s, data_cpu_s = self._pipeline_step(micro_batches)
            loss_sum, micro_batches_run = loss_mean * accum, []
        else:
            micro_batches_run = micro_batches
        for m, indices in enumerate(micro_batches_run):
            fetch, fetch_cpu = time.perf_counter(), time.process_time()
            tokens = self.train_data.batch(indices)
            data_s += time.perf_counter() - fetch
            data_cpu_s += time.process_time() - fetch_cpu
            with gradient_sync(self.model, enabled=m == accum - 1), loss_context(self._tensor_parallel):
                loss, aux, kl = self._loss(tokens, distilled=True)
                if drill_points.poisons_loss(self.step + 1):  # a drill's workload error: NaN from here on
                    loss = loss * float("nan")
                objective = loss + coef * aux if coef else loss  # a tensor-parallel loss is a DTensor, aux is not
                self.scaler.scale(objective / accum).backward()
            loss_sum += _to_tensor(loss.detach())
            aux_sum += _to_tensor(aux.detach())
            if kl is not None:
                kl_sum += kl.detach()
        if self.replica is not None:
            self.replica.sync_gradients(self.model)
            if not self.replica.should_commit():  # a group failed in this step: drop it, take the quorum again
                self.optimizer.zero_grad(set_to_none=True)
                self.sampler.state = position
                return None
        self.scaler.unscale_(self.optimizer)
        clip = cfg.optim.grad_clip_norm if cfg.optim.grad_clip_norm is not None else float("inf")
        if self.meshes is None:
            grad_norm = _to_tensor(torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip))
        else:
            grad_norm = _to_tensor(clip_grad_norm(self.model, clip, self.meshes))
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        skipped = self.scaler.is_enabled() and self.scaler.get_scale() < scale_before
        self.skipped_steps += int(skipped)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

        local_loss = (loss_sum / accum).detach().float()
        # Every rank learns at this step boundary whether any rank got SIGTERM or SIGUSR1 (signals reach the
        # ranks at slightly different times). On GPUs the loss is averaged without the host waiting for it and
        # the preemption flags are summed over the host (a gloo group beside NCCL): no device sync. On CPU
        # (gloo) everything is on the host already: one collective carries the loss and the flags.
        flags = torch.tensor(preemption.WATCH.flags(), dtype=torch.float32)
        loss_work = None
        drill_points.before_collective(self.step + 1)  # the hang drill's rank stops here, short of the collective
        self.watchdog.beat("loss_sync")
        if compute_events is not None:
            compute_events[1].record()
        if self.world == 1:  # nothing to agree on: the collective would hand back this rank's own figures
            global_loss, loss_sync_s, loss_sync_cpu_s = local_loss.reshape(1), 0.0, 0.0
        elif self.backend == "nccl":
            global_loss = local_loss.reshape(1).clone()
            loss_work = dist.all_reduce(global_loss, op=dist.ReduceOp.AVG, async_op=True)
            synced, synced_cpu = time.perf_counter(), time.process_time()  # waiting for a slower rank is no compute
            dist.all_reduce(flags, group=self.host_group)
            loss_sync_s, loss_sync_cpu_s = time.perf_counter() - synced, time.process_time() - synced_cpu
        else:
            synced, synced_cpu = time.perf_counter(), time.process_time()
            reduced = torch.cat([local_loss.reshape(1), flags])
            dist.all_reduce(reduced)  # gloo has no average: the sum is divided when the record is read
            global_loss, flags = reduced[:1], reduced[1:]
            loss_sync_s, loss_sync_cpu_s = time.perf_counter() - synced, time.process_time() - synced_cpu
        self.preempt_signal = self.preempt_signal or preemption.agreed_signal(flags.tolist())
        self.step += 1
        tokens_step = self.sampler.global_batch * self.workload.units_per_sample
        self.tokens_seen += tokens_step
        elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        comm_s = self.comm_timer.take() if self.comm_measured else None
        # The process's CPU time is what a busy host does not inflate (a descheduled rank's wall time grows, its CPU
        # time does not), so the straggler rule and the regression gate judge it on CPU. On a GPU the host's CPU
        # time says nothing about the device's work (it may spin in a synchronisation): CUDA events time it there.
        on_cpu = self.device.type == "cpu"
        record = {
            "step": self.step,
            "epoch": epoch,
            "loss": None,  # the device figures: filled in by flush_metrics
            "rank_loss": None,
            "aux_loss": None,
            "lr": lr,
            "grad_norm": None,
            "loss_scale": self.scaler.get_scale() if self.scaler.is_enabled() else None,
            "skipped": skipped,
            "tokens_per_s": tokens_step / elapsed,
            "tokens_per_s_rank": tokens_step / self.world / elapsed,
            "step_time_s": elapsed,
            "data_wait_s": data_s,
            "comm_s": comm_s,
            "compute_s": max(0.0, elapsed - data_s - (comm_s or 0.0) - loss_sync_s),
            "tokens": tokens_step,
            "cpu_s": cpu_s if on_cpu else None,
            "compute_cpu_s": max(0.0, cpu_s - data_cpu_s - loss_sync_cpu_s) if on_cpu else None,
            "compute_device_s": None,  # GPUs: filled in by flush_metrics from compute_events
            "peak_mem_bytes": peak_memory_bytes(self.device),
            "runtime_mem_bytes": self.runtime_mem_bytes,
            "dropped_tokens": self._dropped_tokens(),
            "comm_bytes": dict(counted.sent) if counted is not None else None,
            "comm_s_per_dim": dict(counted.seconds) if counted is not None else None,
            "time_unix_s": time.time(),
            "memory_copy_before_s": self._take_copy_held(),  # held training between the previous step and this one
            **self.telemetry.gpu_readings(),
        }
        device = {"loss": global_loss.reshape(()), "rank_loss": local_loss.reshape(()), "grad_norm": grad_norm}
        if cfg.model.moe:
            device["aux_loss"] = (aux_sum / accum).detach().float().reshape(())
        if self.teacher is not None:
            device["distill_kl"] = (kl_sum / accum).float().reshape(())
        pending = PendingRecord(record, device, loss_work, 1 if self.backend == "nccl" else self.world, compute_events)
        if cfg.run.record_samples and (self.meshes is None or self.meshes.is_data_leader):
            # One record per data-parallel rank (its first-stage, tensor-rank-0 process), keyed by that rank.
            sampler = self.sampler
            offset = sampler.state.offset - sampler.global_batch  # where this step's global batch began
            record = {"step": self.step, "epoch": epoch, "offset": offset, "resumed_from": self.resumed_from,
                      "indices": np.concatenate(draws).tolist()}  # fmt: skip
            if self.blend:  # the indices are the blend's draw ids; the samples they drew, per source
                record["samples"] = np.concatenate(micro_batches).tolist()
            self.out.append_samples(self.dp_rank, record)
            if self.rank == 0 and sampler.epoch_done:
                dropped, padded = sampler.remainder(epoch).tolist(), sampler.padding(epoch).tolist()
                end = EpochEnd(epoch, self.step, sampler.n_samples, sampler.global_batch, dropped, padded)
                self.out.append_epoch(end)
        return pending

    def _take_copy_held(self) -> float | None:
        """The stall of the in-memory copy taken since the last step record (once: None afterwards)."""
        held, self._copy_held_s = self._copy_held_s, None
        return held

    def flush_metrics(self) -> list[StepRecord]:
        """Read the pending steps' device figures in one host transfer, write their records (in step order),
        and return them."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        for p in pending:
            if p.work is not None:
                p.work.wait()
        names = [sorted(p.device) for p in pending]
        values = torch.stack([p.device[n].float() for p, keys in zip(pending, names, strict=True) for n in keys])
        flat = iter(values.tolist())
        records = []
        for p, keys in zip(pending, names, strict=True):
            figures = p.record | {n: next(flat) for n in keys}
            figures["loss"] /= p.divide
            if p.compute_events is not None:
                p.compute_events[1].synchronize()  # already done: the values above were read after it
                figures["compute_device_s"] = p.compute_events[0].elapsed_time(p.compute_events[1]) / 1000
            record = StepRecord(rank=self.rank, **figures)
            self.out.append_metrics(record)
            self.telemetry.observe(record)
            records.append(record)
        return records

    @property
    def metrics_sync_every(self) -> int:
        """Steps between host reads of the device figures (run.metrics_sync_every_steps; see its description)."""
        every = self.cfg.run.metrics_sync_every_steps
        if every is not None:
            return every
        return 1 if self.device.type == "cpu" else self.cfg.run.log_every_steps

    def _dropped_tokens(self) -> int | None:
        """MoE assignments over expert capacity in this step on this rank (None: dense model)."""
        if self.cfg.model.moe is None:
            return None
        from training.experts import take_dropped_tokens  # noqa: PLC0415 - MoE models only

        return take_dropped_tokens(self.model)

    @torch.no_grad()
    def evaluate(self, of_teacher: bool = False) -> dict[str, Any]:
        """Mean validation loss and perplexity over eval_batches micro-batches per rank, reduced across ranks;
        `of_teacher`: the distillation teacher's on the same batches (not recorded as an evaluation)."""
        self.model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        counts: torch.Tensor | None = None  # the workload's tallies (a vit's confusion matrix), summed over ranks
        for j in range(self.cfg.run.eval_batches):
            tokens = self._val_batch(j)
            if of_teacher and self.teacher is not None:
                autocast = self.autocast_dtype is not None
                with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=autocast):
                    loss = self.teacher.cross_entropy(tokens.to(self.device))
            elif self.pipeline is not None:
                loss = self._from_last_stage(self.pipeline.eval_loss(tokens))
            else:
                with loss_context(self._tensor_parallel):
                    part = self.workload.eval_batch(self.model, tokens, self._loss_inputs)
                loss = part.loss
                if part.counts is not None:
                    counts = part.counts if counts is None else counts + part.counts
            count = self.workload.eval_units(tokens)
            totals += torch.tensor([loss.item() * count, count], dtype=torch.float64, device=self.device)
        # Tensor and pipeline peers of a data-parallel rank hold the same figures: the ratio is unchanged.
        dist.all_reduce(totals)
        val_loss = (totals[0] / totals[1]).item()
        result = {"step": self.step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0))}
        if counts is not None:  # summed over every rank: a data-parallel rank's tensor and pipeline peers repeat its
            dist.all_reduce(counts)  # counts, so the sum is divided by how many hold each
            result |= self.workload.eval_metrics(counts / max(1, self.world // self.dp_size))
        if self.rank == 0 and not of_teacher:
            self.out.append_eval(result)
        return result

    def _val_batch(self, j: int) -> Any:
        """This rank's `j`-th validation micro-batch of every evaluation."""
        b, n = self.cfg.parallel.micro_batch, len(self.val_data)
        first = (j * self.dp_size + self.dp_rank) * b
        return self.val_data.batch([(first + k) % n for k in range(b)])

    def _write_distillation(self, student_val_loss: float, teacher_val_loss: float) -> None:
        """distillation.json: the student beside its teacher on rank 0's validation batches (collective: the
        student's weights are gathered on rank 0, which alone measures both forwards)."""
        assert self.teacher is not None
        student = gathered_student(self.model, self.cfg.model, self.rank)
        if student is None:
            return
        batches = [self._val_batch(j) for j in range(self.cfg.run.eval_batches)]
        record = distillation_record(self.step, student, self.teacher.model, student_val_loss, teacher_val_loss,
                                     batches)  # fmt: skip
        self.out.write_distillation(record)
        log.info("%s", record.summary())

    def _save(self, background: bool = False) -> None:
        """Checkpoint this step, after recording the background save still in flight (if any). `background`:
        return once the state is staged; the commit is recorded by the next `_save` or `_await_save`."""
        self._await_save()
        save = self.checkpoints.save_async if background else self.checkpoints.save
        self._record_save(lambda: save(self.step, self.model, self.optimizer, self._train_state()))

    def _await_save(self) -> None:
        """Wait for the background save, if one is in flight, and record it."""
        self._record_save(self.checkpoints.wait)

    def _record_save(self, finish: Callable[[], SavedCheckpoint | None]) -> None:
        """Record the checkpoint `finish` commits (None: none yet), or its loss if continue_on_save_failure."""
        try:
            saved = finish()
        except CheckpointSaveError as err:
            step = self.step if err.step is None else err.step
            if self.rank == 0:  # the run output says which save failed and why, whether or not training goes on
                self.out.append_checkpoint(CheckpointEvent(step, error=str(err)))
                self.out.sync()
            if not self.cfg.checkpoint.continue_on_save_failure:
                raise
            log.error("checkpoint of step %d lost, training goes on (the next save will try again): %s", step, err)
            return
        if saved is None:
            return
        self.saved_step = saved.step
        if self.rank == 0:
            log.info(
                "checkpoint step %d: %.1f MB in %.2fs (training held %.2fs)",
                saved.step, saved.nbytes / 1e6, saved.seconds, saved.stall_s,
            )  # fmt: skip
            self.out.append_checkpoint(CheckpointEvent(saved.step, saved.nbytes, saved.seconds,
                                                       stall_s=round(saved.stall_s, 4)))  # fmt: skip

    def _saved_at(self, step: int, stall_s: float, step_s: float) -> None:
        """Tell the save schedule a periodic save's stall and the step time; under save_every_steps=auto the ranks
        agree on them first (the largest), so that every rank chooses the same next save."""
        if self.save_schedule.auto:
            figures = torch.tensor([stall_s, step_s], dtype=torch.float64, device=self.device)
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
            stall_s, step_s = figures.tolist()
        self.save_schedule.saved(step, stall_s, step_s)

    def _preempt(self, signal_name: str) -> None:
        """Checkpoint this step (unless it was just saved), record the preemption (rank 0), and wait for every
        rank, so that the record exists before any worker exits with PREEMPTED_EXIT_CODE."""
        if self.rank == 0:
            log.warning("step %d: %s received, checkpointing before exiting", self.step, signal_name)
        self._await_save()  # a background save of this very step counts once it is committed
        if self.saved_step != self.step:
            self._save()
        if self.saved_step != self.step:  # the save failed and continue_on_save_failure let training go on
            raise CheckpointSaveError(
                self.checkpoints.step_url(self.step), 0, RuntimeError(f"preempted by {signal_name}: save failed")
            )
        request = preemption.WATCH.request
        self.out.sync()
        if self.rank == 0:
            since = request.monotonic_s if request else time.monotonic()  # rank 0 learnt it from a peer
            record = preemption.PreemptionRecord(
                step=self.step, signal=signal_name, signal_to_exit_s=round(time.monotonic() - since, 4),
                checkpoint=self.checkpoints.step_url(self.step), time=time.time(),
                run_id=os.environ.get("TORCHELASTIC_RUN_ID"), world_size=self.world,
            )  # fmt: skip
            preemption.append_record(self.cfg.run.output_url, record, self.cfg.storage)
            self.preempted = record
            log.warning("%s (%.2fs after the signal)", record.describe(), record.signal_to_exit_s)
        else:
            self.preempted = preemption.PreemptionRecord(self.step, signal_name, 0.0, "", time.time())
        dist.barrier()

    def fit(self) -> dict[str, Any]:
        """Train until run.steps; returns the result the run output records."""
        cfg = self.cfg
        if self.rank == 0:
            log.info(
                "training %.2fM params, world %d (%s, %s), global batch %d x %d tokens, steps %d -> %d",
                self.n_params / 1e6, self.world, cfg.parallel.sharding, self.backend,
                self.sampler.global_batch, self.workload.units_per_sample, self.step, cfg.run.steps,
            )  # fmt: skip
        first_loss = last = None
        last_eval: dict[str, Any] | None = None
        last_step = min(cfg.run.steps, cfg.run.stop_after_steps or cfg.run.steps)
        if self.started_from_hf:  # the starting model's validation loss (step 0): the quality gate's bar
            with self.watchdog.phase("eval", self.step):
                self.evaluate()
        while self.step < last_step:
            for lease in self.leases:
                lease.check()
            step_started = time.perf_counter()
            with self.watchdog.phase("step", self.step + 1):
                self._pending.append(self.train_step())
            step_s = time.perf_counter() - step_started
            evaluating = bool(cfg.run.eval_every_steps and self.step % cfg.run.eval_every_steps == 0)
            saving = self.save_schedule.due(self.step) and self.step < last_step
            holding = drill_points.holds_after(self.step)
            drill_points.leak()  # the soak's planted leak (off unless a test sets it)
            stopping = self.preempt_signal is not None or holding or self.step == last_step
            # The step's records are written before anything that reads or keeps them (the log line, an
            # evaluation, a checkpoint, a stop), and at least every metrics_sync_every steps.
            if (
                evaluating
                or saving
                or stopping
                or self.step % cfg.run.log_every_steps == 0
                or (self.step % self.metrics_sync_every == 0)
            ):
                nonfinite: StepRecord | None = None
                for step_record in self.flush_metrics():
                    last = step_record
                    first_loss = first_loss if first_loss is not None else step_record.loss
                    if not math.isfinite(step_record.loss) and not step_record.skipped:
                        log.error("step %d: loss is %s", step_record.step, step_record.loss)
                        nonfinite = nonfinite or step_record
                if nonfinite is not None and cfg.run.stop_on_nonfinite_loss:  # every rank reads the same loss
                    self.out.sync()
                    raise failure.NonFiniteLoss(nonfinite.step, nonfinite.loss)
            if (
                self.rank == 0
                and last is not None
                and (self.step % cfg.run.log_every_steps == 0 or self.step == last_step)
            ):
                log.info(
                    "step %d/%d loss %.4f lr %.2e grad_norm %.3f tok/s %.0f mem %.0f MiB",
                    self.step, cfg.run.steps, last.loss, last.lr, last.grad_norm,
                    last.tokens_per_s, last.peak_mem_bytes / 2**20,
                )  # fmt: skip
            if self.step % cfg.run.log_every_steps == 0:
                self.out.sync()
            if evaluating:
                with self.watchdog.phase("eval", self.step):
                    last_eval = self.evaluate()
            if saving:
                save_started = time.perf_counter()
                with self.watchdog.phase("save", self.step):
                    self._save(background=cfg.checkpoint.async_save)
                self._saved_at(self.step, time.perf_counter() - save_started, step_s)
            if self.memory is not None and self.memory.due(self.step) and self.step < last_step:
                self._copy_held_s = self.memory.snapshot(self.step, self.model, self.optimizer, self._train_state())
            if self.preempt_signal is not None and self.step < last_step:
                self._preempt(self.preempt_signal)
                break
            if holding:  # a drill (rank_kill, node_loss) strikes here, with this run's checkpoints committed
                self._await_save()
                if self.memory is not None:  # and its in-memory copies kept
                    self.memory.wait()
                self.out.sync()
                drill_points.hold(self.step)
        if self.preempted is not None:  # stopped early: no final evaluation, save or result
            self.out.close()
            self.telemetry.close()
            return {"steps": self.step, "preempted": True, "signal": self.preempted.signal}
        if last_eval is None or last_eval["step"] != self.step:
            with self.watchdog.phase("eval", self.step):
                last_eval = self.evaluate()
        with self.watchdog.phase("save", self.step):
            self._await_save()  # the run's last background save is committed before it ends
            if cfg.checkpoint.save_at_end and self.checkpoints.read_commit(self.step) is None:
                self._save()
        if self.memory is not None:  # the run is over: its host memory is freed
            stalls, waits = self.memory.stalls_s, self.memory.waits_s
            if self.rank == 0 and stalls:
                log.info("in-memory copies: %d, training held %.2f ms per copy (mean; %.2f ms of it waiting for the "
                         "previous exchange), %.2f ms at most", len(stalls), 1e3 * sum(stalls) / len(stalls),
                         1e3 * sum(waits) / len(waits), 1e3 * max(stalls))  # fmt: skip
            self.memory.discard()
        result = {
            "steps": self.step,
            "resumed_from_step": self.resumed_from,
            "world_size": self.world,
            "first_loss": first_loss,
            "final_loss": last.loss if last else None,
            "val_loss": last_eval["val_loss"],
            "val_ppl": last_eval["val_ppl"],
            "skipped_steps": self.skipped_steps,
            "tokens_seen": self.tokens_seen,
            "n_params": self.n_params,
            "teacher_val_loss": self.evaluate(of_teacher=True)["val_loss"] if self.teacher is not None else None,
        }
        # Every rank's parameter pieces: acceptance checks that replicas are bit-identical and compares the
        # whole parameters with the reference's.
        self.out.write_params(param_record(self.model, self.rank, self.step, cfg.model))
        if self.teacher is not None:
            with self.watchdog.phase("eval", self.step):
                self._write_distillation(result["val_loss"], result["teacher_val_loss"])
        if self.rank == 0:
            self.out.write_result(RunResult(**result))
            log.info("done: step %d val_loss %.4f val_ppl %.2f", self.step, result["val_loss"], result["val_ppl"])
        self.out.close()
        self.telemetry.close()
        return result


@record
def main(argv: list[str] | None = None) -> int:
    """Entry point under torchrun; the exit code (0, PREEMPTED_EXIT_CODE after a checkpoint on a signal, or
    WORKLOAD_EXIT_CODE when an earlier attempt of this job recorded a workload error: training/failure.py)."""
    preemption.WATCH.install()  # first: a signal during start-up stops the job after its first step
    parser = argparse.ArgumentParser(description="transformer-deploy training payload")
    parser.add_argument("--config", required=True, help="run.json written from the deployment spec")
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    if "TORCHELASTIC_RUN_ID" in os.environ:
        # Workers run in sessions of their own: without this, a SIGKILLed agent leaves them training unsupervised.
        # SIGKILL, as SIGTERM now asks for a checkpoint at the next step boundary, which a worker whose agent is
        # gone (or that hangs) must not wait for; a graceful stop goes through the agent, which waits for it.
        process.die_with_parent(signal.SIGKILL)
    cfg = TrainConfig.from_json_file(args.config)
    earlier = failure.failure_of_this_job(cfg.run.output_url, cfg.storage)
    if earlier is not None:  # torchrun restarts workers whatever failed: a workload error is not retried
        log.error("not retried: %s", earlier.describe())
        return failure.WORKLOAD_EXIT_CODE
    trainer: Trainer | None = None
    watchdog: Watchdog | None = None
    code = 0
    try:
        enable_flight_recorder()  # before the process group: a hang dump then names each rank's last collective
        init_distributed(DistEnv.from_environ())
        with exclusive_roots(cfg) as leases:
            if cfg.reference is not None:  # the acceptance suite's independent reference, not the trainer
                run_reference(cfg)
            else:
                # Start-up is timed from here (rendezvous done, the run's folders ours): nothing is written before.
                watchdog = Watchdog.for_rank(cfg.watchdog, dist.get_rank(), dist.get_world_size(), cfg.run.output_url)
                trainer = Trainer(cfg, leases, watchdog)
                trainer.fit()
                code = 0 if trainer.preempted is None else preemption.PREEMPTED_EXIT_CODE
    except Exception as err:
        found = failure.classify(err, None if trainer is None else trainer.step, int(rank))
        if found is not None:  # the restart policy stops on it instead of recovering
            failure.write_failure(cfg.run.output_url, found, cfg.storage)
            log.error("%s", found.describe())
        raise
    finally:
        # Free the model (DDP's reducer holds the process group and its last work) while the interpreter is
        # fully alive: left to interpreter shutdown, gloo's teardown can abort a job that finished its work.
        if watchdog is not None:
            watchdog.close()
        del trainer
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    # A failure raises (torchrun's error file, exit 1); success and preemption skip the interpreter's teardown.
    process.exit_now(main())
