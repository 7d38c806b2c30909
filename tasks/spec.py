"""The deployment spec: one YAML file, one typed model built from the sections' own models."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import fsspec
import yaml
from pydantic import Field, ValidationError, model_validator

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.capacity.config import CapacityConfig, capacity_problems
from tasks.cluster import ClusterConfig
from tasks.image.config import ImageConfig
from tasks.nodes.config import NodesConfig
from tasks.prepare.config import DataSpec
from training.config import (
    CheckpointConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    Problem,
    RunConfig,
    StrictModel,
    TrainConfig,
    format_validation_error,
    raise_problems,
    training_problems,
)
from training.storage import StorageConfig


class SpecError(ValueError):
    """A spec that cannot be used; `problems` has one `field=value: what and fix` line per error."""

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: invalid deployment spec:\n" + "\n".join(f"  - {p}" for p in problems))
        self.source, self.problems = source, problems


class DeploymentSpec(StrictModel):
    """A whole deployment: cluster, model, parallelism, precision, optimizer, data, checkpoints, run, storage."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,62}$", description="Deployment name (lowercase, digits, -).")
    cluster: ClusterConfig
    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    optim: OptimConfig
    data: DataSpec
    checkpoint: CheckpointConfig
    run: RunConfig
    storage: StorageConfig = Field(default_factory=StorageConfig)
    capacity: CapacityConfig = Field(
        default_factory=CapacityConfig, description="Capacity planning assumptions (tdeploy plan)."
    )
    image: ImageConfig | None = Field(
        default_factory=ImageConfig, description="The training image (tdeploy build-image); None = no image."
    )
    nodes: NodesConfig = Field(
        default_factory=NodesConfig, description="Node environment checks (tdeploy check-nodes); default: localhost."
    )
    acceptance: AcceptanceConfig = Field(
        default_factory=AcceptanceConfig, description="Acceptance tests (tdeploy accept): thresholds and run lengths."
    )
    drills: DrillConfig = Field(default_factory=DrillConfig, description="Checkpoint-restore drills (tdeploy drill).")

    @model_validator(mode="after")
    def _consistent(self) -> DeploymentSpec:
        c = self.cluster
        capacity = capacity_problems(self.capacity, c.accelerator, c.nodes, c.procs_per_node, self.model, self.parallel)
        raise_problems("DeploymentSpec", training_problems(self) + self._cluster_problems() + capacity)
        return self

    def _cluster_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        world, par = self.cluster.world_size, self.parallel
        if par.data_parallel is not None and par.data_parallel != world:
            problems.append(
                (
                    ("parallel", "data_parallel"),
                    par.data_parallel,
                    f"must equal cluster.nodes x cluster.procs_per_node = {world}; set it to {world} or remove it",
                )
            )
        if par.sharding == "hsdp":
            shard = par.hsdp_shard_size or self.cluster.procs_per_node
            if world % shard:
                valid = [d for d in range(1, world + 1) if world % d == 0]
                problems.append(
                    (("parallel", "hsdp_shard_size"), shard, f"must divide the world size {world}; use one of {valid}")
                )
        prepared_vocab = self.data.prepare.vocab_size if self.data.prepare else None
        if prepared_vocab is not None and self.model.vocab_size < prepared_vocab:
            problems.append(
                (
                    ("model", "vocab_size"),
                    self.model.vocab_size,
                    f"must be >= the dataset's vocabulary ({prepared_vocab}, data.prepare.tokenizer); "
                    f"set it to {prepared_vocab}",
                )
            )
        return problems

    def training_config(self, dataset_url: str | None = None, tokenizer_sha256: str | None = None) -> TrainConfig:
        """The training payload's slice of the spec, for data.dataset_url or the dataset `prepare` produced."""
        if dataset_url is None:
            if self.data.dataset_url is None:
                raise ValueError("data.prepare is set: prepare the dataset first and pass its dataset_url")
            dataset_url, tokenizer_sha256 = self.data.dataset_url, self.data.tokenizer_sha256
        return TrainConfig(
            model=self.model,
            parallel=self.parallel,
            precision=self.precision,
            optim=self.optim,
            data=self.data.training(dataset_url, tokenizer_sha256),
            checkpoint=self.checkpoint,
            run=self.run,
            storage=self.storage,
        )

    @property
    def reports_dir(self) -> str:
        """Where pipeline reports go (node checks, image record): beside run.output_url, else runs/<name>."""
        if "://" in self.run.output_url and not self.run.output_url.startswith("file://"):
            return f"runs/{self.name}"
        return str(Path(self.run.output_url.removeprefix("file://")).parent)

    def digest(self) -> str:
        """sha256 of the normalised spec (for cache keys and labels)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()

    def summary(self) -> str:
        """One short paragraph for humans."""
        m, p, c = self.model, self.parallel, self.cluster
        kind = f"MoE {m.moe.n_experts}x top-{m.moe.top_k}" if m.moe else "dense"
        return (
            f"{self.name}: {c.scheduler} {c.nodes} node(s) x {c.procs_per_node} {c.accelerator} process(es); "
            f"model {m.n_layers}L d{m.d_model} {m.n_heads}h/{m.kv_heads}kv ffn{m.ffn_hidden} {kind} "
            f"vocab {m.vocab_size} seq {m.seq_len}; {p.sharding} micro_batch {p.micro_batch} x accum "
            f"{p.grad_accum_steps} (global {p.micro_batch * p.grad_accum_steps * c.world_size} sequences); "
            f"{self.precision.dtype}; {self.run.steps} steps"
        )


def parse_spec(data: Any, source: str = "<spec>") -> DeploymentSpec:
    """Validate spec data, raising SpecError with every problem at once."""
    if not isinstance(data, dict):
        raise SpecError(source, [f"<spec>={type(data).__name__}: the spec must be a YAML mapping of sections"])
    try:
        return DeploymentSpec.model_validate(data)
    except ValidationError as err:
        raise SpecError(source, format_validation_error(err)) from err


def load_spec(source: str | Path) -> DeploymentSpec:
    """Read and validate a spec from a local path or fsspec URL."""
    source = str(source)
    try:
        with fsspec.open(source, "r", encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError as err:
        raise SpecError(source, [f"spec file {source} does not exist; pass the path of a YAML spec"]) from err
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(source, [f"not valid YAML: {err}"]) from err
    return parse_spec(data, source)
