"""The one model of a parallel layout, without torch: `Layout` (built from a `parallel` section by `Layout.of`),
the checks of a section against the model and the world, the mesh dimensions and what is planned only.

A layout is the degrees of the device mesh (training/mesh.py), outermost first:
pipeline x data replicate x data shard x context x tensor = world size. Expert
parallelism is carved out of the data-parallel ranks (the EP ranks of one group
are consecutive data-parallel ranks and see different samples), so it divides
the data-parallel degree rather than multiplying the world size.

Everything here is pure arithmetic on the config so that the operator's machine
(tasks/spec.py, which knows the cluster), the planner (tasks/capacity/, which
plans `capacity.layout` and searches layouts) and every training process (which
knows the world it was started in) give the same messages: field, value and the
fix. Acceptance checks the ranks' mesh records against MESH_DIMS / MESH_GROUPS.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from training.config import ModelConfig, ParallelConfig, Problem

Recompute = Literal["none", "selective", "full"]

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""The world mesh's dimensions (training/mesh.py builds it), outermost first; their product is the world size."""
EXPERT_MESH_DIMS = ("pp", "dp_mod_ep", "ep", "cp", "tp")
"""The expert mesh: the data-parallel ranks viewed as dp_mod_ep x ep."""
MESH_GROUPS = {"tp": ("tp",), "cp": ("cp",), "pp": ("pp",), "dp": ("dp_replicate", "dp_shard"), "ep": ("ep",)}
"""A sub-group's name (the ranks' mesh records, ranks.json) and the mesh coordinates its ranks differ in (an EP
group: consecutive data-parallel ranks)."""

CONTEXT_PARALLEL_UNSUPPORTED = (
    "context parallelism is not available: torch 2.13's ring attention "
    "(torch.distributed.tensor.experimental.context_parallel) shards the CUDA flash/efficient/cuDNN attention "
    "kernels only, not the CPU kernel this payload runs on gloo; set it to 1 (use tensor_parallel with "
    "sequence_parallel to cut activation memory instead)"
)

PLANNED_ONLY = {"context_parallel": CONTEXT_PARALLEL_UNSUPPORTED}
"""The `parallel` degrees the planner plans but the payload does not run (above 1), each with why and the fix:
the payload's check rejects them, the planner searches them only when asked for more than the payload runs."""


def _choices(values: list[int]) -> str:
    return ", ".join(str(v) for v in values[:8]) + (" ..." if len(values) > 8 else "")


def _divisors(n: int) -> list[int]:
    from training.config import divisors  # noqa: PLC0415 - config imports this module

    return divisors(n)


def balanced_split(n_layers: int, chunks: int) -> list[int]:
    """Layers per pipeline chunk as even as possible, the larger chunks last (the first stage also holds the
    embedding, the last the output layer; torchtitan puts the extra layers in the middle-to-late stages too)."""
    base, extra = divmod(n_layers, chunks)
    return [base + (1 if i >= chunks - extra else 0) for i in range(chunks)]


def pipeline_split(model: ModelConfig, par: ParallelConfig) -> list[int]:
    """The layers of each pipeline chunk: the spec's `pipeline_split`, or a balanced one."""
    return list(par.pipeline_split) if par.pipeline_split else balanced_split(model.n_layers, par.pipeline_chunks)


def layout_problems(
    model: ModelConfig, par: ParallelConfig, dtype: str | None, *, loc: tuple[str, ...] = ("parallel",),
    planned: bool = False,
) -> list[Problem]:
    """Problems of a `parallel` section that do not depend on the world size, reported at `loc` (the spec's
    `parallel`, or `capacity.layout` for a layout the planner plans). A `planned` layout only has to make sense:
    what the payload does not run (PLANNED_ONLY, tensor or pipeline parallelism with MoE, uneven MLP or vocabulary
    splits, microbatching, precision; `dtype` None) is left to the planner's payload check of each layout."""
    problems: list[Problem] = []
    tp, pp, ep = par.tensor_parallel, par.pipeline_parallel, par.expert_parallel
    if not planned:
        for name, why in PLANNED_ONLY.items():
            if getattr(par, name) > 1:
                problems.append(((*loc, name), getattr(par, name), why))
    if tp > 1:
        if model.n_heads % tp:
            ok = [d for d in _divisors(model.n_heads) if model.kv_heads % d == 0]
            problems.append(
                (
                    (*loc, "tensor_parallel"),
                    tp,
                    f"must divide model.n_heads={model.n_heads} (each rank takes whole heads); use {_choices(ok)}",
                )
            )
        elif model.kv_heads % tp:
            ok = [d for d in _divisors(model.n_heads) if model.kv_heads % d == 0]
            problems.append(
                (
                    (*loc, "tensor_parallel"),
                    tp,
                    f"must divide model.n_kv_heads={model.kv_heads} (KV heads are split, not replicated, over the "
                    f"tensor-parallel ranks); use {_choices(ok)}, or raise n_kv_heads to a multiple of {tp}",
                )
            )
        if model.ffn_hidden % tp and not planned:
            problems.append(
                (
                    (*loc, "tensor_parallel"),
                    tp,
                    f"must divide model.ffn_hidden={model.ffn_hidden}; use {_choices(_divisors(model.ffn_hidden))} "
                    f"or set ffn_hidden to {-(-model.ffn_hidden // tp) * tp}",
                )
            )
        if model.vocab_size % tp and not planned and model.kind != "vit":  # a vit's classifier head is replicated
            padded = -(-model.vocab_size // tp) * tp
            problems.append(
                (
                    ("model", "vocab_size"),
                    model.vocab_size,
                    f"is not divisible by parallel.tensor_parallel={tp} (the embedding and output layer are split "
                    f"by vocabulary rows); pad the embedding: set model.vocab_size to {padded} (ids above the "
                    "tokenizer's are never produced, as in Megatron's make-vocab-size-divisible-by)",
                )
            )
        if model.moe is not None and not planned:
            problems.append(
                (
                    (*loc, "tensor_parallel"),
                    tp,
                    "is not supported with model.moe (experts are not split by columns); shard experts with "
                    "parallel.expert_parallel and use tensor_parallel=1",
                )
            )
    if par.sequence_parallel:
        if tp == 1:
            problems.append(((*loc, "sequence_parallel"), True, "needs tensor_parallel > 1; remove it or raise it"))
        elif model.seq_len % tp:
            problems.append(
                (
                    (*loc, "sequence_parallel"),
                    True,
                    f"needs model.seq_len={model.seq_len} divisible by tensor_parallel={tp}; "
                    f"set seq_len to {-(-model.seq_len // tp) * tp} or turn sequence_parallel off",
                )
            )
    if par.pipeline_schedule == "interleaved-1f1b":
        if par.virtual_stages < 2:
            problems.append(
                ((*loc, "virtual_stages"), par.virtual_stages, "interleaved-1f1b needs virtual_stages >= 2; set 2")
            )
        if pp == 1:
            problems.append(
                ((*loc, "pipeline_schedule"), par.pipeline_schedule, "needs pipeline_parallel > 1; use 1f1b or gpipe")
            )
    elif par.virtual_stages > 1:
        problems.append(
            (
                (*loc, "virtual_stages"),
                par.virtual_stages,
                f"only applies to pipeline_schedule=interleaved-1f1b (got {par.pipeline_schedule}); remove it",
            )
        )
    chunks = par.pipeline_chunks
    if par.pipeline_split is not None:
        split = par.pipeline_split
        if pp == 1:
            problems.append(((*loc, "pipeline_split"), split, "only applies to pipeline_parallel > 1; remove it"))
        elif len(split) != chunks or sum(split) != model.n_layers or min(split) < 1:
            problems.append(
                (
                    (*loc, "pipeline_split"),
                    split,
                    f"must list {chunks} chunk sizes (pipeline_parallel x virtual_stages), each >= 1, summing to "
                    f"model.n_layers={model.n_layers}; for example {balanced_split(model.n_layers, chunks)}",
                )
            )
    elif pp > 1 and chunks > model.n_layers:
        problems.append(
            (
                (*loc, "pipeline_parallel"),
                pp,
                f"{chunks} pipeline chunks (pipeline_parallel x virtual_stages) exceed model.n_layers="
                f"{model.n_layers}; each chunk needs at least one layer",
            )
        )
    if pp > 1 and model.tie_embeddings and not planned:
        problems.append(
            (
                ("model", "tie_embeddings"),
                True,
                "cannot be shared across pipeline stages (the embedding is on the first stage, the output layer on "
                "the last); set tie_embeddings: false or pipeline_parallel: 1",
            )
        )
    if pp > 1 and model.moe is not None and not planned:
        problems.append(
            (
                (*loc, "pipeline_parallel"),
                pp,
                "is not supported with model.moe yet (the load-balancing loss would have to cross the stages); "
                "use expert_parallel with data parallelism, or a dense model",
            )
        )
    if pp > 1 and not planned:
        micro = par.n_microbatches
        sequences = par.micro_batch * par.grad_accum_steps
        if sequences % micro:
            problems.append(
                (
                    (*loc, "pipeline_microbatches"),
                    micro,
                    f"must divide the {sequences} sequences of a pipeline step (micro_batch x grad_accum_steps); "
                    f"use {_choices(_divisors(sequences))}",
                )
            )
        if par.pipeline_schedule == "interleaved-1f1b" and micro % pp:
            problems.append(
                (
                    (*loc, "pipeline_microbatches"),
                    micro,
                    f"interleaved-1f1b needs a multiple of pipeline_parallel={pp} microbatches; set "
                    f"{-(-micro // pp) * pp} (and micro_batch x grad_accum_steps to a multiple of it)",
                )
            )
        elif micro < pp:
            problems.append(
                (
                    (*loc, "pipeline_microbatches"),
                    micro,
                    f"fewer microbatches than the {pp} pipeline stages leave stages idle and 1F1B cannot fill the "
                    f"pipeline; set pipeline_microbatches (or grad_accum_steps) >= {pp}",
                )
            )
    if ep > 1:
        if model.moe is None:
            problems.append(((*loc, "expert_parallel"), ep, "needs model.moe (a dense model has no experts); set 1"))
        elif model.moe.n_experts % ep:
            problems.append(
                (
                    (*loc, "expert_parallel"),
                    ep,
                    f"must divide model.moe.n_experts={model.moe.n_experts}; use "
                    f"{_choices(_divisors(model.moe.n_experts))}",
                )
            )
    if par.expert_capacity_factor is not None and model.moe is None and not planned:
        problems.append(((*loc, "expert_capacity_factor"), par.expert_capacity_factor, "needs model.moe; remove it"))
    if par.model_parallel and not planned:
        if dtype == "fp16":
            problems.append(
                (
                    ("precision", "dtype"),
                    "fp16",
                    "fp16 loss scaling is supported on data-parallel layouts only; use bf16 with tensor, pipeline "
                    "or expert parallelism",
                )
            )
        if par.ddp_grad_compression is not None:
            problems.append(
                (
                    (*loc, "ddp_grad_compression"),
                    par.ddp_grad_compression,
                    "only applies to data-parallel layouts (tensor/pipeline/expert parallel layouts synchronise "
                    "gradients through FSDP2); remove it",
                )
            )
    return problems


def data_parallel_degree(par: ParallelConfig, world: int) -> int:
    """Data-parallel ranks of the layout on `world` processes (model-parallel degrees divided out)."""
    return world // (par.tensor_parallel * par.pipeline_parallel * par.context_parallel)


def world_problems(
    par: ParallelConfig, world: int, procs_per_node: int, where: str, *, loc: tuple[str, ...] = ("parallel",),
    planned: bool = False,
) -> list[Problem]:
    """Problems of the layout on `world` processes, `procs_per_node` per node, reported at `loc`; `where` names
    the world (for example "cluster.nodes x cluster.procs_per_node = 8"). A `planned` layout (capacity.layout)
    takes its shard groups from the planner, not from hsdp_shard_size."""
    problems: list[Problem] = []
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    model_ranks = tp * pp * cp
    if world % model_ranks:
        degrees = {"tensor_parallel": tp, "pipeline_parallel": pp, "context_parallel": cp}
        field = next((name for name, degree in degrees.items() if degree > 1), "pipeline_parallel")
        named = " x ".join(name for name, degree in degrees.items() if name != "context_parallel" or degree > 1)
        problems.append(
            (
                (*loc, field),
                degrees[field],
                f"{named} = {model_ranks} must divide {where}; with those processes use a product among "
                f"{_choices(_divisors(world))}",
            )
        )
        return problems
    dp = world // model_ranks
    if par.data_parallel is not None and par.data_parallel != dp:
        problems.append(
            (
                (*loc, "data_parallel"),
                par.data_parallel,
                f"must be {where} / (tensor_parallel x pipeline_parallel) = {dp}; set it to {dp} or remove it",
            )
        )
    if tp > 1 and procs_per_node % tp:
        problems.append(
            (
                (*loc, "tensor_parallel"),
                tp,
                f"a tensor-parallel group must sit within one node ({procs_per_node} processes per node): its "
                f"all-reduces run every layer; use a divisor of {procs_per_node}: "
                f"{_choices(_divisors(procs_per_node))}",
            )
        )
    if par.expert_parallel > 1 and dp % par.expert_parallel:
        problems.append(
            (
                (*loc, "expert_parallel"),
                par.expert_parallel,
                f"expert-parallel ranks are data-parallel ranks: it must divide the data-parallel degree {dp}; use "
                f"{_choices(_divisors(dp))}",
            )
        )
    if par.sharding == "hsdp" and par.model_parallel and not planned:
        shard = par.hsdp_shard_size or max(1, procs_per_node // tp)
        if dp % shard:
            problems.append(
                (
                    (*loc, "hsdp_shard_size"),
                    shard,
                    f"must divide the data-parallel degree {dp}; use one of {_divisors(dp)}",
                )
            )
    return problems


@dataclass(frozen=True)
class Layout:
    """How a job is spread: degrees, sharding, micro-batching and recompute.

    `zero` is the sharding stage over the data-parallel group (0: DDP; 1: optimizer states; 2: + gradients;
    3: + weights, i.e. FSDP). `shard_group` is the number of ranks a ZeRO/FSDP shard spans (hsdp: a node);
    None means the whole data-parallel group. Experts are spread over `ep` ranks of the data-parallel group.
    `cp` context-parallel ranks split each sequence (Llama 3's all-gather attention, torch's ring attention):
    they hold the same weights, reduce gradients with the data-parallel ranks and, sharded, shard over both
    (torchtitan's dp_shard x cp).
    """

    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    zero: int = 0
    shard_group: int | None = None
    micro_batch: int = 1
    grad_accum: int = 1
    recompute: Recompute = "none"
    sequence_parallel: bool = False
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b"] = "1f1b"
    virtual_stages: int = 1
    cp: int = 1
    split: tuple[int, ...] | None = None
    """Layers of each pipeline chunk in order (pp x virtual_stages of them); None = balanced (the payload's
    balanced_split: the extra layers on the later chunks)."""

    @property
    def chunks(self) -> int:
        """Pipeline chunks: pp, times the virtual stages when interleaved."""
        return self.pp * (self.virtual_stages if self.pp > 1 and self.pp_schedule == "interleaved-1f1b" else 1)

    def chunk_layers(self, n_layers: int) -> list[int]:
        """Layers of each chunk, in model order."""
        return list(self.split) if self.split else balanced_split(n_layers, self.chunks)

    def stage_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers of each pipeline stage: stage r holds chunks r, r + pp, ... (as the payload places them)."""
        return _stage_layers(n_layers, self.pp, self.chunks, self.split)

    @property
    def world(self) -> int:
        """Ranks in the job."""
        return self.dp * self.tp * self.pp * self.cp

    @property
    def shard(self) -> int:
        """Ranks one ZeRO/FSDP shard spans."""
        return self.shard_group or self.dp

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step."""
        return self.dp * self.micro_batch * self.grad_accum

    @classmethod
    def of(cls, par: ParallelConfig, world: int, procs_per_node: int, global_batch: int | None = None) -> Layout:
        """The layout `par` runs on `world` processes, `procs_per_node` per node: ddp is ZeRO-0, fsdp and hsdp
        ZeRO-3 (hsdp sharded over hsdp_shard_size, else a node's ranks); a pipeline splits micro_batch x
        grad_accum_steps sequences into its microbatches. `global_batch`: sequences per step (None: the spec's).
        An hsdp layout keeps its shard group even where it spans every data-parallel rank (it prints as hsdp)."""
        tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
        dp = world // (tp * pp * cp)
        zero = 0 if par.sharding == "ddp" else 3
        micro = par.micro_batch
        if pp > 1:  # the pipeline splits micro_batch x grad_accum_steps sequences into its microbatches
            micro = par.micro_batch * par.grad_accum_steps // par.n_microbatches
        shard = None
        if par.sharding == "hsdp":
            shard = par.hsdp_shard_size or (procs_per_node // tp if par.model_parallel else procs_per_node)
        batch = global_batch or par.micro_batch * par.grad_accum_steps * dp
        return cls(
            dp=dp, tp=tp, pp=pp, ep=par.expert_parallel, cp=cp, zero=zero, shard_group=shard,
            micro_batch=micro, grad_accum=batch // (dp * micro), recompute=par.activation_recompute,
            sequence_parallel=par.sequence_parallel, pp_schedule=par.pipeline_schedule,
            virtual_stages=par.virtual_stages,
            split=tuple(par.pipeline_split) if par.pipeline_split and pp > 1 else None,
        )  # fmt: skip

    @property
    def sharding(self) -> str:
        """The payload's name of its sharding: ddp (ZeRO-0), fsdp (ZeRO-3 over every data-parallel rank), hsdp
        (ZeRO-3 in shard groups: `shard_group` set), zero1 / zero2 (planned only)."""
        if self.zero == 0:
            return "ddp"
        if self.zero in (1, 2):
            return f"zero{self.zero}"
        return "hsdp" if self.shard_group is not None else "fsdp"

    def degrees(self, *extra: str) -> str:
        """The mesh in words, outermost dimension first, a degree of 1 left out (dp always shown), then the
        sharding and `extra`: "pp2 x dp2 x tp2 (fsdp, 1f1b)", "dp4 (ddp)"."""
        sizes = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        text = " x ".join(f"{d}{n}" for d, n in sizes.items() if n > 1 or d == "dp")
        return text + (f" ep{self.ep}" if self.ep > 1 else "") + f" ({', '.join([self.sharding, *extra])})"

    def describe(self) -> str:
        """Short name of the whole layout, batching and recompute included, e.g. `dp8 tp2 pp1 zero3 mb4x2 sel sp`
        (the planner's tables, plan.json); `degrees()` is the mesh alone."""
        name = f"dp{self.dp} tp{self.tp} pp{self.pp}"
        if self.cp > 1:
            name += f" cp{self.cp}"
        if self.ep > 1:
            name += f" ep{self.ep}"
        name += f" zero{self.zero}"
        if self.zero and self.shard != self.dp:
            name += f"/{self.shard}"
        name += f" mb{self.micro_batch}x{self.grad_accum} {self.recompute}"
        if self.sequence_parallel:
            name += " sp"
        if self.pp > 1 and self.pp_schedule == "interleaved-1f1b":
            name += f" v{self.virtual_stages}"
        if self.pp > 1 and self.pp_schedule == "gpipe":
            name += " gpipe"
        if self.split and len(set(self.split)) > 1:
            name += " split " + "-".join(str(n) for n in self.split)
        return name


@functools.lru_cache(maxsize=4096)
def _stage_layers(n_layers: int, pp: int, chunks: int, split: tuple[int, ...] | None) -> tuple[int, ...]:
    """Layers per stage (memoised: a search asks for the same few splits many times)."""
    sizes = list(split) if split else balanced_split(n_layers, chunks)
    return tuple(sum(sizes[stage::pp]) for stage in range(pp))
