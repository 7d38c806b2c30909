"""The trainer bugs of TestFaults, patched into the payload from outside (tests/faults/harness/sitecustomize.py).

Each patch wraps the payload function or method where the bug would be written, so the payload itself carries
no switch. Under torchrun the trainer's module runs as `__main__` (`python -m training.train`): its own names
(the Trainer class, build_optimizer, ...) exist once the job reads its config, so `install` patches them then
(TrainConfig.from_json_file); the other modules' names are patched at once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import importlib
import logging
import os
import signal
import statistics
import sys
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tests.faults.bugs import TestFaults
from training import config, dataset, drill_points, preemption, workload
from training.checkpoint import manager
from training.sampler import GlobalBatchSampler
from training.watchdog import deliberate_hold

log = logging.getLogger(__name__)
Setter = Callable[[Any, str, Any], None]  # setattr, or pytest's monkeypatch.setattr


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def install(faults: TestFaults, put: Setter = setattr) -> None:
    """Patch the sampler and the checkpoint writer now, and the trainer's module when the job reads its config."""
    log.warning("TEST FAULTS ACTIVE: %s", faults.model_dump(exclude_defaults=True))
    patch_sampler(faults, put)
    patch_checkpoints(faults, put)
    patch_data(faults, put)
    read = config.TrainConfig.from_json_file.__func__
    patched: list[ModuleType] = []

    def from_json_file(cls: type, path: Any) -> Any:
        cfg = read(cls, path)
        if not patched:
            patched.append(_trainer_module())
            patch_trainer(patched[0], faults, cfg.run.seed, put)
        return cfg

    put(config.TrainConfig, "from_json_file", classmethod(from_json_file))


def _trainer_module() -> ModuleType:
    """training/train.py as this process runs it: `__main__` under `python -m training.train`."""
    main = sys.modules.get("__main__")
    if main is not None and getattr(main.__spec__, "name", None) == "training.train":
        return main
    return importlib.import_module("training.train")


# ---- the trainer ------------------------------------------------------------------------------------------


def patch_trainer(module: ModuleType, faults: TestFaults, run_seed: int, put: Setter = setattr) -> None:
    """Patch the Trainer of `module` (training/train.py, as imported or as `__main__`) and the names it calls."""
    trainer = module.Trainer

    def offset(seed: int) -> int:  # seed_offset_rank seeds everything (init, data order) with seed + seed_offset
        return seed + faults.seed_offset if faults.seed_offset_rank == _rank() else seed

    if faults.seed_offset_rank is not None:
        blend_of, seed_everything = workload.blend_of, module.seed_everything  # the text workload's blend
        put(workload, "blend_of", lambda dataset, seed: blend_of(dataset, offset(seed)))
        # Only the initial weights' seed: the per-rank streams (seed + 1 + stream) are seeded apart.
        put(module, "seed_everything", lambda seed: seed_everything(offset(seed) if seed == run_seed else seed))
    if faults.seed_offset_rank is not None or faults.same_samples_as_rank0 is not None:
        sampler_class = module.GlobalBatchSampler

        def sampler(n: int, micro: int, accum: int, world: int, rank: int, seed: int, drop_last: bool = True) -> Any:
            fed = 0 if faults.same_samples_as_rank0 == rank else rank
            return sampler_class(n, micro, accum, world, fed, offset(seed), drop_last=drop_last)

        put(module, "GlobalBatchSampler", sampler)
    if faults.tp_shard_seed:
        model_parallel = trainer._model_parallel  # noqa: SLF001

        def _model_parallel(self: Any, model: torch.nn.Module) -> torch.nn.Module:
            parallel = model_parallel(self, model)
            reseed_tp_shards(parallel, self.meshes.coords["tp"], self.cfg.run.seed, faults)
            return parallel

        put(trainer, "_model_parallel", _model_parallel)
    if faults.lr_scale is not None:
        build_optimizer = module.build_optimizer

        def scaled(*args: Any, **kwargs: Any) -> torch.optim.Optimizer:
            optimizer = build_optimizer(*args, **kwargs)
            log.warning("test fault: learning rate x %g", faults.lr_scale)
            for group in optimizer.param_groups:  # before the scheduler takes the groups' lr as its base
                group["lr"] *= faults.lr_scale
            return optimizer

        put(module, "build_optimizer", scaled)
    if faults.skip_grad_sync:
        gradient_sync = module.gradient_sync
        put(module, "gradient_sync", lambda model, enabled: gradient_sync(model, enabled=False))
    _patch_step(trainer, faults, put)
    _patch_stops(trainer, faults, put)


def _patch_step(trainer: type, faults: TestFaults, put: Setter) -> None:
    """The bugs inside one optimizer step: accum_bug, nan_at_step and slow_rank."""
    slow = SlowDown(faults) if faults.slow_rank is not None else None
    if not (faults.accum_bug or faults.nan_at_step is not None or slow):
        return
    train_step, compute_loss, pipeline_step = trainer._train_step, trainer._loss, trainer._pipeline_step  # noqa: SLF001
    micro_batch: dict[int, int] = {}  # id(trainer) -> the next micro-batch of the step it is running

    def _train_step(self: Any, counted: Any = None) -> Any:
        micro_batch[id(self)] = 0
        try:
            pending = train_step(self, counted)
        finally:
            del micro_batch[id(self)]
        if slow:
            on_cpu = self.device.type == "cpu"
            slow.step_computed(pending.record["compute_cpu_s" if on_cpu else "compute_s"], on_cpu)
        return pending

    def _loss(self: Any, tokens: torch.Tensor, distilled: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
        m = micro_batch.get(id(self))
        if m is None:  # an evaluation
            return compute_loss(self, tokens, distilled)
        micro_batch[id(self)] = m + 1
        if m > 0 and faults.accum_bug:
            self.optimizer.zero_grad(set_to_none=True)
        loss, aux, kl = compute_loss(self, tokens, distilled)
        if faults.nan_at_step == self.step + 1:
            loss = loss * float("nan")
        if m == 0 and slow:
            slow.maybe_slow_down()
        return loss, aux, kl

    def _pipeline_step(self: Any, micro_batches: list[np.ndarray]) -> Any:
        if slow:
            slow.maybe_slow_down()
        return pipeline_step(self, micro_batches)

    put(trainer, "_train_step", _train_step)
    put(trainer, "_loss", _loss)
    put(trainer, "_pipeline_step", _pipeline_step)


def _patch_stops(trainer: type, faults: TestFaults, put: Setter) -> None:
    """crash_at_step and pause_after_step: after that step (its records written, as a healthy run's would be by
    then), before the next one starts."""
    if faults.crash_at_step is None and faults.pause_after_step is None:
        return
    train_step = trainer.train_step

    def stopping_train_step(self: Any) -> Any:
        step, rank = self.step, _rank()
        crash = faults.crash_at_step == step and faults.crash_rank == rank
        pause = faults.pause_after_step is not None and step >= faults.pause_after_step
        if crash or pause:
            self.flush_metrics()
            self.out.sync()
        if crash:
            raise RuntimeError(f"test fault: injected crash on rank {rank} after step {step}")
        if pause:  # a hang to kill: SIGTERM ends it at once, with no checkpoint
            log.warning("test fault: pausing after step %d", step)
            preemption.WATCH.uninstall()
            with deliberate_hold(f"test fault: paused after step {step}"):  # the test kills it, not the watchdog
                while True:
                    time.sleep(60)
        return train_step(self)

    put(trainer, "train_step", stopping_train_step)


class SlowDown:
    """slow_rank's slow-down: its own compute times of its recent steps (the slow-down taken out), what it added
    in this one, and whether those times are CPU time (the busy loop then runs by the process's CPU clock)."""

    def __init__(self, faults: TestFaults) -> None:
        self.faults = faults
        self.own_compute_s: collections.deque[float] = collections.deque(maxlen=5)
        self.slept_s = 0.0
        self.cpu_clock = False

    def maybe_slow_down(self) -> None:
        """Slow slow_rank down inside the compute part of a step: sleep slow_step_s, or with slow_factor busy-loop
        (factor - 1) x its own compute time per step (the median of its last 5 steps, so one busy step does not
        double the next; nothing in its first step)."""
        faults = self.faults
        if faults.slow_rank != _rank():
            return
        if faults.slow_factor is None:
            self.slept_s = 0.0 if self.cpu_clock else faults.slow_step_s  # a sleep costs no CPU time
            time.sleep(faults.slow_step_s)
            return
        seconds = (faults.slow_factor - 1) * statistics.median(self.own_compute_s) if self.own_compute_s else 0.0
        self.slept_s = seconds
        busy_loop(seconds, self.cpu_clock)

    def step_computed(self, compute_s: float, cpu_clock: bool) -> None:
        """Note this rank's compute time of the step that ended (CPU time with `cpu_clock`), what maybe_slow_down
        added taken out."""
        self.own_compute_s.append(max(0.0, compute_s - self.slept_s))
        self.slept_s = 0.0
        self.cpu_clock = cpu_clock


def busy_loop(seconds: float, cpu_clock: bool) -> None:
    """Compute (spin) for `seconds` of this process's CPU time, or of wall time with `cpu_clock` False."""
    clock = time.process_time if cpu_clock else time.perf_counter
    end = clock() + seconds
    while clock() < end:
        pass


def tp_shard_seed_offset(faults: TestFaults, tp_coordinate: int) -> int:
    """What tp_shard_seed adds to the init seed of a rank at `tp_coordinate` of its tensor-parallel group: 0, or
    seed_offset on coordinate 1."""
    return faults.seed_offset if faults.tp_shard_seed and tp_coordinate == 1 else 0


@torch.no_grad()
def reseed_tp_shards(model: torch.nn.Module, tp_coordinate: int, seed: int, faults: TestFaults) -> int:
    """With tp_shard_seed, redraw this rank's local shard of every parameter sharded over the "tp" mesh
    dimension from seed + tp_shard_seed_offset (same mean and spread, other values); the number redrawn.

    Applied after the model is parallelised (parallelize_module, fully_shard): the DTensors are distributed
    from one rank's full weights, so seeding the init alone would not reach the shards.
    """
    offset = tp_shard_seed_offset(faults, tp_coordinate)
    if not offset:
        return 0
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415 - model-parallel jobs only

    generator = torch.Generator(device="cpu").manual_seed(seed + offset)
    redrawn = 0
    for param in model.parameters():
        if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
            continue
        if not isinstance(param.placements[param.device_mesh.mesh_dim_names.index("tp")], Shard):
            continue
        local = param.to_local()
        if local.numel() < 2:
            continue
        mean, std = local.float().mean().item(), local.float().std().item()
        fresh = torch.randn(local.shape, generator=generator) * (std or 0.02) + mean
        local.copy_(fresh.to(device=local.device, dtype=local.dtype))
        redrawn += 1
    log.warning("test fault: tensor-parallel rank %d redrew %d shards with seed %d", tp_coordinate, redrawn,
                seed + offset)  # fmt: skip
    return redrawn


# ---- the sampler and the checkpoint writer ----------------------------------------------------------------


def patch_sampler(faults: TestFaults, put: Setter = setattr) -> None:
    """sampler_skip_index: an epoch's order hands out the next index in place of that sample (seen twice)."""
    skip = faults.sampler_skip_index
    if skip is None:
        return
    permutation = GlobalBatchSampler.permutation

    def skipping(self: GlobalBatchSampler, epoch: int) -> np.ndarray:
        fresh = epoch != self._perm_epoch  # noqa: SLF001
        order = permutation(self, epoch)
        if fresh and skip < len(order):
            order = self._perm = np.where(order == skip, (skip + 1) % len(order), order)  # noqa: SLF001
        return order

    put(GlobalBatchSampler, "permutation", skipping)


def patch_data(faults: TestFaults, put: Setter = setattr) -> None:
    """slow_data_s: every batch read sleeps that long first (a starved input pipeline)."""
    if faults.slow_data_s is None:
        return
    batch = dataset.TokenDataset.batch

    def slow_batch(self: dataset.TokenDataset, indices: Any) -> torch.Tensor:
        time.sleep(faults.slow_data_s)
        return batch(self, indices)

    put(dataset.TokenDataset, "batch", slow_batch)


def patch_checkpoints(faults: TestFaults, put: Setter = setattr) -> None:
    """The save bugs: checkpoint_without_optimizer, save_bug_rank, kill_during_save_step, commit_before_extras."""
    writer = manager.CheckpointManager
    if faults.checkpoint_without_optimizer or faults.save_bug_rank is not None:
        take = writer._job  # noqa: SLF001

        def _job(self: Any, step: int, *args: Any, **kwargs: Any) -> Any:
            job = take(self, step, *args, **kwargs)
            if faults.checkpoint_without_optimizer:
                job = dataclasses.replace(job, state={k: v for k, v in job.state.items() if k != "optim"})
            rank = _rank()
            if faults.save_bug_rank == rank:  # raised inside the save, where every rank learns of it
                bug = TypeError(f"test fault: a bug inside the checkpoint save of step {step} on rank {rank}")
                job = dataclasses.replace(job, problem=bug)
            return job

        put(writer, "_job", _job)
    if faults.kill_during_save_step is not None:
        commit = writer._commit  # noqa: SLF001

        def _commit(self: Any, job: Any, *args: Any, **kwargs: Any) -> int:
            if job.step == faults.kill_during_save_step and _rank() == 0:
                log.warning("test fault: SIGKILL during the save of step %d", job.step)
                os.kill(os.getpid(), signal.SIGKILL)
            return commit(self, job, *args, **kwargs)

        put(writer, "_commit", _commit)
    if faults.commit_before_extras:
        put(writer, "_write", _write_commit_before_extras)


def _write_commit_before_extras(self: Any, job: Any, path: str, disk_full: Callable[[], bool], threads: int) -> int:
    """CheckpointManager._write with the commit marker early: COMMIT.json right after the DCP files (listing
    only those), then the small files (a broken save protocol for the drill to catch)."""
    step, group = job.step, job.group
    digests = manager.Digests()

    def write_dcp() -> None:
        writer = self._writer(self._url(path), digests, threads)
        if drill_points.pauses_a_save():
            writer = manager.PhaseWriter(writer, step)
        manager.dcp.save(job.state, storage_writer=writer, process_group=group)

    manager.agree(write_dcp, disk_full, group)
    nbytes = self._commit(job, path, digests, disk_full)
    drill_points.at_save_phase("after_dcp", step)

    def extras() -> None:
        if job.problem is not None:
            raise job.problem
        for rel, data in job.files.items():
            manager.write_bytes_atomic(self.fs, manager.join(path, rel), data)
            digests.add(rel, hashlib.sha256(data).hexdigest(), len(data))
        self._flush(path, digests.files())

    manager.agree(extras, disk_full, group)
    drill_points.at_save_phase("after_extras", step)
    drill_points.at_save_phase("after_commit", step)
    self._check_committed(job, path, digests, disk_full)
    return nbytes
