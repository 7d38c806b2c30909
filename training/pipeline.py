"""Pipeline parallelism with torch.distributed.pipelining: the layers cut into chunks, one or more per pipeline rank.

The model is cut by layer into `parallel.pipeline_chunks` chunks (sizes from training/layout.py's
`pipeline_split`, uneven allowed). Pipeline rank s holds chunks s, s + pp, s + 2 pp, ... (the looped placement
of ScheduleInterleaved1F1B; one chunk per rank for gpipe and 1f1b). A chunk is a pruned Transformer: its blocks
keep their global layer index as key, the embedding lives on the first chunk, the final norm and the output
layer on the last, so every parameter keeps its full-model name and a pipeline checkpoint is a part of the
whole model's.

Gradient accumulation is folded into the microbatches: one `train_step` runs the schedule over the step's
micro_batch x grad_accum_steps sequences, forward and backward, and the trainer steps the optimizer once.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor

from training.config import TrainConfig
from training.layout import pipeline_split
from training.mesh import Meshes
from training.model import Transformer
from training.tensor_parallel import lm_loss, loss_context

logger = logging.getLogger(__name__)

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class StageModel(nn.Module):
    """The parameters of this rank's chunks under their full-model names (tok_emb, blocks.<i>, norm, lm_head).

    A holder for the optimizer and torch.distributed.checkpoint's get_state_dict/set_state_dict when a rank
    holds two or more chunks: its children are the chunks' own modules, so nothing is copied. It has no
    forward; the schedule runs the chunks.
    """

    def __init__(self, chunks: list[Transformer]) -> None:
        super().__init__()
        self.tok_emb = next((c.tok_emb for c in chunks if c.tok_emb is not None), None)
        self.blocks = nn.ModuleDict({key: block for c in chunks for key, block in c.blocks.items()})
        self.norm = next((c.norm for c in chunks if c.norm is not None), None)
        self.lm_head = next((c.lm_head for c in chunks if c.lm_head is not None), None)


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its chunks, their stages and the schedule that runs them."""

    model: nn.Module  # every parameter this rank holds, full-model names: optimizer and checkpoint target
    chunks: list[nn.Module]  # this rank's chunks in stage order, after parallelize_chunk
    stages: list[PipelineStage]
    schedule: ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B
    n_microbatches: int
    holds_first: bool  # holds chunk 0: feeds the tokens
    holds_last: bool  # holds the last chunk: computes the loss
    tensor_parallel: bool  # run the schedule under loss_parallel

    def train_step(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one optimizer step's (B, T + 1) tokens of this data-parallel rank; the mean
        loss over its B sequences on the ranks holding the last chunk, None elsewhere."""
        return self._run(tokens, self.schedule.step)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Forward only (dropout off) of (B, T + 1) tokens; their mean loss on the last chunk's ranks, else None."""
        # The schedule splits into exactly n_microbatches: a batch that does not divide is repeated k times,
        # which leaves the mean over its sequences unchanged (k <= n_microbatches, on a small eval batch).
        repeat = self.n_microbatches // math.gcd(tokens.shape[0], self.n_microbatches)
        if repeat > 1:
            tokens = tokens.repeat(repeat, 1)
        modes = [chunk.training for chunk in self.chunks]
        for chunk in self.chunks:
            chunk.eval()
        try:
            return self._run(tokens, self.schedule.eval)
        finally:
            for chunk, mode in zip(self.chunks, modes, strict=True):
                chunk.train(mode)

    def _run(self, tokens: torch.Tensor, run: Callable[..., object]) -> torch.Tensor | None:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        args = (inputs,) if self.holds_first else ()
        losses: list[torch.Tensor] | None = [] if self.holds_last else None
        with loss_context(self.tensor_parallel):
            run(*args, target=targets if self.holds_last else None, losses=losses, return_outputs=False)
        if losses is None:
            return None
        # Each microbatch's loss is already divided by n_microbatches (see _loss_fn): their sum is the mean.
        return torch.stack([_local(loss).detach() for loss in losses]).sum()


def _local(loss: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss_parallel is a replicated DTensor; the plain tensor otherwise."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


def split_ranges(sizes: list[int]) -> list[range]:
    """The layer indices of each chunk, in order."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=True)]


def describe_split(sizes: list[int]) -> str:
    """`layers 0-1 | 2-3 | ...`: the layers of each chunk, for the log."""
    return " | ".join(f"{r.start}-{r.stop - 1}" for r in split_ranges(sizes))


def build_chunk(model: Transformer, layers: range, first: bool, last: bool) -> Transformer:
    """A copy of `model` holding only `layers` (keys stay global), the embedding if `first`, the final norm and
    output layer if `last`.

    Only what the chunk keeps is copied: the dropped modules are put in deepcopy's memo as None, so the copy
    gets None in their place. A meta-device build would construct the full model on `meta`, prune, then
    `to_empty` and initialise each chunk's own parameters; the seeded init draws the whole model's parameters in
    order, so each chunk would have to skip the others' draws (or use per-parameter seeds) to stay equal to the
    single-process model. Copying from the seed-initialised full model keeps that equality for free.
    """
    keep = {str(i) for i in layers}
    dropped = [block for key, block in model.blocks.items() if key not in keep]
    if not first:
        dropped.append(model.tok_emb)
    if not last:
        dropped += [model.norm, model.lm_head]
    chunk = copy.deepcopy(model, memo={id(module): None for module in dropped})
    for key in [k for k in chunk.blocks if k not in keep]:
        del chunk.blocks[key]
    return chunk


def _stage_output(_module: nn.Module, _args: object, output: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """A stage sends one tensor: hidden states, or logits on the last chunk. The MoE aux loss is dropped:
    training/layout.py refuses MoE models with pipeline parallelism."""
    return output[0]


def build_pipeline(
    model: Transformer,
    cfg: TrainConfig,
    meshes: Meshes,
    device: torch.device,
    parallelize_chunk: Callable[[nn.Module], nn.Module],
) -> Pipeline:
    """Cut the seed-initialised `model` into this rank's chunks, parallelise each (TP, FSDP2) with
    `parallelize_chunk`, and make their stages and the schedule `cfg.parallel.pipeline_schedule`."""
    par = cfg.parallel
    pp, rank = meshes.dims.pp, meshes.coords["pp"]
    n_chunks = par.pipeline_chunks
    sizes = pipeline_split(cfg.model, par)
    ranges = split_ranges(sizes)
    if dist.get_rank() == 0:
        logger.info(
            "pipeline split: layers %s (%s, %d chunks on %d pipeline ranks, %d microbatches)",
            describe_split(sizes), par.pipeline_schedule, n_chunks, pp, par.n_microbatches,
        )  # fmt: skip
    indices = list(range(rank, n_chunks, pp))
    chunks: list[nn.Module] = []
    stages: list[PipelineStage] = []
    group = meshes.pp.get_group()
    for index in indices:
        chunk = build_chunk(model, ranges[index], first=index == 0, last=index == n_chunks - 1).to(device)
        chunk = parallelize_chunk(chunk)
        # A hook rather than a wrapper module: the stage must hold the FSDPModule itself, or the schedule's
        # FSDP handling (no reduce-scatter before the last microbatch's backward) does not apply.
        chunk.register_forward_hook(_stage_output)
        chunks.append(chunk)
        stages.append(PipelineStage(chunk, index, n_chunks, device, group=group))

    n_micro = par.n_microbatches

    def _loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Microbatches are equal in size, so the mean of their means is the step's mean loss: each is divided
        # by their number here and the schedule does not rescale the gradients (scale_grads=False). FSDP2's
        # reduce-scatter then averages over the data-parallel ranks: the gradient of the global batch's mean.
        return lm_loss(output, target) / n_micro

    schedule_cls = SCHEDULES[par.pipeline_schedule]
    if par.pipeline_schedule == "interleaved-1f1b":
        schedule = schedule_cls(stages, n_microbatches=n_micro, loss_fn=_loss_fn, scale_grads=False)
    else:
        schedule = schedule_cls(stages[0], n_microbatches=n_micro, loss_fn=_loss_fn, scale_grads=False)
    holder = chunks[0] if len(chunks) == 1 else StageModel(chunks)  # type: ignore[arg-type]
    return Pipeline(
        model=holder,
        chunks=chunks,
        stages=stages,
        schedule=schedule,
        n_microbatches=n_micro,
        holds_first=indices[0] == 0,
        holds_last=indices[-1] == n_chunks - 1,
        tensor_parallel=meshes.dims.tp > 1,
    )
