"""Model-parallel layouts: the checks of a `parallel` section against the model and the world, without torch.

A layout is the degrees of the device mesh (training/mesh.py), outermost first:
pipeline x data replicate x data shard x context x tensor = world size. Expert
parallelism is carved out of the data-parallel ranks (the EP ranks of one group
are consecutive data-parallel ranks and see different samples), so it divides
the data-parallel degree rather than multiplying the world size.

Everything here is pure arithmetic on the config so that the operator's machine
(tasks/spec.py, which knows the cluster) and every training process (which knows
the world it was started in) give the same messages: field, value and the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from training.config import ModelConfig, ParallelConfig, Problem

CONTEXT_PARALLEL_UNSUPPORTED = (
    "context parallelism is not available: torch 2.13's ring attention "
    "(torch.distributed.tensor.experimental.context_parallel) shards the CUDA flash/efficient/cuDNN attention "
    "kernels only, not the CPU kernel this payload runs on gloo; set it to 1 (use tensor_parallel with "
    "sequence_parallel to cut activation memory instead)"
)


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


def layout_problems(model: ModelConfig, par: ParallelConfig, dtype: str) -> list[Problem]:
    """Problems of the `parallel` section that do not depend on the world size."""
    problems: list[Problem] = []
    tp, pp, ep = par.tensor_parallel, par.pipeline_parallel, par.expert_parallel
    loc = ("parallel",)
    if par.context_parallel > 1:
        problems.append(((*loc, "context_parallel"), par.context_parallel, CONTEXT_PARALLEL_UNSUPPORTED))
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
        if model.ffn_hidden % tp:
            problems.append(
                (
                    (*loc, "tensor_parallel"),
                    tp,
                    f"must divide model.ffn_hidden={model.ffn_hidden}; use {_choices(_divisors(model.ffn_hidden))} "
                    f"or set ffn_hidden to {-(-model.ffn_hidden // tp) * tp}",
                )
            )
        if model.vocab_size % tp:
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
        if model.moe is not None:
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
    if pp > 1 and model.tie_embeddings:
        problems.append(
            (
                ("model", "tie_embeddings"),
                True,
                "cannot be shared across pipeline stages (the embedding is on the first stage, the output layer on "
                "the last); set tie_embeddings: false or pipeline_parallel: 1",
            )
        )
    if pp > 1 and model.moe is not None:
        problems.append(
            (
                (*loc, "pipeline_parallel"),
                pp,
                "is not supported with model.moe yet (the load-balancing loss would have to cross the stages); "
                "use expert_parallel with data parallelism, or a dense model",
            )
        )
    if pp > 1:
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
    if par.expert_capacity_factor is not None and model.moe is None:
        problems.append(((*loc, "expert_capacity_factor"), par.expert_capacity_factor, "needs model.moe; remove it"))
    if par.model_parallel:
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


def world_problems(par: ParallelConfig, world: int, procs_per_node: int, where: str) -> list[Problem]:
    """Problems of the layout on `world` processes, `procs_per_node` per node; `where` names the world (for
    example "cluster.nodes x cluster.procs_per_node = 8")."""
    problems: list[Problem] = []
    loc = ("parallel",)
    tp, pp, cp = par.tensor_parallel, par.pipeline_parallel, par.context_parallel
    model_ranks = tp * pp * cp
    if world % model_ranks:
        problems.append(
            (
                (*loc, "tensor_parallel" if tp > 1 else "pipeline_parallel"),
                tp if tp > 1 else pp,
                f"tensor_parallel x pipeline_parallel = {model_ranks} must divide {where}; with those processes "
                f"use a product among {_choices(_divisors(world))}",
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
    if par.sharding == "hsdp" and par.model_parallel:
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


def describe(par: ParallelConfig, world: int) -> dict[str, Any]:
    """The degrees of the layout on `world` processes, for logs and reports."""
    dp = data_parallel_degree(par, world)
    return {
        "world": world,
        "pipeline": par.pipeline_parallel,
        "data": dp,
        "context": par.context_parallel,
        "tensor": par.tensor_parallel,
        "expert": par.expert_parallel,
        "sharding": par.sharding,
    }
