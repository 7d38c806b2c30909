"""Self-check: measure the peak memory of one of the payload's training steps and compare it with the estimate.

On a machine without a GPU the model, optimizer and batch are built under FakeTensorMode (shapes and dtypes only,
no data; MoE models, whose routing has data-dependent shapes, use small real tensors) and two steps run inside
torch's MemTracker (FSDPMemTracker with a fake process group for fsdp/hsdp), which records every storage by role:
the same peak torch.cuda.max_memory_allocated would report, before the allocator's rounding and fragmentation.
On a GPU the real step is run and the CUDA allocator's peak is read.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tasks.capacity.catalogue import CATALOGUE
from tasks.capacity.memory import MemoryBreakdown, MemoryModel, Precision, Runtime
from tasks.capacity.params import Architecture
from tasks.capacity.search import Estimator
from tasks.capacity.teacher import TeacherLoad
from tasks.capacity.timing import StepTime
from tasks.launch.cluster import ClusterConfig
from training.config import ModelConfig, OptimConfig, ParallelConfig, PrecisionConfig
from training.distill import distill_loss
from training.layout import Layout
from training.model import Transformer
from training.train import build_optimizer
from training.vision import VisionTransformer

log = logging.getLogger(__name__)

# fp8 is measured and planned as bf16: its float8 casts are transient, the weights, states and activations bf16's
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.bfloat16}

# The tracker's roles, folded into the estimate's components.
_ROLE_TO_COMPONENT = {
    "Parameter": "weights",
    "Sharded Param": "weights",
    "Unsharded Param": "buffers",
    "Buffer": "buffers",
    "All Gather": "buffers",
    "Reduce Scatter": "buffers",
    "Gradient": "gradients",
    "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients",
    "Activation": "activations",
    "Temp": "transient",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Other": "buffers",
    "Inputs": "buffers",
}
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers", "transient")


@dataclass(frozen=True)
class MeasureCase:
    """One configuration of the payload's model to measure on this machine (one rank's view)."""

    model: ModelConfig
    micro_batch: int
    dtype: str = "fp32"
    recompute: str = "none"
    sharding: str = "ddp"
    world: int = 1
    grad_accum: int = 1
    label: str = ""
    teacher: ModelConfig | None = None
    """distill: a frozen teacher whose forward runs on every micro-batch (ddp only, as the payload replicates it)."""

    def layout(self) -> Layout:
        """The estimator's layout for this case (DDP with one rank has no buckets: the payload does not wrap it)."""
        return Layout(
            dp=self.world,
            zero=3 if self.sharding in ("fsdp", "hsdp") else 0,
            micro_batch=self.micro_batch,
            grad_accum=self.grad_accum,
            recompute=self.recompute,  # type: ignore[arg-type]
        )


@dataclass
class Comparison:
    """Predicted and measured peak (bytes) of one case, per component, with the relative error of the total."""

    label: str
    predicted: dict[str, float]
    measured: dict[str, float]
    predicted_peak: float
    measured_peak: float
    predicted_phase: str
    seconds: float
    device: str = "cpu (fake tensors)"
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float:
        """(predicted - measured) / measured of the peak."""
        return (self.predicted_peak - self.measured_peak) / self.measured_peak

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (bytes, and the error as a fraction)."""
        return {
            "label": self.label,
            "device": self.device,
            "predicted_peak_bytes": self.predicted_peak,
            "measured_peak_bytes": self.measured_peak,
            "error_fraction": self.error,
            "predicted_phase": self.predicted_phase,
            "predicted_bytes": self.predicted,
            "measured_bytes": self.measured,
            "seconds": self.seconds,
        }


def predict(case: MeasureCase, device: str = "cpu") -> MemoryBreakdown:
    """The estimator's breakdown for `case` on this kind of device (no margin)."""
    arch = Architecture.from_model_config(case.model)
    runtime = Runtime(device=device, ddp_buckets=case.world > 1, foreach_optimizer=device != "cpu")  # type: ignore[arg-type]
    precision = Precision.of(case.dtype)
    teacher = None
    if case.teacher is not None:
        teacher = TeacherLoad.of(Architecture.from_model_config(case.teacher), precision, runtime)
    return MemoryModel(arch, precision, runtime, teacher=teacher).estimate(case.layout())


def _components(breakdown: MemoryBreakdown) -> dict[str, float]:
    """The estimate folded the way the tracker attributes storages (it counts the optimizer's temporaries as
    optimizer state and autocast's weight copies as activations)."""
    in_optimizer = breakdown.phase == "optimizer step"
    return {
        "weights": breakdown.weights + breakdown.teacher_weights,
        "gradients": breakdown.gradients,
        "optimizer": breakdown.optimizer + (breakdown.transient if in_optimizer else 0.0),
        "activations": breakdown.activations + breakdown.weight_copies + breakdown.teacher_logits,
        "buffers": breakdown.buffers,
        "transient": 0.0 if in_optimizer else breakdown.transient,
    }


@contextlib.contextmanager
def _fake_process_group(world: int) -> Iterator[None]:
    """A one-process 'fake' process group of `world` ranks (collectives do nothing), torn down afterwards."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised; measure in a process of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    case: MeasureCase,
    after_micro_batch: Callable[[], None] = lambda: None,
    teacher: torch.nn.Module | None = None,
) -> None:
    """One optimizer step as training/train.py runs it (loss in a function so the logits die before backward)."""
    dtype = _AUTOCAST[case.dtype]
    images = tokens if isinstance(tokens, tuple) else None
    device_type = (images[0] if images is not None else tokens).device.type

    def loss_of(batch: Any) -> torch.Tensor:
        if images is not None:  # a ViT classifier, as training/workload.py's vit loss
            with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
                logits = model(images[0])
            return F.cross_entropy(logits.float(), images[1])
        with torch.autocast(device_type, dtype=dtype, enabled=dtype is not None):
            logits, aux = model(batch[:, :-1])
            if teacher is not None:  # as training/distill.py: the teacher's forward, no autograd
                with torch.no_grad():
                    teacher_logits = teacher(batch[:, :-1])[0]
        if teacher is not None:
            return distill_loss(logits, teacher_logits, batch[:, 1:], 0.5, 2.0).total + 0.01 * aux
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        return loss + 0.01 * aux

    for m in range(case.grad_accum):
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(m == case.grad_accum - 1)
        (loss_of(tokens) / case.grad_accum).backward()
        after_micro_batch()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _model(case: MeasureCase) -> torch.nn.Module:
    """The payload's model of `case`: the Transformer, or the ViT classifier for kind vit."""
    cfg = case.model
    if cfg.kind == "vit":
        assert cfg.vision is not None
        return VisionTransformer(cfg.vision, cfg.vision.num_classes, case.recompute, cfg.dropout, cfg.init_std)
    return Transformer(cfg, recompute=case.recompute)


def _batch(case: MeasureCase, device: torch.device | str = "cpu") -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch: token ids (B, seq_len + 1), or uint8 images and class labels for kind vit."""
    cfg = case.model
    if cfg.kind == "vit":
        vision = cfg.vision
        assert vision is not None and vision.num_classes is not None
        shape = (case.micro_batch, vision.channels, vision.image_size, vision.image_size)
        images = torch.randint(0, 256, shape, dtype=torch.uint8, device=device)
        return images, torch.randint(0, vision.num_classes, (case.micro_batch,), device=device)
    return torch.randint(0, cfg.vocab_size, (case.micro_batch, cfg.seq_len + 1), device=device)


def _measure_fake(case: MeasureCase) -> dict[str, float]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    sharded = case.sharding in ("fsdp", "hsdp")
    with _fake_process_group(case.world) if sharded else contextlib.nullcontext():
        mesh = None
        if sharded:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", (case.world,), mesh_dim_names=("shard",))
        # MoE routing has data-dependent shapes, which fake tensors cannot follow: small real tensors instead.
        real = case.model.moe is not None
        if real:
            torch.manual_seed(0)
        with contextlib.nullcontext() if real else FakeTensorMode():
            model: Any = _model(case)
            if mesh is not None:
                from training.parallel import apply_fsdp

                model = apply_fsdp(model, mesh)
            optimizer = build_optimizer(model, OptimConfig(lr_peak=1e-3))
            tokens = _batch(case)
            # The teacher keeps requires_grad (the tracker hooks every parameter it meets); no_grad keeps it frozen.
            teacher = None if case.teacher is None else Transformer(case.teacher).eval()
            if sharded:
                tracker: Any = FSDPMemTracker(model, optimizer)
                tracker.track_inputs(tokens if isinstance(tokens, tuple) else (tokens,))
            else:
                tracker = MemTracker()
                inputs = tokens if isinstance(tokens, tuple) else (tokens,)
                tracker.track_external(model, optimizer, *inputs, *([teacher] if teacher is not None else []))
            with tracker:
                for _ in range(2):  # the first step creates the optimizer states
                    _step(model, optimizer, tokens, case, tracker.reset_mod_stats, teacher)
            peak = tracker.get_tracker_snapshot("peak")
    (snapshot,) = peak.values()
    measured = dict.fromkeys(COMPONENTS, 0.0)
    for role, nbytes in snapshot.items():
        name = getattr(role, "value", role)
        if name != "Total":
            measured[_ROLE_TO_COMPONENT[name]] += nbytes
    measured["total"] = float(snapshot["Total"])
    return measured


def _measure_cuda(case: MeasureCase) -> dict[str, float]:
    device = torch.device("cuda")
    model = _model(case).to(device)
    optimizer = build_optimizer(model, OptimConfig(lr_peak=1e-3))
    tokens = _batch(case, device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):
        _step(model, optimizer, tokens, case)
    torch.cuda.synchronize()
    return {**dict.fromkeys(COMPONENTS, float("nan")), "total": float(torch.cuda.max_memory_allocated(device))}


def compare(case: MeasureCase, on_gpu: bool = False) -> Comparison:
    """Measure `case` (fake tensors on CPU, or the real step on a GPU) and set it beside the estimate."""
    if on_gpu and case.sharding != "ddp":
        raise ValueError("the GPU self-check measures one process; use sharding=ddp with world=1")
    started = time.perf_counter()
    measured = _measure_cuda(case) if on_gpu else _measure_fake(case)
    seconds = time.perf_counter() - started
    breakdown = predict(case, device="gpu" if on_gpu else "cpu")
    label = case.label or (
        f"{case.model.n_layers}L d{case.model.d_model} {case.dtype} {case.sharding}x{case.world} "
        f"mb{case.micro_batch} {case.recompute}"
    )
    return Comparison(
        label=label,
        predicted=_components(breakdown),
        measured={k: v for k, v in measured.items() if k != "total"},
        predicted_peak=breakdown.allocated_peak,
        measured_peak=measured["total"],
        predicted_phase=breakdown.phase,
        seconds=seconds,
        device="cuda (allocator peak)" if on_gpu else "cpu (fake tensors, MemTracker)",
    )


def time_step(case: MeasureCase, steps: int = 5) -> float:
    """Median seconds of one real optimizer step of `case` in this process on the CPU (one rank, real tensors,
    the step training/train.py runs), after one untimed step that creates the optimizer states."""
    if case.sharding != "ddp" or case.world != 1:
        raise ValueError("the step time is measured in one process; use sharding=ddp with world=1")
    torch.manual_seed(0)
    model = _model(case)
    optimizer = build_optimizer(model, OptimConfig(lr_peak=1e-3))
    tokens = _batch(case)
    _step(model, optimizer, tokens, case)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        _step(model, optimizer, tokens, case)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def predict_step(case: MeasureCase, accelerator: str = "cpu", mfu: float = 0.4) -> StepTime:
    """The planner's step time of `case` on one `accelerator` (the catalogue's figures, uncalibrated)."""
    arch = Architecture.from_model_config(case.model)
    acc = CATALOGUE[accelerator]
    runtime = Runtime(device=acc.kind, ddp_buckets=case.world > 1, foreach_optimizer=acc.kind != "cpu")
    memory = MemoryModel(arch, Precision.of(case.dtype), runtime)
    estimator = Estimator(arch, memory, acc, case.world, acc.memory_bytes, mfu)
    return estimator.evaluate(case.layout()).time


def run_self_check(
    model: ModelConfig, parallel: ParallelConfig, precision: PrecisionConfig, cluster: ClusterConfig
) -> dict[str, Any]:
    """Measure one rank of the spec's own training step on this machine and compare it with the estimate."""
    on_gpu = torch.cuda.is_available() and parallel.sharding == "ddp"
    case = MeasureCase(
        model=model,
        micro_batch=parallel.micro_batch,
        dtype=precision.dtype,
        recompute=parallel.activation_recompute,
        sharding=parallel.sharding if not on_gpu else "ddp",
        world=cluster.world_size if parallel.sharding != "ddp" and not on_gpu else 1,
        grad_accum=parallel.grad_accum_steps,
    )
    return compare(case, on_gpu=on_gpu).as_dict()
