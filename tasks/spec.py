"""The deployment spec: one YAML file, one typed model built from the sections' own models."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import fsspec
import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from tasks.acceptance.config import AcceptanceConfig, DrillConfig
from tasks.capacity.catalogue import CATALOGUE, resolve_accelerator
from tasks.capacity.config import CapacityConfig, capacity_problems
from tasks.distill import with_teacher_model
from tasks.errors import TransientError, UserError, is_connection_error
from tasks.image.config import ImageConfig
from tasks.init_from import fill_model
from tasks.launch import registry
from tasks.launch.base import Launcher
from tasks.launch.cluster import ClusterConfig
from tasks.names import NAME_PATTERN, NAME_RULE
from tasks.nodes.config import NodesConfig
from tasks.paths import RUNS_DIR, UNNAMED, derived_paths
from tasks.prepare.config import DataSpec
from tasks.quantize.config import QuantizeConfig, quantize_problems
from tasks.recovery.config import RecoveryConfig
from tasks.serve.config import ServeConfig, unservable
from tasks.soak.config import SoakConfig
from training.config import (
    MAX_RANKS,
    CheckpointConfig,
    DistillConfig,
    FaultToleranceConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    Problem,
    RunConfig,
    StrictModel,
    TrainConfig,
    WatchdogConfig,
    divisors,
    format_validation_error,
    raise_problems,
    training_problems,
)
from training.layout import Layout, data_parallel_degree, world_problems
from training.secrets import REDACTED, credential_message, find_credentials
from training.storage import LocalPath, StorageConfig, is_local

MAX_SPEC_BYTES = 1 << 20
"""A spec is a few kB; anything past 1 MiB is the wrong file (or an attack on the parser)."""
MAX_INT_DIGITS = 64
"""Longest integer a spec may spell (byte counts and seeds need 20)."""
MAX_SPEC_DEPTH = 32
"""Deepest nesting of mappings and lists a spec may have (the schema needs 5)."""


REMOVED_FIELDS: dict[str, str] = {
    "data.bootstrap": "data.prepare replaced it: drop data.bootstrap and data.dataset_url and write `data: "
    "{prepare: {builtin_corpus: python-docs, tokenizer: {kind: bytes}}}` for the byte-level dataset of the "
    "standard library's documentation it built (its max_bytes is prepare.builtin_max_bytes, its min_doc_chars "
    "prepare.cleaning.min_chars); examples/local.yaml does the same with a BPE tokenizer",
}
"""Fields a spec once had, by dotted path, with what replaced them: an old spec is told, not called a typo."""


def with_precision_default(data: dict[str, Any]) -> dict[str, Any]:
    """Raw spec data whose precision.dtype, where the spec leaves it out, is the accelerator's default: bf16 on
    GPUs (what they compute fastest, without fp16's loss scaling), fp32 on CPUs."""
    precision, cluster, capacity = data.get("precision"), data.get("cluster"), data.get("capacity")
    if precision is None:
        precision = {}
    if not isinstance(precision, dict) or "dtype" in precision or not isinstance(cluster, dict):
        return data
    accelerator = cluster.get("accelerator", "cpu")
    own = (capacity or {}).get("accelerators") if isinstance(capacity, dict) else None
    kind = (
        own.get(accelerator, {}).get("kind")
        if isinstance(own, dict) and isinstance(own.get(accelerator), dict)
        else None
    )
    if kind is None and isinstance(accelerator, str) and accelerator in CATALOGUE:
        kind = CATALOGUE[accelerator].kind
    return {**data, "precision": {**precision, "dtype": "bf16"}} if kind == "gpu" else data


def _scheduler_defaults(data: dict[str, Any]) -> dict[str, Any]:
    """The cluster section with what its scheduler takes from other sections filled in (the launcher says what:
    an SSH job's hosts come from the nodes section, so the node checks and the job see one inventory)."""
    cluster = data.get("cluster")
    found = registry.find(cluster.get("scheduler", "local")) if isinstance(cluster, dict) else None
    if found is None:
        return data  # the cluster section's own validation names what is wrong
    assert isinstance(cluster, dict)
    return {**data, "cluster": found.launcher.cluster_defaults(cluster, data.get("nodes"))}


class SpecError(UserError, ValueError):
    """A spec that cannot be used; `problems` has one `field=value: what and fix` line per error.

    A UserError (never retried, shown without a traceback) and still the ValueError it always was.
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        super().__init__(f"{source}: invalid deployment spec:\n" + "\n".join(f"  - {p}" for p in problems))
        self.source, self.problems = source, problems

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle by the constructor's arguments (Prefect stores a failed task's exception)."""
        return (type(self), (self.source, self.problems))


class DeploymentSpec(StrictModel):
    """A whole deployment: cluster, model, parallelism, precision, optimizer, data, checkpoints, run, storage."""

    name: str = Field(pattern=NAME_PATTERN, description=f"Deployment name: {NAME_RULE}.")
    deployment_dir: LocalPath = Field(
        default=f"{RUNS_DIR}/{UNNAMED}",
        description="This deployment's folder: every report (plan.json, node-check.json, image/, acceptance/) "
        "and, where the spec omits them, run.output_url (output/), checkpoint.url (checkpoints/) and "
        "data.prepare.output_url (datasets/); default runs/<name> (relative to where tdeploy runs).",
    )
    cluster: ClusterConfig
    model: ModelConfig
    parallel: ParallelConfig
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    optim: OptimConfig
    data: DataSpec
    checkpoint: CheckpointConfig
    run: RunConfig
    storage: StorageConfig = Field(default_factory=StorageConfig)
    watchdog: WatchdogConfig = Field(
        default_factory=WatchdogConfig,
        description="Hang detection per phase (start-up, step, save, evaluation): timeouts, stack dumps, restart.",
    )
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
    fault_tolerance: FaultToleranceConfig = Field(
        default_factory=FaultToleranceConfig,
        description="Live recovery of a lost data-parallel replica (rung 1 of the recovery ladder, torchft): "
        "mode none (the default) or replica_groups, where the launcher can run them (its live_recovery capability).",
    )
    recovery: RecoveryConfig = Field(
        default_factory=RecoveryConfig,
        description="The restart policy: requeues after an infrastructure failure (without the failing hosts) and "
        "the node quarantine; workload errors are never retried.",
    )
    soak: SoakConfig | None = Field(
        default=None,
        description="The soak under injected failures (tdeploy soak, the nightly flow's soak step): hours, mean "
        "time between failures, which failures; None (the default) = the nightly flow skips it.",
    )
    serve: ServeConfig | None = Field(
        default=None,
        description="Serving the trained model with vLLM (tdeploy serve, the pipeline's serving check); "
        "None (the default) = no serving. `serve: {}` takes every serving default.",
    )
    quantize: QuantizeConfig | None = Field(
        default=None,
        description="Quantize the exported model with LLM Compressor and gate it against the unquantized one, both "
        "served by vLLM (tdeploy quantize, the pipeline's quantize step; the serving check then serves the "
        "quantized folder); needs the serve section. None (the default) = serve the unquantized export.",
    )
    distill: DistillConfig | None = Field(
        default=None,
        description="Train the model as the student of a frozen teacher (our checkpoint or a Hugging Face folder): "
        "alpha x T^2 x KL to the teacher + (1 - alpha) x cross-entropy; None (the default) = plain training.",
    )

    @field_validator("name", mode="before")
    @classmethod
    def _name_in_words(cls, value: Any) -> Any:
        """The name's rule in words, before the pattern (a regex) would say it."""
        if isinstance(value, str) and re.fullmatch(NAME_PATTERN, value) is None:
            fixed = re.sub(r"[^a-z0-9-]+", "-", value.lower()).strip("-")[:63].strip("-") or "my-run"
            raise ValueError(f"must be {NAME_RULE} (it names folders, jobs and flow runs); e.g. {fixed}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _derive_paths(cls, data: Any) -> Any:
        return with_precision_default(_scheduler_defaults(derived_paths(data))) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _teacher_read(self) -> DeploymentSpec:
        """The teacher's architecture, where the spec leaves it out, from the teacher's own record (tasks/distill.py):
        before _consistent, which checks it against the model."""
        if self.distill is not None and self.distill.teacher_model is None:
            distill, problems = with_teacher_model(self.distill, self.storage)
            raise_problems("DeploymentSpec", problems)
            self.distill = distill
        return self

    @model_validator(mode="after")
    def _consistent(self) -> DeploymentSpec:
        c = self.cluster
        if c.world_size > MAX_RANKS:  # every check below multiplies or factors the world size
            raise_problems(
                "DeploymentSpec",
                [
                    (
                        ("cluster", "procs_per_node") if c.procs_per_node > c.nodes else ("cluster", "nodes"),
                        max(c.nodes, c.procs_per_node),
                        f"nodes x procs_per_node = {c.world_size} processes must be <= {MAX_RANKS}; "
                        "use fewer nodes or processes per node",
                    )
                ],
            )
        capacity = capacity_problems(self.capacity, c.accelerator, c.nodes, c.procs_per_node, self.model, self.parallel)
        capacity += self.capacity.spec_problems(self.precision.dtype, self.parallel.sharding)
        problems = training_problems(self) + self._cluster_problems() + capacity + self._serve_problems()
        problems += self._fp8_problems()
        if self.quantize is not None:
            problems += quantize_problems(self.quantize, self.serve, self.cluster.accelerator, self.model.seq_len)
        raise_problems("DeploymentSpec", problems)
        return self

    def _fp8_problems(self) -> list[Problem]:
        """precision.dtype fp8 on an accelerator that is not a GPU (float8 matmuls need CUDA capability 8.9+)."""
        if self.precision.dtype != "fp8":
            return []
        try:
            kind = resolve_accelerator(self.cluster.accelerator, self.capacity.accelerator_overrides()).kind
        except (KeyError, TypeError):  # an unknown accelerator: capacity_problems names it
            return []
        if kind == "gpu":
            return []
        return [(("precision", "dtype"), "fp8", f"float8 training needs a GPU, and cluster.accelerator="
                 f"{self.cluster.accelerator} is a {kind}; set precision.dtype: bf16 on CPU (fp8 needs H100-class "
                 "GPUs, CUDA compute capability 8.9+: sm_89)")]  # fmt: skip

    def _serve_problems(self) -> list[Problem]:
        """Why the trained model could not be served as the serve section says (checked before training)."""
        if self.serve is None:
            return []
        problems: list[Problem] = []
        for text in unservable(self.model, self.serve, self.cluster.accelerator):
            name, _, rest = text.partition("=")  # unservable() words each one as "field=value: problem; fix"
            value, _, message = rest.partition(": ")
            problems.append((tuple(name.split(".")), value, f"{message}; or set serve: null to train without serving"))
        return problems

    def _cluster_problems(self) -> list[Problem]:
        problems: list[Problem] = []
        world, par = self.cluster.world_size, self.parallel
        scheduler = self.cluster.scheduler
        launcher = registry.launcher_class(scheduler)
        problems += [(("cluster", *at), value, why) for at, value, why in launcher.cluster_problems(self.cluster)]
        if launcher.capabilities.needs_shared_output and not is_local(self.run.output_url):
            shared = not launcher.capabilities.runs_on_this_machine_only
            where = "a filesystem every node shares" if shared else "this machine"
            problems.append(
                (
                    ("run", "output_url"),
                    self.run.output_url,
                    f"cluster.scheduler={scheduler} writes the run's logs and metrics to a folder on {where}; "
                    f"use a path such as {self.deployment_dir}/output, or remove it to get that default "
                    "(object stores suit checkpoint.url)",
                )
            )
        problems += self._fault_tolerance_problems(launcher)
        if par.model_parallel:
            where = f"cluster.nodes x cluster.procs_per_node = {world}"
            problems.extend(world_problems(par, world, self.cluster.procs_per_node, where))
        else:
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
                    valid = divisors(world)
                    problems.append(
                        (
                            ("parallel", "hsdp_shard_size"),
                            shard,
                            f"must divide the world size {world}; use one of {valid}",
                        )
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

    def _fault_tolerance_problems(self, launcher: type[Launcher]) -> list[Problem]:
        """Why fault_tolerance cannot run on this scheduler or world size (the layout is training_problems')."""
        ft, cluster = self.fault_tolerance, self.cluster
        if ft.mode == "none":
            return []
        if not launcher.capabilities.live_recovery:
            able = [name for name in registry.names() if registry.capabilities(name).live_recovery]
            return [(
                ("fault_tolerance", "mode"), ft.mode,
                f"cluster.scheduler={cluster.scheduler} cannot run replica groups: its launcher does not start them; "
                f"use a scheduler that does ({', '.join(able)}), "
                "or set fault_tolerance.mode=none: a lost rank then recovers through the memory tier "
                "(checkpoint.memory_every_steps) or storage",
            )]  # fmt: skip
        if cluster.max_restarts == 0:
            return [(
                ("cluster", "max_restarts"), cluster.max_restarts,
                "must be >= 1 with fault_tolerance.mode=replica_groups: a lost replica group comes back by its torchrun "
                "restarting it, then heals from a peer; set cluster.max_restarts to 1 or more",
            )]  # fmt: skip
        if cluster.spares or cluster.min_nodes is not None:
            field, value = ("spares", cluster.spares) if cluster.spares else ("min_nodes", cluster.min_nodes)
            return [(
                ("cluster", field), value,
                "is not used with fault_tolerance.mode=replica_groups (the groups replace hot spares and elastic "
                f"nodes: a lost group restarts and heals from a peer); remove cluster.{field}",
            )]  # fmt: skip
        if launcher.capabilities.replica_group_per_node and ft.replica_groups != cluster.nodes:
            return [(
                ("fault_tolerance", "replica_groups"), ft.replica_groups,
                f"must equal cluster.nodes={cluster.nodes} on the {cluster.scheduler} launcher (each node or host runs "
                f"one replica group); set fault_tolerance.replica_groups to {cluster.nodes}, or cluster.nodes to "
                f"{ft.replica_groups} (with as many hosts)",
            )]  # fmt: skip
        if cluster.world_size % ft.replica_groups:
            valid = [d for d in divisors(cluster.world_size) if d >= 2]
            return [(
                ("fault_tolerance", "replica_groups"), ft.replica_groups,
                f"must divide cluster.nodes x cluster.procs_per_node = {cluster.world_size} (each group runs an "
                f"equal share of the ranks); use one of {valid or 'none: give the job at least 2 ranks'}",
            )]  # fmt: skip
        return []

    def training_config(
        self, dataset_url: str | None = None, tokenizer_sha256: str | None = None, sources: list[str] | None = None
    ) -> TrainConfig:
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
            data=self.data.training(dataset_url, tokenizer_sha256, sources),
            checkpoint=self.checkpoint,
            run=self.run,
            storage=self.storage,
            watchdog=self.watchdog,
            fault_tolerance=self.fault_tolerance,
            distill=self.distill,
        )

    @property
    def reports_dir(self) -> str:
        """The one folder of this deployment's reports: plan.json, node-check.json, image/, acceptance/."""
        return self.deployment_dir.removeprefix("file://").rstrip("/") or "/"

    def digest(self) -> str:
        """sha256 of the normalised spec (for cache keys and labels)."""
        return hashlib.sha256(self.model_dump_json().encode()).hexdigest()

    def uses_s3(self) -> bool:
        """True when any URL of the spec is on S3 (the image then also gets s3fs)."""
        text = self.model_dump_json()
        return "s3://" in text or "s3a://" in text or self.storage.s3_endpoint_url is not None

    @property
    def data_parallel_degree(self) -> int:
        """Data-parallel ranks of the job: the world size with the tensor and pipeline degrees divided out."""
        return data_parallel_degree(self.parallel, self.cluster.world_size)

    def layout(self) -> str:
        """The layout in words, outermost mesh dimension first: "pp2 x dp2 x tp2 (fsdp, sp, 1f1b)", "dp4 (ddp)"."""
        p = self.parallel
        extra = (["sp"] if p.sequence_parallel else []) + ([p.pipeline_schedule] if p.pipeline_parallel > 1 else [])
        return Layout.of(p, self.cluster.world_size, self.cluster.procs_per_node).degrees(*extra)

    def summary(self) -> str:
        """One short paragraph for humans."""
        m, p, c = self.model, self.parallel, self.cluster
        kind = f"MoE {m.moe.n_experts}x top-{m.moe.top_k}" if m.moe else "dense"
        return (
            f"{self.name}: {c.scheduler} {c.nodes} node(s) x {c.procs_per_node} {c.accelerator} process(es); "
            f"model {m.n_layers}L d{m.d_model} {m.n_heads}h/{m.kv_heads}kv ffn{m.ffn_hidden} {kind} "
            f"vocab {m.vocab_size} seq {m.seq_len}; layout {self.layout()} micro_batch {p.micro_batch} x accum "
            f"{p.grad_accum_steps} (global {p.micro_batch * p.grad_accum_steps * self.data_parallel_degree} "
            f"sequences); {self.precision.dtype}; {self.run.steps} steps"
        )


def credential_problems(data: Any) -> list[str]:
    """One line per credential-like key with a value, at any depth of raw spec data (values never shown)."""
    return [
        f"{'.'.join(str(part) for part in loc)}={REDACTED}: {credential_message(variable)}"
        for loc, variable in find_credentials(data)
    ]


def parse_spec(data: Any, source: str = "<spec>") -> DeploymentSpec:
    """Validate spec data, raising SpecError with every problem at once."""
    if data is None:
        raise SpecError(
            source, ["<spec>: the spec is empty; it must be a YAML mapping of sections (name, cluster, ...)"]
        )
    if not isinstance(data, dict):
        raise SpecError(source, [f"<spec>={type(data).__name__}: the spec must be a YAML mapping of sections"])
    problems = credential_problems(data)
    data, filled = fill_model(data)  # model.init_from: the architecture config.json gives (tasks/init_from.py)
    problems += filled
    try:
        spec = DeploymentSpec.model_validate(data)
    except ValidationError as err:
        problems += [p for p in format_validation_error(err, REMOVED_FIELDS) if p not in problems]
    if problems:
        raise SpecError(source, problems)
    return spec


class _SpecLoader(yaml.SafeLoader):
    """PyYAML's safe loader without aliases (a few lines of them expand without bound), deep nesting or
    duplicate keys (the second one silently won)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None,
                None,
                f"found the alias *{event.anchor}: aliases are not allowed in a deployment spec; write the value out",
                event.start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_SPEC_DEPTH:
                raise yaml.composer.ComposerError(
                    None,
                    None,
                    f"nesting deeper than {MAX_SPEC_DEPTH} levels; a deployment spec needs a handful",
                    self.peek_event().start_mark,
                )
            return super().compose_node(parent, index)  # type: ignore[arg-type]
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        """An integer of at most MAX_INT_DIGITS digits (Python refuses to parse past 4300 with a bare ValueError)."""
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"an integer of {digits} digits; no spec field takes more than {MAX_INT_DIGITS}: check the value",
                node.start_mark,
            )
        return super().construct_yaml_int(node)  # type: ignore[no-untyped-call]

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)  # type: ignore[no-untyped-call]
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping; keep one", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)


_SpecLoader.add_constructor("tag:yaml.org,2002:int", _SpecLoader.construct_yaml_int)


def read_spec_text(source: str) -> str:
    """The text of a spec file: at most MAX_SPEC_BYTES of UTF-8; SpecError for a user error, TransientError else."""
    try:
        with fsspec.open(source, "rb") as handle:
            raw = handle.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError as err:
        raise SpecError(source, [f"spec file {source} does not exist; pass the path of a YAML spec"]) from err
    except IsADirectoryError as err:
        raise SpecError(source, [f"{source} is a folder; pass the path of a YAML spec file"]) from err
    except Exception as err:
        if is_connection_error(err):
            raise TransientError(f"reading the spec {source} failed: {err}", "retry once storage answers") from err
        raise SpecError(source, [f"spec file {source} cannot be read: {type(err).__name__}: {err}"]) from err
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(
            source, [f"spec file {source} is larger than {MAX_SPEC_BYTES} bytes; a spec is a few kB: check the path"]
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SpecError(
            source,
            [
                f"spec file {source} is not UTF-8 text: byte 0x{raw[err.start]:02x} at offset {err.start} "
                "cannot be decoded; save the file as UTF-8"
            ],
        ) from err


def parse_spec_text(text: str, source: str = "<spec>") -> DeploymentSpec:
    """Parse YAML text (no aliases, no duplicate keys) and validate it."""
    try:
        data = yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise SpecError(source, [_yaml_problem(err)]) from err
    return parse_spec(data, source)


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    if isinstance(err, yaml.MarkedYAMLError) and mark is not None:
        what = "; ".join(str(part) for part in (err.context, err.problem) if part)
        return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {what}"
    return "not valid YAML: " + " ".join(str(err).split())


def load_spec(source: str | Path) -> DeploymentSpec:
    """Read and validate a spec from a local path or fsspec URL."""
    source = str(source)
    return parse_spec_text(read_spec_text(source), source)
