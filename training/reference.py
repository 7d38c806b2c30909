"""The independent correctness reference: the trainer's mathematics computed the plainest way.

Acceptance compares a distributed job's step losses with this run. It can only catch a bug that it does not
share, so it shares none of the trainer's step code (training/train.py): not its loop, loss scaling,
gradient accumulation, gradient synchronisation, optimizer construction, LR scheduler or sampler. What it
does share is what defines the problem, and only where each is a definition rather than a computation:

- the model (training/model.py, training/vision.py's VisionTransformer for model.kind vit, training/vlm.py's
  VisionLanguageModel for vlm) and its initial
  weights: torch seeded with `run.seed` right before the model is built, as the trainer does on every rank; with
  model.init_from, the Hugging Face checkpoint's weights read whole by training/hf_load.py's `load_hf_state` (the
  trainer reads each rank's slices instead);
- the data: the dataset reader of the model's kind, opened and checked as the trainer opens it (training/
  workload.py's `open_datasets` and `blend`, not its loss), and the sampler's documented order
  (training/sampler.py) written out again here: epoch e is `np.random.default_rng([seed, e]).permutation(n)`,
  step after step takes the next global batch of it, and the rest of an epoch (less than one global batch) is
  dropped, or with data.drop_last false the last batch is filled up from the start of the same order;
- the optimizer's definition: `torch.optim.AdamW` over the same two parameter groups (weight decay on the
  matrices only) and the spec's hyperparameters; the LR schedule written out below from OptimConfig's
  description (linear warmup, then cosine, linear or constant towards lr_min over run.steps);
- the run-output format, through training/run_output.py, so acceptance reads it like any other run;
- under distillation (the distill section), the teacher's weights as training/distill.py's `load_teacher` reads
  them: which teacher is part of the problem. Its forward here is plain, and the objective, alpha x T^2 x
  KL(teacher || student at temperature T) + (1 - alpha) x cross-entropy, is written out again below from its
  definition (`_softened_kl`), not taken from training/distill.py.

What it does differently on purpose: one process, fp32, no sharding, no loss scaling and no accumulation.
The whole global batch (micro_batch x grad_accum_steps x the distributed job's world size) goes through one
forward and one backward; its mean token loss equals the trainer's average over micro-batches and ranks
because each holds the same number of tokens. (Under MoE the load-balancing loss is defined per micro-batch
of a rank, so there the loss is the mean over groups of micro_batch samples, still with one backward. A
vision-language model's caption loss is the summed cross-entropy of the trained caption tokens over the batch's
caption positions, the same for the whole batch as for any split of it.) The caption loss (model.kind vlm) is
written out again below from its definition (`_caption_sum`), not taken from training/vlm.py.
Dropout is off: the trainer draws its masks from per-rank RNG streams that no single process reproduces,
so acceptance compares this run with a distributed run that has dropout off as well.

It trains the same steps twice: first a noise twin, from initial weights each off by one fp32 rounding error
and with its backward in one part per micro-batch of the distributed job (the same mathematics in the distributed
job's summation order, and the rounding-level perturbations that MoE routing and long runs amplify), then the
reference itself.
Each step's record carries the twin's loss and gradient norm (`twin_loss`, `twin_grad_norm`) and the params
record at the end the twin's parameters (`twin`): how far they stray from the reference is the clean noise of
this very job, which acceptance multiplies into its correctness tolerances.

Started as `-m training.train --config run.json` with `reference` set in the config (only the acceptance
suite sets it); one process only.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from training.config import OptimConfig, TrainConfig
from training.distill import load_teacher
from training.hf_load import load_hf_state
from training.holdings import param_pieces, param_record
from training.image_dataset import ImageBatch
from training.metrics import peak_memory_bytes
from training.model import Transformer
from training.run_output import Ranks, RunOutputWriter, RunResult, StepRecord
from training.vision import VisionTransformer
from training.vlm import VisionLanguageModel
from training.workload import Dataset, workload_of

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Step:
    """What one reference step computed."""

    epoch: int
    indices: np.ndarray
    lr: float
    loss: float
    aux: float
    kl: float
    grad_norm: float
    data_s: float
    elapsed_s: float


class ReferenceSetupError(RuntimeError):
    """The reference was started in a way it cannot run (more than one process, no reference section)."""


def learning_rate(optim: OptimConfig, total_steps: int, step: int) -> float:
    """The learning rate of 0-based optimizer step `step` of a run of `total_steps` steps."""
    if step < optim.warmup_steps:
        return optim.lr_peak * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr_peak
    decay_steps = max(1, total_steps - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    if optim.schedule == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:  # linear
        remaining = 1.0 - progress
    return optim.lr_min + (optim.lr_peak - optim.lr_min) * remaining


def batch_indices(
    n_samples: int, global_batch: int, seed: int, step: int, drop_last: bool = True
) -> tuple[int, np.ndarray]:
    """The epoch and the sample indices (all ranks' together) of 0-based optimizer step `step`."""
    whole, rest = divmod(n_samples, global_batch)
    steps_per_epoch = whole + int(rest > 0 and not drop_last)  # padding: one more step, wrapping to the start
    epoch, position = divmod(step, steps_per_epoch)
    order = np.random.default_rng([seed, epoch]).permutation(n_samples)
    return epoch, order[np.arange(position * global_batch, (position + 1) * global_batch) % n_samples]


def _softened_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) of the teacher's (p) and the student's (q) distributions at the
    temperature, averaged over the positions."""
    log_p = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1).mean()


@dataclass(frozen=True)
class _Distill:
    """The reference's teacher and the objective's weights."""

    teacher: torch.nn.Module
    alpha: float
    temperature: float


Batch = torch.Tensor | ImageBatch
"""Token rows (lm) or images with their class ids (vit) or captions (vlm), as the dataset reader returns them."""


@dataclass(frozen=True)
class _Captions:
    """What defines model.kind vlm's caption loss besides the batch: the dataset's EOS and padding ids and how many
    image tokens precede the caption in the language model's sequence."""

    eos_id: int | None
    pad_id: int | None
    image_tokens: int


def _trained(captions: torch.Tensor, spec: _Captions) -> torch.Tensor:
    """Which caption tokens are trained on (bool, (B, L)): each one up to and including the caption's first EOS
    (all of them when it has none), and none that is the padding id (where that is not EOS)."""
    positions = torch.arange(captions.shape[1], device=captions.device)
    if spec.eos_id is None:
        trained = torch.ones_like(captions, dtype=torch.bool)
    else:
        is_eos = captions == spec.eos_id
        first_eos = torch.where(is_eos.any(dim=1), is_eos.int().argmax(dim=1), captions.shape[1] - 1)
        trained = positions[None, :] <= first_eos[:, None]
    if spec.pad_id is not None and spec.pad_id != spec.eos_id:
        trained &= captions != spec.pad_id
    return trained


def _caption_sum(model: torch.nn.Module, batch: ImageBatch, spec: _Captions) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over the trained caption tokens of `batch` and how many they are: the model
    reads the image tokens and all but the last caption token; the logits at the last image token and at each
    caption token predict the next caption token."""
    captions = batch.targets
    logits, _ = model(batch.images, captions[:, :-1])
    predicting = logits[:, spec.image_tokens - 1 :].float()  # (B, L, V): position P - 1 + j predicts captions[:, j]
    per_token = F.cross_entropy(predicting.transpose(1, 2), captions, reduction="none")
    trained = _trained(captions, spec)
    return (per_token * trained).sum(), int(trained.sum())


def _on(batch: Batch, device: torch.device) -> Batch:
    if isinstance(batch, ImageBatch):
        return ImageBatch(batch.images.to(device), batch.targets.to(device))
    return batch.to(device)


def _split(batch: Batch, size: int) -> list[Batch]:
    if isinstance(batch, ImageBatch):
        return [ImageBatch(*parts) for parts in zip(batch.images.split(size), batch.targets.split(size), strict=True)]
    return list(batch.split(size))


def _new_model(cfg: TrainConfig) -> torch.nn.Module:
    """The model of the spec with its initial weights (torch seeded by the caller), without dropout."""
    model_cfg = cfg.model
    if model_cfg.kind == "vit":
        assert model_cfg.vision is not None
        return VisionTransformer(model_cfg.vision, model_cfg.vision.num_classes, init_std=model_cfg.init_std)
    if model_cfg.kind == "vlm":
        return VisionLanguageModel(model_cfg.model_copy(update={"dropout": 0.0}))
    return Transformer(model_cfg.model_copy(update={"dropout": 0.0}))


def _mean_loss(
    model: torch.nn.Module,
    tokens: Batch,
    group: int | None,
    distill: _Distill | None = None,
    captions: _Captions | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean next-token objective over `tokens` (the cross-entropy, or under `distill` the distillation objective),
    the MoE load-balancing loss and the KL to the teacher (0 without one), each a mean over groups. Images: the
    mean cross-entropy of the class logits (no aux loss, no teacher); with `captions`, the summed caption-token
    cross-entropy over the batch's caption positions (no groups: the figure is the same for any split)."""
    if isinstance(tokens, ImageBatch) and captions is not None:  # over the caption positions, whatever the split
        total, _ = _caption_sum(model, tokens, captions)
        zero = torch.zeros((), device=total.device)
        return total / tokens.targets.numel(), zero, zero
    if isinstance(tokens, ImageBatch):
        ce = F.cross_entropy(model(tokens.images).float(), tokens.targets)
        zero = torch.zeros((), device=ce.device)
        return ce, zero, zero
    groups = tokens.split(group) if group else (tokens,)
    losses, auxes, kls = [], [], []
    for part in groups:
        logits, aux = model(part[:, :-1])
        ce = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), part[:, 1:].reshape(-1))
        kl = torch.zeros((), device=logits.device)
        if distill is not None:
            with torch.no_grad():
                teacher_logits, _ = distill.teacher(part[:, :-1])
            kl = _softened_kl(teacher_logits, logits, distill.temperature)
            ce = distill.alpha * distill.temperature**2 * kl + (1 - distill.alpha) * ce
        losses.append(ce)
        auxes.append(aux)
        kls.append(kl.detach())
    return torch.stack(losses).mean(), torch.stack(auxes).mean(), torch.stack(kls).mean()


def run_reference(cfg: TrainConfig) -> RunResult:
    """Train `cfg.run.stop_after_steps or cfg.run.steps` steps the plain way; write metrics and the result."""
    if cfg.reference is None:
        raise ReferenceSetupError("the config has no reference section; the trainer runs such configs")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 1:
        raise ReferenceSetupError(f"the reference runs as one process, {world} were started; start it with one")
    model_cfg, run, optim = cfg.model.model_copy(update={"dropout": 0.0}), cfg.run, cfg.optim
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if torch.cuda.is_available() else None
    device = device or torch.device("cpu")
    torch.set_num_threads(run.threads_per_rank or os.cpu_count() or 1)
    global_batch = cfg.parallel.micro_batch * cfg.parallel.grad_accum_steps * cfg.reference.world_size
    workload = workload_of(cfg)  # the dataset reader of the model's kind, and its checks against the spec
    train, val = workload.open_datasets()
    blend = workload.blend(train, run.seed)  # a blend's draws resolve to samples as the trainer resolves them
    n_draws = blend.epoch_size if blend else len(train)
    if global_batch > n_draws:
        raise ReferenceSetupError(f"global batch {global_batch} exceeds the {n_draws} training samples")

    coef = model_cfg.moe.aux_loss_coef if model_cfg.moe else 0.0
    # Group k of micro_batch sequences is micro-batch k // world of rank k % world (the sampler's layout).
    group = cfg.parallel.micro_batch if model_cfg.moe else None
    captions = None
    if model_cfg.kind == "vlm":  # the caption's ids as the dataset defines them (its manifest)
        assert model_cfg.vision is not None
        manifest = train.manifest  # type: ignore[attr-defined]
        captions = _Captions(manifest.eos_id, manifest.pad_id, model_cfg.vision.num_patches)
    clip = optim.grad_clip_norm if optim.grad_clip_norm is not None else math.inf
    distill = None
    if cfg.distill is not None:
        teacher = load_teacher(cfg.distill, model_cfg, cfg.storage, device).model
        distill = _Distill(teacher, cfg.distill.alpha, cfg.distill.temperature)

    def build(perturbed: bool = False) -> tuple[torch.nn.Module, torch.optim.AdamW]:
        torch.manual_seed(run.seed)  # the trainer's initial weights: torch seeded with run.seed, then the model built
        model = _new_model(cfg).to(device)
        if model_cfg.init_from is not None:  # the trainer's starting weights, read whole (the trainer reads slices)
            state = load_hf_state(model_cfg.init_from, model_cfg, storage=cfg.storage)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(state.pop(name).to(device))
        if model_cfg.vision is not None and model_cfg.vision.init_from is not None:  # the encoder's, as the trainer's
            from training.hf_vision_load import load_vision_into  # noqa: PLC0415 - only with model.vision.init_from

            load_vision_into(model, model_cfg, cfg.storage)
        if perturbed:  # every initial value off by one rounding error of fp32, up or down at random
            signs = torch.Generator().manual_seed(run.seed)
            with torch.no_grad():
                for param in model.parameters():
                    flip = torch.randint(0, 2, param.shape, generator=signs).to(device=device, dtype=param.dtype)
                    param.mul_(1 + (2 * flip - 1) * torch.finfo(torch.float32).eps / 2)
        matrices = [p for p in model.parameters() if p.dim() >= 2]
        vectors = [p for p in model.parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": matrices, "weight_decay": optim.weight_decay}, {"params": vectors, "weight_decay": 0.0}],
            lr=optim.lr_peak,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
        )
        model.train()
        return model, optimizer

    def train_step(model: torch.nn.Module, optimizer: torch.optim.AdamW, step: int, parts: int) -> _Step:
        """0-based `step`; its backward in `parts` equal parts of the global batch (1: one backward)."""
        started = time.perf_counter()
        epoch, indices = batch_indices(n_draws, global_batch, run.seed, step, cfg.data.drop_last)
        tokens = _on(train.batch(blend.samples(epoch, indices) if blend else indices), device)
        data_s = time.perf_counter() - started
        lr = learning_rate(optim, run.steps, step)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if parts == 1:
            loss, aux, kl = _mean_loss(model, tokens, group, distill, captions)
            (loss + coef * aux).backward()
        else:
            losses, auxes, kls = [], [], []
            for part in _split(tokens, global_batch // parts):
                part_loss, part_aux, part_kl = _mean_loss(model, part, group, distill, captions)
                ((part_loss + coef * part_aux) / parts).backward()
                losses.append(part_loss.detach())
                auxes.append(part_aux.detach())
                kls.append(part_kl)
            loss, aux, kl = torch.stack(losses).mean(), torch.stack(auxes).mean(), torch.stack(kls).mean()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return _Step(
            epoch, indices, lr, loss.item(), aux.item(), kl.item(), grad_norm, data_s, time.perf_counter() - started
        )

    out = RunOutputWriter(run.output_url, cfg.storage)
    me = {
        "rank": 0,
        "local_rank": 0,
        "world_size": 1,
        "local_world_size": 1,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "device": str(device),
        "backend": None,
        "restart_count": 0,
        "resumed_from_step": None,
        "reference_of_world_size": cfg.reference.world_size,
    }
    out.write_ranks(Ranks(1, [me]))
    out.sync()

    last_step = min(run.steps, run.stop_after_steps or run.steps)
    log.info(
        "independent reference: global batch %d x %d tokens, steps 0 -> %d of %d (fp32, one process)",
        global_batch,
        workload.units_per_sample,
        last_step,
        run.steps,
    )
    # The noise twin (see the module's docstring): how far it strays from the reference is the clean noise of this
    # job's figures, from which acceptance derives its correctness tolerances.
    parts = max(1, global_batch // cfg.parallel.micro_batch)
    twin_model, twin_optimizer = build(perturbed=True)
    twin = [train_step(twin_model, twin_optimizer, step, parts) for step in range(last_step)]
    twin_pieces = param_pieces(twin_model)
    del twin_model, twin_optimizer

    model, optimizer = build()
    first_loss = loss_value = None
    for step in range(last_step):
        done = train_step(model, optimizer, step, 1)
        epoch, indices, lr, grad_norm, data_s, elapsed = (
            done.epoch, done.indices, done.lr, done.grad_norm, done.data_s, done.elapsed_s
        )  # fmt: skip
        loss_value = done.loss
        first_loss = loss_value if first_loss is None else first_loss
        tokens_step = global_batch * workload.units_per_sample
        out.append_metrics(
            StepRecord(
                rank=0,
                step=step + 1,
                epoch=epoch,
                loss=loss_value,
                rank_loss=loss_value,
                aux_loss=done.aux if model_cfg.moe else None,
                distill_kl=done.kl if distill is not None else None,
                lr=lr,
                grad_norm=grad_norm,
                twin_loss=twin[step].loss,
                twin_grad_norm=twin[step].grad_norm,
                twin_parts=parts,
                tokens_per_s=tokens_step / elapsed,
                tokens_per_s_rank=tokens_step / elapsed,
                step_time_s=elapsed,
                data_wait_s=data_s,
                compute_s=elapsed - data_s,
                peak_mem_bytes=peak_memory_bytes(device),
                time_unix_s=time.time(),
            )
        )
        if run.record_samples:
            out.append_samples(0, {"step": step + 1, "epoch": epoch, "resumed_from": None, "indices": indices.tolist()})
        if (step + 1) % run.log_every_steps == 0 or step + 1 == last_step:
            log.info(
                "reference step %d/%d loss %.4f lr %.2e grad_norm %.3f", step + 1, run.steps, loss_value, lr, grad_norm
            )
            out.sync()

    val_loss = _validation_loss(model, val, cfg, device, captions)
    result = RunResult(
        steps=last_step,
        resumed_from_step=None,
        world_size=1,
        first_loss=first_loss,
        final_loss=loss_value,
        val_loss=val_loss,
        val_ppl=math.exp(min(val_loss, 700.0)),
        skipped_steps=0,
        tokens_seen=last_step * global_batch * workload.units_per_sample,
        n_params=sum(p.numel() for p in model.parameters()),
        teacher_val_loss=None if distill is None else _validation_loss(distill.teacher, val, cfg, device),
    )
    out.write_params(replace(param_record(model, 0, last_step, model_cfg), twin=twin_pieces))
    out.write_result(result)
    out.close()
    log.info("reference done: step %d val_loss %.4f", last_step, val_loss)
    return result


@torch.no_grad()
def _validation_loss(
    model: torch.nn.Module, val: Dataset, cfg: TrainConfig, device: torch.device, captions: _Captions | None = None
) -> float:
    """Mean token loss over the validation samples the distributed job evaluates (the first eval_batches x
    micro_batch x world_size of the split, wrapping around); with `captions`, each micro-batch's mean weighted by
    its trained caption tokens, so that the whole is the mean over every caption token evaluated."""
    assert cfg.reference is not None
    model.eval()
    b = cfg.parallel.micro_batch
    count = cfg.run.eval_batches * b * cfg.reference.world_size
    losses, weights = [], []
    for first in range(0, count, b):
        tokens = _on(val.batch([k % len(val) for k in range(first, first + b)]), device)
        if captions is not None:  # the sum and the number of trained caption tokens of this micro-batch
            total, trained = _caption_sum(model, tokens, captions)  # type: ignore[arg-type]
            losses.append(total.item() / max(trained, 1))
            weights.append(trained)
            continue
        loss, _, _ = _mean_loss(model, tokens, None)
        losses.append(loss.item())
        weights.append(1)
    return float(np.average(losses, weights=weights))
