"""The `capacity` section of the spec: what the plan assumes, and a layout to plan that the payload does not run."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from tasks.capacity.catalogue import CATALOGUE, Accelerator, accelerator_names, resolve_accelerator
from training.config import (
    MAX_BATCH,
    MAX_LAYERS,
    MAX_RANKS,
    ModelConfig,
    ParallelConfig,
    Problem,
    StrictModel,
    divisors,
    raise_problems,
)
from training.layout import layout_problems, world_problems
from training.storage import StorageUrl

_MAX_FIGURE = 1e9  # GiB, TFLOP/s, TB/s, GB/s: a million times today's largest accelerator

_ACCELERATOR_FIELDS = [
    name for name in Accelerator.__dataclass_fields__ if name not in ("name", "description", "max_per_node")
]


class AcceleratorOverride(StrictModel):
    """Figures of an accelerator that replace the catalogue's (all of them for a type the catalogue lacks)."""

    kind: Literal["gpu", "cpu"] | None = Field(default=None, description="gpu or cpu.")
    memory_gib: float | None = Field(default=None, gt=0, le=_MAX_FIGURE, description="Device memory in GiB.")
    peak_tflops_bf16: float | None = Field(
        default=None, gt=0, le=_MAX_FIGURE, description="Dense bf16 peak in TFLOP/s."
    )
    peak_tflops_fp16: float | None = Field(
        default=None, gt=0, le=_MAX_FIGURE, description="Dense fp16 peak in TFLOP/s."
    )
    peak_tflops_fp32: float | None = Field(
        default=None, gt=0, le=_MAX_FIGURE, description="fp32 (no TF32) peak in TFLOP/s."
    )
    hbm_tb_s: float | None = Field(default=None, gt=0, le=_MAX_FIGURE, description="Memory bandwidth in TB/s.")
    intra_node_gb_s: float | None = Field(
        default=None, gt=0, le=_MAX_FIGURE, description="Per-GPU, per-direction GB/s in a node."
    )
    inter_node_gb_s: float | None = Field(
        default=None, gt=0, le=_MAX_FIGURE, description="Per-GPU, per-direction GB/s across nodes."
    )
    max_per_node: int | None = Field(
        default=None, ge=1, le=MAX_RANKS, description="Most devices one node holds; None = no limit."
    )

    def fields(self) -> dict[str, object]:
        """The figures that are set."""
        return self.model_dump(exclude_none=True)


_RENAMED = {"pipeline_schedule": {"interleaved": "interleaved-1f1b"}}
"""Values capacity.layout once took that now read as in `parallel` (field: {old: new})."""


class LayoutOverride(StrictModel):
    """Plan a layout beyond what the payload runs (context parallelism, ZeRO-1/2, ...): the degrees and schedule
    of a `parallel` section, with its field names and values, over the spec's sharding and batching."""

    tensor_parallel: int = Field(default=1, ge=1, le=MAX_RANKS, description="Tensor-parallel degree (within a node).")
    pipeline_parallel: int = Field(default=1, ge=1, le=MAX_RANKS, description="Pipeline stages.")
    expert_parallel: int = Field(
        default=1, ge=1, le=MAX_RANKS, description="Ranks the experts of an MoE layer are spread over."
    )
    context_parallel: int = Field(
        default=1,
        ge=1,
        le=MAX_RANKS,
        description="Context-parallel degree: ranks that split each sequence (Llama 3's all-gather attention, "
        "torch's ring attention); needs attention: flash and model.seq_len divisible by 2 x context_parallel. "
        "Planned only: the payload runs 1.",
    )
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        default=None,
        description="Sharding over the data-parallel group; None = from parallel.sharding (ddp 0, fsdp 3).",
    )
    sequence_parallel: bool = Field(default=False, description="Megatron sequence parallelism (needs TP > 1).")
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = Field(
        default="1f1b", description="Pipeline schedule, as parallel.pipeline_schedule names it."
    )
    virtual_stages: int = Field(
        default=1, ge=1, le=1024, description="interleaved-1f1b: model chunks per pipeline stage (>= 2)."
    )
    pipeline_split: list[int] | None = Field(
        default=None,
        max_length=MAX_LAYERS,
        description="Layers of each pipeline chunk in order (pipeline_parallel x virtual_stages numbers summing to "
        "model.n_layers, uneven allowed: 126 layers on 16 stages); None = balanced, the extra layers last (what the "
        "payload runs by default).",
    )

    @field_validator("pipeline_schedule", mode="before")
    @classmethod
    def _renamed(cls, value: object, info: ValidationInfo) -> object:
        new = _RENAMED[info.field_name].get(value) if isinstance(value, str) else None
        if new is not None:
            raise ValueError(
                f"{value} is named {new} now, as in parallel.{info.field_name}; set capacity.layout."
                f"{info.field_name}: {new}"
            )
        return value

    def applied_to(self, parallel: ParallelConfig) -> ParallelConfig:
        """The `parallel` section this layout plans: its degrees and schedule over `parallel`'s other fields."""
        return parallel.model_copy(update=self.model_dump(exclude={"zero_stage"}))


class CapacityConfig(StrictModel):
    """Capacity planning: memory headroom, assumed efficiency, training budget, catalogue overrides."""

    enforce: bool = Field(
        default=True, description="Stop the deployment when the requested layout does not fit (false: warn only)."
    )
    headroom_fraction: float = Field(
        default=0.1, ge=0, lt=1, description="Share of device memory kept free beyond the estimate's margin."
    )
    fragmentation_fraction: float = Field(
        default=0.05, ge=0, lt=1, description="Allocator fragmentation, as a share of the tensor peak."
    )
    framework_overhead_gib: float | None = Field(
        default=None,
        ge=0,
        le=_MAX_FIGURE,
        description="CUDA context, NCCL and library workspaces per GPU in GiB; None = 1 on GPUs, 0 on CPU.",
    )
    mfu: float = Field(
        default=0.4,
        gt=0,
        le=1,
        description="Fraction of the dense peak the matmuls achieve (memory-bound work and communication are "
        "timed apart).",
    )
    achieved_tflops_per_gpu: float | None = Field(
        default=None, gt=0, le=_MAX_FIGURE, description="Measured hardware TFLOP/s per GPU; overrides mfu when set."
    )
    mixed_precision: Literal["autocast", "master-weights", "pure-16bit"] = Field(
        default="autocast",
        description="bf16/fp16: torch autocast over fp32 weights (the payload), 16-bit weights with fp32 masters "
        "(ZeRO, Megatron-LM, DeepSpeed), or pure-16bit: 16-bit weights, gradients and optimizer states, no master.",
    )
    optimizer: Literal["adamw", "sgd-momentum", "adafactor", "adam-8bit"] = Field(
        default="adamw",
        description="Optimizer whose states the plan counts (the payload runs adamw): adamw (two moments), "
        "sgd-momentum (one buffer), adafactor (factored second moment, no first moment), adam-8bit (bitsandbytes' "
        "block-wise 8-bit moments).",
    )
    grad_dtype: Literal["fp32"] | None = Field(
        default=None,
        description="fp32: gradients kept and reduced in fp32 beside 16-bit weights (Megatron's "
        "--accumulate-allreduce-grads-in-fp32); None = the weights' dtype.",
    )
    offload: Literal["none", "optimizer", "optimizer+params"] = Field(
        default="none",
        description="Model states kept in host memory (DeepSpeed's offload_optimizer and offload_param, FSDP2's "
        "CPUOffloadPolicy): optimizer needs ZeRO >= 1, optimizer+params ZeRO-3 for the parameters; searched layouts "
        "of lower stages keep them on the device.",
    )
    host_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=_MAX_FIGURE,
        description="Host memory per node in GiB that offloaded model states may fill; None = not checked.",
    )
    attention: Literal["flash", "math"] = Field(
        default="flash", description="flash: fused SDPA (no score matrices kept); math: scores kept (Korthikanti)."
    )
    train_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10**18,
        description="Token budget for the time estimate; None = run.steps x global batch x seq_len.",
    )
    flop_budget: float | None = Field(
        default=None,
        gt=0,
        le=1e32,
        description="A training budget in FLOPs (6ND): the plan gives its time on this cluster at the requested "
        "layout's MFU, and the compute-optimal model size and tokens for it (Hoffmann et al. 2022); None = off.",
    )
    global_batch: int | None = Field(
        default=None,
        ge=1,
        le=MAX_BATCH * MAX_RANKS,
        description="Sequences per optimizer step to plan for; None = the spec's (micro x accum x world).",
    )
    layout: LayoutOverride | None = Field(
        default=None, description="Plan this layout instead of the payload's (DDP/FSDP/HSDP as in `parallel`)."
    )
    accelerators: dict[str, AcceleratorOverride] = Field(
        default_factory=dict, description="Catalogue overrides by name, or whole entries for unlisted accelerators."
    )
    calibration_url: StorageUrl | None = Field(
        default=None,
        description="JSON of measured corrections per accelerator ({name: {peak_scale: ...}}); None = off.",
    )
    comm_warn_ratio: float = Field(
        default=1.0, gt=0, le=1e6, description="Warn when communication time exceeds this multiple of compute time."
    )
    comm_overlap: bool = Field(default=True, description="Data-parallel traffic overlaps the backward pass.")
    dp_overlap_fraction: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="Share of the backward pass data-parallel traffic can hide behind (measure it: the first "
        "bucket is ready only after the last layers' backward).",
    )
    memory_bandwidth_efficiency: float | None = Field(
        default=0.8,
        gt=0,
        le=1,
        description="Share of the memory bandwidth that norms, softmax, dropout and elementwise kernels reach; "
        "their bytes over it is the memory-bound time of a step. None = not modelled (FLOPs only).",
    )
    pipeline_scatter_gather: bool = Field(
        default=False,
        description="Pipeline boundary tensors sent 1/TP per tensor-parallel rank and all-gathered on arrival "
        "(Megatron-LM's default); false = the whole tensor from each rank, as the payload sends it.",
    )
    search_runnable_only: bool = Field(
        default=True,
        description="Search only layouts the payload runs (false: also ZeRO-1/2, tensor or pipeline parallelism on "
        "MoE models, ..., listed with what the payload would reject).",
    )
    search_top: int = Field(default=5, ge=1, le=1000, description="Fitting layouts listed in the plan.")
    max_micro_batch: int = Field(
        default=64, ge=1, le=MAX_BATCH, description="Largest micro-batch the plan search tries."
    )
    output_url: StorageUrl | None = Field(
        default=None, description="Folder for plan.json; None = the spec's deployment_dir (runs/<name>/)."
    )

    def accelerator_overrides(self) -> dict[str, dict[str, object]]:
        """The overrides as plain dictionaries."""
        return {name: entry.fields() for name, entry in self.accelerators.items()}

    @model_validator(mode="after")
    def _offload_stage(self) -> CapacityConfig:
        zero = self.layout.zero_stage if self.layout else None
        if zero is not None:
            where, how = f"capacity.layout.zero_stage={zero}", "capacity.layout.zero_stage"
            raise_problems("CapacityConfig", self._offload(zero, where, how))
        return self

    def _offload(self, zero: int, where: str, how: str) -> list[Problem]:
        """Offload that ZeRO stage `zero` (set by `where`, changed with `how`) cannot do: DeepSpeed offloads the
        optimizer of ZeRO-1, 2 and 3 only (DDP has no partition to hand over), the parameters of ZeRO-3 only."""
        if self.offload == "optimizer+params" and zero < 3:
            return [
                (
                    ("offload",),
                    self.offload,
                    "offloading parameters needs ZeRO-3 (DeepSpeed's offload_param, FSDP2's CPUOffloadPolicy), "
                    f"but {where}; set {how}: 3, or offload: {'optimizer' if zero else 'none'}",
                )
            ]
        if self.offload == "optimizer" and zero < 1:
            return [
                (
                    ("offload",),
                    self.offload,
                    f"offloading the optimizer needs ZeRO-1 or higher (DeepSpeed's offload_optimizer), but {where}; "
                    f"set {how} to 1, 2 or 3, or offload: none",
                )
            ]
        return []

    def spec_problems(self, dtype: str, sharding: str) -> list[Problem]:
        """What this section contradicts in others: pure-16bit over precision.dtype fp32, and offload that the ZeRO
        stage of parallel.sharding (ddp: 0, fsdp and hsdp: 3) cannot do when capacity.layout sets no stage."""
        problems: list[Problem] = []
        if self.mixed_precision == "pure-16bit" and dtype == "fp32":
            problems.append(
                (
                    ("capacity", "mixed_precision"),
                    "pure-16bit",
                    "keeps 16-bit weights, but precision.dtype=fp32 trains in fp32; set precision.dtype: bf16 "
                    "(or fp16), or mixed_precision: autocast",
                )
            )
        if self.layout is None or self.layout.zero_stage is None:
            zero = 0 if sharding == "ddp" else 3
            where = f"parallel.sharding={sharding} is ZeRO-{zero}"
            how = "parallel.sharding: fsdp, or capacity.layout.zero_stage"
            problems += [(("capacity", *loc), v, m) for loc, v, m in self._offload(zero, where, how)]
        return problems


def _choices(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:-1]) + (" or " if len(values) > 1 else "") + str(values[-1])


def _context_parallel_problems(cp: int, attention: str, seq_len: int, world: int, tp_pp: int) -> list[Problem]:
    """Context parallelism splits each sequence in 2 x cp chunks (each rank a chunk from either end, so that the
    causal mask's work is even) and needs fused attention (no score matrices over the whole sequence)."""
    loc = ("capacity", "layout", "context_parallel")
    problems: list[Problem] = []
    if attention != "flash":
        problems.append(
            (loc, cp, f"needs capacity.attention: flash (attention={attention} keeps score matrices of the whole "
                      "sequence on every rank); set attention: flash or context_parallel: 1")
        )  # fmt: skip
    if seq_len % (2 * cp):
        valid = [d for d in divisors(world // tp_pp if world % tp_pp == 0 else world) if seq_len % (2 * d) == 0]
        problems.append(
            (loc, cp, f"model.seq_len={seq_len} must split in 2 x context_parallel = {2 * cp} equal chunks "
                      f"(load-balanced causal attention); use {_choices(valid)}")
        )  # fmt: skip
    return problems


def capacity_problems(
    capacity: CapacityConfig,
    accelerator: str,
    nodes: int,
    procs_per_node: int,
    model: ModelConfig,
    parallel: ParallelConfig,
) -> list[Problem]:
    """Cross-section checks: the accelerator is known, the planned layout's degrees divide what they must."""
    problems: list[Problem] = []
    known = accelerator_names(capacity.accelerators)
    if accelerator not in known:
        problems.append(
            (
                ("cluster", "accelerator"),
                accelerator,
                f"is not in the accelerator catalogue; use one of {', '.join(known)} "
                "or describe it under capacity.accelerators",
            )
        )
    else:
        try:
            limit = resolve_accelerator(accelerator, capacity.accelerator_overrides()).max_per_node
        except (KeyError, TypeError):  # a partial spec-defined entry: reported below, field by field
            limit = None
        if limit is not None and procs_per_node > limit:
            problems.append(
                (
                    ("cluster", "procs_per_node"),
                    procs_per_node,
                    f"a {accelerator} node holds at most {limit} devices; use procs_per_node <= {limit} and more "
                    f"nodes, or set capacity.accelerators.{accelerator}.max_per_node",
                )
            )
    for name, entry in capacity.accelerators.items():
        missing = [f for f in _ACCELERATOR_FIELDS if f not in entry.fields()]
        if name not in CATALOGUE and missing:
            problems.append(
                (
                    ("capacity", "accelerators", name),
                    name,
                    f"is not in the catalogue, so it needs every figure; add {', '.join(missing)}",
                )
            )
    world = nodes * procs_per_node
    lo = capacity.layout
    tp, pp, cp = (lo.tensor_parallel, lo.pipeline_parallel, lo.context_parallel) if lo else (1, 1, 1)
    if lo is not None:  # the same checks as the payload's section, of what a planned layout has to make sense
        planned = lo.applied_to(parallel).model_copy(update={"data_parallel": None})
        loc = ("capacity", "layout")
        where = f"cluster.nodes x cluster.procs_per_node = {world}"
        problems += layout_problems(model, planned, None, loc=loc, planned=True)
        problems += world_problems(planned, world, procs_per_node, where, loc=loc, planned=True)
        if cp > 1:
            problems += _context_parallel_problems(cp, capacity.attention, model.seq_len, world, tp * pp)
    dp = world // (tp * pp * cp) if world % (tp * pp * cp) == 0 else 0
    if lo is None and world % (parallel.tensor_parallel * parallel.pipeline_parallel) == 0:
        dp = world // (parallel.tensor_parallel * parallel.pipeline_parallel)  # the payload's own layout
    if dp:
        default_batch = parallel.micro_batch * parallel.grad_accum_steps * (world if lo else dp)
        global_batch = capacity.global_batch or default_batch
        if global_batch % (dp * parallel.micro_batch):
            problems.append(
                (
                    ("capacity", "global_batch"),
                    global_batch,
                    f"must be a multiple of data-parallel degree {dp} x parallel.micro_batch {parallel.micro_batch} "
                    f"= {dp * parallel.micro_batch} so that gradient accumulation absorbs the rest",
                )
            )
    return problems
