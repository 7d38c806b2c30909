"""The student against its teacher at the end of a distill run: size, held-out loss and forward speed side by side.

The losses are the trainer's own evaluations on the same validation batches (every rank's, reduced). The speed is
measured in the one process that holds both models (rank 0), on its validation micro-batches: one intra-op thread,
the two forwards alternated over the repeats (which goes first alternates too, so neither always meets a warm or
a cold cache), each timed by the CPU time of the calling thread, the median kept. CPU time, not wall time: a busy
machine stretches wall time but not the work done, and the trainer's own background threads (watchdog,
telemetry) are left out. The student is timed as a plain `Transformer` holding the trained weights, so DDP's and
FSDP's wrappers cost it nothing the teacher does not pay.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from training.config import ModelConfig
from training.holdings import canonical_name
from training.model import Transformer
from training.run_output import DistillationRecord, ModelFigures

SPEED_REPEATS = 5
SPEED_THREADS = 1


@torch.no_grad()
def gathered_student(model: nn.Module, cfg: ModelConfig, rank: int) -> Transformer | None:
    """The trained student as a plain `Transformer` on the CPU of rank 0, None on the other ranks (collective:
    every rank calls it; DDP replicas and FSDP shards alike). Parameter by parameter, as training/holdings.py
    reads them: FSDP2's state_dict hooks fail on a model whose root stays unsharded after an evaluation."""
    whole = {}
    for wrapped, param in model.named_parameters():
        whole[canonical_name(wrapped)] = (param.full_tensor() if isinstance(param, DTensor) else param).cpu()
    if rank != 0:
        return None
    with torch.random.fork_rng(devices=[]):  # the copy's throw-away init draws nothing from the run's streams
        student = Transformer(cfg)
    for name, value in whole.items():
        student.get_parameter(name).copy_(value)
    return student.eval()


def _cpu_seconds(model: nn.Module, batches: Sequence[torch.Tensor]) -> float:
    """CPU seconds of the calling thread for the forward of every batch's inputs."""
    started = time.thread_time()
    for tokens in batches:
        model(tokens[:, :-1])
    return time.thread_time() - started


@torch.no_grad()
def forward_speeds(
    student: nn.Module, teacher: nn.Module, batches: Sequence[torch.Tensor], repeats: int = SPEED_REPEATS
) -> tuple[float, float]:
    """(student, teacher) forward tokens per CPU-second on `batches` (CPU tensors), measured alternately."""
    threads = torch.get_num_threads()
    torch.set_num_threads(SPEED_THREADS)
    try:
        student, teacher = student.cpu().eval(), teacher.cpu().eval()
        _cpu_seconds(student, batches[:1]), _cpu_seconds(teacher, batches[:1])  # warm-up
        times: dict[str, list[float]] = {"student": [], "teacher": []}
        for repeat in range(repeats):
            order = [("student", student), ("teacher", teacher)]
            for name, model in order if repeat % 2 == 0 else order[::-1]:
                times[name].append(_cpu_seconds(model, batches))
    finally:
        torch.set_num_threads(threads)
    tokens = sum(t[:, :-1].numel() for t in batches)
    return tokens / statistics.median(times["student"]), tokens / statistics.median(times["teacher"])


def distillation_record(
    step: int,
    student: Transformer,
    teacher: Transformer,
    student_val_loss: float,
    teacher_val_loss: float,
    batches: Sequence[torch.Tensor],
) -> DistillationRecord:
    """distillation.json's record: both models' validation figures (already evaluated) and their forward speed."""
    student_speed, teacher_speed = forward_speeds(student, teacher, batches)

    def figures(model: Transformer, loss: float, speed: float) -> ModelFigures:
        return ModelFigures(model.num_params(), loss, math.exp(min(loss, 700.0)), speed)

    return DistillationRecord(
        step=step,
        student=figures(student, student_val_loss, student_speed),
        teacher=figures(teacher, teacher_val_loss, teacher_speed),
        speed_tokens=sum(t[:, :-1].numel() for t in batches),
        speed_repeats=SPEED_REPEATS,
        speed_threads=SPEED_THREADS,
    )
