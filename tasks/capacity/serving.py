"""Memory per GPU of a model served by vLLM: weights, paged KV cache, one forward pass's activations, and how many
sequences of a context length the KV cache holds.

vLLM sizes its KV cache after it has loaded the weights and profiled a forward pass of `max_num_batched_tokens`
tokens and a sampling step of `max_num_seqs` sequences (`Worker.determine_available_memory` in
vllm/v1/worker/gpu_worker.py): the engine may take `gpu_memory_utilization` of the device's total memory, and what
the weights, the profiled peak and the memory outside torch's tensors (NCCL, CUDA graphs) leave of that becomes the
KV cache; the rest of the device is left to other processes. The cache is cut into blocks of `block_size` tokens
whose page holds the keys and values of those tokens for the KV heads this rank holds (`AttentionSpec.page_size_bytes`
in vllm/v1/kv_cache_interface.py; as many pages per block as the model has layers). A sequence of `context` tokens
takes ceil(context / block_size) blocks (`FullAttentionSpec.max_memory_usage_bytes`); the whole sequences the
blocks hold are the maximum concurrency vLLM logs at start (`get_max_concurrency_for_kv_cache_config` in
vllm/v1/core/kv_cache_utils.py), and vLLM refuses to start when not even one fits (`check_enough_kv_cache_memory`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from tasks.capacity.catalogue import Accelerator
from tasks.capacity.memory import kv_cache_bytes
from tasks.capacity.params import Architecture, count_params
from tasks.capacity.units import GIB, count, gib
from training.config import PrecisionConfig

if TYPE_CHECKING:
    from tasks.serve.config import ServeConfig

ServeDtype = Literal["float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8"]
ProblemKind = Literal["tensor_parallel", "weights", "budget", "context", "concurrency"]

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
LOGITS_BYTES = 4
"""vLLM's sampler works on fp32 logits whatever the model's dtype."""
MAX_TENSOR_PARALLEL = 64
"""Largest tensor-parallel degree a fix suggests on an accelerator without a per-node limit."""


def vllm_batch_defaults(accelerator: Accelerator) -> tuple[int, int]:
    """(max_num_batched_tokens, max_num_seqs) that vLLM's OpenAI-compatible server picks when they are not set:
    8192 and 1024 on devices of at least 70 GiB other than the A100, else 2048 and 256 (`EngineArgs`)."""
    if accelerator.memory_gib >= 70 and "a100" not in accelerator.name.lower():
        return 8192, 1024
    return 2048, 256


POD_PROCESS_GIB = 2.0
"""Host memory of one GPU server process beside the weights (Python, torch, the CUDA runtime), in GiB."""


@dataclass(frozen=True)
class ServingSettings:
    """The engine settings that decide serving memory, named after vLLM's flags and the spec's `serve` fields.

    `max_num_seqs` and `max_num_batched_tokens` of None take vLLM's defaults for the device (`vllm_batch_defaults`).
    `kv_cache_gib` fixes the KV cache's size (vLLM's --kv-cache-memory-bytes; VLLM_CPU_KVCACHE_SPACE on CPU) instead
    of giving it what `gpu_memory_utilization` leaves. `overhead_gib` is the memory outside the profiled tensors:
    CUDA graphs, NCCL and cuBLAS workspaces, the CUDA context's share torch does not see.
    """

    dtype: ServeDtype = "bfloat16"
    tensor_parallel: int = 1
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    kv_cache_dtype: KVCacheDtype = "auto"
    kv_cache_gib: float | None = None
    overhead_gib: float = 1.0

    @classmethod
    def of(
        cls, serve: ServeConfig, accelerator: Accelerator, precision: PrecisionConfig | None = None
    ) -> ServingSettings:
        """The settings `tasks.serve.server` starts vLLM with for `serve` on `accelerator`, for a model trained at
        `precision` (default fp32), which an export is served in unless serve.dtype says otherwise."""
        # On CPU the server sizes the cache with VLLM_CPU_KVCACHE_SPACE in whole GiB (server_env_vars).
        kv_cache_gib = float(max(1, int(serve.kv_cache_gib))) if accelerator.kind == "cpu" else None
        return cls(
            dtype=serve.dtype or (precision or PrecisionConfig()).torch_name,
            tensor_parallel=serve.tensor_parallel,
            gpu_memory_utilization=serve.gpu_memory_utilization,
            max_num_seqs=serve.max_num_seqs,
            kv_cache_gib=kv_cache_gib,
        )

    def resolved(self, accelerator: Accelerator) -> ServingSettings:
        """These settings with vLLM's defaults for `accelerator` in place of the unset batch limits."""
        tokens, seqs = vllm_batch_defaults(accelerator)
        return replace(
            self,
            max_num_batched_tokens=self.max_num_batched_tokens or tokens,
            max_num_seqs=self.max_num_seqs or seqs,
        )

    @property
    def kv_bytes_per_element(self) -> int:
        """Bytes of one cached key or value element: the model's dtype under `auto`, one under fp8."""
        return 1 if self.kv_cache_dtype == "fp8" else DTYPE_BYTES[self.dtype]


def kv_shards(arch: Architecture, tp: int) -> int:
    """Ranks the KV heads are split over: `tp`, or all of them when there are fewer KV heads than ranks (vLLM then
    keeps one replicated KV head per rank)."""
    return min(tp, arch.kv_heads)


def kv_block_bytes(arch: Architecture, block_size: int = 16, bytes_per_element: int = 2, tp: int = 1) -> int:
    """Bytes of one KV-cache block on a rank: keys and values of `block_size` tokens in every layer."""
    return int(kv_cache_bytes(arch, 1, block_size, bytes_per_element, kv_shards(arch, tp)))


def serving_weight_bytes(arch: Architecture, dtype: ServeDtype = "bfloat16", tp: int = 1) -> float:
    """Bytes of the weights on each rank: matrices and embeddings split by tensor parallelism; norms, the MoE
    router and learned positions replicated; the output layer counted once more unless tied to the embedding."""
    pc = count_params(arch)
    replicated = arch.n_layers * (pc.per_layer_norms + pc.per_layer_router) + pc.final_norm + pc.positions
    return ((pc.total - replicated) / tp + replicated) * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class ServingActivations:
    """The tensors a profiled forward pass of `tokens` tokens and a sampling step of `sequences` sequences allocate
    on a rank, in bytes. Inference keeps nothing for backward, so the peak is the largest moment of the pass."""

    tokens: int
    sequences: int
    stream: float
    """Hidden states and residual entering a block: tokens x d_model each, on every rank."""
    attention: float
    """Fused q/k/v projection output and attention output (this rank's heads)."""
    mlp: float
    """MLP inner activations: gate/up output and the activated half (SwiGLU), or fc1's output and GeLU's."""
    logits: float
    """fp32 logits of the sampled tokens: sequences x vocab, gathered whole on the rank that samples."""

    @property
    def layer_peak(self) -> float:
        """Inside a block: the stream plus the larger of attention's and the MLP's intermediates."""
        return self.stream + max(self.attention, self.mlp)

    @property
    def sampling_peak(self) -> float:
        """After the last block: the final hidden states and the logits."""
        return self.stream / 2 + self.logits

    @property
    def peak(self) -> float:
        """What the profile run's peak adds to the weights."""
        return max(self.layer_peak, self.sampling_peak)


def serving_activations(
    arch: Architecture, tokens: int, sequences: int, dtype: ServeDtype = "bfloat16", tp: int = 1
) -> ServingActivations:
    """The activations of a forward pass of `tokens` tokens (a prefill chunk of max_num_batched_tokens) that
    samples `sequences` tokens, on one rank of `tp`."""
    b, h = DTYPE_BYTES[dtype], arch.d_model
    q_and_out = 2 * h / tp
    kv = 2 * arch.kv_dim / kv_shards(arch, tp)
    inner = (3 if arch.mlp == "swiglu" else 2) * arch.ffn_hidden / tp
    if arch.is_moe:
        inner *= arch.top_k  # fused MoE keeps every token's top_k expert activations at once
    return ServingActivations(
        tokens=tokens,
        sequences=sequences,
        stream=2 * tokens * h * b,
        attention=tokens * (q_and_out + kv) * b,
        mlp=tokens * inner * b,
        logits=sequences * arch.vocab_size * LOGITS_BYTES,
    )


@dataclass(frozen=True)
class ServingProblem:
    """Why a serving plan does not fit: what kind of limit, the field to change, its value, and the message with
    the fix. Only `concurrency` lets vLLM start (it then queues the sequences its cache cannot hold)."""

    kind: ProblemKind
    field: str
    value: float | str
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class ServingMemory:
    """Memory on each GPU of a model served by vLLM with `concurrent` sequences of `context` tokens, in bytes."""

    accelerator: str
    device: float
    """The device's total memory."""
    budget: float
    """What the engine takes: device x gpu_memory_utilization, or its parts when kv_cache_gib fixes the cache."""
    weights: float
    activations: ServingActivations
    overhead: float
    kv_budget: float
    """What is left for the KV cache: budget - weights - peak activations - overhead (may be negative)."""
    block_size: int
    block_bytes: int
    num_blocks: int
    context: int
    blocks_per_sequence: int
    concurrent: int
    kv_cache: float
    """The KV cache of `concurrent` sequences of `context` tokens, in whole blocks."""
    problems: tuple[ServingProblem, ...] = ()

    @property
    def kv_bytes_per_token(self) -> float:
        """KV-cache bytes of one token on this rank."""
        return self.block_bytes / self.block_size

    @property
    def max_concurrency(self) -> int:
        """Most sequences of `context` tokens the KV cache holds at once."""
        return self.num_blocks // self.blocks_per_sequence

    @property
    def max_context(self) -> int:
        """Longest single sequence the KV cache holds."""
        return self.num_blocks * self.block_size

    @property
    def reserved(self) -> float:
        """What the engine leaves of the device (to other processes, or as slack)."""
        return self.device - self.budget

    @property
    def used(self) -> float:
        """What the model needs: weights, peak activations, overhead and the KV cache of its sequences."""
        return self.weights + self.activations.peak + self.overhead + self.kv_cache

    @property
    def fits(self) -> bool:
        """Whether the sequences fit as asked."""
        return not self.problems


@dataclass(frozen=True)
class ServingPlan:
    """A model served as its `serve` section says: memory at max_num_seqs sequences of max_model_len tokens, and
    the concurrency the engine reaches (the smaller of the two limits)."""

    model: str
    settings: ServingSettings
    memory: ServingMemory

    @property
    def concurrency(self) -> int:
        """Sequences of max_model_len tokens the engine runs at once."""
        return min(self.memory.concurrent, self.memory.max_concurrency)

    @property
    def problems(self) -> tuple[ServingProblem, ...]:
        """Every reason the plan does not fit, each with its fix."""
        return self.memory.problems

    def pod_memory_bytes(self, accelerator: Accelerator) -> float:
        """Host memory of one server pod on `accelerator` (its Kubernetes memory request, before headroom): on CPU
        everything the engine holds (weights, activations, overhead, and the KV cache it allocates whole:
        kv_cache_gib, VLLM_CPU_KVCACHE_SPACE); on GPUs the weights of all tensor_parallel ranks, which pass through
        host memory as they load, plus POD_PROCESS_GIB per rank."""
        if accelerator.kind == "cpu":
            m, kv_space = self.memory, (self.settings.kv_cache_gib or 0) * GIB
            return m.weights + m.activations.peak + m.overhead + max(m.kv_cache, kv_space)
        return self.settings.tensor_parallel * (self.memory.weights + POD_PROCESS_GIB * GIB)

    @property
    def fits(self) -> bool:
        """Whether max_num_seqs sequences of max_model_len tokens fit."""
        return self.memory.fits


_ARG_FIELDS = {
    name: name
    for name in ("context", "concurrent", "tensor_parallel", "gpu_memory_utilization", "kv_cache_gib", "dtype")
}
_SPEC_FIELDS = {
    "context": "serve.max_model_len",
    "concurrent": "serve.max_num_seqs",
    **{name: f"serve.{name}" for name in ("tensor_parallel", "gpu_memory_utilization", "kv_cache_gib", "dtype")},
}


def _breakdown(
    arch: Architecture, accelerator: Accelerator, context: int, concurrent: int, settings: ServingSettings
) -> ServingMemory:
    """The numbers of `serving_memory`, without the problems; `settings` resolved."""
    assert settings.max_num_batched_tokens is not None and settings.max_num_seqs is not None
    tp = settings.tensor_parallel
    device = float(accelerator.memory_bytes)
    weights = serving_weight_bytes(arch, settings.dtype, tp)
    sequences = min(settings.max_num_seqs, settings.max_num_batched_tokens)
    acts = serving_activations(arch, settings.max_num_batched_tokens, sequences, settings.dtype, tp)
    overhead = settings.overhead_gib * GIB
    if settings.kv_cache_gib is None:
        budget = device * settings.gpu_memory_utilization
        kv_budget = budget - weights - acts.peak - overhead
    else:
        kv_budget = settings.kv_cache_gib * GIB
        budget = weights + acts.peak + overhead + kv_budget
    block_bytes = kv_block_bytes(arch, settings.block_size, settings.kv_bytes_per_element, tp)
    blocks_per_sequence = math.ceil(context / settings.block_size)
    return ServingMemory(
        accelerator=accelerator.name,
        device=device,
        budget=budget,
        weights=weights,
        activations=acts,
        overhead=overhead,
        kv_budget=kv_budget,
        block_size=settings.block_size,
        block_bytes=block_bytes,
        num_blocks=max(0, int(kv_budget // block_bytes)),
        context=context,
        blocks_per_sequence=blocks_per_sequence,
        concurrent=concurrent,
        kv_cache=concurrent * blocks_per_sequence * block_bytes,
    )


def _tp_fits(arch: Architecture, tp: int) -> bool:
    """Whether vLLM can split `arch` over `tp` ranks: query heads evenly, KV heads evenly or replicated."""
    return arch.n_heads % tp == 0 and (arch.kv_heads % tp == 0 or tp % arch.kv_heads == 0)


def _tp_limit(accelerator: Accelerator) -> int:
    return accelerator.max_per_node or MAX_TENSOR_PARALLEL


def _smallest_tp(
    arch: Architecture, accelerator: Accelerator, context: int, sequences: int, settings: ServingSettings
) -> int | None:
    """The smallest tensor-parallel degree above the current one that holds `sequences` sequences of `context`."""
    for tp in range(settings.tensor_parallel + 1, _tp_limit(accelerator) + 1):
        if not _tp_fits(arch, tp):
            continue
        mem = _breakdown(arch, accelerator, context, sequences, replace(settings, tensor_parallel=tp))
        if mem.budget <= mem.device and mem.max_concurrency >= sequences:
            return tp
    return None


def _fixes(
    arch: Architecture,
    accelerator: Accelerator,
    mem: ServingMemory,
    sequences: int,
    settings: ServingSettings,
    names: dict[str, str],
) -> list[str]:
    """Changes that would hold `sequences` sequences of mem.context tokens: more utilization, more ranks, 16 bits."""
    fixes = []
    need = mem.weights + mem.activations.peak + mem.overhead + sequences * mem.blocks_per_sequence * mem.block_bytes
    if settings.kv_cache_gib is None:
        utilization = math.ceil(need / mem.device * 100) / 100
        if settings.gpu_memory_utilization < utilization <= 1:
            fixes.append(f"{names['gpu_memory_utilization']}={utilization:.2f}")
    tp = _smallest_tp(arch, accelerator, mem.context, sequences, settings)
    if tp is not None:
        fixes.append(f"{names['tensor_parallel']}={tp}")
    if settings.dtype == "float32":
        fixes.append(f"{names['dtype']}=bfloat16 (half the weights and KV cache)")
    return fixes


def _either(fixes: list[str], otherwise: str) -> str:
    return "use " + " or ".join(fixes) if fixes else otherwise


def _problems(
    arch: Architecture,
    accelerator: Accelerator,
    mem: ServingMemory,
    settings: ServingSettings,
    names: dict[str, str],
) -> tuple[ServingProblem, ...]:
    """Every reason `mem` does not fit, most basic first: the split, the weights, the budget, one sequence, all."""
    problems = []
    tp = settings.tensor_parallel
    if not _tp_fits(arch, tp):
        good = [t for t in range(1, _tp_limit(accelerator) + 1) if _tp_fits(arch, t)]
        problems.append(
            ServingProblem(
                "tensor_parallel", names["tensor_parallel"], tp,
                f"{names['tensor_parallel']}={tp}: must divide n_heads={arch.n_heads} and divide or be a multiple "
                f"of n_kv_heads={arch.kv_heads}; use one of {good}",
            )
        )  # fmt: skip
    nothing_fits = f"no {names['tensor_parallel']} up to {_tp_limit(accelerator)} fits: use a larger accelerator"
    on = f"the {accelerator.name}'s {gib(mem.device)} GiB"
    if mem.weights > mem.device:
        fixes = _fixes(arch, accelerator, mem, 1, settings, names)
        problems.append(
            ServingProblem(
                "weights", names["tensor_parallel"], tp,
                f"{names['tensor_parallel']}={tp}: the weights take {gib(mem.weights)} GiB per GPU in "
                f"{settings.dtype}, more than {on}; {_either(fixes, nothing_fits)}",
            )
        )  # fmt: skip
        return tuple(problems)
    parts = (
        f"weights {gib(mem.weights)} GiB + activations {gib(mem.activations.peak)} GiB + overhead "
        f"{gib(mem.overhead)} GiB"
    )
    one = mem.blocks_per_sequence * mem.block_bytes
    if settings.kv_cache_gib is not None and mem.budget > mem.device:
        room = mem.device - (mem.budget - mem.kv_budget)
        fixes = [f"{names['kv_cache_gib']} <= {room / GIB:.2f}"] if room >= one else []
        problems.append(
            ServingProblem(
                "budget", names["kv_cache_gib"], settings.kv_cache_gib,
                f"{names['kv_cache_gib']}={settings.kv_cache_gib:g}: {parts} + KV cache {gib(mem.kv_budget)} GiB "
                f"exceed {on}; {_either(fixes + _fixes(arch, accelerator, mem, 1, settings, names), nothing_fits)}",
            )
        )  # fmt: skip
        return tuple(problems)
    if mem.kv_budget <= 0:
        fixes = _fixes(arch, accelerator, mem, 1, settings, names)
        problems.append(
            ServingProblem(
                "budget", names["gpu_memory_utilization"], settings.gpu_memory_utilization,
                f"{names['gpu_memory_utilization']}={settings.gpu_memory_utilization:g}: {parts} leave nothing of "
                f"the {gib(mem.budget)} GiB the engine may take for the KV cache; {_either(fixes, nothing_fits)}",
            )
        )  # fmt: skip
        return tuple(problems)
    if mem.max_concurrency < 1:
        shorter = [f"{names['context']} <= {mem.max_context}"] if mem.max_context else []
        fixes = shorter + _fixes(arch, accelerator, mem, 1, settings, names)
        problems.append(
            ServingProblem(
                "context", names["context"], mem.context,
                f"{names['context']}={mem.context}: one sequence needs {gib(one)} GiB of KV cache, the "
                f"{gib(mem.kv_budget)} GiB left after {parts} hold {count(mem.max_context)} tokens; "
                f"{_either(fixes, nothing_fits)}",
            )
        )  # fmt: skip
        return tuple(problems)
    if mem.concurrent > mem.max_concurrency:
        fixes = [f"{names['concurrent']} <= {mem.max_concurrency}"]
        fixes += _fixes(arch, accelerator, mem, mem.concurrent, settings, names)
        problems.append(
            ServingProblem(
                "concurrency", names["concurrent"], mem.concurrent,
                f"{names['concurrent']}={mem.concurrent}: {mem.concurrent} sequences of {count(mem.context)} tokens "
                f"need {count(mem.concurrent * mem.blocks_per_sequence)} KV blocks of {mem.block_size} tokens, the "
                f"{gib(mem.kv_budget)} GiB cache holds {count(mem.num_blocks)} ({mem.max_concurrency} sequences); "
                f"{_either(fixes, '')}",
            )
        )  # fmt: skip
    return tuple(problems)


def serving_memory(
    arch: Architecture,
    accelerator: Accelerator,
    context: int,
    concurrent: int,
    settings: ServingSettings | None = None,
) -> ServingMemory:
    """Memory on each GPU of `arch` served by vLLM on `accelerator` with `concurrent` sequences of `context` tokens,
    with every reason it does not fit."""
    settings = (settings or ServingSettings()).resolved(accelerator)
    mem = _breakdown(arch, accelerator, context, concurrent, settings)
    return replace(mem, problems=_problems(arch, accelerator, mem, settings, _ARG_FIELDS))


def max_concurrency(
    arch: Architecture, accelerator: Accelerator, context: int, settings: ServingSettings | None = None
) -> int:
    """Most sequences of `context` tokens whose KV cache fits beside the weights, activations and overhead
    (0 when not even one does)."""
    settings = (settings or ServingSettings()).resolved(accelerator)
    return _breakdown(arch, accelerator, context, 0, settings).max_concurrency


def plan_serving(
    arch: Architecture,
    accelerator: Accelerator,
    settings: ServingSettings | None = None,
    max_model_len: int | None = None,
) -> ServingPlan:
    """`arch` served with `settings` on `accelerator`: max_num_seqs sequences of `max_model_len` tokens (None: the
    model's seq_len), problems named after the spec's `serve` fields."""
    settings = (settings or ServingSettings()).resolved(accelerator)
    assert settings.max_num_seqs is not None
    mem = _breakdown(arch, accelerator, max_model_len or arch.seq_len, settings.max_num_seqs, settings)
    mem = replace(mem, problems=_problems(arch, accelerator, mem, settings, _SPEC_FIELDS))
    return ServingPlan(model=arch.name, settings=settings, memory=mem)
