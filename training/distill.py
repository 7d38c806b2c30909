"""Knowledge distillation: a frozen teacher, and the student's loss against it.

The student (the model the run trains) minimises

    alpha x T^2 x KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) x cross-entropy(student, data)

(Hinton, Vinyals and Dean 2015). The KL divergence is summed over the vocabulary at each position and averaged
over the positions, as the cross-entropy is; T^2 keeps the gradient of the soft term at the scale of the hard one
as the temperature changes. alpha = 0 is plain training, alpha = 1 learns from the teacher alone.

The teacher is one of our checkpoints (read as export reads them: the newest sound step or a named one, checksums
verified, the architecture from its model.json) or a Hugging Face folder (training/hf_load.py). Every rank holds
the whole teacher (data-parallel layouts: DDP, FSDP, HSDP), in eval mode and without gradients, and runs its
forward under the trainer's autocast. Building it draws nothing from the RNG streams the student's run depends on.

The independent reference (training/reference.py) writes the same loss out again; it shares only `load_teacher`,
the teacher's weights being part of the problem's definition.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from training.checkpoint import CheckpointManager, CheckpointStore
from training.config import MAX_SEQ_LEN, CheckpointConfig, DistillConfig, ModelConfig
from training.hf_config import read_hf_config
from training.hf_load import load_into
from training.model import Transformer
from training.storage import StorageConfig

log = logging.getLogger(__name__)


class TeacherError(ValueError):
    """The teacher cannot be loaded or cannot teach this student: the field, its value, what is wrong, the fix.

    The trainer records it as a bad_model workload failure (training/failure.py): the restart policy does not
    retry it."""

    def __init__(self, field: str, value: object, problem: str, fix: str) -> None:
        super().__init__(f"{field}={value}: {problem}; {fix}")
        self.field, self.value, self.problem, self.fix = field, value, problem, fix

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.field, self.value, self.problem, self.fix))


@dataclass(frozen=True)
class DistillLoss:
    """The student's objective and its two terms (means over the positions)."""

    total: torch.Tensor
    kl: torch.Tensor
    """KL(teacher || student) at the temperature, per position, before the T^2 and alpha factors."""
    ce: torch.Tensor


def distill_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor, alpha: float, temperature: float
) -> DistillLoss:
    """The objective of (..., V) student logits against the teacher's logits and the (...) next-token targets."""
    vocab = student_logits.size(-1)
    student = student_logits.float().reshape(-1, vocab)
    teacher = teacher_logits.float().reshape(-1, vocab)
    ce = F.cross_entropy(student, targets.reshape(-1))
    kl = F.kl_div(
        F.log_softmax(student / temperature, dim=-1),
        F.log_softmax(teacher / temperature, dim=-1),
        reduction="batchmean",  # the sum over the vocabulary, averaged over the positions (the rows)
        log_target=True,
    )
    return DistillLoss(alpha * temperature**2 * kl + (1.0 - alpha) * ce, kl, ce)


class Teacher:
    """The frozen teacher of a run: its logits, and the student's loss against them."""

    def __init__(self, model: Transformer, cfg: DistillConfig) -> None:
        self.model, self.cfg = model, cfg

    @torch.no_grad()
    def logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The teacher's logits of (B, T) token ids (under the caller's autocast)."""
        return self.model(inputs)[0]

    @torch.no_grad()
    def cross_entropy(self, tokens: torch.Tensor) -> torch.Tensor:
        """The teacher's mean next-token cross-entropy on (B, T + 1) tokens (its validation loss)."""
        logits = self.logits(tokens[:, :-1]).float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))

    def loss(self, student_logits: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> DistillLoss:
        """The student's objective on `inputs` (the teacher's forward included) against the next tokens."""
        return distill_loss(student_logits, self.logits(inputs), targets, self.cfg.alpha, self.cfg.temperature)


def _checkpoint_step(cfg: DistillConfig, manager: CheckpointManager) -> tuple[int, dict]:
    """The teacher's step and its verified commit record (collective), or TeacherError naming the step."""

    def listed() -> str:
        return ", ".join(map(str, manager.committed_steps())) or "none"

    if cfg.teacher_step is None:
        found = manager.latest_sound()
        if found is None:
            raise TeacherError(
                "distill.teacher_url", cfg.teacher_url, f"no sound checkpoint there (committed steps: {listed()})",
                "point it at the teacher run's checkpoint.url, or set teacher_kind: hf for a Hugging Face folder",
            )  # fmt: skip
        return found
    commit = manager.sound(cfg.teacher_step)
    if commit is None:
        raise TeacherError(
            "distill.teacher_step", cfg.teacher_step,
            f"no sound checkpoint of that step under {cfg.teacher_url} (committed steps: {listed()})",
            "name a committed step, or leave teacher_step out for the newest sound one",
        )  # fmt: skip
    return cfg.teacher_step, commit


def teacher_architecture(cfg: DistillConfig, storage: StorageConfig) -> ModelConfig:
    """The teacher's ModelConfig: distill.teacher_model when stated, else its model.json (of teacher_step, or the
    newest committed step: not verified here, load_teacher checks the step it loads against it) or its config.json;
    one process, no collectives."""
    if cfg.teacher_model is not None:
        return cfg.teacher_model
    if cfg.teacher_kind == "hf":
        hf = read_hf_config(cfg.teacher_url, storage)
        # The teacher's own context length: load_teacher sizes its rotary tables for the student's sequences.
        return ModelConfig(**hf.fields, seq_len=min(hf.max_position_embeddings, MAX_SEQ_LEN))
    store = CheckpointStore(CheckpointConfig(url=cfg.teacher_url), storage)
    step = cfg.teacher_step if cfg.teacher_step is not None else store.newest_committed_step()
    card = None if step is None else store.read_card(step)
    if card is None:
        what = "no committed checkpoint" if step is None else f"checkpoint step {step} has no model card (model.json)"
        raise TeacherError(
            "distill.teacher_url", cfg.teacher_url, f"{what}, so the teacher's architecture is unknown",
            "state the teacher's architecture as distill.teacher_model, or point teacher_url at the teacher run's "
            "checkpoint.url",
        )  # fmt: skip
    return card.model


def check_teacher(teacher: ModelConfig, student: ModelConfig, where: str) -> None:
    """TeacherError when `teacher` cannot teach `student` (read from `where`)."""
    if teacher.vocab_size != student.vocab_size:
        raise TeacherError(
            "distill.teacher_model.vocab_size", teacher.vocab_size,
            f"the teacher ({where}) has another vocabulary than the student (model.vocab_size={student.vocab_size}): "
            "the KL term compares their distributions token by token",
            "distil from a teacher of the same tokenizer and vocabulary",
        )  # fmt: skip


_NOT_FUNCTION = ("seq_len", "dropout", "init_std")
"""ModelConfig fields that do not change what a trained teacher computes on the student's sequences."""


def check_stated(stated: ModelConfig, read: ModelConfig, where: str) -> None:
    """TeacherError when distill.teacher_model (as the spec stated or filled it) is not the architecture that the
    teacher being loaded records (`read`, from `where`): its weights would not fit, or compute something else."""
    ours, theirs = stated.model_dump(exclude=set(_NOT_FUNCTION)), read.model_dump(exclude=set(_NOT_FUNCTION))
    for name in ours:
        if ours[name] != theirs[name]:
            raise TeacherError(
                f"distill.teacher_model.{name}", ours[name], f"the teacher being loaded ({where}) has {theirs[name]}",
                "leave distill.teacher_model out (it is read from the teacher) or state the teacher's own value",
            )  # fmt: skip


def load_teacher(cfg: DistillConfig, student: ModelConfig, storage: StorageConfig, device: torch.device) -> Teacher:
    """The frozen teacher on `device` (collective for a checkpoint teacher: every rank calls it, each gets the
    whole model); TeacherError when there is none or it does not fit the student."""
    manager, step, commit = None, None, None
    if cfg.teacher_kind == "checkpoint":
        manager = CheckpointManager(CheckpointConfig(url=cfg.teacher_url), storage)
        step, commit = _checkpoint_step(cfg, manager)
    if manager is not None:
        card = manager.read_card(step, commit)
        read, where = (None if card is None else card.model), f"{manager.step_url(step)}/model.json"
    else:
        read, where = teacher_architecture(cfg.model_copy(update={"teacher_model": None}), storage), cfg.teacher_url
    if read is None and cfg.teacher_model is None:
        raise TeacherError(
            "distill.teacher_url", cfg.teacher_url,
            f"checkpoint step {step} has no model card (model.json), so its architecture is unknown",
            "state the teacher's architecture as distill.teacher_model",
        )  # fmt: skip
    if read is not None and cfg.teacher_model is not None:
        check_stated(cfg.teacher_model, read, where)
    arch = cfg.teacher_model or read
    assert arch is not None
    check_teacher(arch, student, where)
    # The student's sequence length sizes the rotary tables; the teacher's own dropout is off (eval mode anyway).
    arch = arch.model_copy(update={"seq_len": student.seq_len, "dropout": 0.0})
    with torch.random.fork_rng(devices=[]):  # the teacher's throw-away init draws nothing from the run's streams
        model = Transformer(arch)
    if manager is not None:
        manager.load_model(step, model)
        source = manager.step_url(step)
    else:
        load_into(model, cfg.teacher_url, arch, storage)
        source = cfg.teacher_url
    model = model.to(device).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    log.info(
        "teacher %s: %.2fM params (%d layers, d_model %d), alpha %.3g, temperature %.3g",
        source, model.num_params() / 1e6, arch.n_layers, arch.d_model, cfg.alpha, cfg.temperature,
    )  # fmt: skip
    return Teacher(model, cfg)

